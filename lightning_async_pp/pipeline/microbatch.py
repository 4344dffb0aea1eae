"""Batches: splitting into microbatches along dim 0 (equal for training, ragged for evaluation), each
microbatch's share of its batch's mean loss, the microbatches' outputs joined back into the batch's, and a
fingerprint that lets the stages of a pipeline check they were given the same batch."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_async_pp.parallel.tensor_parallel import whole_value
from lightning_async_pp.pipeline.structure import flatten, unflatten


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor in ``batch``."""
    sizes = {t.shape[0] for t in tensors_of(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"Every tensor in a batch must share dim 0 to be split into microbatches; found sizes {sorted(sizes)}"
        )
    return sizes.pop()


def check_splittable(size: int, num_microbatches: int, what: str = "A batch of size {size}") -> None:
    """Raise a ValueError naming both numbers unless ``size`` splits into ``num_microbatches`` equal microbatches
    (``what`` names the batch, with ``{size}`` for its size)."""
    if num_microbatches < 1 or size % num_microbatches != 0:
        raise ValueError(
            f"{what.format(size=size)} cannot be split into num_microbatches={num_microbatches} equal microbatches; "
            f"use a batch size that is a multiple of {num_microbatches}, or a num_microbatches that divides {size}"
        )


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``batch`` (nested tuples, lists, dicts) into ``num_microbatches`` equal parts."""
    size = batch_size_of(batch)
    check_splittable(size, num_microbatches)
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


def tensors_of(batch: Any):
    """Every tensor in ``batch`` (nested tuples, lists, mappings), in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from tensors_of(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_of(v)


_SAMPLES = 4096  # positions a fingerprint weighs per tensor: enough to catch reordered rows, cheap to read
_weights_cache: dict[tuple[int, str], Tensor] = {}


def _position_weights(n: int, device: torch.device) -> Tensor:
    key = (n, str(device))
    weights = _weights_cache.get(key)
    if weights is None:
        weights = _weights_cache[key] = torch.arange(n, dtype=torch.float64, device=device).remainder_(251).add_(1)
    return weights


def fingerprint(batch: Any) -> Tensor:
    """A cheap, order-sensitive checksum of a batch's tensors (float64, on their device), to detect stages of one
    pipeline that were given different data.

    Every element enters through the tensor's sum; positions through a weighted sum over at most ``_SAMPLES``
    evenly strided elements, so rows in another order change it too. One pass over the data and no temporaries
    of the batch's size: a fingerprint is taken every step on every stage.
    """
    total: Optional[Tensor] = None
    for i, t in enumerate(tensors_of(batch)):
        flat = t.detach().reshape(-1)
        n = flat.numel()
        sample = flat[:: max(1, n // _SAMPLES)].to(torch.float64)
        positions = (sample * _position_weights(sample.numel(), sample.device)).sum()
        term = flat.sum(dtype=torch.float64) + positions * (i + 1) + n
        total = term if total is None else total + term.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


# ---- a microbatch's share of its batch's mean loss --------------------------------------------------------------
def loss_shares(weights: Sequence[Any]) -> Optional[Tensor]:
    """Each microbatch's share of its batch's mean loss, from its weight (``pipeline_loss_weight``): ``w_j / sum w``
    (float64, on the weights' device: no host read), or ``None`` where the weights are equal numbers: the mean of the
    microbatch means, each divided by ``m`` as gradient accumulation does."""
    if all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights) and len(set(weights)) == 1:
        check_loss_weights(weights)
        return None
    return weight_shares(weights)


def check_loss_weights(weights: Sequence[Any]) -> None:
    """Refuse a weight that is neither a number >= 0 nor a one-element tensor, naming the hook (a tensor's sign is
    not read: that would wait for the device)."""
    for w in weights:
        count = isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0
        if not (count or isinstance(w, Tensor) and w.numel() == 1):
            raise TypeError(f"pipeline_loss_weight must return a number >= 0 or a one-element tensor (the microbatch's "
                            f"weight in its batch's mean loss, such as its count of targets); got {w!r}")


def weight_shares(weights: Sequence[Any]) -> Tensor:
    """``w_j / sum w`` as a float64 vector on the weights' device, whatever the weights' scale (fractions too); all
    shares 0 where the weights add up to 0 (every target of the batch skipped), not NaN."""
    check_loss_weights(weights)
    values = [torch.as_tensor(w, dtype=torch.float64).detach().reshape(()) for w in weights]
    device = next((v.device for v in values if v.device.type != "cpu"), values[0].device)
    stacked = torch.stack([v.to(device) for v in values])
    total = stacked.sum()
    return stacked / torch.where(total > 0, total, torch.ones_like(total))


def scalar_loss(loss: Any) -> Tensor:
    if isinstance(loss, Tensor):
        loss = whole_value(loss)  # a DTensor loss (tensor parallelism): its value, replicated on every rank
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"pipeline_loss must return a scalar tensor (the mean loss of the microbatch), got shape {shape}; "
            f"reduce it, e.g. with .mean()"
        )
    return loss.reshape(())


# ---- the microbatches' outputs, joined back ------------------------------------------------------------------------
def shape_signature(value: Any) -> tuple:
    """The shapes and dtypes of ``value``'s tensors: what both sides of a boundary know of a microbatch, and all a
    stage's output layout depends on."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in tensors_of(value))


def concatenate(outputs: list[Any]) -> Any:
    """Microbatch outputs joined along dim 0, leaf by leaf (any nesting)."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [flatten(o, "the last layer's output") for o in outputs]
    spec = flat[0][1]
    leaves = [torch.cat([f[0][i] for f in flat]) if flat[0][0][i].dim() > 0 else flat[0][0][i]
              for i in range(len(flat[0][0]))]
    return unflatten(leaves, spec)
