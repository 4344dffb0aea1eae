"""``TextDataModule``: token streams from litdata (bytes, or a local Hugging Face tokenizer's ids), sharded by
*data-parallel* rank only.

Under pipeline parallelism every stage of one pipeline must see the same batch, so sharding by the process rank
(what litdata and Lightning would do on their own) is wrong: the data-parallel size and rank come from the
strategy's ``distributed_sampler_kwargs`` and are handed to litdata in place of the environment it detects.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union
from unittest import mock

import lightning as L
import torch
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming import dataloader as _litdata_dataloader
from litdata.streaming.item_loader import TokensLoader
from litdata.utilities.env import _DistributedEnv
from litdata.utilities.train_test_split import train_test_split

from lightning_async_pp.data.corpus import (
    VOCAB_SIZE,
    build_token_cache,
    byte_tokenizer,
    cache_info,
    corpus_key,
    stdlib_files,
    text_files,
)
from lightning_async_pp.data.inputs import DEFAULT_ENCODING, check_encoding, is_record_file, text_inputs
from lightning_async_pp.data.split import DEFAULT_VAL_FRACTION, check_val_fraction, split_corpus
from lightning_async_pp.data.tokenized import (
    TOKENIZER_DIR,
    build_tokenized_cache,
    eos_id,
    load_tokenizer,
    prepared_root,
    prepared_tokenizer,
    tokenized_key,
    tokenizer_file,
    tokenizer_hash,
)

_INDEX = "index.json"
DEFAULT_CACHE_DIR = os.path.join(".cache", "lightning_async_pp")


def collate_tokens(items: list[torch.Tensor]) -> torch.Tensor:
    """Stack windows of token ids (uint8 bytes, uint16 or int32 ids) into a (B, block_size + 1) LongTensor."""
    return torch.stack(items).long()


class PackedRows:
    """``collate_fn`` of ``TextDataModule(document_mask=True)``: windows of token ids -> ``{"input_ids": (B, T + 1),
    "position_ids": (B, T + 1)}``, positions counting from 0 at each window's start and after each ``eos`` (the token
    that ends a document). Picklable, for DataLoader workers."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def __call__(self, items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        from lightning_async_pp.models.packing import INPUT_IDS, POSITION_IDS, packed_positions

        ids = collate_tokens(items)
        return {INPUT_IDS: ids, POSITION_IDS: packed_positions(ids, self.eos)}


#: The byte that ends each document of a byte corpus read with ``document_mask=True`` (text has no NUL bytes:
#: files with one near their start are not text, ``data/inputs.py``).
BYTE_DOCUMENT_END = 0


def data_parallel_env(num_replicas: int, rank: int) -> _DistributedEnv:
    """The litdata environment that shards by data-parallel rank. ``num_nodes=1``: litdata uses the node count only
    to keep chunks node-local when caching remote data; with one "node" the assignment of items to ranks is a
    plain function of (num_replicas, rank, seed, epoch)."""
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
    return _DistributedEnv(world_size=num_replicas, global_rank=rank, num_nodes=1)


class DataParallelStreamingDataLoader(StreamingDataLoader):
    """A ``StreamingDataLoader`` that resumes with its dataset's data-parallel world size.

    ``StreamingDataLoader.load_state_dict`` compares the checkpoint's world size with the one litdata detects
    (all processes); under pipeline parallelism that is not the data-parallel size the dataset was sharded with,
    so litdata takes the resume for an elastic re-shard and zeroes its count of samples served. The first resume
    still reads the right samples, but the next checkpoint records a position too early and replays data.
    """

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        env = getattr(self.dataset, "distributed_env", None)
        if env is None:
            return super().load_state_dict(obj)
        with mock.patch.object(_litdata_dataloader._DistributedEnv, "detect", return_value=env):
            return super().load_state_dict(obj)


class TextDataModule(L.LightningDataModule):
    """Language-modelling data: windows of ``block_size + 1`` tokens, streamed with litdata.

    Without a tokenizer the tokens are bytes (vocabulary 256); with one, its ids, each document followed by its
    end-of-text id. Before training (``prepare_data``/``setup`` under a Trainer) a model whose vocabulary cannot
    take the data's ids is refused, as is raw text read as bytes under a model whose vocabulary is not 256.

    Args:
        data_path: ``None`` for the embedded corpus (the Python standard library's sources); a text file or a
            folder of text files (tokenized once into ``cache_dir``; with a tokenizer also ``.jsonl`` and
            ``.parquet`` files, one document per record); or a litdata-optimized folder, either with ``train/`` and
            ``val/`` subfolders (what ``python -m lightning_async_pp.data.prepare`` writes) or a single one (then
            ``val_fraction`` of it is held out). Files that are not text (a NUL byte near their start: images,
            archives, event files) are skipped with a warning; suffixes match in any case (``.JSONL``).
        tokenizer: a local Hugging Face tokenizer: a ``tokenizer.json`` file or a folder holding one (nothing is
            downloaded). ``None``: bytes, or the tokenizer a prepared ``data_path`` was tokenized with.
        text_field: the field of ``.jsonl`` records and the column of ``.parquet`` files that holds the text.
        encoding: the text's encoding (text files and ``.jsonl``). Text that does not decode is refused before
            tokenizing, naming the file; bytes are the text's UTF-8 (transcoded from another encoding).
        block_size: tokens the model sees per row; each row holds ``block_size + 1`` (inputs and shifted targets).
        batch_size: rows per batch (per data-parallel replica); every batch has exactly this many.
        num_workers: DataLoader worker processes.
        val_fraction: share of the corpus held out for validation: that share of its pieces (whole records; pieces
            of at least 4 KiB of text), every ``1 / val_fraction``-th from a seeded start, so from across the corpus
            and about that share of the tokens (``data/split.py``). A single litdata-optimized folder is split by
            litdata's ``train_test_split`` instead.
        max_bytes: cap on the corpus size, for tests and quick runs.
        cache_dir: where tokenized corpora are kept, one subfolder per corpus hash.
        seed: seeds the split, the order the training pieces are written in, litdata's shuffle of the chunks and of
            the rows within each (again every epoch) and ``max_bytes``'s choice of files.
        document_mask: yield packed batches ``{"input_ids": (B, T + 1), "position_ids": (B, T + 1)}`` whose
            positions restart at 0 after each document's end (the tokenizer's end-of-text id; for bytes a NUL byte
            written after each file or piece of one, in a cache of its own), so the models attend within documents
            only (docs/design/data.md, 'Packed documents'). ``False`` (default): token tensors (B, T + 1) as before.
    """

    def __init__(
        self,
        data_path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        max_bytes: Optional[int] = None,
        cache_dir: Optional[str] = None,
        seed: int = 42,
        tokenizer: Optional[str] = None,
        text_field: str = "text",
        encoding: str = DEFAULT_ENCODING,
        document_mask: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(document_mask, bool):
            raise TypeError(f"document_mask must be true or false, got {document_mask!r}")
        if data_path is not None and not os.path.exists(data_path):
            raise FileNotFoundError(f"data_path {data_path!r} does not exist")
        if tokenizer is not None:
            tokenizer_file(tokenizer)  # exists, or a clear error now
        check_val_fraction(val_fraction)
        check_encoding(encoding)
        # In checkpoints as ``datamodule_hyper_parameters``: ``consolidate --hf`` copies the tokenizer from there.
        self.save_hyperparameters()
        self.data_path = data_path
        self.tokenizer_path = tokenizer
        self.text_field = text_field
        self.encoding = encoding
        self._tokenizer: Any = None
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.cache_dir = cache_dir or DEFAULT_CACHE_DIR
        self.seed = seed
        self.document_mask = document_mask
        self.train_dataset: Optional[StreamingDataset] = None
        self.val_dataset: Optional[StreamingDataset] = None

    # ---- where the optimized data lives ------------------------------------------------------------------------
    def example_batch(self, rows: int = 1) -> Union[torch.Tensor, dict[str, torch.Tensor]]:
        """A batch of ``rows`` sequences shaped as this module's: what ``partition="balanced"`` costs the layers on
        (the CLI sets it as the model's example batch). Token ids ``(rows, block_size + 1)``, all zero; with
        ``document_mask=True`` the packed batch its loaders yield, ``{"input_ids", "position_ids"}`` of that shape,
        each row one document (positions ``0 .. block_size``): the costliest attention a row can have, and what
        crosses a stage boundary beside the hidden state."""
        from lightning_async_pp.models.packing import INPUT_IDS, POSITION_IDS

        ids = torch.zeros(rows, self.block_size + 1, dtype=torch.long)
        if not self.document_mask:
            return ids
        return {INPUT_IDS: ids, POSITION_IDS: torch.arange(self.block_size + 1).repeat(rows, 1)}

    def prepared_dirs(self) -> Optional[tuple[str, Optional[str]]]:
        """``(train_dir, val_dir)`` if ``data_path`` is litdata-optimized already (``val_dir`` ``None`` for a single
        folder), else ``None``."""
        path = self.data_path
        if path is not None:
            if os.path.isfile(os.path.join(path, "train", _INDEX)) and os.path.isfile(os.path.join(path, "val", _INDEX)):
                return os.path.join(path, "train"), os.path.join(path, "val")
            if os.path.isfile(os.path.join(path, _INDEX)):
                return path, None
        return None

    def optimized_dirs(self) -> tuple[str, Optional[str]]:
        """``(train_dir, val_dir)`` of litdata-optimized data, tokenizing the corpus first if it is not cached.
        ``val_dir`` is ``None`` for a single optimized folder (validation is then split off it)."""
        prepared = self.prepared_dirs()
        if prepared is not None:
            self._check_prepared_tokenizer()
            return prepared
        files = stdlib_files() if self.data_path is None else text_inputs(text_files(self.data_path))
        if self.tokenizer_path is None:
            records = [str(f) for f in files if is_record_file(f)]
            if records:
                raise ValueError(f"data_path {self.data_path!r} holds {records[0]}: .jsonl and .parquet files hold "
                                 f"records, which are read with a tokenizer; give TextDataModule(tokenizer=...) (a "
                                 f"tokenizer.json or its folder)")
        train, val = split_corpus(files, self.val_fraction, self.max_bytes, self.seed)
        if self.tokenizer_path is None and self.document_mask:  # a cache of its own: each document ends in a NUL
            key = corpus_key(train, val, tokens={"document_end": BYTE_DOCUMENT_END}, encoding=self.encoding)
            cache = build_token_cache(train, val, Path(self.cache_dir) / key,
                                      fn=byte_tokenizer(self.encoding, document_end=BYTE_DOCUMENT_END),
                                      info={"vocab_size": VOCAB_SIZE, "dtype": "uint8", "eos_id": BYTE_DOCUMENT_END})
        elif self.tokenizer_path is None:
            key = corpus_key(train, val, encoding=self.encoding)
            cache = build_token_cache(train, val, Path(self.cache_dir) / key, fn=byte_tokenizer(self.encoding))
        else:
            key = tokenized_key(train, val, self.tokenizer_path, self.text_field, self.encoding)
            cache = build_tokenized_cache(train, val, self.tokenizer_path, Path(self.cache_dir) / key, self.text_field,
                                          key=key, encoding=self.encoding)
        return str(cache / "train"), (str(cache / "val") if val else None)

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node before setup(); build_token_cache is also safe to call
        # from every process, so setup() repeats it for a DataModule used outside a Trainer.
        self.check_model_vocab()
        self.check_model_documents()
        self.optimized_dirs()

    # ---- vocabulary ----------------------------------------------------------------------------------------------
    def _prepared_root(self) -> Optional[Path]:
        """The folder holding a prepared ``data_path``'s marker and tokenizer (itself, or the parent of a split)."""
        if self.prepared_dirs() is None:
            return None
        return prepared_root(self.data_path) or Path(self.data_path)  # type: ignore[arg-type]

    def _check_prepared_tokenizer(self) -> None:
        root = self._prepared_root()
        info = cache_info(root) if root is not None else None
        if self.tokenizer_path is None or info is None:
            return
        if "tokenizer_sha256" not in info:
            raise ValueError(f"data_path {self.data_path!r} holds tokens prepared without a tokenizer (vocabulary "
                             f"{info.get('vocab_size')}), but tokenizer {self.tokenizer_path!r} was given: leave "
                             f"tokenizer unset to read it as it is, or prepare the corpus with this tokenizer")
        if info["tokenizer_sha256"] != tokenizer_hash(self.tokenizer_path):
            raise ValueError(f"data_path {self.data_path!r} was tokenized with another tokenizer than "
                             f"{self.tokenizer_path!r} (its files differ from {root / TOKENIZER_DIR}); leave tokenizer "
                             f"unset to use the prepared one, or prepare the corpus again with this tokenizer")

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` of the data (``tokenizer=``, else a prepared ``data_path``'s), or ``None``
        for bytes."""
        if self._tokenizer is None:
            path: Optional[Path] = Path(self.tokenizer_path) if self.tokenizer_path is not None else None
            if path is None and self.prepared_dirs() is not None:
                path = prepared_tokenizer(self.data_path)  # type: ignore[arg-type]
            self._tokenizer = load_tokenizer(path) if path is not None else None
        return self._tokenizer

    @property
    def reads_bytes(self) -> bool:
        """Whether the module itself reads raw text as bytes (no tokenizer, ``data_path`` not optimized)."""
        return self.tokenizer_path is None and self.prepared_dirs() is None

    @property
    def vocab_size(self) -> Optional[int]:
        """How many distinct ids the data may hold: 256 for bytes, the tokenizer's vocabulary, a prepared folder's
        recorded one; ``None`` for an optimized folder that records none (written by other code)."""
        if self.reads_bytes:
            return VOCAB_SIZE
        if self.tokenizer_path is not None:
            return self.tokenizer.get_vocab_size(with_added_tokens=True)
        root = self._prepared_root()
        info = cache_info(root) if root is not None else None
        return info.get("vocab_size") if info is not None else None

    def check_model_vocab(self, vocab: Optional[int] = None) -> None:
        """Refuse a model that cannot read the data: raw text as bytes under a vocabulary other than 256, or a
        vocabulary smaller than the data's. ``vocab``: default the trainer's module's (``models.model_vocab_size``);
        nothing is checked when neither is known."""
        if vocab is None:
            from lightning_async_pp.models.vocab import model_vocab_size

            module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
            vocab = model_vocab_size(module) if module is not None else None
        if vocab is None:
            return
        where = "the embedded corpus" if self.data_path is None else f"data_path {self.data_path!r}"
        if self.reads_bytes and vocab != VOCAB_SIZE:
            raise ValueError(f"TextDataModule reads {where} as bytes (vocabulary {VOCAB_SIZE}), but the model's "
                             f"vocabulary is {vocab}: give TextDataModule(tokenizer=...) (a tokenizer.json or its "
                             f"folder) for the model's tokens, or set the model's vocab_size to {VOCAB_SIZE}")
        data_vocab = self.vocab_size
        if data_vocab is not None and vocab < data_vocab:
            raise ValueError(f"the model's vocabulary ({vocab}) is smaller than the data's ({data_vocab}, {where}"
                             f"{'' if self.tokenizer_path is None else f' tokenized with {self.tokenizer_path!r}'}): "
                             f"ids up to {data_vocab - 1} would index past its embedding; set the model's vocab_size "
                             f"to at least {data_vocab}")

    def check_model_documents(self, skip_document_ends: Optional[bool] = None) -> None:
        """Refuse a model that skips document ends (``skip_document_ends=True``) under ``document_mask=False``: its
        batches would be token rows, with no documents to end, and the setting would do nothing. ``None``: the
        trainer's module's (an attribute or a hyperparameter of that name)."""
        if skip_document_ends is None:
            module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
            skip_document_ends = getattr(module, "skip_document_ends", None)
            if skip_document_ends is None and module is not None:
                skip_document_ends = getattr(module, "hparams", {}).get("skip_document_ends")
        if skip_document_ends is True and not self.document_mask:
            raise ValueError("the model has skip_document_ends=True but TextDataModule has document_mask=False: its "
                             "batches are token rows without documents, so nothing would be skipped; set the data's "
                             "document_mask: true (packed rows, positions restarting at each document) or the "
                             "model's skip_document_ends: false")

    # ---- datasets ------------------------------------------------------------------------------------------------
    def data_parallel_size_and_rank(self) -> tuple[int, int]:
        """From the strategy's ``distributed_sampler_kwargs`` when there is a trainer, else what litdata detects."""
        trainer = self.trainer
        if trainer is not None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
            if kwargs:
                return int(kwargs["num_replicas"]), int(kwargs["rank"])
            return 1, 0  # a single-process strategy
        env = _DistributedEnv.detect()
        return env.world_size, env.global_rank

    def setup(self, stage: Optional[str] = None) -> None:
        self.check_model_vocab()  # before any tokenizing or training step
        self.check_model_documents()
        train_dir, val_dir = self.optimized_dirs()
        env = data_parallel_env(*self.data_parallel_size_and_rank())
        train = self._dataset(train_dir, shuffle=True)
        if val_dir is not None:
            val = self._dataset(val_dir, shuffle=False)
        elif self.val_fraction > 0:
            train, val = train_test_split(train, splits=[1.0 - self.val_fraction, self.val_fraction], seed=self.seed)
            val.set_shuffle(False)
        else:
            val = None
        for ds in (train, val):
            if ds is not None:
                # In place of the (process) environment litdata detected: shard by data-parallel rank only.
                ds.distributed_env = env
        self.train_dataset, self.val_dataset = train, val

    def _dataset(self, input_dir: str, shuffle: bool) -> StreamingDataset:
        return StreamingDataset(
            input_dir=input_dir,
            item_loader=TokensLoader(block_size=self.block_size + 1),
            shuffle=shuffle,
            drop_last=True,
            seed=self.seed,
        )

    def document_end(self) -> int:
        """The token that ends each document (``document_mask=True``): the tokenizer's end-of-text id, a prepared
        folder's recorded one, or :data:`BYTE_DOCUMENT_END` for bytes."""
        if self.reads_bytes:
            return BYTE_DOCUMENT_END
        if self.tokenizer_path is not None:
            return eos_id(self.tokenizer_path, self.tokenizer)
        root = self._prepared_root()
        info = cache_info(root) if root is not None else None
        if info is None or "eos_id" not in info:
            raise ValueError(f"document_mask=True needs to know where documents end, but data_path "
                             f"{self.data_path!r} records no end-of-text id (prepared without a tokenizer, or written "
                             f"by other code): prepare it with a tokenizer, or give the raw text as data_path")
        return int(info["eos_id"])

    # ---- loaders -------------------------------------------------------------------------------------------------
    def _loader(self, dataset: Optional[StreamingDataset]) -> Any:
        if dataset is None:
            return []
        return DataParallelStreamingDataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=PackedRows(self.document_end()) if self.document_mask else collate_tokens,
            drop_last=True,
        )

    def train_dataloader(self) -> StreamingDataLoader:
        if self.train_dataset is None:
            raise RuntimeError("Call setup() before train_dataloader()")
        return self._loader(self.train_dataset)

    def val_dataloader(self) -> Any:
        return self._loader(self.val_dataset)

    def test_dataloader(self) -> Any:
        # The held-out split doubles as the test set: the corpus has no third split.
        return self._loader(self.val_dataset)
