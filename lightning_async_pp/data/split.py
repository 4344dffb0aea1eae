"""The train/validation split of a corpus and the order its training pieces are written in (docs/design/data.md,
'Data').

A corpus is cut into *pieces*, byte ranges ``(path, start, stop)`` of its files (:data:`Segment`), of about
:func:`piece_bytes` bytes: a ``.jsonl`` file at line starts (a piece holds the whole records whose line starts in it),
a text file at the next line start where one is within a piece, else at the next word start (else at a character,
``corpus.segment_text``), a ``.parquet`` file also at its row groups' starts (a piece holds the rows whose
proportional position falls in it).

- **Validation** is every ``1 / val_fraction``-th piece from a seeded start, the files walked in a seeded order (the
  same order that picks the files a ``max_bytes`` cap keeps): ``val_fraction`` of the pieces, so about that share of
  the bytes whatever the file sizes, spread over the corpus; every file of at least ``1 / val_fraction`` pieces gives
  some, and a small file is held out whole or not at all. Records are never cut.
- **Training** is the other pieces, adjacent ones of a file joined up to :func:`train_piece_bytes` (a ``.parquet``
  file's up to its row group, which it is read by), in a seeded shuffle: the order the cache is written in, so each
  chunk litdata reads holds pieces of the whole corpus.

Every piece of text is a document of its own (the tokenizer's end-of-text token after it; a NUL byte under
``document_mask``), as a file cut by the split always was. One seed gives one split and one order; prepare and
``TextDataModule`` make the same.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union

from lightning_async_pp.data.inputs import suffix

#: ``(path, start, stop)``: the bytes ``[start, stop)`` of a file.
Segment = tuple[str, int, int]

#: The share of the corpus held out for validation, for ``TextDataModule`` and ``prepare`` alike.
DEFAULT_VAL_FRACTION = 0.01
#: How many pieces the training split is cut into at least, where they can be at least MIN_PIECE_BYTES: the first tenth
#: of an epoch then draws on about a hundred of them, from across the corpus.
TRAIN_PIECES = 1024
#: The shortest piece where the corpus allows it.
MIN_PIECE_BYTES = 1 << 12
#: The longest training piece: 64 KiB of text, about 16K ids of a BPE tokenizer, longer than the rows trained on.
MAX_PIECE_BYTES = 1 << 16
#: How many pieces a large held-out share is spread over (pieces of its 64th part).
VAL_PIECES = 64


def check_val_fraction(val_fraction: float) -> float:
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1) (the share of the corpus held out for validation; default "
                         f"{DEFAULT_VAL_FRACTION}), got {val_fraction!r}")
    return float(val_fraction)


def train_piece_bytes(total: int) -> int:
    """The longest training piece of a corpus of ``total`` bytes: its :data:`TRAIN_PIECES`-th part, at least 4 KiB,
    at most 64 KiB (from a 64 MiB corpus on)."""
    return min(max(total // TRAIN_PIECES, MIN_PIECE_BYTES), MAX_PIECE_BYTES)


def piece_bytes(total: int, held: int) -> int:
    """The size a corpus of ``total`` bytes, ``held`` of them to hold out, is cut at: ``held``'s 64th part
    (:data:`VAL_PIECES`), at least 4 KiB or ``held`` where that is less, at most the longest training piece and
    ``total - held`` (so that both splits get a piece); the longest training piece when nothing is held out."""
    longest = train_piece_bytes(total)
    if held <= 0:
        return longest
    return max(1, min(max(held // VAL_PIECES, min(MIN_PIECE_BYTES, held)), longest, total - held))


def split_corpus(
    files: Sequence[Union[str, Path]], val_fraction: float = DEFAULT_VAL_FRACTION, max_bytes: Optional[int] = None,
    seed: int = 42,
) -> tuple[list[Segment], list[Segment]]:
    """``(train, val)``: the corpus's pieces held out for validation (in the corpus's order) and those left for
    training (in a seeded shuffle), deterministically for a ``seed`` (see the module's docstring).

    The files are taken in a seeded shuffle of their sorted order; ``max_bytes`` caps the corpus there (the last file
    taken is truncated), so a cap still samples the whole corpus. Each file's pieces tile the bytes taken of it,
    training is never empty, and validation holds a piece wherever ``floor(val_fraction * total)`` is a byte or more.
    """
    check_val_fraction(val_fraction)
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    rng = random.Random(seed)
    order = sorted(str(f) for f in files)
    rng.shuffle(order)

    taken: list[tuple[str, int]] = []
    total = 0
    for path in order:
        size = os.path.getsize(path)
        if max_bytes is not None:
            size = min(size, max_bytes - total)
        if size > 0:
            taken.append((path, size))
            total += size
        if max_bytes is not None and total >= max_bytes:
            break
    if not taken:
        raise ValueError("The corpus is empty")

    held = int(total * val_fraction)  # < total, as val_fraction < 1
    piece, longest = piece_bytes(total, held), train_piece_bytes(total)
    cut = [_cuts(path, size, piece) for path, size in taken]
    count = sum(len(c) - 1 for c in cut)
    if held and count < 2:
        path, size = taken[0]
        raise ValueError(f"val_fraction={val_fraction} holds out whole pieces of the corpus, but its {size} bytes "
                         f"({path}) are one piece (a .jsonl record or a .parquet row group is never cut): there is "
                         f"nothing to hold out that would leave training some; give more documents, or "
                         f"val_fraction=0 for no validation")
    flags = _held_out(count, val_fraction if held else 0.0, rng)
    train: list[Segment] = []
    val: list[Segment] = []
    at = 0
    for (path, _), cuts in zip(taken, cut):
        groups = _row_groups(path, cuts)
        pieces = [(path, a, b) for a, b in zip(cuts, cuts[1:])]
        held_out = flags[at:at + len(pieces)]
        at += len(pieces)
        start = 0
        for i in range(1, len(pieces) + 1):  # runs of pieces on one side of the split
            if i == len(pieces) or held_out[i] != held_out[start]:
                run = pieces[start:i]
                (val if held_out[start] else train).extend(_join(run, groups[start:i], longest))
                start = i
    rng.shuffle(train)
    return train, val


def _held_out(n: int, fraction: float, rng: random.Random) -> list[bool]:
    """Which of ``n`` pieces are held out: every ``1 / fraction``-th from a seeded start (systematic sampling), at
    least one, and of two or more never all."""
    if fraction <= 0.0 or n == 0:
        return [False] * n
    start = rng.random()
    flags = [math.floor((i + 1) * fraction + start) > math.floor(i * fraction + start) for i in range(n)]
    if not any(flags):  # n * fraction fell short of 1 by float rounding
        flags[min(n - 1, int(start * n))] = True
    if all(flags) and n > 1:
        flags[-1] = False
    return flags


def _join(run: list[Segment], groups: list[Optional[int]], longest: int) -> list[Segment]:
    """Adjacent pieces of one file joined: up to ``longest`` bytes, or, in a ``.parquet`` file (``groups``: the row
    group of each piece), within their row group, whatever its size (each piece reads its row group)."""
    joined: list[Segment] = []
    last_group: Optional[int] = None
    for (path, a, b), group in zip(run, groups):
        if joined:
            _, ja, jb = joined[-1]
            same = group == last_group if group is not None else b - ja <= longest
            if same and jb == a:
                joined[-1] = (path, ja, b)
                continue
        joined.append((path, a, b))
        last_group = group
    return joined


# ---- where a file is cut ------------------------------------------------------------------------------------------
def _cuts(path: str, size: int, piece: int) -> list[int]:
    """``0 = c_0 < c_1 < ... < c_n = size``: the file's first ``size`` bytes cut into pieces of about ``piece`` bytes,
    each cut moved to a line start (see the module's docstring)."""
    n = max(1, -(-size // piece))
    grid = [i * size // n for i in range(1, n)]
    kind = suffix(path)
    if kind == ".parquet":
        cuts = set(grid) | {c for c in _row_group_starts(path) if 0 < c < size}
    else:
        with open(path, "rb") as f:
            # A record file's cut goes to the next line start however far (a record is never cut); text's only
            # within a piece.
            record = kind == ".jsonl"
            cuts = {_line_start(f, c, size if record else min(size, c + piece), record) for c in grid}
    return [0, *sorted(c for c in cuts if 0 < c < size), size]


def _line_start(f: BinaryIO, at: int, stop: int, record: bool) -> int:
    """The first line start at or after ``at`` before ``stop``; where there is none, ``stop`` for a ``record`` file
    (its last record runs on to there), else the first word start (after a space or tab: a line of text8's kind),
    else ``at`` (a character start there, ``corpus.segment_text``). Text's ``stop`` is a piece away at most."""
    f.seek(at - 1)
    if f.read(1) == b"\n":
        return at
    pos, first = at, b""
    while pos < stop:  # a record file's next line start may be far: read on in blocks
        block = f.read(min(1 << 16, stop - pos))
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return pos + found + 1
        first = first or block
        pos += len(block)
    if record:
        return stop
    words = [i for i in (first.find(b" "), first.find(b"\t")) if i >= 0]
    return at + min(words) + 1 if words else at


def _row_group_starts(path: str) -> list[int]:
    """The byte at which each row group's first row starts in the proportional mapping (row ``r`` at
    ``r * file_size / num_rows``, see ``tokenized.py``)."""
    meta = parquet_metadata(path)
    size, rows = os.path.getsize(path), meta.num_rows
    starts, row = [], 0
    for g in range(meta.num_row_groups):
        starts.append(row * size // rows if rows else 0)
        row += meta.row_group(g).num_rows
    return starts


def _row_groups(path: str, cuts: list[int]) -> list[Optional[int]]:
    """The row group each piece of a ``.parquet`` file starts in; ``None`` for each piece of another file."""
    if suffix(path) != ".parquet":
        return [None] * (len(cuts) - 1)
    starts = _row_group_starts(path)
    return [max(0, bisect.bisect_right(starts, a) - 1) for a in cuts[:-1]]


def parquet_metadata(path: str) -> Any:
    """pyarrow's metadata of a ``.parquet`` file (rows, row groups), read once per file version."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    return _metadata(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _metadata(path: str, stamp: int) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata
