"""Tokenize a corpus once, outside training, into a folder ``TextDataModule(data_path=...)`` takes as it is.

    python -m lightning_async_pp.data.prepare --tokenizer path/to/tokenizer --output data/tokens corpus/ more.jsonl

INPUTs are text files, ``.jsonl`` or ``.parquet`` files, or folders of them (files that are not text are skipped
with a warning; text is decoded in ``--encoding``, strictly). Validation is ``--val-fraction`` of the corpus, as in
``TextDataModule``. The output holds ``train/`` and
``val/`` (ordered litdata chunks, see docs/design/data.md, 'Data'), ``tokenizer/`` (the tokenizer's files) and
``COMPLETE.json`` (vocabulary, end-of-text id, dtype, token counts). Running it again with the same inputs and
tokenizer does nothing; other inputs into the same output, and an output holding an input, are refused.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

from lightning_async_pp.data.corpus import DEFAULT_VAL_FRACTION, cache_info, split_corpus, text_files
from lightning_async_pp.data.inputs import DEFAULT_ENCODING, check_encoding, text_inputs
from lightning_async_pp.data.tokenized import build_tokenized_cache, tokenized_key


def prepare(
    inputs: Sequence[Union[str, Path]],
    tokenizer: Union[str, Path],
    output: Union[str, Path],
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: Optional[int] = None,
    seed: int = 42,
    num_workers: Optional[int] = None,
    encoding: str = DEFAULT_ENCODING,
) -> Path:
    """Split ``inputs`` (as ``TextDataModule`` does: ``val_fraction`` of the corpus held out for validation) and
    tokenize both splits into ``output``; returns ``output``."""
    if not inputs:
        raise ValueError("prepare: give at least one input (a text, .jsonl or .parquet file, or a folder)")
    check_encoding(encoding)
    files = text_inputs(sorted({f for path in inputs for f in text_files(path)}))
    train, val = split_corpus(files, val_fraction, max_bytes, seed)
    key = tokenized_key(train, val, tokenizer, text_field, encoding)
    output = Path(output)
    inside = [f for f in files if _is_under(Path(f), output)]
    if inside:  # an unfinished build is removed before it is redone: never with the user's corpus in it
        raise ValueError(f"prepare: input {str(inside[0])!r} lies inside the output folder {str(output)!r}; give an "
                         f"--output outside the inputs")
    info = cache_info(output)
    if info is not None and info.get("key") != key:
        raise FileExistsError(f"prepare: {output} already holds a corpus prepared from other inputs, tokenizer or "
                              f"options; choose another --output or remove it")
    others = sorted(p.name for p in output.iterdir() if not _written_by_prepare(p)) if (
        info is None and output.is_dir()) else []
    if others:  # an unfinished build is redone from scratch: never delete what prepare did not write
        raise FileExistsError(f"prepare: {output} is not empty ({', '.join(others[:5])}); give a new folder as "
                              f"--output")
    build_tokenized_cache(train, val, tokenizer, output, text_field, num_workers, key=key, encoding=encoding)
    return output


def _is_under(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _written_by_prepare(path: Path) -> bool:
    """Whether ``path`` (in an output without a completion marker) is what an unfinished prepare leaves: its
    ``tokenizer/`` folder, or a ``train/``/``val/`` folder of nothing but litdata's files."""
    if path.name == "tokenizer" and path.is_dir():
        return True
    if path.name in ("train", "val") and path.is_dir():
        # litdata writes chunk-*.bin, index.json and, while it works, {rank}.index.json and *.tmp files.
        return all(f.is_file() and re.fullmatch(r".*(\.bin|index\.json)(\.tmp.*)?", f.name) for f in path.iterdir())
    return False


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_async_pp.data.prepare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text, .jsonl or .parquet files, or folders")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer.json or a folder holding one")
    parser.add_argument("--output", required=True, help="the folder to write (give it to TextDataModule's data_path)")
    parser.add_argument("--text-field", default="text", help="field of .jsonl records / column of .parquet files")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="share of the corpus held out for validation (default: %(default)s)")
    parser.add_argument("--encoding", default=DEFAULT_ENCODING,
                        help="encoding of text and .jsonl files, e.g. latin-1 (default: %(default)s)")
    parser.add_argument("--max-bytes", type=int, default=None, help="cap on the corpus size")
    parser.add_argument("--seed", type=int, default=42, help="seeds the split")
    parser.add_argument("--num-workers", type=int, default=None, help="tokenizing processes (default: up to 4)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = argument_parser().parse_args(argv)
    output = prepare(args.inputs, args.tokenizer, args.output, args.text_field, args.val_fraction, args.max_bytes,
                     args.seed, args.num_workers, args.encoding)
    info = cache_info(output) or {}
    print(json.dumps({k: info.get(k) for k in ("vocab_size", "dtype", "eos_id", "train_tokens", "val_tokens")}))
    print(f"data_path: {output}")


if __name__ == "__main__":
    main(sys.argv[1:])
