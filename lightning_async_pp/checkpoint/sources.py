"""Reading a checkpoint's flat dictionary: a sharded directory (each process reads only its own keys, laid out as
its shards are, whatever the layout they were saved in) or a dictionary in memory (a single file), and a sharded
checkpoint's ``meta.pt``."""
from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lightning_async_pp.checkpoint.checksums import _CheckedReader, check_sharded, read_checksums, verify_file
from lightning_async_pp.checkpoint.format import (FORMAT, META_FILE, MODEL, SAFE_GLOBALS, UnreadableCheckpoint,
                                                  _first_line, _refused_global, unreadable_file)
from lightning_async_pp.checkpoint.writing import resolve
from lightning_async_pp.parallel.tensor_parallel import DTensorSpec, is_one_block, lay_out

class TensorSource:
    """Reads keys of the flat dictionary. ``shapes`` lists every key (``None`` for pickled values)."""

    shapes: dict[str, Optional[tuple[torch.Size, torch.dtype]]]

    def read(self, keys: Iterable[str], layouts: Optional[Mapping[str, DTensorSpec]] = None) -> dict[str, Any]:
        """The values of ``keys``; those in ``layouts`` (tensor parallelism) as DTensors laid out so, each process
        holding its own shard."""
        raise NotImplementedError

class MemorySource(TensorSource):
    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.flat = flat
        self.shapes = {k: (v.shape, v.dtype) if isinstance(v, Tensor) else None for k, v in flat.items()}

    def read(self, keys: Iterable[str], layouts: Optional[Mapping[str, DTensorSpec]] = None) -> dict[str, Any]:
        """Collective nowhere: every process reads what it needs (and slices its shard of a laid-out key)."""
        return lay_out({k: self.flat[k] for k in keys}, layouts or {})

class ShardedSource(TensorSource):
    def __init__(self, path: str) -> None:
        self.path = path
        metadata = check_sharded(path)
        self.shapes = {k: (m.size, m.properties.dtype) if hasattr(m, "size") else None
                       for k, m in metadata.state_dict_metadata.items()}
        self.checksums = read_checksums(path)
        self.verified: set[str] = set()

    def read(self, keys: Iterable[str], layouts: Optional[Mapping[str, DTensorSpec]] = None) -> dict[str, Any]:
        """Collective: every process calls it (each with the keys it needs). Each process checks the shard files it
        reads against their checksums (each once) inside DCP's read, so a damaged file fails the load on every
        process alike, named: a process refusing alone before the load would leave the others waiting in it. A
        key in ``layouts`` is read into a DTensor of that layout: DCP reads only the pieces of the saved shards
        that this process's shard covers, whatever the layout they were saved in."""
        keys, layouts = list(keys), layouts or {}
        out: dict[str, Any] = {}
        for k in keys:
            shape = self.shapes[k]
            out[k] = (b"" if shape is None else torch.empty(shape[0], dtype=shape[1]) if k not in layouts
                      else _empty_laid_out(shape[0], shape[1], layouts[k]))
        strided = {k: spec for k, spec in layouts.items() if not is_one_block(spec[1])}  # read whole, then sliced
        reader = _CheckedReader(self.path, self.checksums or {}, self.verified)
        # Without a process group (one device, consolidation) each process reads alone.
        try:
            dcp.load(out, storage_reader=reader, planner=WeightsOnlyLoadPlanner(),
                     no_dist=not torch.distributed.is_initialized())
        except UnreadableCheckpoint:  # read alone: the file is named already
            raise
        except (Exception, CheckpointException) as err:  # DCP's names neither the file nor the cause's kind
            damaged = _damaged_file(err)
            if damaged is not None:  # a process found a damaged file: every process raises its error
                raise UnreadableCheckpoint(damaged.path, damaged.problem, damaged.way_out) from err
            refused = _refused_global(str(err))
            if refused is not None:
                raise UnreadableCheckpoint(
                    self.path, f"a value in its shards that is not a tensor names {refused}, which "
                    f"torch.load(weights_only=True) will not build", SAFE_GLOBALS) from err
            raise UnreadableCheckpoint(self.path, f"reading its shards failed ({_first_line(err)}): a shard is "
                                       "damaged") from err
        return lay_out({k: v.to_local() if k in strided else v for k, v in out.items()}, strided)

def _empty_laid_out(shape: torch.Size, dtype: torch.dtype, spec: DTensorSpec) -> Tensor:
    from torch.distributed.tensor import Replicate, empty

    mesh, placements, _, _ = spec
    if not is_one_block(placements):  # DCP reads into one block: the whole tensor, sliced after the read
        placements = [Replicate()] * mesh.ndim
    return empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)

def _damaged_file(err: BaseException) -> Optional["UnreadableCheckpoint"]:
    """The :class:`UnreadableCheckpoint` of the lowest rank among the failures DCP's ``CheckpointException`` holds."""
    failures = getattr(err, "failures", None) or {}
    found = [failures[rank][0] for rank in sorted(failures)
             if isinstance(failures[rank], tuple) and isinstance(failures[rank][0], UnreadableCheckpoint)]
    return found[0] if found else None

class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint``'s default planner, but its values that are not tensors (written with
    ``torch.save``) are read with ``weights_only=True``: the default reads them with ``weights_only=False``, which
    runs whatever code a checkpoint names."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True, map_location="cpu")
        fqn = read_item.dest_index.fqn
        # Where the default puts it: the caller's dictionary, along the path its flattening recorded.
        path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
        target: Any = self.original_state_dict if self.flatten_state_dict else self.state_dict
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = obj

def read_meta(path: str, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt``, read with ``weights_only=True`` unless the caller passes ``False`` (as
    ``Trainer.fit(weights_only=False)`` does, for a checkpoint the user trusts)."""
    folder = resolve(path)
    checksums = read_checksums(folder)
    if checksums is not None:
        verify_file(folder, META_FILE, checksums)
    meta = os.path.join(folder, META_FILE)
    try:
        return torch.load(meta, weights_only=weights_only is not False, map_location="cpu")
    except Exception as err:
        raise unreadable_file(meta, err) from err

def file_source(checkpoint: Mapping[str, Any]) -> MemorySource:
    """The flat dictionary of a single-file checkpoint (``single_file_parts``), or of a plain Lightning one."""
    saved = checkpoint.get("async_pipeline")
    if saved is not None and saved.get("format") != FORMAT:
        raise ValueError(
            f"this checkpoint was written by an earlier version of lightning-async-pp (checkpoint format "
            f"{saved.get('format', 0)}, this version reads {FORMAT}); its weights still load with "
            f"model.load_state_dict(torch.load(path, weights_only=True)['state_dict'])"
        )
    aliases = checkpoint.get("async_pipeline", {}).get("aliases", {})
    flat = {MODEL + k: v for k, v in checkpoint["state_dict"].items() if k not in aliases}
    flat.update(checkpoint.get("async_pipeline", {}).get("tensors", {}))
    return MemorySource(flat)
