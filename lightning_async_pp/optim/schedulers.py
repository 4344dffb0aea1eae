"""Learning-rate schedules for pretraining, usable from YAML (``lr_scheduler: class_path: ...``)."""
from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """Linear warmup from 0 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the base rate at
    ``total_steps`` (held there after). Multiplies every parameter group's base ``lr``, so with
    ``optim.Muon`` both the Muon and the AdamW part follow it."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, total_steps: int = 1000, min_lr_ratio: float = 0.1,
                 last_epoch: int = -1) -> None:
        if warmup_steps < 0 or total_steps <= warmup_steps:
            raise ValueError(
                f"WarmupCosine needs 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
                f"total_steps={total_steps}"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        super().__init__(optimizer, self.factor, last_epoch=last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
