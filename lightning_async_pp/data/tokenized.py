"""Corpora tokenized with a local Hugging Face tokenizer (``tokenizer.json``), through the byte corpus's machinery.

The split is :func:`~lightning_async_pp.data.split.split_corpus`'s (segments are pieces of files, cut at line
starts and row groups), and the cache is built by the same ordered ``litdata.optimize`` (see docs/design/data.md,
'Data'). What changes is what a segment yields: the ids of its documents, each followed by the tokenizer's
end-of-text id, in the smallest dtype that holds the vocabulary. A document is

- a text file's segment (a piece of it, or the whole of a small file: the characters that start inside the
  segment's bytes, decoded in the corpus's ``encoding``; the text was checked to decode before);
- a record of a ``.jsonl`` file (its ``text_field``): the records whose line starts inside the segment's bytes;
- a row of a ``.parquet`` file (its ``text_field`` column, read with pyarrow): the rows whose proportional
  position ``row * file_size / num_rows`` falls inside the segment's bytes (only their row groups are read).

Suffixes are matched in any case (``.JSONL``), see ``data/inputs.py``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_async_pp.data.corpus import Segment, build_token_cache, cache_info, corpus_key, segment_text
from lightning_async_pp.data.inputs import DEFAULT_ENCODING, is_utf8, suffix
from lightning_async_pp.data.split import parquet_metadata

TOKENIZER_FILE = "tokenizer.json"
#: The files a Hugging Face tokenizer folder may hold (what ``save_pretrained`` of a tokenizer writes): hashed,
#: copied next to the tokens (so the tokens say how to read them) and exported beside a trained model.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
#: Where a cache or a prepared directory keeps its tokenizer's files.
TOKENIZER_DIR = "tokenizer"
#: End-of-text tokens looked for when the folder has no ``tokenizer_config.json`` naming its ``eos_token``.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


def tokenizer_file(path: Union[str, Path]) -> Path:
    """``path`` itself if it is a file, else ``path/tokenizer.json``; a clear error if neither exists."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / TOKENIZER_FILE).is_file():
        return path / TOKENIZER_FILE
    raise FileNotFoundError(f"tokenizer {str(path)!r} is neither a tokenizer.json file nor a folder holding one "
                            f"(a Hugging Face tokenizer saved with save_pretrained or Tokenizer.save; nothing is "
                            f"downloaded)")


def load_tokenizer(path: Union[str, Path]) -> Any:
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json`` or a folder holding one."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file(path)))


def tokenizer_hash(path: Union[str, Path]) -> str:
    """sha256 of the tokenizer's files: a changed vocabulary, merge or end-of-text token names another cache."""
    digest = hashlib.sha256()
    tokenizer_file(path)  # a clear error if there is none
    for name, f in tokenizer_files(path).items():
        # Under the names a copy gives them, so a prepared folder's copy of mytok.json hashes the same.
        digest.update(name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def eos_id(path: Union[str, Path], tokenizer: Any) -> int:
    """The end-of-text id: ``eos_token`` of the folder's ``tokenizer_config.json``, else the first of
    :data:`EOS_CANDIDATES` the vocabulary has."""
    config = tokenizer_file(path).parent / "tokenizer_config.json"
    if config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None:
            found = tokenizer.token_to_id(token)
            if found is None:
                raise ValueError(f"{config} names eos_token {token!r}, which the tokenizer's vocabulary lacks")
            return found
    for token in EOS_CANDIDATES:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    raise ValueError(f"tokenizer {str(path)!r} has no end-of-text token to separate documents: its folder has no "
                     f"tokenizer_config.json naming an eos_token, and its vocabulary has none of "
                     f"{list(EOS_CANDIDATES)}")


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype litdata stores that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


def tokenizer_info(path: Union[str, Path]) -> dict[str, Any]:
    """What the tokens of this tokenizer are: vocabulary, end-of-text id, dtype, hash."""
    tokenizer = load_tokenizer(path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return {"vocab_size": vocab, "eos_id": eos_id(path, tokenizer), "dtype": str(token_dtype(vocab)).split(".")[-1],
            "tokenizer_sha256": tokenizer_hash(path)}


def prepared_root(data_path: Union[str, Path]) -> Optional[Path]:
    """The folder holding a prepared ``data_path``'s completion marker (and tokenizer): ``data_path`` itself, or the
    parent of its ``train/``/``val/`` folder; ``None`` if neither has a marker."""
    path = Path(data_path)
    return next((root for root in (path, path.parent) if cache_info(root) is not None), None)


def prepared_tokenizer(data_path: Union[str, Path]) -> Optional[Path]:
    """The tokenizer folder a prepared ``data_path`` carries (``prepare``'s output, or its ``train/``/``val/``
    folder), or ``None``."""
    root = prepared_root(data_path)
    return root / TOKENIZER_DIR if root is not None and (root / TOKENIZER_DIR).is_dir() else None


def tokenizer_files(path: Union[str, Path]) -> dict[str, Path]:
    """The tokenizer files at ``path`` (a folder, or a ``tokenizer.json`` under any name and the other files beside
    it) by the name a copy gives them (the main file: ``tokenizer.json``); empty if there are none."""
    path = Path(path)
    main = path if path.is_file() else path / TOKENIZER_FILE
    files = {TOKENIZER_FILE: main} if main.is_file() else {}
    files.update({name: main.parent / name for name in TOKENIZER_FILES[1:] if (main.parent / name).is_file()})
    return files


def copy_tokenizer(path: Union[str, Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, f in tokenizer_files(path).items():
        shutil.copyfile(f, dest / name)


# ---- documents -------------------------------------------------------------------------------------------------
def documents(segment: Segment, text_field: str, encoding: str = DEFAULT_ENCODING) -> Iterator[str]:
    """The documents of one segment (see the module's docstring)."""
    path, start, stop = segment
    kind = suffix(path)
    if kind == ".jsonl":
        yield from _jsonl_documents(path, start, stop, text_field, encoding)
    elif kind == ".parquet":
        yield from _parquet_documents(path, start, stop, text_field)
    else:
        text = segment_text(path, start, stop, encoding)
        if text:
            yield text


def _jsonl_documents(path: str, start: int, stop: int, text_field: str, encoding: str) -> Iterator[str]:
    # A UTF-8 file may begin with a byte-order mark, which json.loads refuses in text (and skipped in bytes).
    encoding = "utf-8-sig" if is_utf8(encoding) else encoding
    with open(path, "rb") as f:
        if start > 0:  # a line that began before `start` belongs to the previous segment
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()
        while f.tell() < stop:
            line = f.readline()
            if not line:
                break
            if line.strip():
                yield _field(json.loads(line.decode(encoding)), text_field,
                             f"{path} (line starting at byte {f.tell() - len(line)})")


def _parquet_documents(path: str, start: int, stop: int, text_field: str) -> Iterator[str]:
    meta = parquet_metadata(path)  # a clear error without pyarrow
    names = meta.schema.to_arrow_schema().names
    if text_field not in names:
        raise ValueError(f"{path} has no column {text_field!r} (text_field); its columns: {names}")
    size, rows = Path(path).stat().st_size, meta.num_rows
    first = -(-start * rows // size)  # the first row r with r * size / rows >= start
    last = -(-stop * rows // size)
    row = 0
    for group in range(meta.num_row_groups):  # only the row groups the rows lie in are read
        count = meta.row_group(group).num_rows
        lo, hi = max(first, row), min(last, row + count)
        if lo < hi:
            column = _row_group_column(path, Path(path).stat().st_mtime_ns, group, text_field)
            for value in column.slice(lo - row, hi - lo).to_pylist():
                yield _field({text_field: value}, text_field, path)
        row += count


@functools.lru_cache(maxsize=2)
def _row_group_column(path: str, stamp: int, group: int, text_field: str) -> Any:
    """One row group's ``text_field`` column; the last ones read are kept, for the pieces of one row group a worker
    reads in turn (the validation pieces, in the corpus's order)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(group, columns=[text_field]).column(text_field)


def _field(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no {text_field!r} field (text_field); it has {keys}")
    value = record[text_field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value


class TokenizeSegment:
    """``litdata.optimize`` worker function: one segment -> one tensor of its documents' ids, each document
    followed by the end-of-text id. Picklable (it holds paths); each worker loads the tokenizer once."""

    def __init__(self, tokenizer: str, text_field: str, eos: int, dtype: torch.dtype,
                 encoding: str = DEFAULT_ENCODING) -> None:
        self.tokenizer_path, self.text_field, self.eos, self.dtype = tokenizer, text_field, eos, dtype
        self.encoding = encoding
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    def __call__(self, segment: Segment) -> Iterator[torch.Tensor]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        docs = list(documents(segment, self.text_field, self.encoding))
        ids: list[int] = []
        # No special tokens of the tokenizer's post-processor (a BOS, say): documents are separated by EOS only.
        for encoding in self._tokenizer.encode_batch(docs, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(self.eos)
        if ids:  # litdata cannot store empty items
            yield torch.tensor(ids, dtype=torch.int64).to(self.dtype)


# ---- building ------------------------------------------------------------------------------------------------------
def build_tokenized_cache(
    train: Sequence[Segment],
    val: Sequence[Segment],
    tokenizer: Union[str, Path],
    cache: Union[str, Path],
    text_field: str = "text",
    num_workers: Optional[int] = None,
    key: Optional[str] = None,
    encoding: str = DEFAULT_ENCODING,
) -> Path:
    """Tokenize ``train`` and ``val`` with ``tokenizer`` into ``cache/train`` and ``cache/val`` (ordered litdata
    chunks, as :func:`~lightning_async_pp.data.corpus.build_token_cache`), once, with the tokenizer's files in
    ``cache/tokenizer`` and what the tokens are (vocabulary, EOS id, dtype, tokenizer hash, ``key``) in its marker.
    Text is decoded in ``encoding``."""
    info = {**tokenizer_info(tokenizer), "text_field": text_field, "key": key}
    fn = TokenizeSegment(str(tokenizer), text_field, info["eos_id"], getattr(torch, info["dtype"]), encoding)
    return build_token_cache(train, val, cache, num_workers=num_workers, fn=fn, info=info,
                             before_marker=lambda c: copy_tokenizer(tokenizer, Path(c) / TOKENIZER_DIR))


def tokenized_key(train: Sequence[Segment], val: Sequence[Segment], tokenizer: Union[str, Path],
                  text_field: str, encoding: str = DEFAULT_ENCODING) -> str:
    """The cache key of this split (the files' contents in ``encoding``) tokenized with this tokenizer (its files'
    hash) and text field."""
    return corpus_key(train, val, tokens={"tokenizer_sha256": tokenizer_hash(tokenizer), "text_field": text_field},
                      encoding=encoding)
