"""Parameter groups shared by the example models."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def decay_matrices_only(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weight decay on matrices (linear weights, embeddings), none on biases and norm gains.

    Parameters stay named so that the optimizer's state dict carries the names; frozen ones are left out.
    """
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
