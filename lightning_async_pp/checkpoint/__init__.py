"""Checkpoints of a pipeline that do not depend on its layout.

Every tensor is keyed by its global name in the model (a tied parameter under its first name), so a checkpoint
saved with any number of stages, data-parallel size or partition loads into any other (docs/design/checkpoints.md,
"Checkpoints"). The keys of one flat dictionary:

    model.<name>                      the module's state: parameters at the newest version W_k, and buffers
    stash.<o>.<name>                  the older weight version W_{k-o} a stage holds (o = 1 .. its delay)
    optim.<i>/<name>/<key>            per-parameter state of optimizer i (moments, the ErrorFeedback buffer, ...)
    optim.<i>/<name>/@group           the hyperparameters of that parameter's group (torch.save bytes)

Each stage contributes the keys of its own parameters; a sharded checkpoint is that dictionary written through
``torch.distributed.checkpoint`` (each process writes its own tensors), plus ``meta.pt`` with what is not a
tensor (the loops' and data state, written once), plus ``checksums.json`` with each file's CRC-32. A single file holds
the same dictionary (``torch.save`` records a CRC-32 of each of its records). Nothing of a checkpoint is read
with ``weights_only=False`` (:class:`WeightsOnlyLoadPlanner`, :func:`read_settings`, :func:`read_meta`), and no file
is read before its checksum is checked (:func:`check_sharded`, :func:`check_file`).
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_async_pp.parallel.zero import local_optimizer, sync_group_settings
from lightning_async_pp.parallel.tensor_parallel import (DTensorSpec, as_laid_out, dtensor_spec, in_blocks,
                                                         is_one_block, lay_out, local_tensor)

MODEL, STASH, OPTIM, GROUP = "model.", "stash.", "optim.", "@group"
META_FILE = "meta.pt"
#: Each file's CRC-32 in a sharded checkpoint (docs/design/checkpoints.md, "Checksums"); earlier ones have none.
CHECKSUMS_FILE = "checksums.json"
FORMAT = 1


# ---- what a process contributes --------------------------------------------------------------------------------
def engine_tensors(engine: Any, module_state: Mapping[str, Tensor], optimizers: Sequence[torch.optim.Optimizer],
                   weights: bool = True) -> dict[str, Any]:
    """This process's part of the flat dictionary: its module state, stashed versions (unless ``weights`` is
    False: a data-parallel replica) and optimizer states (a sharded optimizer: the parameters this process owns)."""
    flat: dict[str, Any] = {MODEL + engine.aliases.get(n, n): t for n, t in module_state.items()} if weights else {}
    for view in engine.stats.stages if weights else ():
        k = engine.stats.batch_index
        # A slot holds a DTensor parameter's local shard: saved as a DTensor laid out as the parameter, so DCP
        # records the global shape and this shard's offset
        # (docs/design/tensor-parallel.md, "Checkpoints of sharded stages").
        specs = [dtensor_spec(p) for p in view.params]
        for o in range(1, min(view.delay, k) + 1):
            flat.update({f"{STASH}{o}.{n}": as_laid_out(t, s)
                         for n, t, s in zip(view.param_names, view.version(k - o), specs)})
        if view.predicts:  # "stash.0": what the batches due the newest version will run on (its prediction)
            flat.update({f"{STASH}0.{n}": as_laid_out(t, s)
                         for n, t, s in zip(view.param_names, view.predicted_newest(), specs)})
    for i, optimizer in enumerate(optimizers):
        flat.update(_optimizer_by_name(optimizer, engine.global_names, f"{OPTIM}{i}/"))
    return in_blocks(flat)  # DCP writes a shard as one block: a strided one is written whole


def _optimizer_by_name(optimizer: torch.optim.Optimizer, names: Mapping[int, str], prefix: str) -> dict[str, Any]:
    # Sharded: the local groups take the exposed groups' settings first (what the next step would use: an LR
    # scheduler changed the exposed ones after the last step), as ZeroRedundancyOptimizer.consolidate_state_dict.
    sync_group_settings(optimizer)
    optimizer = local_optimizer(optimizer)  # sharded: only the state this replica holds
    state = optimizer.state_dict()
    name_of = {index: names[id(p)] for saved, group in zip(state["param_groups"], optimizer.param_groups)
               for index, p in zip(saved["params"], group["params"])}
    return _state_by_name(state, name_of, prefix)


def _state_by_name(state: Mapping[str, Any], name_of: Mapping[int, str], prefix: str) -> dict[str, Any]:
    """A torch optimizer ``state_dict`` (keyed by parameter index) as flat keys of parameter names."""
    out: dict[str, Any] = {}
    for saved in state["param_groups"]:
        hyper = settings_bytes({k: v for k, v in saved.items() if k != "params"})
        for index in saved["params"]:
            name = name_of[index]
            out[f"{prefix}{name}/{GROUP}"] = hyper
            for key, value in state["state"].get(index, {}).items():
                out[f"{prefix}{name}/{key}"] = value
    return out


# ---- nothing in a checkpoint runs code: what is not a tensor is read with torch.load(weights_only=True) ------------
def settings_bytes(settings: Mapping[str, Any]) -> bytes:
    """A param group's hyperparameters as the bytes stored under ``optim.<i>/<name>/@group``: ``torch.save``'s
    format, which :func:`read_settings` reads with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(dict(settings), buffer)
    return buffer.getvalue()


class _NoGlobals(pickle.Unpickler):
    """Reads a plain pickle of numbers, strings, tuples, lists and dicts; refuses any class or function it names."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"weights_only: a checkpoint's optimizer settings name {module}.{name}, which is "
                                     f"not loaded from a checkpoint")


def read_settings(data: bytes, key: str) -> dict[str, Any]:
    """The hyperparameters :func:`settings_bytes` stored under ``key`` (or, written by earlier versions, a plain
    pickle of them), without running code the checkpoint names."""
    try:
        if data[:2] == b"PK":  # torch.save's zip format
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return _NoGlobals(io.BytesIO(data)).load()
    except Exception as err:
        raise ValueError(f"cannot read the optimizer settings {key!r} of the checkpoint: "
                         f"{_first_line(err)}") from err


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


def plain_optimizer_tensors(optimizer_states: Sequence[Mapping[str, Any]], names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The optimizer keys of the flat dictionary from a plain Lightning checkpoint, whose ``optimizer_states`` know
    parameters by index only. ``names[i]`` lists optimizer ``i``'s parameter names in index order, as the whole
    model's ``configure_optimizers()`` builds it (what the checkpointed run built)."""
    if len(optimizer_states) != len(names):
        raise ValueError(
            f"the checkpoint holds {len(optimizer_states)} optimizer state(s) but configure_optimizers() returns "
            f"{len(names)} optimizer(s); resume with the optimizers the checkpoint was trained with"
        )
    out: dict[str, Any] = {}
    for i, (state, order) in enumerate(zip(optimizer_states, names)):
        indices = [index for group in state["param_groups"] for index in group["params"]]
        if len(indices) != len(order):
            raise ValueError(
                f"optimizer {i} of the checkpoint holds {len(indices)} parameters, but the model's "
                f"configure_optimizers() gives it {len(order)}; resume with the model and optimizer it was trained with"
            )
        out.update(_state_by_name(state, dict(zip(indices, order)), f"{OPTIM}{i}/"))
    return out


def checkpoint_meta(engine: Any, schedule: str, data_parallel_size: int) -> dict[str, Any]:
    return {
        "format": FORMAT, "schedule": schedule, "num_stages": engine.num_stages,
        "data_parallel_size": data_parallel_size, "num_updates": engine.stats.batch_index,
        "aliases": dict(engine.aliases), "layers_per_stage": list(engine.split.counts),
    }


# ---- sources: a sharded directory or a dictionary in memory ----------------------------------------------------
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


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader, which first checks each shard file this process's plan reads against its checksum (those
    in ``verified`` passed already). In DCP's read step, so that its gather of each process's outcome carries the
    refusal to every process."""

    def __init__(self, path: str, checksums: Mapping[str, str], verified: set[str]) -> None:
        super().__init__(path)
        self.root, self.checksums, self.verified = path, checksums, verified

    def read_data(self, plan: Any, planner: Any) -> Future:
        for relative in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}
                               - self.verified):
            verify_file(self.root, relative, self.checksums)
            self.verified.add(relative)
        return super().read_data(plan, planner)


def _damaged_file(err: BaseException) -> Optional["UnreadableCheckpoint"]:
    """The :class:`UnreadableCheckpoint` of the lowest rank among the failures DCP's ``CheckpointException`` holds."""
    failures = getattr(err, "failures", None) or {}
    found = [failures[rank][0] for rank in sorted(failures)
             if isinstance(failures[rank], tuple) and isinstance(failures[rank][0], UnreadableCheckpoint)]
    return found[0] if found else None


# ---- damaged checkpoints: say which file, what is wrong and what to do ----------------------------------------------
class UnreadableCheckpoint(ValueError):
    """A checkpoint that cannot be read: cut short, damaged, or not a checkpoint. The message names the file or
    directory, what is wrong with it and the way out."""

    def __init__(self, path: str, problem: str, way_out: Optional[str] = None) -> None:
        self.path, self.problem, self.way_out = path, problem, way_out
        super().__init__(f"cannot read the checkpoint {path!r}: {problem}. {way_out or DAMAGED}")

    def __reduce__(self) -> tuple:  # rebuilt on the other processes when DCP gathers a process's failure
        return type(self), (self.path, self.problem, self.way_out)


#: The way out of a checkpoint that was cut short or damaged.
DAMAGED = ("Use another checkpoint (ModelCheckpoint(save_top_k=...) keeps earlier ones beside it), or copy this one "
           "again from where it was written")


#: The way out of an object that ``weights_only`` loading refuses.
SAFE_GLOBALS = ("If the checkpoint is yours and holds such an object on purpose, allow exactly that class with "
                "torch.serialization.add_safe_globals([...]) before loading; otherwise do not load it")


def _refused_global(text: str) -> Optional[str]:
    """The global that torch's ``weights_only`` unpickler refused, named in its error ``text``."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"name (\S+), which is not loaded", text)
    return found.group(1) if found else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    # DCP's CheckpointException lists each rank's traceback: its last line is the cause.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = (lines[-1] if type(err).__name__ == "CheckpointException" and lines else lines[0] if lines else "")
    return f"{type(err).__name__}: {line[:200]}" if line else type(err).__name__


def check_sharded(path: str) -> Any:
    """The ``torch.distributed.checkpoint`` metadata of the sharded checkpoint directory ``path``, once every file it
    needs is there and long enough: ``.metadata`` (and its checksum), ``meta.pt`` and each shard up to the last byte
    the metadata places in it. A :class:`UnreadableCheckpoint` names the first file that is missing, cut short or
    damaged. A checkpoint without checksums (written by an earlier version) is read unchecked, with a warning."""
    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        raise UnreadableCheckpoint(path, "the directory has no .metadata (torch.distributed.checkpoint's index of the "
                                   "shards), so it is not a sharded checkpoint or its save never finished")
    checksums = read_checksums(path)
    if checksums is None:
        warnings.warn(f"the checkpoint {path!r} has no {CHECKSUMS_FILE} (it was written before lightning-async-pp "
                      f"recorded checksums, or by torch.distributed.checkpoint directly): its files are read without "
                      f"checking that they are intact", stacklevel=2)
    else:
        verify_file(path, ".metadata", checksums)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise UnreadableCheckpoint(index, f"torch.distributed.checkpoint cannot read it ({_first_line(err)})") from err
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise UnreadableCheckpoint(path, f"the directory has no {META_FILE} (the loops' and callbacks' state)")
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if relative is not None:
            ends[relative] = max(ends.get(relative, 0), end)
    for relative, end in sorted(ends.items()):
        shard = os.path.join(path, relative)
        if not os.path.isfile(shard):
            raise UnreadableCheckpoint(shard, "the shard is missing (.metadata places tensors in it)")
        size = os.path.getsize(shard)
        if size < end:
            raise UnreadableCheckpoint(shard, f"the shard is {size} bytes, but .metadata places tensors in it up to "
                                       f"byte {end}: it was cut short")
    return metadata


def check_file(path: str) -> None:
    """Refuse, before ``torch.load`` reads it, a checkpoint file that is not a ``torch.save`` archive (a zip file with
    its index at the end): one cut short, or not a checkpoint at all; and one whose records fail the CRC-32 that
    ``torch.save`` wrote for each (``torch.load`` does not check them): a damaged file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if not _ends_with_zip_index(path):
        raise UnreadableCheckpoint(path, f"it is not a torch.save archive ({os.path.getsize(path)} bytes without the "
                                   "zip index torch.save writes at its end): it was cut short (a copy or a save "
                                   "interrupted, a full disk), or it is not a checkpoint")
    _check_records(path)


def _check_records(path: str) -> None:
    """Read each record of the ``torch.save`` archive ``path`` through :mod:`zipfile`, which checks its CRC-32 at
    its end. A record whose recorded CRC is 0 is not checked: ``torch.save`` writes 0 when
    ``torch.utils.serialization.config.save.compute_crc32`` is off."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:
                    while record.read(_CHUNK):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise UnreadableCheckpoint(path, f"it fails the checks of its zip records ({err}): it is damaged (it changed "
                                   f"since torch.save wrote it: a flipped bit on the disk or in a copy)") from err


# ---- checksums of a sharded checkpoint's files ----------------------------------------------------------------------
_CHUNK = 8 << 20


def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32 of the file ``path`` as 8 hex digits (zlib's: about 4x as fast as blake2b here, BENCHMARKS.md;
    it is against damage, not tampering)."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _manifest_crc(files: Mapping[str, str]) -> str:
    return f"{zlib.crc32(json.dumps(dict(files), sort_keys=True).encode()):08x}"


def read_checksums(path: str) -> Optional[dict[str, str]]:
    """The CRC-32 of each file that the sharded checkpoint ``path`` recorded at its save (``None`` where it recorded
    none: one written before checksums were). The list carries its own checksum, so damage to it is named as such."""
    manifest = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.isfile(manifest):
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            saved = json.load(f)
        files = {str(k): str(v) for k, v in saved["files"].items()}
        intact = saved["algorithm"] == "crc32" and saved["self"] == _manifest_crc(files)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UnreadableCheckpoint(manifest, f"its list of the files' checksums cannot be read ({_first_line(err)}): "
                                   "it is damaged") from err
    if not intact:
        raise UnreadableCheckpoint(manifest, "its list of the files' checksums fails its own checksum: it is damaged")
    return files


def verify_file(path: str, relative: str, checksums: Mapping[str, str]) -> None:
    """Refuse the file ``relative`` of the sharded checkpoint ``path`` if it no longer has the CRC-32 recorded at its
    save (a file the list does not name is not checked)."""
    expected = checksums.get(relative)
    if expected is None:
        return
    file = os.path.join(path, relative)
    if not os.path.isfile(file):
        raise UnreadableCheckpoint(file, f"the file is missing ({CHECKSUMS_FILE} lists it)")
    found = file_crc32(file)
    if found != expected:
        raise UnreadableCheckpoint(file, f"its CRC-32 is {found}, but {CHECKSUMS_FILE} recorded {expected} when it was "
                                   f"saved: the file changed since (a flipped bit on the disk or in a copy), it is "
                                   f"damaged")


class _FileSums(dict):
    """The CRC-32 of the shard files one process wrote, carried to the coordinator among its write results."""


class ChecksummedWriter(dcp.FileSystemWriter):
    """``torch.distributed.checkpoint``'s file writer, which also records each file's CRC-32 in
    ``checksums.json``: every process hashes the shards it wrote, inside DCP's write (an async save's background
    thread), the coordinator receives them with the write results and, after ``.metadata``, writes the list with
    the checksums of ``.metadata`` and ``meta.pt`` (written before the save). All of it is inside the temporary
    directory, put in place only when complete."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        written = super().write_data(plan, planner)
        written.wait()
        results = list(written.value())
        sums = _FileSums({name: file_crc32(os.path.join(self.path, name))
                          for name in {r.storage_data.relative_path for r in results}})
        future: Future = Future()
        future.set_result([*results, sums])
        return future

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        files: dict[str, str] = {}
        for part in results:
            for r in part:
                if isinstance(r, _FileSums):
                    files.update(r)
        super().finish(metadata, [[r for r in part if isinstance(r, WriteResult)] for part in results])
        for name in (".metadata", META_FILE):
            if os.path.isfile(os.path.join(self.path, name)):
                files[name] = file_crc32(os.path.join(self.path, name))
        with open(os.path.join(self.path, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
            json.dump({"algorithm": "crc32", "files": dict(sorted(files.items())), "self": _manifest_crc(files)}, f,
                      indent=1)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())


def _ends_with_zip_index(path: str) -> bool:
    """Whether the file ends with a zip archive's end record, as every ``torch.save`` file does (it writes no
    archive comment). A file cut short may still hold such records of archives saved inside it (the optimizer
    settings are ``torch.save`` bytes), so only the file's last 22 bytes count."""
    size = os.path.getsize(path)
    if size < 22:
        return False
    with open(path, "rb") as f:
        f.seek(size - 22)
        return f.read(4) == b"PK\x05\x06"


def unreadable_file(path: str, err: BaseException) -> UnreadableCheckpoint:
    """The error to raise when ``torch.load`` of the checkpoint file ``path`` failed with ``err``. A refusal of
    ``weights_only`` loading names what it refused and the safe way to allow it."""
    if isinstance(err, pickle.UnpicklingError) and "weights_only" in str(err).lower():
        refused = _refused_global(str(err))
        return UnreadableCheckpoint(
            path, f"it holds an object that torch.load(weights_only=True) will not build"
            f"{f' ({refused})' if refused else f' ({_first_line(err)})'}", SAFE_GLOBALS)
    return UnreadableCheckpoint(path, f"torch.load failed ({_first_line(err)}): it is damaged")


# ---- loading into a layout ---------------------------------------------------------------------------------------
def model_key(engine: Any, name: str) -> str:
    return MODEL + engine.aliases.get(name, name)


def check_model_fits(engine: Any, module_state: Mapping[str, Tensor], source: TensorSource, whole_model: bool,
                     check: Callable[[dict, dict, str], None], strict: bool = True) -> None:
    """Names and shapes of the module state against the checkpoint's (all of them when this process holds the
    whole model, else those of its own stage). Not ``strict``: only the shapes of the names both have, as
    ``Module.load_state_dict(strict=False)`` (missing and unexpected names are left out)."""
    expected = {engine.aliases.get(n, n): tuple(t.shape) for n, t in module_state.items()}
    found = {k[len(MODEL):]: tuple(shape[0]) for k, shape in source.shapes.items()
             if k.startswith(MODEL) and shape is not None and (whole_model or k[len(MODEL):] in expected)}
    if not strict:
        expected = {n: shape for n, shape in expected.items() if n in found}
        found = {n: shape for n, shape in found.items() if n in expected}
    check(expected, found, "the model's state_dict")


def needed_keys(engine: Any, module_state_names: Iterable[str], source: TensorSource,
                optimizer_owned: Optional[set[str]] = None) -> list[str]:
    """The keys this process reads: its module state, the stashed versions its stages hold under their delay
    (those the checkpoint has) and its parameters' optimizer states (with ``optimizer_owned``, a sharded
    optimizer's names: only those parameters' state, and every parameter's group settings)."""
    keys = {model_key(engine, n) for n in module_state_names}
    for view in engine.stats.stages:
        for o in range(0 if view.predicts else 1, view.delay + 1):
            keys.update(f"{STASH}{o}.{n}" for n in view.param_names)
    own = {n for view in engine.stats.stages for n in view.param_names}
    keys.update(k for k in source.shapes if k.startswith(OPTIM) and k.split("/", 2)[1] in own
                and (optimizer_owned is None or k.endswith("/" + GROUP) or k.split("/", 2)[1] in optimizer_owned))
    return sorted(k for k in keys if k in source.shapes)


def layouts(engine: Any, keys: Iterable[str], source: TensorSource) -> dict[str, DTensorSpec]:
    """The keys among ``keys`` that this process holds as DTensors (tensor parallelism) and how: a DTensor
    parameter's weights (``model.``, ``stash.``) and its optimizer state of the parameter's shape, laid out as the
    parameter (a scalar such as AdamW's ``step`` stays whole), or of its shape behind one more leading dimension
    (``DelayCompensation``'s stacked weight history), laid out as the parameter along the others. Empty without
    tensor parallelism."""
    specs = {n: (dtensor_spec(p), tuple(p.shape)) for view in engine.stats.stages
             for n, p in zip(view.param_names, view.params)}
    specs = {n: spec for n, spec in specs.items() if spec[0] is not None}
    if not specs:
        return {}
    out: dict[str, DTensorSpec] = {}
    for key in keys:
        if key.startswith(MODEL):
            name = key[len(MODEL):]
        elif key.startswith(STASH):
            name = key[len(STASH):].split(".", 1)[1]
        elif key.startswith(OPTIM):
            name = key.split("/", 2)[1]
        else:
            continue
        saved = source.shapes.get(key)
        if name not in specs or saved is None:
            continue
        spec, shape = specs[name]
        if tuple(saved[0]) == shape:
            out[key] = spec
        elif key.startswith(OPTIM) and tuple(saved[0][1:]) == shape:
            out[key] = _stacked(spec, int(saved[0][0]))
    return out


def _stacked(spec: DTensorSpec, n: int) -> DTensorSpec:
    """The layout of ``n`` tensors laid out as ``spec`` stacked along a new first dimension: each sharded dimension
    one further on."""
    from torch.distributed.tensor import Shard

    mesh, placements, shape, _ = spec
    shifted = tuple(Shard(p.dim + 1) if p.is_shard() else p for p in placements)
    whole = torch.Size((n, *shape))
    return mesh, shifted, whole, torch.empty(whole, device="meta").stride()


def load_engine(engine: Any, module: nn.Module, tensors: Mapping[str, Any], num_updates: int,
                strict: bool = True) -> None:
    """Load the module state and every held weight version of this process's stages.

    A version the checkpoint lacks (it was saved with a smaller delay: 1f1b -> 2bw) is the newest one: the delay
    starts from the loaded weights, as at the first update of a run. A checkpoint with a larger delay than this
    run (2bw -> 1f1b) continues from its newest weights. Not ``strict``: a parameter or buffer the checkpoint lacks
    keeps its present value (in every version), as ``Module.load_state_dict(strict=False)`` keeps it.
    """
    names = [n for n in module.state_dict() if strict or model_key(engine, n) in tensors]
    module.load_state_dict({n: tensors[model_key(engine, n)] for n in names}, strict=strict)
    stages: dict[str, Any] = {}
    for view in engine.stats.stages:
        newest = {n: tensors[MODEL + n] if strict or MODEL + n in tensors else p.detach().clone()
                  for n, p in zip(view.param_names, view.params)}
        versions = {num_updates: newest}
        for o in range(1, min(view.delay, num_updates) + 1):
            versions[num_updates - o] = {n: tensors.get(f"{STASH}{o}.{n}", newest[n]) for n in view.param_names}
        stages[str(view.index)] = {"num_updates": num_updates, "delay": view.delay, "versions": versions}
        if view.predicts and all(f"{STASH}0.{n}" in tensors for n in view.param_names):
            stages[str(view.index)]["predicted_newest"] = {n: tensors[f"{STASH}0.{n}"] for n in view.param_names}
    engine.load_state_dict({"stages": stages})


def has_optimizer_state(source: TensorSource) -> bool:
    return any(k.startswith(OPTIM) for k in source.shapes)


def load_optimizers(optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str], tensors: Mapping[str, Any]) -> None:
    """Give each optimizer the saved state and group hyperparameters of its own parameters (by name)."""
    saved: dict[tuple[str, str], dict[str, Any]] = {}  # (optimizer prefix, parameter name) -> {key: value}
    for key, value in tensors.items():
        if key.startswith(OPTIM):
            prefix, name, entry = key.split("/", 2)
            saved.setdefault((prefix, name), {})[entry] = value
    for i, sharded in enumerate(optimizers):
        prefix = f"{OPTIM}{i}"
        optimizer = local_optimizer(sharded)
        if optimizer is not sharded:
            # The exposed groups take the settings saved with their parameters, also where this replica owns
            # none of a group's parameters (its local group is then empty).
            for group in sharded.param_groups:
                hyper = next((saved[(prefix, names[id(p)])][GROUP] for p in group["params"]
                              if GROUP in saved.get((prefix, names[id(p)]), {})), None)
                if hyper is not None:
                    group.update(read_settings(hyper, f"{prefix}/{names[id(group['params'][0])]}/{GROUP}"))
        state: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for group in optimizer.param_groups:
            params = list(group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            first = saved.get((prefix, names[id(params[0])]), {}) if params else {}
            if GROUP in first:
                # The saved group's hyperparameters, but not its member list: in another layout the group holds
                # other parameters, and ``param_names`` must stay this group's own.
                settings = read_settings(first[GROUP], f"{prefix}/{names[id(params[0])]}/{GROUP}")
                hyper.update({k: v for k, v in settings.items() if k != "param_names"})
            groups.append({**hyper, "params": list(range(index, index + len(params)))})
            for p in params:
                entry = {k: v for k, v in saved.get((prefix, names[id(p)]), {}).items() if k != GROUP}
                if entry:
                    state[index] = entry
                index += 1
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        sync_group_settings(sharded)


def owned_parameters(optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str]) -> Optional[set[str]]:
    """The names of the parameters whose optimizer state this process holds, when its optimizers are sharded
    (``None`` otherwise: it holds them all)."""
    locals_ = [local_optimizer(o) for o in optimizers]
    if all(local is o for local, o in zip(locals_, optimizers)):
        return None
    return {names[id(p)] for local in locals_ for g in local.param_groups for p in g["params"]}


# ---- writing a checkpoint safely ----------------------------------------------------------------------------------
#: Temporaries are written under this folder beside the target, out of the names Lightning lists when it looks for a
#: checkpoint to resume (``last*.ckpt`` for ``ckpt_path="last"``, any name containing ``hpc_ckpt_`` for SLURM):
#: a partial write must never be a candidate (docs/design/checkpoints.md, "Faults").
PARTIAL_DIR = ".partial"


def partial_path(path: str) -> str:
    """Where a checkpoint for ``path`` is written before it is put in place (same filesystem, so a rename moves it)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, PARTIAL_DIR, name)


def save_sharded(path: str, flat: Mapping[str, Any], meta: Mapping[str, Any], *, is_coordinator: bool,
                 barrier: Callable[[], None]) -> None:
    """Write ``flat`` through ``torch.distributed.checkpoint`` (collective) and ``meta`` into directory ``path``.

    Everything goes into :func:`partial_path` first; only a complete checkpoint is put in place
    (:func:`put_in_place`), so a crash mid-save leaves the previous checkpoint at ``path``."""
    tmp = begin_sharded(path, is_coordinator=is_coordinator, barrier=barrier)
    if is_coordinator:  # before the shards: the coordinator's write lists its checksum with theirs
        torch.save(dict(meta), os.path.join(tmp, META_FILE))
    dcp.save(dict(flat), storage_writer=ChecksummedWriter(tmp), no_dist=not torch.distributed.is_initialized())
    if is_coordinator:
        put_in_place(tmp, path)
    barrier()


def begin_sharded(path: str, *, is_coordinator: bool, barrier: Callable[[], None]) -> str:
    """An empty temporary directory for a sharded save of ``path`` (created by the coordinator, then a barrier)."""
    tmp = partial_path(path)
    if is_coordinator:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    return tmp


class PendingSave:
    """A sharded save written in the background (``torch.distributed.checkpoint.async_save``), put in place by
    :meth:`finish` once every shard is written. Checkpoints to delete meanwhile (Lightning removing the previous
    top-k one) wait for it, so the newest complete checkpoint is never removed before its successor is in place."""

    def __init__(self, path: str, flat: Mapping[str, Any], meta: Mapping[str, Any], *, is_coordinator: bool,
                 barrier: Callable[[], None], process_group: Any = None) -> None:
        self.path, self.is_coordinator = path, is_coordinator
        self.removals: list[Callable[[], None]] = []
        tmp = begin_sharded(path, is_coordinator=is_coordinator, barrier=barrier)
        if is_coordinator:
            # Now, not at finish: ``meta`` holds live objects (callback states such as ModelCheckpoint's top-k map)
            # that the next save changes before this one is finished.
            torch.save(dict(meta), os.path.join(tmp, META_FILE))
        # The tensors are copied (staged) before this returns, so training may change them at once.
        self.future = dcp.async_save(dict(flat), storage_writer=ChecksummedWriter(tmp), process_group=process_group,
                                     no_dist=not torch.distributed.is_initialized())

    def finish(self) -> None:
        """Wait for the write (its error, if any, is raised here); the coordinator then puts the checkpoint in place,
        and runs the removals that waited for it. A checkpoint whose write failed is never put in place. The
        coordinator's write finishes after every process's (DCP writes the metadata once all shards are written), so
        no barrier is needed before the rename."""
        self.future.result()
        if self.is_coordinator:
            put_in_place(partial_path(self.path), self.path)
        for remove in self.removals:
            remove()


def put_in_place(tmp: str, path: str) -> None:
    """Move the complete checkpoint ``tmp`` (a file or a directory) to ``path``, replacing what is there.

    A directory cannot be renamed over a non-empty one, so replacing a sharded checkpoint swaps the two atomically
    (Linux ``renameat2(RENAME_EXCHANGE)``): ``path`` always holds a complete checkpoint, the old or the new one. Where
    the filesystem cannot swap, the old one goes to ``<path>.old`` for the instant between two renames, and
    :func:`resolve` finds it there."""
    if os.path.isdir(path) and _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
    else:
        old = f"{path}.old"
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        elif os.path.isdir(tmp) and os.path.exists(path):
            os.remove(path)  # a single file replaced by a directory
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(tmp))  # the partial folder, once nothing else is being written there
    except OSError:
        pass


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False where the platform or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def is_sharded(path: str) -> bool:
    return os.path.isdir(resolve(path))


def resolve(path: str) -> str:
    """``path``, or the previous checkpoint a crash between the two renames of :func:`put_in_place` left at
    ``<path>.old`` (only where the filesystem cannot swap directories atomically)."""
    if not os.path.exists(path) and os.path.isdir(f"{path}.old"):
        return f"{path}.old"
    return path


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


def consolidate(src: str, dst: str) -> dict[str, Any]:
    """Turn the sharded checkpoint ``src`` into one checkpoint file ``dst``: the module's ``state_dict`` (newest
    weights, under every name a tied parameter has) plus the rest of the flat dictionary, so the file loads with
    ``load_from_checkpoint`` anywhere and still resumes a pipeline in any layout. Returns the checkpoint."""
    src = resolve(src)
    source = ShardedSource(src)
    checkpoint = read_meta(src)
    flat = source.read(source.shapes)
    checkpoint.update(single_file_parts(flat, checkpoint["async_pipeline"]))
    tmp = f"{dst}.tmp-{os.getpid()}"
    torch.save(checkpoint, tmp)
    os.replace(tmp, dst)
    return checkpoint


def read_model_state(src: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The sharded checkpoint ``src``'s non-tensor part (hyperparameters and the rest) and its module ``state_dict``
    (newest weights, aliases included), without reading the optimizer states."""
    src = resolve(src)
    source = ShardedSource(src)
    checkpoint = read_meta(src)
    flat = source.read([k for k in source.shapes if k.startswith(MODEL)])
    return checkpoint, single_file_parts(flat, checkpoint["async_pipeline"])["state_dict"]


def single_file_parts(flat: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a single-file checkpoint holds: ``state_dict`` (newest weights, aliases included) and the rest."""
    state = {k[len(MODEL):]: v for k, v in flat.items() if k.startswith(MODEL)}
    for alias, name in meta.get("aliases", {}).items():
        if name in state:
            state[alias] = state[name]
    rest = {k: v for k, v in flat.items() if not k.startswith(MODEL)}
    return {"state_dict": state, "async_pipeline": {**meta, "tensors": rest}}


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
