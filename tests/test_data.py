import json
import os
import socket
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from lightning_async_pp.data import TextDataModule, corpus, decode, encode, split, split_corpus, stdlib_files

BLOCK = 32


def data_parallel_trainer(num_replicas: int, rank: int) -> SimpleNamespace:
    """What the datamodule reads from a pipeline strategy: its data-parallel size and rank."""
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas,
                                                                                "rank": rank}))


@pytest.fixture
def count_optimize(monkeypatch):
    calls = []
    real = corpus._optimize

    def counting(segments, output_dir, *args, **kwargs):
        calls.append(output_dir)
        return real(segments, output_dir, *args, **kwargs)

    monkeypatch.setattr(corpus, "_optimize", counting)
    return calls


@pytest.fixture(scope="module")
def numbered_corpus(tmp_path_factory) -> Path:
    """A folder of text files in which every 33-byte window is unique (numbered lines), so data can be
    identified by content."""
    root = tmp_path_factory.mktemp("numbered")
    for f in range(4):
        lines = [f"file {f} line {i:06d}\n" for i in range(600)]
        (root / f"part{f}.txt").write_text("".join(lines))
    (root / ".hidden").write_text("never read")
    return root


def rows(loader) -> list[bytes]:
    return [decode(row) for b in loader for row in b]


# ---- corpus ---------------------------------------------------------------------------------------------------
def test_stdlib_corpus_is_found_on_disk_without_tests_or_site_packages():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all(root in f.parents for f in files)
    assert root / "pydoc_data" / "topics.py" in files and root / "json" / "decoder.py" in files
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    assert sum(f.stat().st_size for f in files) > 5_000_000


def test_encode_decode_round_trip_bytes():
    raw = bytes(range(256)) + "naïve 日本 \x00".encode()
    tokens = encode(raw)
    assert tokens.dtype == torch.long and tokens.min() >= 0 and tokens.max() <= 255 and len(tokens) == len(raw)
    assert decode(tokens) == raw
    assert decode(encode("naïve")).decode() == "naïve"
    assert len(encode(b"")) == 0


def pieces_by_file(train, val) -> dict[str, list[tuple[int, int]]]:
    pieces: dict[str, list[tuple[int, int]]] = {}
    for path, start, stop in (*train, *val):
        pieces.setdefault(path, []).append((start, stop))
    return {path: sorted(p) for path, p in pieces.items()}


def tiles(pieces: list[tuple[int, int]], size: int) -> bool:
    """Whether byte ranges cover ``[0, size)`` exactly once."""
    return [a for a, _ in pieces] == [0] + [b for _, b in pieces[:-1]] and pieces[-1][1] == size


@pytest.fixture(scope="module")
def one_big_two_small(tmp_path_factory) -> Path:
    """The corpus that gave validation 1% or 99% of the tokens by seed: one 0.5 MB file and two small ones, every
    line unique."""
    root = tmp_path_factory.mktemp("big_small")
    (root / "big.txt").write_text("".join(f"big line {i:07d}\n" for i in range(2 ** 19 // 17)))
    for name in ("a", "b"):
        (root / f"{name}.txt").write_text("".join(f"{name} line {i:05d}\n" for i in range(150)))
    return root


def longest(*splits) -> int:
    return max(b - a for split in splits for _, a, b in split)


def test_validation_holds_val_fraction_of_the_bytes_from_across_the_corpus_whatever_the_file_sizes_and_seed(
    one_big_two_small
):
    files = sorted(one_big_two_small.glob("*.txt"))
    sizes = {str(f): f.stat().st_size for f in files}
    total = sum(sizes.values())
    held_whole, big_starts = set(), set()
    for val_fraction in (0.002, 0.05, 0.3):
        for seed in range(8):
            train, val = split_corpus(files, val_fraction, None, seed)
            assert split_corpus(files, val_fraction, None, seed) == (train, val)  # deterministic
            # val_fraction of the pieces: of the bytes to within a piece, whatever the file sizes.
            assert abs(sum(b - a for _, a, b in val) - val_fraction * total) <= longest(train, val)
            assert train and val
            # Disjoint and together the whole corpus: each file's pieces tile it.
            pieces = pieces_by_file(train, val)
            assert pieces.keys() == sizes.keys() and all(tiles(pieces[p], sizes[p]) for p in sizes)
            # Every piece of a text file starts at a line start (each of these lines is shorter than a piece).
            assert all(a == 0 or open(p, "rb").read()[a - 1:a] == b"\n" for p, a, _ in (*train, *val))
            # The big file (at least 1 / val_fraction pieces) always gives validation some, never all of it.
            big = [(a, b) for p, a, b in val if p.endswith("big.txt")]
            assert big and sum(b - a for a, b in big) < sizes[str(one_big_two_small / "big.txt")] / 2
            big_starts |= {a for a, _ in big}
            held_whole |= {Path(p).name for p, a, b in val if (a, b) == (0, sizes[p])}
    # Small files are held out whole, for some seeds; the big file's pieces come from all over it, not its tail.
    assert held_whole & {"a.txt", "b.txt"}
    big_size = sizes[str(one_big_two_small / "big.txt")]
    assert min(big_starts) < big_size / 4 and max(big_starts) > big_size / 2


def test_a_record_is_never_cut_and_a_line_of_text_is_cut_at_word_starts_else_anywhere(tmp_path):
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"text": "w" * (i % 400)}) + "\n" for i in range(600)))
    (tmp_path / "words.txt").write_text(" ".join(f"w{i % 977}" for i in range(12_000)))  # one line, as text8
    (tmp_path / "one_word.txt").write_bytes(b"x" * 50_000)
    train, val = split_corpus(sorted(tmp_path.iterdir()), 0.2, None, 0)
    data = {p: Path(p).read_bytes() for p, _, _ in (*train, *val)}
    starts = {Path(p).name: set() for p in data}
    for p, a, b in (*train, *val):
        starts[Path(p).name].add(data[p][a - 1:a] if a else b"")
    # The byte before each piece: none (the file's start), a newline, a space, or (no space in the line) any byte.
    assert starts == {"records.jsonl": {b"", b"\n"}, "words.txt": {b"", b" "}, "one_word.txt": {b"", b"x"}}
    assert {Path(p).name for p, _, _ in val} == set(starts)


def test_training_pieces_are_written_in_a_seeded_shuffle_of_the_whole_corpus(tmp_path):
    for f in range(3):
        (tmp_path / f"part{f}.txt").write_text("".join(f"file {f} line {i:06d}\n" for i in range(20_000)))
    train, _ = split_corpus(sorted(tmp_path.glob("*.txt")), 0.01, None, 0)
    # At most the longest training piece (4 KiB here), and the rest of the line its cut moved to the end of.
    assert longest(train) <= split.train_piece_bytes(sum(f.stat().st_size for f in tmp_path.glob("*.txt"))) + 19
    tenth = {Path(p).name for p, _, _ in train[: len(train) // 10]}
    assert tenth == {"part0.txt", "part1.txt", "part2.txt"}  # the first tenth of the cache from every file
    assert split_corpus(sorted(tmp_path.glob("*.txt")), 0.01, None, 1)[0] != train  # another seed, another order


def test_max_bytes_caps_the_corpus_before_the_split():
    files = stdlib_files()
    train, val = split_corpus(files, val_fraction=0.1, max_bytes=300_000, seed=3)
    assert split_corpus(files, 0.1, 300_000, 4) != (train, val)  # the seed picks the files
    sizes = lambda segs: sum(stop - start for _, start, stop in segs)  # noqa: E731
    assert sizes(train) + sizes(val) == 300_000 and abs(sizes(val) - 30_000) <= longest(train, val)
    pieces = pieces_by_file(train, val)
    assert all(pieces[p][0][0] == 0 and [a for a, _ in pieces[p][1:]] == [b for _, b in pieces[p][:-1]]
               for p in pieces)  # each file's head, in disjoint pieces


def test_pieces_of_a_text_cut_at_any_byte_decode_and_together_are_the_text(tmp_path):
    for encoding, text in (("utf-8", "aé€𝄞 b\n" * 2), ("utf-8-sig", "é€ x"), ("cp1252", "café € ok\n")):
        path = tmp_path / f"{encoding}.txt"
        path.write_bytes(text.encode(encoding))
        size = path.stat().st_size
        for cut in range(size + 1):
            head, tail = corpus.segment_text(str(path), 0, cut, encoding), corpus.segment_text(str(path), cut, size,
                                                                                                 encoding)
            assert head + tail == text, (encoding, cut)


def test_val_fraction_outside_zero_one_is_refused_at_construction():
    for bad in (1.0, -0.1, 2):
        with pytest.raises(ValueError, match=rf"val_fraction must be in \[0, 1\).*got {bad}"):
            TextDataModule(val_fraction=bad)


def test_prepare_and_the_data_module_share_one_default_val_fraction():
    import inspect

    from lightning_async_pp.data.corpus import DEFAULT_VAL_FRACTION
    from lightning_async_pp.data.prepare import argument_parser, prepare

    assert TextDataModule().val_fraction == DEFAULT_VAL_FRACTION
    assert inspect.signature(prepare).parameters["val_fraction"].default == DEFAULT_VAL_FRACTION
    assert argument_parser().parse_args(["x", "--tokenizer", "t", "--output", "o"]).val_fraction == DEFAULT_VAL_FRACTION
def test_a_single_file_gives_val_fraction_of_its_pieces_from_a_seeded_place(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"x" * 1000)
    places = set()
    for seed in range(6):
        train, val = split_corpus([f], val_fraction=0.2, seed=seed)
        assert len(val) == 1 and val[0][2] - val[0][1] == 200 and tiles(pieces_by_file(train, val)[str(f)], 1000)
        places.add(val[0][1])
    assert len(places) > 1  # not always the tail


def test_a_corpus_of_one_piece_cannot_be_split_and_says_so(tmp_path):
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a single record " * 100}) + "\n")
    with pytest.raises(ValueError, match=r"val_fraction=0.2 holds out whole pieces.*one\.jsonl.*val_fraction=0"):
        split_corpus([tmp_path / "one.jsonl"], 0.2)
    assert split_corpus([tmp_path / "one.jsonl"], 0.0)[1] == []


# ---- tokenization cache ---------------------------------------------------------------------------------------
def test_tokenized_cache_holds_exactly_the_corpus_bytes(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the corpus must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    dm = TextDataModule(max_bytes=60_000, cache_dir=str(tmp_path), block_size=BLOCK)
    train_dir, val_dir = dm.optimized_dirs()
    train, val = split_corpus(stdlib_files(), dm.val_fraction, dm.max_bytes, dm.seed)
    for segments, d in ((train, train_dir), (val, val_dir)):
        source = b"".join(open(p, "rb").read()[a:b] for p, a, b in segments)
        index = json.loads((Path(d) / "index.json").read_text())
        assert sum(c["dim"] for c in index["chunks"]) == len(source)
    # Read the held-out split back one token at a time: the same bytes.
    tokens = torch.stack(list(StreamingDataset(val_dir, item_loader=TokensLoader(block_size=1)))).flatten()
    source = b"".join(open(p, "rb").read()[a:b] for p, a, b in val)
    assert torch.equal(tokens.long(), encode(source).long())


def test_the_cache_holds_the_split_in_its_order_so_two_builds_give_the_same_batches(tmp_path):
    # Many segments, two workers: when litdata's workers took segments from a shared queue, worker 0's chunks
    # (segments 0, 2, 4, ... or whichever it got first) came before worker 1's, and which it got depended on timing.
    for f in range(64):
        (tmp_path / f"part{f:02d}.txt").write_text("".join(f"file {f:02d} line {i:05d}\n" for i in range(60)))
    train, val = split_corpus(sorted(tmp_path.glob("*.txt")), 0.1, None, 0)
    source = b"".join(open(p, "rb").read()[a:b] for p, a, b in train)
    assert len(train) >= 50
    corpus.build_token_cache(train, val, tmp_path / "c", num_workers=2, chunk_bytes=4096)
    blocks = [decode(x) for x in StreamingDataset(str(tmp_path / "c" / "train"), item_loader=TokensLoader(block_size=33))]
    offsets = [source.find(b) for b in blocks]  # every 33-byte window of these files is unique
    assert -1 not in offsets and offsets == sorted(offsets) and len(blocks) >= len(source) // 33 - len(train) * 2


def stream(optimized_dir: str) -> bytes:
    """Every byte token of an optimized folder, in order, read from its chunk files (litdata's TokensLoader layout: a
    uint32 item count and item offsets, then the tokens); reading one token per item takes a minute for 0.5 MB."""
    index = json.loads((Path(optimized_dir) / "index.json").read_text())
    return b"".join((Path(optimized_dir) / c["filename"]).read_bytes()[(c["chunk_size"] + 2) * 4:]
                    for c in index["chunks"])


def test_the_cached_splits_hold_their_pieces_in_the_splits_order_and_together_the_whole_corpus(
    tmp_path, one_big_two_small
):
    files = sorted(one_big_two_small.glob("*.txt"))
    total = sum(f.stat().st_size for f in files)
    for seed in (0, 1):
        dm = TextDataModule(data_path=str(one_big_two_small), cache_dir=str(tmp_path), val_fraction=0.05, seed=seed)
        train_dir, val_dir = dm.optimized_dirs()
        train, val = split_corpus(files, 0.05, None, seed)
        info = corpus.cache_info(Path(train_dir).parent)
        assert info["val_tokens"] == sum(b - a for _, a, b in val) and info["train_tokens"] + info["val_tokens"] == total
        # Each split is its pieces one after another, in the split's order (the pieces tile the files: nothing twice,
        # nothing left, test_validation_holds_val_fraction_of_the_bytes_from_across_the_corpus_...).
        for segments, d in ((train, train_dir), (val, val_dir)):
            assert stream(d) == b"".join(open(p, "rb").read()[a:b] for p, a, b in segments)
    # The chunk reader reads what litdata serves.
    assert stream(val_dir) == decode(torch.cat(list(StreamingDataset(val_dir, item_loader=TokensLoader(block_size=1)))))


def test_second_setup_reuses_the_cache(tmp_path, count_optimize):
    kwargs = dict(max_bytes=50_000, cache_dir=str(tmp_path), block_size=BLOCK)
    TextDataModule(**kwargs).setup("fit")
    assert len(count_optimize) == 2  # train and val
    marker = next(tmp_path.glob("*/COMPLETE.json"))
    mtime = marker.stat().st_mtime_ns
    dm = TextDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    assert len(count_optimize) == 2 and marker.stat().st_mtime_ns == mtime
    # A different corpus (another cap) gets its own cache.
    TextDataModule(**{**kwargs, "max_bytes": 40_000}).setup("fit")
    assert len(count_optimize) == 4 and len(list(tmp_path.glob("*/COMPLETE.json"))) == 2


def test_half_written_cache_is_rebuilt(tmp_path, count_optimize):
    kwargs = dict(max_bytes=30_000, cache_dir=str(tmp_path), block_size=BLOCK)
    TextDataModule(**kwargs).setup("fit")
    next(tmp_path.glob("*/COMPLETE.json")).unlink()  # as if the process died mid-way
    dm = TextDataModule(**kwargs)
    dm.setup("fit")
    assert len(count_optimize) == 4
    assert len(rows(dm.train_dataloader())) > 0


def test_building_the_cache_leaves_global_rng_and_environment_alone(tmp_path):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    env = dict(os.environ)
    TextDataModule(max_bytes=20_000, cache_dir=str(tmp_path)).prepare_data()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert dict(os.environ) == env


# ---- batches and sharding -------------------------------------------------------------------------------------
def test_batches_are_batch_size_rows_of_block_size_plus_one_token_ids(tmp_path):
    dm = TextDataModule(max_bytes=80_000, cache_dir=str(tmp_path), block_size=BLOCK, batch_size=5)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batches = list(loader)
        assert len(batches) == len(loader) > 0
        for b in batches:
            assert b.shape == (5, BLOCK + 1) and b.dtype == torch.long
            assert 0 <= b.min() and b.max() <= 255


def lines_in(rows_: list[bytes]) -> set[bytes]:
    """The whole lines of the numbered corpus in rows (between two newlines): pieces start at line starts, so a line
    is never made of two pieces."""
    return {line for r in rows_ for line in r.split(b"\n")[1:-1]}


def test_validation_rows_come_from_every_file_and_never_from_training(tmp_path, numbered_corpus):
    # Each file is 3 pieces (4 KiB each at most): every third piece held out is one of each file's.
    dm = TextDataModule(data_path=str(numbered_corpus), cache_dir=str(tmp_path), block_size=BLOCK, batch_size=4,
                        val_fraction=0.34)
    dm.setup("fit")
    train, val = lines_in(rows(dm.train_dataloader())), lines_in(rows(dm.val_dataloader()))
    file_of = lambda line: line.split(b" ")[1]  # noqa: E731
    assert {file_of(x) for x in val} == {file_of(x) for x in train} == {b"0", b"1", b"2", b"3"}
    assert train and val and not train & val
    assert not any(b"never read" in r for r in rows(dm.train_dataloader()))  # hidden files are skipped


#: Each file of ``three_alphabets`` is lines of its own bytes: a row's files are known from any of its bytes.
_FILE_OF_BYTE = bytes.maketrans(b"abcdefghABCDEFGH01234567\n", bytes([0] * 8 + [1] * 8 + [2] * 8 + [255]))


def files_of(row: bytes) -> set[int]:
    return set(row.translate(_FILE_OF_BYTE)) - {255}


@pytest.fixture(scope="module")
def three_alphabets(tmp_path_factory) -> Path:
    """Three files of 0.2, 0.4 and 0.6 MB (3200, 6400 and 9600 lines of 64 bytes), each of its own 8 bytes."""
    root = tmp_path_factory.mktemp("alphabets")
    rng = torch.Generator().manual_seed(0)
    for f, alphabet in enumerate((b"abcdefgh", b"ABCDEFGH", b"01234567")):
        ids = torch.randint(0, 8, (3200 * (f + 1), 63), generator=rng)
        lines = [bytes(alphabet[i] for i in row) + b"\n" for row in ids.tolist()]
        (root / f"part{f}.txt").write_bytes(b"".join(lines))
    return root


def test_training_draws_on_every_file_from_the_first_tenth_of_an_epoch_in_an_order_of_its_seed(
    tmp_path, three_alphabets
):
    """Issue 60: with the files' chunks read one after another, the first half of an epoch held no row of the last
    file whatever the seed, and validation was the tail of one file."""
    orders = {}
    for seed in (0, 1, 2):
        kwargs = dict(data_path=str(three_alphabets), cache_dir=str(tmp_path), block_size=127, batch_size=8,
                      val_fraction=0.05, seed=seed)
        dm = TextDataModule(**kwargs)
        dm.setup("fit")
        batches = [[decode(row) for row in b] for b in dm.train_dataloader()]
        for k in range(10):  # every tenth of the epoch, the first included, has rows of every file
            tenth = batches[k * len(batches) // 10:(k + 1) * len(batches) // 10]
            assert set().union(*(files_of(row) for b in tenth for row in b)) == {0, 1, 2}, (seed, k)
        assert set().union(*(files_of(row) for row in rows(dm.val_dataloader()))) == {0, 1, 2}
        again = TextDataModule(**kwargs)
        again.setup("fit")
        assert [[decode(row) for row in b] for b in again.train_dataloader()] == batches  # one order a seed
        orders[seed] = batches
    assert orders[0] != orders[1] != orders[2] != orders[0]


def test_each_epoch_is_reshuffled_and_a_resume_inside_a_later_epoch_continues_it(tmp_path, three_alphabets):
    kwargs = dict(data_path=str(three_alphabets), cache_dir=str(tmp_path), block_size=1023, batch_size=4,
                  val_fraction=0.05)
    for workers in (0, 2):
        dm = TextDataModule(**kwargs, num_workers=workers)
        dm.trainer = data_parallel_trainer(1, 0)
        dm.setup("fit")
        loader = dm.train_dataloader()
        first, second = rows(loader), rows(loader)
        assert first != second and sorted(first) == sorted(second)  # each epoch all the rows, in another order
        it = iter(loader)  # the third epoch: 3 batches, then the state a checkpoint records
        head = [decode(r) for _ in range(3) for r in next(it)]
        state = loader.state_dict()
        resumed = TextDataModule(**kwargs, num_workers=workers)
        resumed.trainer = data_parallel_trainer(1, 0)
        resumed.setup("fit")
        fresh = resumed.train_dataloader()
        fresh.load_state_dict(state)
        third = head + rows(fresh)
        assert sorted(third) == sorted(first) and third not in (first, second), workers
        uninterrupted = TextDataModule(**kwargs, num_workers=workers)
        uninterrupted.setup("fit")
        reference = uninterrupted.train_dataloader()
        rows(reference), rows(reference)
        assert rows(reference) == third, workers


def test_a_checkpoint_resumes_the_training_order_where_it_stopped(tmp_path, three_alphabets):
    """The loader's position travels in the checkpoint (Lightning saves a stateful loader's state): a run stopped
    after 2 updates and resumed from its checkpoint trains the batches one run of 5 updates trains, in order."""
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.models import GPT

    seen: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(batch.clone())

    def fit(steps: int, ckpt_path=None, save=None) -> list[torch.Tensor]:
        seen.clear()
        L.seed_everything(0, verbose=False)
        dm = TextDataModule(data_path=str(three_alphabets), cache_dir=str(tmp_path / "c"), block_size=BLOCK,
                            batch_size=4, val_fraction=0.05, seed=3)
        model = GPT(block_size=BLOCK, n_layer=2, n_head=2, n_embd=16)
        trainer = L.Trainer(strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2), accelerator="cpu",
                            devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[Record()])
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return list(seen)

    whole = fit(5)
    head = fit(2, save=tmp_path / "two.ckpt")
    tail = fit(5, ckpt_path=tmp_path / "two.ckpt")
    assert len(whole) == 5 and len(head) == 2
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole)) and len(head + tail) == 5


def test_data_parallel_ranks_get_disjoint_data_and_stages_of_one_rank_identical_batches(
    tmp_path, numbered_corpus, monkeypatch
):
    def loader(dp_rank: int, process_rank: int):
        # Two pipeline stages x two data-parallel replicas = four processes; litdata would see WORLD_SIZE=4.
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("GLOBAL_RANK", str(process_rank))
        dm = TextDataModule(data_path=str(numbered_corpus), cache_dir=str(tmp_path), block_size=BLOCK,
                            batch_size=4, seed=7)
        dm.trainer = data_parallel_trainer(num_replicas=2, rank=dp_rank)
        dm.setup("fit")
        return dm.train_dataloader()

    stage0_rank0, stage1_rank0 = rows(loader(0, 0)), rows(loader(0, 1))
    rank1 = rows(loader(1, 2))
    assert stage0_rank0 == stage1_rank0  # same batches, same order
    assert len(stage0_rank0) == len(rank1) > 0
    assert not set(stage0_rank0) & set(rank1)
    # Together the replicas cover (nearly) the whole training split: nothing but the remainder is dropped.
    everything = TextDataModule(data_path=str(numbered_corpus), cache_dir=str(tmp_path), block_size=BLOCK,
                                batch_size=4, seed=7)
    everything.trainer = data_parallel_trainer(1, 0)
    everything.setup("fit")
    total = len(everything.train_dataset)
    assert total - 2 * 4 * 2 < len(stage0_rank0) + len(rank1) <= total


def test_loader_resumes_twice_in_a_row_under_the_data_parallel_world_size(tmp_path, numbered_corpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # one pipeline of two stages: data-parallel size 1
    kwargs = dict(data_path=str(numbered_corpus), cache_dir=str(tmp_path), block_size=BLOCK, batch_size=4)

    def fresh_loader():
        dm = TextDataModule(**kwargs)
        dm.trainer = data_parallel_trainer(1, 0)
        dm.setup("fit")
        return dm.train_dataloader()

    uninterrupted = rows(fresh_loader())
    first = fresh_loader()
    it = iter(first)
    head = [r for _ in range(3) for r in next(it)]
    second = fresh_loader()
    second.load_state_dict(first.state_dict())  # resume after 3 batches ...
    it = iter(second)
    middle = [r for _ in range(2) for r in next(it)]
    third = fresh_loader()
    third.load_state_dict(second.state_dict())  # ... and again 2 batches later
    tail = rows(third)
    assert [decode(r) for r in head + middle] + tail == uninterrupted


def test_a_single_optimized_folder_is_split_into_train_and_val(tmp_path, numbered_corpus, count_optimize):
    built = TextDataModule(data_path=str(numbered_corpus), cache_dir=str(tmp_path / "c"), block_size=BLOCK)
    train_dir, _ = built.optimized_dirs()
    calls = len(count_optimize)
    dm = TextDataModule(data_path=train_dir, block_size=BLOCK, batch_size=2, val_fraction=0.2)
    dm.setup("fit")
    train, val = set(rows(dm.train_dataloader())), set(rows(dm.val_dataloader()))
    assert train and val and not train & val
    # A folder with train/ and val/ inside is used as it is.
    cache_root = Path(train_dir).parent
    assert TextDataModule(data_path=str(cache_root)).optimized_dirs() == (str(cache_root / "train"),
                                                                          str(cache_root / "val"))
    assert len(count_optimize) == calls  # nothing was tokenized again


def test_missing_data_path_names_the_path(tmp_path):
    missing = tmp_path / "no" / "such" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        TextDataModule(data_path=str(missing))
