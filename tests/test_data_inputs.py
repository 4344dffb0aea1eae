"""What the corpus's files are, read before tokenizing (``data/inputs.py``): a cache named by content, text decoded
in one ``encoding`` or refused naming the file, files that are not text skipped with a warning, suffixes in any case.

References are written out here: the bytes or records the test itself wrote, tokenized with the tokenizer directly.
"""
from __future__ import annotations

import gzip
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import yaml

from lightning_async_pp.data import TextDataModule
from test_data import stream
from test_tokenized_data import EOS, SENTENCES, expected_ids, stored_ids, train_bpe

LATIN1_TEXT = "café crème brûlée, déjà vu\n" * 40


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok"), extra=list("éèûà"))


def bytes_module(data_path, cache, **kwargs) -> TextDataModule:
    return TextDataModule(data_path=str(data_path), cache_dir=str(cache), val_fraction=0.0, **kwargs)


# ---- the cache is named by content ------------------------------------------------------------------------------
def test_a_file_rewritten_with_its_size_and_mtime_kept_is_tokenized_again(tmp_path):
    doc = tmp_path / "corpus" / "doc.txt"
    doc.parent.mkdir()
    doc.write_bytes(b"old text " * 300)
    before = doc.stat()
    assert stream(bytes_module(doc.parent, tmp_path / "c").optimized_dirs()[0]) == b"old text " * 300
    # What cp -p, rsync -t and tar x leave: other bytes, the same size and mtime.
    doc.write_bytes(b"new text " * 300)
    os.utime(doc, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (doc.stat().st_size, doc.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    train_dir = bytes_module(doc.parent, tmp_path / "c").optimized_dirs()[0]
    assert stream(train_dir) == b"new text " * 300
    assert len(list((tmp_path / "c").glob("*/COMPLETE.json"))) == 2


# ---- files that are not text ------------------------------------------------------------------------------------
def binary_files(folder: Path) -> list[Path]:
    """What a folder next to a corpus often holds: an image, a compressed file, a TensorBoard event file."""
    folder.mkdir(parents=True, exist_ok=True)
    png = folder / "figure.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + bytes(range(1, 200)) * 20)
    gz = folder / "notes.txt.gz"
    gz.write_bytes(gzip.compress(b"compressed text\n" * 200))
    event = folder / "events.out.tfevents.1700000000.host"
    record = b"\x08\x01\x12\x05hello" * 30
    event.write_bytes(struct.pack("<Q", len(record)) + struct.pack("<I", 7) + record + struct.pack("<I", 9))
    return [png, gz, event]


def test_files_that_are_not_text_are_skipped_with_a_warning_that_lists_them(tmp_path):
    corpus = tmp_path / "corpus"
    skipped = binary_files(corpus / "runs")
    (corpus / "notes.txt").write_text(SENTENCES[0] * 20)
    dm = bytes_module(corpus, tmp_path / "c")
    with pytest.warns(UserWarning, match=r"skipping 3 input file\(s\) that are not text") as caught:
        train_dir, _ = dm.optimized_dirs()
    message = str(caught[0].message)
    assert all(str(f) in message for f in skipped)
    assert stream(train_dir) == (SENTENCES[0] * 20).encode()  # the text file's bytes, nothing else
    # Nothing but binary files: refused, naming them, before anything is written.
    with pytest.raises(ValueError, match=r"none of the 3 input file\(s\) is text.*figure\.png"):
        bytes_module(corpus / "runs", tmp_path / "c2").optimized_dirs()
    assert not (tmp_path / "c2").exists()


# ---- encodings ----------------------------------------------------------------------------------------------------
def test_text_that_does_not_decode_is_refused_naming_the_file_and_encoding(tmp_path, tokenizer):
    doc = tmp_path / "latin.txt"
    doc.write_bytes(LATIN1_TEXT.encode("latin-1"))
    # "caf" then 0xE9 (é in Latin-1), which UTF-8 reads as a lead byte followed by no continuation.
    refused = rf"{doc} is not utf-8 text \(byte 3: invalid continuation byte\).*encoding"
    for kwargs in ({}, {"tokenizer": str(tokenizer)}):
        with pytest.raises(ValueError, match=refused):
            bytes_module(doc, tmp_path / "c", **kwargs).optimized_dirs()
    assert not (tmp_path / "c").exists()  # refused before tokenizing
    # With encoding="latin-1": bytes are the text's UTF-8; ids are the tokenizer's of the text.
    train_dir = bytes_module(doc, tmp_path / "c", encoding="latin-1").optimized_dirs()[0]
    assert stream(train_dir) == LATIN1_TEXT.encode("utf-8")
    dm = bytes_module(doc, tmp_path / "c", encoding="latin-1", tokenizer=str(tokenizer))
    assert stored_ids(dm.optimized_dirs()[0]) == expected_ids(tokenizer, [LATIN1_TEXT])


def test_encoding_reaches_prepare_through_its_command_line_flag(tmp_path, tokenizer):
    from lightning_async_pp.data.prepare import main

    doc = tmp_path / "corpus" / "latin.txt"
    doc.parent.mkdir()
    doc.write_bytes(LATIN1_TEXT.encode("latin-1"))
    args = ["--tokenizer", str(tokenizer), "--val-fraction", "0", "--num-workers", "1", str(doc.parent)]
    with pytest.raises(ValueError, match=rf"{doc} is not utf-8 text.*--encoding"):
        main(["--output", str(tmp_path / "refused"), *args])
    main(["--output", str(tmp_path / "out"), "--encoding", "latin-1", *args])
    assert stored_ids(str(tmp_path / "out" / "train")) == expected_ids(tokenizer, [LATIN1_TEXT])


def test_an_encoding_a_piece_cannot_be_decoded_in_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"encoding 'latin-9x' is not a text encoding Python knows.*'latin-1'"):
        TextDataModule(encoding="latin-9x")
    for bad in ("utf-16", "shift_jis"):
        with pytest.raises(ValueError, match=rf"encoding '{bad}' is neither UTF-8 nor an ASCII-compatible one-byte "
                                             rf"encoding.*convert the corpus to UTF-8"):
            TextDataModule(encoding=bad)
    for good in ("utf-8", "UTF8", "utf-8-sig", "latin-1", "cp1252", "iso8859_15"):
        assert TextDataModule(encoding=good).encoding == good
    from lightning_async_pp.data.prepare import prepare

    with pytest.raises(ValueError, match=r"encoding 'utf-32' is neither UTF-8"):
        prepare(["x"], "t", "o", encoding="utf-32")


def test_encoding_is_a_data_option_of_the_lightning_cli(tmp_path, monkeypatch):
    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "lightning_async_pp.models.GPT", "init_args": {"n_layer": 1, "n_embd": 16,
                                                                               "n_head": 2}},
        "data": {"encoding": "latin-1", "cache_dir": str(tmp_path / "c")},
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False},
    }))
    cli = AsyncPipelineCLI(args=["--config", str(config)], run=False)
    assert cli.datamodule.encoding == "latin-1"
    with pytest.raises(ValueError, match="encoding 'utf-16' is neither UTF-8"):
        AsyncPipelineCLI(args=["--config", str(config), "--data.encoding=utf-16"], run=False)


# ---- suffixes -----------------------------------------------------------------------------------------------------
def test_an_upper_case_jsonl_suffix_is_read_as_records(tmp_path, tokenizer):
    records = [{"text": SENTENCES[i % 5], "id": i} for i in range(12)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # With a byte-order mark, as some editors write UTF-8.
    (corpus / "RECORDS.JSONL").write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in records))
    dm = TextDataModule(data_path=str(corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"),
                        val_fraction=0.0)
    assert stored_ids(dm.optimized_dirs()[0]) == expected_ids(tokenizer, [r["text"] for r in records])
    assert dm.tokenizer.token_to_id(EOS) in stored_ids(dm.optimized_dirs()[0])
    # Records without a tokenizer are refused as any .jsonl file is.
    with pytest.raises(ValueError, match=r"RECORDS\.JSONL: \.jsonl and \.parquet files hold records"):
        bytes_module(corpus, tmp_path / "c").optimized_dirs()
