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
    return [_index(batch, i, size // num_microbatches) for i in range(num_microbatches)]


def _index(batch: Any, i: int, chunk: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[i * chunk : (i + 1) * chunk] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _index(v, i, chunk) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_index(v, i, chunk) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_index(v, i, chunk) for v in batch)
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
