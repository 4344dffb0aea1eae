"""What a corpus's input files are, found out before anything is tokenized.

- A file with a NUL byte in its first :data:`SNIFF_BYTES` is not text (images, archives, TensorBoard event files,
  checkpoints: what ``git`` and ``grep`` call binary); it is skipped with a warning that lists it, and a corpus with
  nothing else is refused. ``.parquet`` files are binary by format and read with pyarrow, so they are not sniffed.
- Text is decoded in one ``encoding`` (default UTF-8), strictly: a file that is not valid text in it is refused,
  naming the file, the byte and ``encoding=``, instead of being read with replacement characters.
- Suffixes are matched case-insensitively (``.JSONL`` is ``.jsonl``).
- A file's content hash (sha256 of its bytes) names the cache, so a file rewritten with its size and mtime kept
  (``cp -p``, ``rsync -t``, ``tar x``) is tokenized again. The bytes are read once, for the hash and the decoding.
"""
from __future__ import annotations

import codecs
import hashlib
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Union

DEFAULT_ENCODING = "utf-8"
#: How much of a file is sniffed for a NUL byte.
SNIFF_BYTES = 8192
#: Inputs read as records (one document each) with a tokenizer.
RECORD_SUFFIXES = (".jsonl", ".parquet")
#: Inputs that are binary by format and never decoded as text.
_BINARY_FORMATS = (".parquet",)
_BLOCK = 1 << 20
_LISTED = 20  # names a warning or an error lists before "and N more"


def suffix(path: Union[str, Path]) -> str:
    """The file's suffix in lower case: ``.JSONL`` is a ``.jsonl`` file."""
    return Path(path).suffix.lower()


def is_record_file(path: Union[str, Path]) -> bool:
    return suffix(path) in RECORD_SUFFIXES


def check_encoding(encoding: str) -> str:
    """``encoding`` if Python has a codec by that name that is UTF-8 or one byte a character and ASCII-compatible,
    else a clear error.

    A split may cut a file anywhere, and a piece is the characters that start in it (``corpus.segment_text``): in
    UTF-8 a character's first byte is known by its bits, in a one-byte encoding every byte is one; in UTF-16/32,
    Shift-JIS or GBK it takes decoding from the start of the file. ASCII-compatible: ``.jsonl`` records are lines.
    """
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise ValueError(f"encoding {encoding!r} is not a text encoding Python knows; give one such as 'utf-8', "
                         f"'latin-1' or 'cp1252'") from None
    if not (is_utf8_family(encoding) or _one_byte_ascii_compatible(encoding)):
        raise ValueError(f"encoding {encoding!r} is neither UTF-8 nor an ASCII-compatible one-byte encoding "
                         f"(UTF-16/32, Shift-JIS, GBK and the like: a piece cut inside a file cannot be decoded on its "
                         f"own): "
                         f"convert the corpus to UTF-8 (e.g. iconv -f {encoding} -t utf-8), or give 'utf-8', "
                         f"'latin-1', 'cp1252', ...")
    return encoding


def _one_byte_ascii_compatible(encoding: str) -> bool:
    try:
        ascii_compatible = b"a\nb".decode(encoding) == "a\nb"
    except (UnicodeDecodeError, ValueError):
        return False
    # One character a byte: every byte decodes alone, to one character (or is undefined, as 0x81 in cp1252).
    return ascii_compatible and len(bytes(range(256)).decode(encoding, errors="replace")) == 256


def is_utf8(encoding: str) -> bool:
    """Whether ``encoding`` is plain UTF-8 (then text is its bytes already, nothing to transcode)."""
    return codecs.lookup(encoding).name == "utf-8"


def is_utf8_family(encoding: str) -> bool:
    """UTF-8, with or without a byte-order mark (``utf-8-sig``)."""
    return codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")


def looks_binary(path: Union[str, Path]) -> bool:
    """A NUL byte in the first :data:`SNIFF_BYTES`: not text in any encoding :func:`check_encoding` accepts."""
    if suffix(path) in _BINARY_FORMATS:
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


def text_inputs(files: Iterable[Union[str, Path]]) -> list[Path]:
    """``files`` without the ones that are not text (see :func:`looks_binary`), with a warning that lists them; a
    clear error if nothing is left."""
    files = [Path(f) for f in files]
    flags = [looks_binary(f) for f in files]
    binary = [f for f, flag in zip(files, flags) if flag]
    if not binary:
        return files
    listed = ", ".join(str(f) for f in binary[:_LISTED]) + (f" and {len(binary) - _LISTED} more"
                                                            if len(binary) > _LISTED else "")
    if len(binary) == len(files):
        raise ValueError(f"none of the {len(files)} input file(s) is text (each has a NUL byte in its first "
                         f"{SNIFF_BYTES} bytes: images, archives, event files, ...): {listed}; give text, .jsonl or "
                         f".parquet files")
    warnings.warn(f"skipping {len(binary)} input file(s) that are not text (a NUL byte in the first {SNIFF_BYTES} "
                  f"bytes: images, archives, event files, ...): {listed}", UserWarning, stacklevel=2)
    return [f for f, flag in zip(files, flags) if not flag]


def content_sha256(path: Union[str, Path], encoding: str = DEFAULT_ENCODING) -> str:
    """sha256 of the file's bytes. Unless the file is binary by format (``.parquet``) the bytes are decoded as they
    are read, and a file that is not valid ``encoding`` text is refused, naming it, the byte and ``encoding=``."""
    digest = hashlib.sha256()
    decoder = None if suffix(path) in _BINARY_FORMATS else codecs.getincrementaldecoder(encoding)(errors="strict")
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            if decoder is not None:
                _decode(decoder, block, offset, path, encoding)
            offset += len(block)
    if decoder is not None:
        _decode(decoder, b"", offset, path, encoding, final=True)
    return digest.hexdigest()


def _decode(decoder: codecs.IncrementalDecoder, block: bytes, offset: int, path: Union[str, Path], encoding: str,
            final: bool = False) -> None:
    pending = len(decoder.getstate()[0])  # the bytes of a character the previous block cut
    try:
        decoder.decode(block, final=final)
    except UnicodeDecodeError as err:
        at = offset - pending + err.start
        raise ValueError(f"{path} is not {encoding} text (byte {at}: {err.reason}); if it is text in another "
                         f"encoding, give it (TextDataModule(encoding=...), prepare --encoding; e.g. 'latin-1' or "
                         f"'cp1252'), else remove the file from the inputs") from None
