"""What a checkpoint's files are: the keys of the flat dictionary, the files beside the shards, and reading what
is not a tensor without running code (``torch.load(weights_only=True)``); the error that names a checkpoint that
cannot be read, what is wrong with it and the way out."""
from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch

MODEL, STASH, OPTIM, GROUP = "model.", "stash.", "optim.", "@group"

META_FILE = "meta.pt"

#: Each file's CRC-32 in a sharded checkpoint (docs/design/checkpoints.md, "Checksums"); earlier ones have none.
CHECKSUMS_FILE = "checksums.json"

FORMAT = 1


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
    return f"{type(err).__name__}: {line}" if line else type(err).__name__  # whole: a cut reason hides its end

def unreadable_file(path: str, err: BaseException) -> UnreadableCheckpoint:
    """The error to raise when ``torch.load`` of the checkpoint file ``path`` failed with ``err``. A refusal of
    ``weights_only`` loading names what it refused and the safe way to allow it."""
    if isinstance(err, pickle.UnpicklingError) and "weights_only" in str(err).lower():
        refused = _refused_global(str(err))
        return UnreadableCheckpoint(
            path, f"it holds an object that torch.load(weights_only=True) will not build"
            f"{f' ({refused})' if refused else f' ({_first_line(err)})'}", SAFE_GLOBALS)
    return UnreadableCheckpoint(path, f"torch.load failed ({_first_line(err)}): it is damaged")
