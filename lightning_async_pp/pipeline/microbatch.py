"""Splitting a batch into equal microbatches along dim 0."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor in ``batch``."""
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"Every tensor in a batch must share dim 0 to be split into microbatches; found sizes {sorted(sizes)}"
        )
    return sizes.pop()


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``batch`` (nested tuples, lists, dicts) into ``num_microbatches`` equal parts."""
    size = batch_size_of(batch)
    if num_microbatches < 1 or size % num_microbatches != 0:
        raise ValueError(
            f"A batch of size {size} cannot be split into num_microbatches={num_microbatches} equal microbatches; "
            f"use a batch size that is a multiple of {num_microbatches}, or a num_microbatches that divides {size}"
        )
    chunk = size // num_microbatches
    return [_slice(batch, i * chunk, (i + 1) * chunk) for i in range(num_microbatches)]


def split_ragged(batch: Any, num_microbatches: int) -> list[Any]:
    """Split ``batch`` into at most ``num_microbatches`` parts of sizes differing by at most one (evaluation and
    prediction accept any batch size, as ordinary Lightning does)."""
    size = batch_size_of(batch)
    parts = max(1, min(num_microbatches, size))
    bounds = [size * i // parts for i in range(parts + 1)]
    return [_slice(batch, bounds[i], bounds[i + 1]) for i in range(parts)]


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, end) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_slice(v, start, end) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, end) for v in batch)
    return batch


def _tensors(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
