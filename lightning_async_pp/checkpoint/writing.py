"""Writing a checkpoint safely: into a temporary folder beside the target, put in place only when complete (an
atomic swap of directories where the filesystem has one), in the foreground or in the background
(docs/design/checkpoints.md, "Faults")."""
from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from lightning_async_pp.checkpoint.checksums import ChecksummedWriter
from lightning_async_pp.checkpoint.format import META_FILE

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
