"""Optimizers over a stage's share of the parameters, which may be empty.

Across processes each process's model holds only its stage's parameters, so ``configure_optimizers`` builds the
optimizer over that share. A stage whose parameters are all frozen when it runs (the usual fine-tuning optimizer
takes only ``requires_grad`` parameters) gets an empty list, which ``torch.optim.Optimizer`` refuses, although the
whole model, on one device, has parameters to train. Inside :func:`allowing_empty_parameter_lists` such an optimizer
(torch's, a correction wrapping one, ``Muon``) is built with one parameter group holding no parameters: it steps
over nothing, and a parameter group added later (``BaseFinetuning.unfreeze_and_add_param_group``) trains as on one
device.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer


_allowed = False


def empty_parameter_lists_allowed() -> bool:
    """Whether optimizers built now may take an empty parameter list (inside the strategy's optimizer setup)."""
    return _allowed


@contextmanager
def allowing_empty_parameter_lists() -> Iterator[None]:
    """Optimizers built inside accept an empty parameter list: one parameter group with no parameters, holding the
    constructor's defaults (torch refuses only a list without groups; a group may be empty)."""
    global _allowed
    original = Optimizer.__init__

    def init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params)
            if not params:
                params = [{"params": []}]
        original(self, params, defaults)

    Optimizer.__init__ = init  # type: ignore[method-assign]
    _allowed = True
    try:
        yield
    finally:
        Optimizer.__init__ = original  # type: ignore[method-assign]
        _allowed = False
