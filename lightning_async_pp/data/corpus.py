"""Byte-level corpora and their one-time tokenization into litdata chunks.

Tokens are bytes (vocabulary 256), so tokenizing is reading a file. The default corpus is the Python standard
library's own sources (about 12 MB of ``.py`` files, ``pydoc_data/topics.py`` among them), found at run time
through ``sysconfig``: every Python installation carries it, so the demo needs no download.

A corpus is cut into *segments* ``(path, start, stop)``: byte ranges of files, validation a seeded choice of them
from across the corpus and training the others in a seeded shuffle (``data/split.py``); the cache holds each split in
that order. Which files are text, in which encoding, and their content hashes: ``data/inputs.py``.
"""
from __future__ import annotations

import codecs
import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from lightning_async_pp.data.inputs import DEFAULT_ENCODING, content_sha256, is_utf8, is_utf8_family
from lightning_async_pp.data.split import (  # noqa: F401  (the split's names, where they were before)
    DEFAULT_VAL_FRACTION,
    Segment,
    check_val_fraction,
    split_corpus,
)

VOCAB_SIZE = 256
#: Bump when the on-disk layout or the tokenization changes, so old caches are not reused.
# 2: the token order is the split's at any number of workers (see _optimize); 3: keyed by content hash and encoding,
# a text piece is the characters that start in it (segment_text)
_CACHE_FORMAT = 3
_COMPLETE_MARKER = "COMPLETE.json"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


# ---- tokens ------------------------------------------------------------------------------------------------------
def encode(data: Union[str, bytes]) -> torch.Tensor:
    """Text (UTF-8) or bytes -> 1-D LongTensor of token ids 0..255."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.empty(0, dtype=torch.long)


def decode(tokens: Union[torch.Tensor, Sequence[int]]) -> bytes:
    """Token ids -> the bytes they stand for."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values)


def tokenize_segment(segment: Segment, encoding: str = DEFAULT_ENCODING,
                     document_end: Optional[int] = None) -> Iterator[torch.Tensor]:
    """``litdata.optimize`` worker function: one segment -> one uint8 tensor of its bytes (one byte per token). Text
    in another encoding than UTF-8 is transcoded to UTF-8 (see :func:`segment_text`). ``document_end``: a byte
    appended after the segment, which ends its document (``TextDataModule(document_mask=True)``)."""
    path, start, stop = segment
    if is_utf8(encoding):
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
    else:
        data = segment_text(path, start, stop, encoding).encode("utf-8")
    if data and document_end is not None:
        data = bytes(data) + bytes([document_end])
    if data:  # litdata cannot store empty items
        yield torch.frombuffer(bytearray(data), dtype=torch.uint8)


def byte_tokenizer(encoding: str = DEFAULT_ENCODING,
                   document_end: Optional[int] = None) -> Callable[[Segment], Iterator[torch.Tensor]]:
    """:func:`tokenize_segment` for text in ``encoding`` (picklable, for litdata's workers)."""
    if document_end is None:
        return functools.partial(tokenize_segment, encoding=encoding)
    return functools.partial(tokenize_segment, encoding=encoding, document_end=document_end)


def segment_text(path: str, start: int, stop: int, encoding: str = DEFAULT_ENCODING) -> str:
    """The characters of a file that start in ``[start, stop)``, decoded: a character a cut crosses belongs to the
    piece its first byte is in, so pieces decode on their own and together are the file's text once. In UTF-8 a
    cut moves past continuation bytes (``10xxxxxx``); in a one-byte encoding it stays (``inputs.check_encoding``)."""
    with open(path, "rb") as f:
        if is_utf8_family(encoding):
            start, stop = _char_start(f, start), _char_start(f, stop)
        f.seek(start)
        return f.read(max(0, stop - start)).decode(encoding)


def _char_start(f: Any, at: int) -> int:
    """The first byte at or after ``at`` that is not a UTF-8 continuation byte (a character starts there)."""
    f.seek(at)
    data = f.read(4)  # a character has at most 3 continuation bytes
    return at + next((i for i, byte in enumerate(data) if byte & 0xC0 != 0x80), len(data))


# ---- finding files -----------------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` sources (tests and installed packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file() and p.stat().st_size > 0
    ]
    topics = root / "pydoc_data" / "topics.py"
    if topics.is_file() and topics not in files:
        files.append(topics)
    if not files:
        raise FileNotFoundError(f"Found no Python sources under the standard library directory {root}")
    return sorted(files)


def text_files(path: Union[str, Path]) -> list[Path]:
    """A file -> itself; a folder -> every non-hidden, non-empty file below it, sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data_path {str(path)!r} does not exist")
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and p.stat().st_size > 0
    ]
    if not files:
        raise FileNotFoundError(f"data_path {str(path)!r} contains no non-empty files")
    return sorted(files)


# ---- cache keys -------------------------------------------------------------------------------------------------
def corpus_key(train: Sequence[Segment], val: Sequence[Segment], tokens: Optional[dict[str, Any]] = None,
               encoding: str = DEFAULT_ENCODING) -> str:
    """A short hash naming the cache of this exact split (paths, byte ranges, the files' contents and ``encoding``)
    and, for a tokenized corpus, of its tokenization (``tokens``: the tokenizer's hash, the text field, ...).

    Reads every file of the split once (``inputs.content_sha256``): the content hash, not size and mtime, so a file
    rewritten with both kept names another cache; text that is not valid ``encoding`` is refused here, before
    anything is tokenized."""
    paths = sorted({seg[0] for seg in (*train, *val)})
    content: dict[str, Any] = {"format": _CACHE_FORMAT, "train": list(train), "val": list(val),
                               "sha256": [(p, content_sha256(p, encoding)) for p in paths],
                               "encoding": codecs.lookup(encoding).name}
    if tokens is not None:
        content["tokens"] = tokens
    blob = json.dumps(content, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---- one-time tokenization ---------------------------------------------------------------------------------------
def is_complete(cache: Union[str, Path]) -> bool:
    return cache_info(cache) is not None


def cache_info(cache: Union[str, Path]) -> Optional[dict[str, Any]]:
    """The completion marker of a cache (``vocab_size``, ``dtype``, sizes, ...), or ``None`` if it has none (or
    one that does not parse: a cache is not complete until its marker is)."""
    marker = Path(cache) / _COMPLETE_MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def build_token_cache(
    train: Sequence[Segment],
    val: Sequence[Segment],
    cache: Union[str, Path],
    num_workers: Optional[int] = None,
    chunk_bytes: int = 1 << 20,
    fn: Callable[[Segment], Iterator[torch.Tensor]] = tokenize_segment,
    info: Optional[dict[str, Any]] = None,
    before_marker: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Tokenize ``train`` into ``cache/train`` and ``val`` into ``cache/val`` with ``litdata.optimize``, once.

    ``fn`` turns a segment into token tensors (default: its bytes); ``info`` is written into the completion marker
    (default: vocabulary 256, uint8); ``before_marker(cache)`` adds files before the cache is marked complete.
    Safe to call from every process at once: an exclusive file lock serializes them, the first one builds, and
    the others find the completion marker and return. A half-written cache (no marker) is rebuilt.
    """
    cache = Path(cache)
    if is_complete(cache):
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache.with_name(cache.name + ".lock")):
        if is_complete(cache):  # another process built it while we waited
            return cache
        shutil.rmtree(cache, ignore_errors=True)
        nbytes = sum(stop - start for _, start, stop in (*train, *val))
        print(f"Tokenizing {nbytes / 1e6:.1f} MB ({len(train)} train / {len(val)} val segments) into {cache} "
              "(once; later runs reuse it)", flush=True)
        t0 = time.perf_counter()
        for split, segments in (("train", train), ("val", val)):
            if segments:
                _optimize(segments, cache / split, num_workers, chunk_bytes, fn)
        for split, segments in (("train", train), ("val", val)):
            if segments and _tokens(cache / split) == 0:  # litdata would fail to read it, later and obscurely
                raise ValueError(f"the {split} split holds no tokens: its {sum(b - a for _, a, b in segments)} bytes "
                                 f"({', '.join(f'{p}[{a}:{b}]' for p, a, b in segments[:3])}) hold no document that "
                                 f"starts in them (a .jsonl record or .parquet row a cut crosses belongs to the "
                                 f"piece its start is in); give a larger val_fraction or max_bytes, or "
                                 f"val_fraction=0 for no validation")
        if before_marker is not None:
            before_marker(cache)
        marker = {**(info or {"vocab_size": VOCAB_SIZE, "dtype": "uint8"}),
                  "train_tokens": _tokens(cache / "train"), "val_tokens": _tokens(cache / "val"),
                  "train_bytes": sum(s[2] - s[1] for s in train), "val_bytes": sum(s[2] - s[1] for s in val),
                  "seconds": round(time.perf_counter() - t0, 2)}
        # Written beside it and renamed: prepare, the vocabulary checks and consolidate trust a marker that exists.
        tmp = cache / (_COMPLETE_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, cache / _COMPLETE_MARKER)
    return cache


def _optimize(segments: Sequence[Segment], output_dir: Path, num_workers: Optional[int], chunk_bytes: int,
              fn: Callable[[Segment], Iterator[torch.Tensor]] = tokenize_segment) -> None:
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    workers = num_workers or min(len(segments), os.cpu_count() or 1, 4)
    # fork, not litdata's default spawn: a spawned worker re-imports torch and Lightning (~5 s each, longer than
    # tokenizing the whole default corpus) and re-runs an unguarded ``__main__`` script. The workers only read
    # files and copy bytes or run a tokenizer they load themselves, which is safe in a forked child.
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    # litdata.optimize reseeds the global RNGs and leaves an environment variable behind; neither should leak
    # into the training process. A forked child that enters an OpenMP region the parent already ran (any large
    # tensor op, e.g. building the model) waits forever for the parent's thread team: the children start with
    # one thread, which they need no more of.
    with _preserve_global_state(), _one_thread_while_forking(start_method == "fork"):
        litdata.optimize(
            fn=fn,
            inputs=list(segments),
            output_dir=str(output_dir),
            chunk_bytes=chunk_bytes,
            item_loader=TokensLoader(),
            num_workers=max(1, min(workers, len(segments))),
            reorder_files=False,
            # litdata's default lets workers take segments from a shared queue as they finish, so which chunks hold
            # which segments, and with it every batch, depended on timing: two builds of the demo's corpus gave
            # different chunks and different losses. Static slices keep the split's order.
            keep_data_ordered=True,
            start_method=start_method,
            verbose=False,
        )


def _tokens(optimized: Path) -> int:
    index = optimized / "index.json"
    return sum(c["dim"] for c in json.loads(index.read_text())["chunks"]) if index.is_file() else 0


@contextlib.contextmanager
def _preserve_global_state() -> Iterator[None]:
    py, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    env = dict(os.environ)
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        for key in [k for k in os.environ if k.startswith("DATA_OPTIMIZER_") and k not in env]:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith("DATA_OPTIMIZER_")})


@contextlib.contextmanager
def _one_thread_while_forking(forking: bool) -> Iterator[None]:
    threads = torch.get_num_threads()
    if forking:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
