"""Optimizers over a stage's share of the parameters, which may be empty.

Across processes each process's model holds only its stage's parameters, so ``configure_optimizers`` builds the
optimizer over that share. A stage whose parameters are all frozen when it runs (the usual fine-tuning optimizer
takes only ``requires_grad`` parameters) gets an empty list, which ``torch.optim.Optimizer`` refuses, although the
whole model, on one device, has parameters to train. Inside :func:`allowing_empty_parameter_lists` such an optimizer
is built with one parameter group holding no parameters: it steps over nothing, and a parameter group added later
(``BaseFinetuning.unfreeze_and_add_param_group``) trains as on one device.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer


@contextmanager
def allowing_empty_parameter_lists() -> Iterator[None]:
    """Optimizers built inside accept an empty parameter list (one empty group, with the constructor's defaults)."""
    original = Optimizer.__init__

    def init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if isinstance(params, torch.Tensor):
            return original(self, params, defaults)
        params = list(params)
        if params:
            return original(self, params, defaults)
        # The group is built around a stand-in (so the subclass's add_param_group fills in its defaults), which
        # then leaves it: nothing of it remains in the optimizer's state or checkpoints.
        original(self, [torch.nn.Parameter(torch.empty(0))], defaults)
        self.param_groups[0]["params"] = []

    Optimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer.__init__ = original  # type: ignore[method-assign]
