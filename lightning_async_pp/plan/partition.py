"""Assigning layers to pipeline stages: by measured cost (``"balanced"``, plan/balanced.py), by parameter count,
uniformly, or by an explicit list."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from torch import nn

PartitionSpec = Union[str, Sequence[int]]
PARTITION_METHODS = ("balanced", "parameters", "uniform")


def partition_layers(layers: Sequence[nn.Module], num_stages: int, method: PartitionSpec = "parameters", *,
                     balanced: Optional[Sequence[int]] = None) -> list[range]:
    """Split ``layers`` into ``num_stages`` contiguous, non-empty ranges of layer indices.

    ``method`` is ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer counts), a list of
    layer counts per stage, or ``"balanced"``, whose counts the caller computed from the layers' costs
    (:func:`lightning_async_pp.plan.balanced.balanced_split`) and passes as ``balanced``.
    """
    n = len(layers)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n < num_stages:
        raise ValueError(
            f"pipeline_layers() returned {n} layer(s), fewer than the {num_stages} pipeline stages; "
            f"every stage needs at least one layer: use at most {n} stage(s) or split the model into more layers"
        )
    if isinstance(method, str):
        if method == "uniform":
            counts = _balanced_counts([1] * n, num_stages)
        elif method == "balanced":
            if balanced is None:
                raise ValueError("partition='balanced' needs the layer counts the cost model chose (balanced=...)")
            counts = _checked_counts(balanced, num_stages, n)
        elif method == "parameters":
            # A layer without parameters still costs compute; weigh it as one parameter so it is placed.
            weights = [max(1, sum(p.numel() for p in layer.parameters())) for layer in layers]
            counts = _balanced_counts(weights, num_stages)
        else:
            raise ValueError(
                f"Unknown partition method {method!r}; use one of {PARTITION_METHODS} or a list of layer counts"
            )
    else:
        counts = _checked_counts(method, num_stages, n)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def _checked_counts(method: Sequence[int], num_stages: int, n: int) -> list[int]:
    counts = [int(c) for c in method]
    if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != n:
        raise ValueError(
            f"Explicit partition {list(method)} is invalid: it needs {num_stages} positive layer counts that sum "
            f"to the {n} layers of pipeline_layers()"
        )
    return counts


def _balanced_counts(weights: Sequence[int], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimising the heaviest group."""

    def greedy(bound: int) -> list[int]:
        counts, acc = [0], 0
        for w in weights:
            if counts[-1] and acc + w > bound:
                counts.append(0)
                acc = 0
            counts[-1] += 1
            acc += w
        return counts

    lo, hi = max(weights), sum(weights)
    while lo < hi:  # smallest bound whose greedy split needs at most `parts` groups
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    counts = greedy(lo)
    while len(counts) < parts:  # the bound allowed fewer groups: split the largest until every stage has one
        i = max(range(len(counts)), key=lambda j: counts[j])
        counts[i : i + 1] = [counts[i] - counts[i] // 2, counts[i] // 2]
    return counts
