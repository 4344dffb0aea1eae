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

The package, one concern per module (the names the strategy, consolidation and export use are importable from
``lightning_async_pp.checkpoint``):

- ``format.py``: the keys and files, reading what is not a tensor without running code, :class:`UnreadableCheckpoint`;
- ``checksums.py``: each file's CRC-32 recorded at the save and checked before any read;
- ``sources.py``: reading the flat dictionary from a sharded directory or a single file (:class:`TensorSource`);
- ``layouts.py``: what a process contributes, and what it reads back in any layout (stages, data-parallel
  replicas, tensor-parallel ranks, partition);
- ``writing.py``: the temporary folder, the background save, putting a complete checkpoint in place;
- ``consolidation.py``: a sharded checkpoint into one file or a ``state_dict``.

A new format is a new way to write and read the same flat dictionary: a :class:`TensorSource` for reading, and
the writer beside ``writing.py``'s.
"""
from lightning_async_pp.checkpoint.checksums import (ChecksummedWriter, check_file, check_sharded, file_crc32,
                                                     read_checksums, verify_file)
from lightning_async_pp.checkpoint.consolidation import consolidate, read_model_state, single_file_parts
from lightning_async_pp.checkpoint.format import (CHECKSUMS_FILE, FORMAT, GROUP, META_FILE, MODEL, OPTIM, STASH,
                                                  UnreadableCheckpoint, read_settings, settings_bytes, unreadable_file)
from lightning_async_pp.checkpoint.layouts import (check_model_fits, checkpoint_meta, engine_tensors,
                                                   has_optimizer_state, layouts, load_engine, load_optimizers,
                                                   model_key, needed_keys, owned_parameters, plain_optimizer_tensors)
from lightning_async_pp.checkpoint.sources import MemorySource, ShardedSource, TensorSource, file_source, read_meta
from lightning_async_pp.checkpoint.writing import (PARTIAL_DIR, PendingSave, begin_sharded, is_sharded, partial_path,
                                                   put_in_place, resolve, save_sharded)

__all__ = [
    "CHECKSUMS_FILE", "FORMAT", "GROUP", "META_FILE", "MODEL", "OPTIM", "STASH", "UnreadableCheckpoint",
    "read_settings", "settings_bytes", "unreadable_file",
    "ChecksummedWriter", "check_file", "check_sharded", "file_crc32", "read_checksums", "verify_file",
    "PARTIAL_DIR", "PendingSave", "begin_sharded", "is_sharded", "partial_path", "put_in_place", "resolve",
    "save_sharded",
    "MemorySource", "ShardedSource", "TensorSource", "file_source", "read_meta",
    "check_model_fits", "checkpoint_meta", "engine_tensors", "has_optimizer_state", "layouts", "load_engine",
    "load_optimizers", "model_key", "needed_keys", "owned_parameters", "plain_optimizer_tensors",
    "consolidate", "read_model_state", "single_file_parts",
]
