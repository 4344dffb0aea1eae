"""Parameter groups shared by the example models."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def decay_matrices_only(named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weight decay on matrices (linear weights, embeddings), none on biases and norm gains.

    Frozen parameters are left out. The groups hold the parameters without their names: torch refuses a group
    without names in an optimizer whose groups have them, and Lightning's fine-tuning callbacks
    (``BaseFinetuning.unfreeze_and_add_param_group``) add a layer they unfreeze as such a group. (The pipeline's
    checkpoints name each parameter's optimizer state by itself.)
    """
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    return [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
