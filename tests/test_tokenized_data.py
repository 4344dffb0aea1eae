"""TextDataModule(tokenizer=...) and ``python -m lightning_async_pp.data.prepare``: a local Hugging Face tokenizer's
ids, documents separated by its end-of-text id, in the smallest dtype, cached under the tokenizer's hash.

The reference is the tokenizer itself, called here on each document as the test reads it from the files
(``json.loads`` of each line), in the split's order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from lightning_async_pp.data import TextDataModule, corpus, split_corpus
from lightning_async_pp.data.tokenized import token_dtype

tokenizers = pytest.importorskip("tokenizers")

SENTENCES = [
    "the pipeline sends activations forward and gradients back",
    "every stage keeps two versions of its weights",
    "a batch is split into microbatches that flow through the stages",
    "the optimizer steps once per batch with a gradient one step old",
    "data parallel replicas reduce their gradients in buckets",
]
EOS = "<|endoftext|>"


def train_bpe(folder: Path, vocab_size: int = 120, extra: list[str] = (), bos: bool = False) -> Path:
    """A byte-pair tokenizer trained on SENTENCES (nothing downloaded), saved as folder/tokenizer.json; with
    ``bos``, its post-processor adds a BOS to every encoding (as many LLM tokenizers' do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", EOS, *extra, *(["<s>"] if bos else [])]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    tok.train_from_iterator(SENTENCES * 3, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def word_tokenizer(path: Path, words: int) -> Path:
    """A word-level tokenizer of ``words`` words w0, w1, ... and EOS (so its vocabulary has words + 2 entries)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, EOS: 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok"), bos=True)


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory) -> Path:
    """Text files (one document each) and a .jsonl file (one document per record, with other fields)."""
    root = tmp_path_factory.mktemp("mixed")
    for f in range(3):
        (root / f"notes{f}.txt").write_text("\n".join(SENTENCES[f:] * 4) + "\n")
    records = [{"id": i, "text": SENTENCES[i % 5] + f" stage {i}", "meta": {"k": i}} for i in range(40)]
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def lines_starting_in(data: bytes, start: int, stop: int) -> list[bytes]:
    """The lines (with their newline) whose first byte lies in ``[start, stop)``."""
    lines, at = [], 0
    for line in data.splitlines(keepends=True):
        if start <= at < stop:
            lines.append(line)
        at += len(line)
    return lines


def characters_starting_in(text: str, start: int, stop: int, encoding: str = "utf-8") -> str:
    """The characters of ``text`` whose first byte (in ``encoding``) lies in ``[start, stop)``."""
    if text.isascii():  # one byte a character
        return text[start:stop]
    kept, at = [], 0
    for char in text:
        if start <= at < stop:
            kept.append(char)
        at += len(char.encode(encoding))
    return "".join(kept)


def documents_of(segments, encoding: str = "utf-8") -> list[str]:
    """The documents of a split, read here: the characters of a text file that start in the segment, or each record
    of a .jsonl file whose line does."""
    docs = []
    for path, start, stop in segments:
        data = Path(path).read_bytes()
        if path.lower().endswith(".jsonl"):
            docs += [json.loads(line.decode(encoding))["text"] for line in lines_starting_in(data, start, stop)]
        elif text := characters_starting_in(data.decode(encoding), start, stop, encoding):
            docs.append(text)
    return docs


def expected_ids(tokenizer_dir: Path, docs: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    return [i for doc in docs for i in tok.encode(doc, add_special_tokens=False).ids + [eos]]


def stored_ids(optimized_dir: str) -> list[int]:
    return torch.cat(list(StreamingDataset(optimized_dir, item_loader=TokensLoader(block_size=1)))).tolist()


def data_format(optimized_dir: str) -> str:
    return json.loads((Path(optimized_dir) / "index.json").read_text())["config"]["data_format"][0]


# ---- what the cache holds ---------------------------------------------------------------------------------------
def test_each_document_is_the_tokenizers_ids_then_eos_in_the_splits_order(tmp_path, tokenizer, mixed_corpus):
    dm = TextDataModule(data_path=str(mixed_corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path),
                        val_fraction=0.2, block_size=8, batch_size=2)
    train_dir, val_dir = dm.optimized_dirs()
    train, val = split_corpus(sorted(mixed_corpus.glob("*")), 0.2, None, dm.seed)
    assert train and val and any(p.endswith(".jsonl") for p, _, _ in train + val)
    for segments, d in ((train, train_dir), (val, val_dir)):
        assert stored_ids(d) == expected_ids(tokenizer, documents_of(segments))
    # The tokenizer's post-processor adds a BOS to an encoding; the cache holds none (documents are split by EOS).
    bos = dm.tokenizer.token_to_id("<s>")
    assert dm.tokenizer.encode(SENTENCES[0]).ids[0] == bos and bos not in stored_ids(train_dir) + stored_ids(val_dir)
    assert data_format(train_dir).endswith(f"tensor:{corpus_dtype_index(torch.uint8)}")  # 120 tokens fit a byte
    # Batches are (B, block + 1) LongTensors of those ids; the tokenizer and its vocabulary are the module's.
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 9) and batch.dtype == torch.long and int(batch.max()) < 120
    assert dm.vocab_size == dm.tokenizer.get_vocab_size() == 120
    assert (Path(train_dir).parent / "tokenizer" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


def corpus_dtype_index(dtype: torch.dtype) -> int:
    from litdata.constants import _TORCH_DTYPES_MAPPING

    return {v: k for k, v in _TORCH_DTYPES_MAPPING.items()}[dtype]


def test_ids_are_stored_in_the_smallest_dtype_that_holds_the_vocabulary(tmp_path):
    assert [token_dtype(v) for v in (256, 257, 1 << 16, (1 << 16) + 1)] == [torch.uint8, torch.uint16, torch.uint16,
                                                                             torch.int32]
    tok = word_tokenizer(tmp_path / "words.json", words=400)  # 402 ids: uint16
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"w{(7 * i) % 400}" for i in range(3000)))
    dm = TextDataModule(data_path=str(text), tokenizer=str(tok), cache_dir=str(tmp_path / "c"), val_fraction=0.0)
    train_dir, _ = dm.optimized_dirs()
    assert data_format(train_dir).endswith(f"tensor:{corpus_dtype_index(torch.uint16)}")
    train, _ = split_corpus([text], 0.0, None, dm.seed)  # pieces cut at word starts, each ended by EOS (id 1)
    assert stored_ids(train_dir) == expected_word_ids(tok, documents_of(train))
    assert sorted(stored_ids(train_dir)) == sorted([(7 * i) % 400 + 2 for i in range(3000)] + [1] * len(train))


def test_two_builds_with_parallel_workers_give_identical_chunks(tmp_path, tokenizer):
    for f in range(24):
        (tmp_path / "docs" / f"d{f:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / f"d{f:02d}.txt").write_text(" ".join(SENTENCES[f % 5:] * (f + 1)))
    files = sorted((tmp_path / "docs").glob("*.txt"))
    train, val = split_corpus(files, 0.1, None, 0)
    from lightning_async_pp.data.tokenized import build_tokenized_cache

    builds = [build_tokenized_cache(train, val, tokenizer, tmp_path / f"build{i}", num_workers=2) for i in range(2)]
    for split in ("train", "val"):
        chunks = [sorted((b / split).glob("*.bin")) for b in builds]
        assert len(chunks[0]) > 1 and [c.name for c in chunks[0]] == [c.name for c in chunks[1]]
        assert [c.read_bytes() for c in chunks[0]] == [c.read_bytes() for c in chunks[1]]
        assert stored_ids(str(builds[0] / split)) == expected_ids(tokenizer, documents_of(train if split == "train"
                                                                                          else val))


def test_the_cache_key_includes_the_tokenizer(tmp_path, tokenizer, mixed_corpus, monkeypatch):
    calls = []
    real = corpus._optimize
    monkeypatch.setattr(corpus, "_optimize", lambda segs, out, *a, **k: (calls.append(out), real(segs, out, *a, **k)))
    kwargs = dict(data_path=str(mixed_corpus), cache_dir=str(tmp_path), val_fraction=0.2)
    first = TextDataModule(tokenizer=str(tokenizer), **kwargs).optimized_dirs()
    assert TextDataModule(tokenizer=str(tokenizer), **kwargs).optimized_dirs() == first and len(calls) == 2
    other = train_bpe(tmp_path / "other", vocab_size=90)  # another vocabulary: another cache
    second = TextDataModule(tokenizer=str(other / "tokenizer.json"), **kwargs).optimized_dirs()
    assert len(calls) == 4 and Path(second[0]).parent != Path(first[0]).parent
    assert stored_ids(second[0]) != stored_ids(first[0])
    # Bytes of the same corpus are yet another cache (and .jsonl records are refused without a tokenizer).
    with pytest.raises(ValueError, match=r"records\.jsonl.*give TextDataModule\(tokenizer=\.\.\.\)"):
        TextDataModule(**kwargs).optimized_dirs()


def test_a_parquet_column_is_read_row_by_row(tmp_path, tokenizer):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [SENTENCES[i % 5] + f" row {i}" for i in range(50)]
    pq.write_table(pa.table({"body": rows, "n": list(range(50))}), tmp_path / "rows.parquet")
    dm = TextDataModule(data_path=str(tmp_path / "rows.parquet"), tokenizer=str(tokenizer), text_field="body",
                        cache_dir=str(tmp_path / "c"), val_fraction=0.2)
    train_dir, val_dir = dm.optimized_dirs()
    # Each piece is the rows whose proportional position falls in it: together the splits are every row once.
    train, val = split_corpus([tmp_path / "rows.parquet"], 0.2, None, dm.seed)
    size = (tmp_path / "rows.parquet").stat().st_size
    rows_of = lambda segments: [r for _, a, b in segments for i, r in enumerate(rows) if a <= i * size / 50 < b]  # noqa: E731
    assert stored_ids(train_dir) == expected_ids(tokenizer, rows_of(train))
    assert stored_ids(val_dir) == expected_ids(tokenizer, rows_of(val)) and val
    assert sorted(rows_of(train) + rows_of(val)) == sorted(rows)


def test_a_parquet_file_is_cut_at_its_row_groups_and_a_training_piece_lies_in_one(tmp_path, tokenizer):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from lightning_async_pp.data.split import parquet_metadata

    rows = [SENTENCES[i % 5] + f" row {i}" for i in range(100)]
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"text": rows}), path, row_group_size=20)
    assert parquet_metadata(str(path)).num_row_groups == 5
    size = path.stat().st_size
    group_starts = [g * 20 * size // 100 for g in range(5)]  # each group's first row's proportional byte
    train, val = split_corpus([path], 0.2, None, 0)
    assert {a for _, a, _ in (*train, *val)} >= set(group_starts)
    group = lambda byte: max(g for g, s in enumerate(group_starts) if s <= byte)  # noqa: E731
    assert all(group(a) == group(b - 1) for _, a, b in train)
    dm = TextDataModule(data_path=str(path), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"), val_fraction=0.2,
                        seed=0)
    train_dir, val_dir = dm.optimized_dirs()
    rows_of = lambda segments: [r for _, a, b in segments for i, r in enumerate(rows) if a <= i * size / 100 < b]  # noqa: E731
    assert stored_ids(train_dir) == expected_ids(tokenizer, rows_of(train))
    assert stored_ids(val_dir) == expected_ids(tokenizer, rows_of(val))


# ---- prepare ----------------------------------------------------------------------------------------------------
def test_prepare_writes_what_data_path_takes_as_it_is(tmp_path, tokenizer, mixed_corpus):
    out = tmp_path / "tokens"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_async_pp.data.prepare", "--tokenizer", str(tokenizer), "--output", str(out),
         "--val-fraction", "0.2", "--num-workers", "2", str(mixed_corpus)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"data_path: {out}" in proc.stdout
    prepared = TextDataModule(data_path=str(out), block_size=8, batch_size=2, val_fraction=0.2)
    assert prepared.optimized_dirs() == (str(out / "train"), str(out / "val"))
    assert prepared.vocab_size == 120 and prepared.tokenizer.token_to_id(EOS) == 1
    # The same ids, so the same batches, as tokenizing inside the data module.
    inside = TextDataModule(data_path=str(mixed_corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"),
                            block_size=8, batch_size=2, val_fraction=0.2)
    for dm in (prepared, inside):
        dm.setup("fit")
    for a, b in ((prepared.train_dataloader(), inside.train_dataloader()),
                 (prepared.val_dataloader(), inside.val_dataloader())):
        assert [x.tolist() for x in a] == [x.tolist() for x in b]
    # Again: nothing to do; other inputs into the same folder: refused.
    from lightning_async_pp.data.prepare import prepare

    marker = (out / "COMPLETE.json").stat().st_mtime_ns
    prepare([mixed_corpus], tokenizer, out, val_fraction=0.2)
    assert (out / "COMPLETE.json").stat().st_mtime_ns == marker
    with pytest.raises(FileExistsError, match="prepared from other inputs"):
        prepare([mixed_corpus / "notes0.txt"], tokenizer, out)
    # A prepared folder read with another tokenizer is refused.
    with pytest.raises(ValueError, match="tokenized with another tokenizer"):
        TextDataModule(data_path=str(out), tokenizer=str(train_bpe(tmp_path / "t2", vocab_size=90))).optimized_dirs()


def test_prepare_never_deletes_an_input_corpus_inside_its_output(tmp_path, tokenizer):
    from lightning_async_pp.data.prepare import prepare

    corpus_file = tmp_path / "data" / "train" / "a.txt"
    corpus_file.parent.mkdir(parents=True)
    corpus_file.write_text(SENTENCES[0])
    with pytest.raises(ValueError, match=r"input .*a\.txt.* inside the output folder .*data"):
        prepare([tmp_path / "data" / "train"], tokenizer, tmp_path / "data")
    # A train/ folder holding anything but litdata's files is not prepare's, so not removed either.
    other = tmp_path / "out" / "val" / "notes.txt"
    other.parent.mkdir(parents=True)
    other.write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare([corpus_file], tokenizer, tmp_path / "out")
    assert corpus_file.read_text() == SENTENCES[0] and other.read_text() == "mine"
    # What an interrupted build leaves (litdata's files only) is redone.
    other.unlink()
    for name in ("chunk-0-0.bin", "0.index.json", "index.json.tmp"):
        (other.parent / name).write_text("")
    prepare([corpus_file], tokenizer, tmp_path / "out", val_fraction=0)
    assert corpus.cache_info(tmp_path / "out")["train_tokens"] > 0


def test_a_tokenizer_file_under_another_name_hashes_as_its_prepared_copy(tmp_path, tokenizer):
    from lightning_async_pp.data.tokenized import copy_tokenizer, tokenizer_hash

    renamed = tmp_path / "mytok.json"
    renamed.write_bytes((tokenizer / "tokenizer.json").read_bytes())
    copy_tokenizer(renamed, tmp_path / "prepared" / "tokenizer")  # what prepare --tokenizer mytok.json keeps
    assert tokenizer_hash(renamed) == tokenizer_hash(tmp_path / "prepared" / "tokenizer") == tokenizer_hash(tokenizer)
    # Every file of a tokenizer folder is hashed and kept with the tokens, so consolidate exports it from there.
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    copy_tokenizer(renamed, tmp_path / "again")
    assert (tmp_path / "again" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert tokenizer_hash(renamed) == tokenizer_hash(tmp_path / "again") != tokenizer_hash(tokenizer)


def test_an_unparsable_completion_marker_is_no_marker_and_the_cache_is_rebuilt(tmp_path, mixed_corpus):
    train, val = split_corpus([mixed_corpus / "notes0.txt", mixed_corpus / "notes1.txt"], 0.5, None, 0)
    cache = corpus.build_token_cache(train, val, tmp_path / "c")
    assert sorted(p.name for p in cache.iterdir()) == ["COMPLETE.json", "train", "val"]  # no temporary left
    (cache / "COMPLETE.json").write_text('{"vocab_size": 2')  # as a crash while writing it would leave
    assert corpus.cache_info(cache) is None and not corpus.is_complete(cache)
    corpus.build_token_cache(train, val, cache)
    assert corpus.cache_info(cache)["vocab_size"] == 256


def test_a_tokenizer_given_over_tokens_prepared_without_one_is_refused(tmp_path, tokenizer, mixed_corpus):
    train, val = split_corpus([mixed_corpus / "notes0.txt", mixed_corpus / "notes1.txt"], 0.5, None, 0)
    cache = corpus.build_token_cache(train, val, tmp_path / "bytes")
    with pytest.raises(ValueError, match=r"bytes.* prepared without a tokenizer \(vocabulary 256\).* tokenizer"):
        TextDataModule(data_path=str(cache), tokenizer=str(tokenizer)).optimized_dirs()
    assert TextDataModule(data_path=str(cache)).vocab_size == 256  # without tokenizer=: read as it is


# ---- refusals ---------------------------------------------------------------------------------------------------
def with_model(dm: TextDataModule, model) -> TextDataModule:
    dm.trainer = SimpleNamespace(lightning_module=model, strategy=SimpleNamespace(distributed_sampler_kwargs=None))
    return dm


def test_a_model_vocabulary_the_data_does_not_fit_is_refused_naming_both_sizes(tmp_path, tokenizer, mixed_corpus):
    from lightning_async_pp.models import GPT

    small = GPT(vocab_size=100, n_layer=1, n_head=2, n_embd=16)
    dm = with_model(TextDataModule(data_path=str(mixed_corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path)),
                    small)
    with pytest.raises(ValueError, match=r"model's vocabulary \(100\) is smaller than the data's \(120"):
        dm.setup("fit")
    assert not list(tmp_path.iterdir())  # refused before tokenizing
    with_model(dm, GPT(vocab_size=128, n_layer=1, n_head=2, n_embd=16)).check_model_vocab()  # larger is fine


def test_raw_text_read_as_bytes_under_a_vocabulary_other_than_256_is_refused(tmp_path, mixed_corpus):
    import lightning as L

    from lightning_async_pp.models import GPT

    model = GPT(vocab_size=1024, n_layer=1, n_head=2, n_embd=16, block_size=8)
    dm = TextDataModule(data_path=str(mixed_corpus / "notes0.txt"), cache_dir=str(tmp_path), block_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"notes0\.txt' as bytes \(vocabulary 256\), but the model's vocabulary is "
                                         r"1024: give TextDataModule\(tokenizer=\.\.\.\)"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0
    with_model(TextDataModule(cache_dir=str(tmp_path)), GPT(vocab_size=256, n_layer=1)).check_model_vocab()


def test_adapters_vocabularies_are_read_from_their_configs():
    from lightning_async_pp.models import GPT, Llama, model_vocab_size

    assert model_vocab_size(GPT(vocab_size=300, n_layer=1)) == 300
    assert model_vocab_size(Llama("tiny", vocab_size=1000)) == 1000
    if _has("transformers"):
        from lightning_async_pp.models import HuggingFaceCausalLM

        hf = HuggingFaceCausalLM({"model_type": "llama", "vocab_size": 77, "hidden_size": 16, "intermediate_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2})
        assert model_vocab_size(hf) == 77
    if _has("litgpt"):
        from lightning_async_pp.models import LitGPT

        lit = LitGPT({"name": "pythia-14m", "n_layer": 1, "vocab_size": 100})  # padded to a multiple of 128
        assert lit.config.padded_vocab_size == 128 and model_vocab_size(lit) == 100  # the vocabulary, not padding


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_bad_tokenizers_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"tokenizer '{tmp_path}' is neither a tokenizer.json file nor a folder"):
        TextDataModule(tokenizer=str(tmp_path))
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("a a a")
    dm = TextDataModule(data_path=str(tmp_path / "doc.txt"), tokenizer=str(tmp_path), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no end-of-text token to separate documents"):
        dm.optimized_dirs()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))  # the config names it
    assert stored_ids(dm.optimized_dirs()[0]) == [0, 0, 0, 0]


def test_prepare_holds_out_val_fraction_of_the_tokens_whatever_the_file_sizes_and_seed(tmp_path):
    from lightning_async_pp.data.prepare import prepare

    # One 128 KB file and two small ones (validation got 99% or 1% of the tokens by seed when it took whole files).
    # Every line is 15 bytes and 3 tokens of a word-level tokenizer, so tokens are proportional to bytes.
    tok = word_tokenizer(tmp_path / "words.json", words=1000)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = lambda i: f"w{100 + i % 900} w{100 + 7 * i % 900} w{100 + 13 * i % 900}\n"  # noqa: E731
    for name, lines in (("big.txt", 2 ** 17 // 15), ("a.txt", 120), ("b.txt", 90)):
        (corpus / name).write_text("".join(line(i) for i in range(lines)))
    files = sorted(corpus.glob("*.txt"))
    total = sum(f.stat().st_size for f in files)
    for seed in (0, 1, 2):
        out = prepare([corpus], tok, tmp_path / f"out{seed}", val_fraction=0.05, seed=seed, num_workers=1)
        info = json.loads((out / "COMPLETE.json").read_text())
        train, val = split_corpus(files, 0.05, None, seed)
        # Pieces of whole lines: 3 ids a line and an EOS a piece; validation 5% of the bytes to within a piece.
        held = sum(b - a for _, a, b in val)
        assert info["val_tokens"] == 3 * held // 15 + len(val)
        assert abs(held - 0.05 * total) <= max(b - a for _, a, b in (*train, *val))
        for segments, split in ((train, "train"), (val, "val")):
            assert chunk_ids(out / split, info["dtype"]) == expected_word_ids(tok, documents_of(segments))
    assert chunk_ids(out / "val", info["dtype"]) == stored_ids(str(out / "val"))  # the chunk reader reads litdata's


_PREPARE_AFTER_PARALLEL_WORK = """
import sys
from pathlib import Path
import torch
from lightning_async_pp.data.prepare import prepare
a = torch.randn(1500, 1500)
(a @ a).exp().sum()  # the parent's OpenMP thread team is started, as building a model starts it
corpus, tokenizer, out = map(Path, sys.argv[1:])
prepare([corpus], tokenizer, out, val_fraction=0.05, seed=0, num_workers=1)
print("PREPARED")
"""


@pytest.mark.slow
def test_prepare_finishes_in_a_process_whose_torch_thread_pool_already_ran(tmp_path):
    # Forked litdata workers that entered an OpenMP region the parent had run waited for its threads forever.
    tok = word_tokenizer(tmp_path / "words.json", words=1000)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text("".join(f"w{100 + i % 900} w{100 + 7 * i % 900}\n" for i in range(40000)))
    try:
        proc = subprocess.run([sys.executable, "-c", _PREPARE_AFTER_PARALLEL_WORK, str(corpus), str(tok),
                               str(tmp_path / "out")], capture_output=True, text=True, timeout=90,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
    except subprocess.TimeoutExpired:
        pytest.fail("prepare hung after the parent process had used torch's thread pool")
    assert proc.returncode == 0 and "PREPARED" in proc.stdout, proc.stderr[-3000:]


def chunk_ids(optimized_dir: Path, dtype: str) -> list[int]:
    """The ids of an optimized folder, read from its chunk files (TokensLoader's layout: a uint32 item count and
    item offsets, then the ids); ``stored_ids`` reads one id per item, a minute for 0.5 MB."""
    import numpy as np

    index = json.loads((optimized_dir / "index.json").read_text())
    return [i for c in index["chunks"] for i in np.fromfile(optimized_dir / c["filename"], dtype=np.dtype(dtype),
                                                             offset=(c["chunk_size"] + 2) * 4).tolist()]


def expected_word_ids(tokenizer_file: Path, docs: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    return [i for doc in docs for i in tok.encode(doc, add_special_tokens=False).ids + [tok.token_to_id(EOS)]]


def test_a_corpus_of_one_line_is_split_at_characters_and_one_record_cannot_be_split(tmp_path, tokenizer):
    # text8-like: one line, no newline; cut at word starts, and at characters in the multi-byte part without spaces.
    text = "".join(SENTENCES) * 40 + "héhéñ" * 1500
    (tmp_path / "one.txt").write_text(text)
    dm = TextDataModule(data_path=str(tmp_path / "one.txt"), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"),
                        val_fraction=0.2)
    train_dir, val_dir = dm.optimized_dirs()
    train, val = split_corpus([tmp_path / "one.txt"], 0.2, None, dm.seed)
    assert len(train) > 1 and val
    pieces = {(a, b): characters_starting_in(text, a, b) for _, a, b in (*train, *val)}
    assert "".join(pieces[k] for k in sorted(pieces)) == text  # a character a cut crosses is in one piece
    assert stored_ids(train_dir) == expected_ids(tokenizer, [pieces[a, b] for _, a, b in train])
    assert stored_ids(val_dir) == expected_ids(tokenizer, [pieces[a, b] for _, a, b in val])
    # One record is one piece: nothing to hold out. Refused, not an empty split litdata fails on later.
    (tmp_path / "records" / "one.jsonl").parent.mkdir()
    (tmp_path / "records" / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    with pytest.raises(ValueError, match=r"val_fraction=0.2 holds out whole pieces.*one\.jsonl.*val_fraction=0"):
        TextDataModule(data_path=str(tmp_path / "records"), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"),
                       val_fraction=0.2).optimized_dirs()
