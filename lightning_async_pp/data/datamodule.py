"""``TextDataModule``: byte-level token streams from litdata, sharded by *data-parallel* rank only.

Under pipeline parallelism every stage of one pipeline must see the same batch, so sharding by the process rank
(what litdata and Lightning would do on their own) is wrong: the data-parallel size and rank come from the
strategy's ``distributed_sampler_kwargs`` and are handed to litdata in place of the environment it detects.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import lightning as L
import torch
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming import dataloader as _litdata_dataloader
from litdata.streaming.item_loader import TokensLoader
from litdata.utilities.env import _DistributedEnv
from litdata.utilities.train_test_split import train_test_split

from lightning_async_pp.data.corpus import (
    build_token_cache,
    corpus_key,
    split_corpus,
    stdlib_files,
    text_files,
)

_INDEX = "index.json"
DEFAULT_CACHE_DIR = os.path.join(".cache", "lightning_async_pp")


def collate_tokens(items: list[torch.Tensor]) -> torch.Tensor:
    """Stack windows of uint8 bytes into a (B, block_size + 1) LongTensor."""
    return torch.stack(items).long()


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
    """Byte-level language-modelling data: windows of ``block_size + 1`` tokens, streamed with litdata.

    Args:
        data_path: ``None`` for the embedded corpus (the Python standard library's sources); a text file or a
            folder of text files (tokenized once into ``cache_dir``); or a litdata-optimized folder, either with
            ``train/`` and ``val/`` subfolders or a single one (then ``val_fraction`` of it is held out).
        block_size: tokens the model sees per row; each row holds ``block_size + 1`` (inputs and shifted targets).
        batch_size: rows per batch (per data-parallel replica); every batch has exactly this many.
        num_workers: DataLoader worker processes.
        val_fraction: share of the corpus held out for validation (whole files where there are several).
        max_bytes: cap on the corpus size, for tests and quick runs.
        cache_dir: where tokenized corpora are kept, one subfolder per corpus hash.
        seed: seeds the split, the shuffle and ``max_bytes``'s choice of files.
    """

    def __init__(
        self,
        data_path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        cache_dir: Optional[str] = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if data_path is not None and not os.path.exists(data_path):
            raise FileNotFoundError(f"data_path {data_path!r} does not exist")
        self.data_path = data_path
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.cache_dir = cache_dir or DEFAULT_CACHE_DIR
        self.seed = seed
        self.train_dataset: Optional[StreamingDataset] = None
        self.val_dataset: Optional[StreamingDataset] = None

    # ---- where the optimized data lives ------------------------------------------------------------------------
    def optimized_dirs(self) -> tuple[str, Optional[str]]:
        """``(train_dir, val_dir)`` of litdata-optimized data, tokenizing the corpus first if it is not cached.
        ``val_dir`` is ``None`` for a single optimized folder (validation is then split off it)."""
        path = self.data_path
        if path is not None:
            if os.path.isfile(os.path.join(path, "train", _INDEX)) and os.path.isfile(os.path.join(path, "val", _INDEX)):
                return os.path.join(path, "train"), os.path.join(path, "val")
            if os.path.isfile(os.path.join(path, _INDEX)):
                return path, None
        files = stdlib_files() if path is None else text_files(path)
        train, val = split_corpus(files, self.val_fraction, self.max_bytes, self.seed)
        cache = build_token_cache(train, val, Path(self.cache_dir) / corpus_key(train, val))
        return str(cache / "train"), (str(cache / "val") if val else None)

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node before setup(); build_token_cache is also safe to call
        # from every process, so setup() repeats it for a DataModule used outside a Trainer.
        self.optimized_dirs()

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

    # ---- loaders -------------------------------------------------------------------------------------------------
    def _loader(self, dataset: Optional[StreamingDataset]) -> Any:
        if dataset is None:
            return []
        return DataParallelStreamingDataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_tokens,
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
