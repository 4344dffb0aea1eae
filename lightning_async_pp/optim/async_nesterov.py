"""``AsyncNesterov``: the Nesterov rule for asynchronous pipelines of Ajanthan et al., as its authors' code runs it.

Ajanthan, Ramasinghe, Zuo, Avraham, Long, "Nesterov Method for Asynchronous Pipeline Parallel Optimization",
ICML 2025 (arXiv 2505.01099); code: PluralisResearch/AsyncPP (``--optimizer nadamw``: ``optim/nadamw.py`` builds
``torch.optim.NAdam`` by name through its weight-stashing wrapper, with ``decoupled_weight_decay=True``,
``betas=(momentum, 0.999)``, ``momentum_decay`` (default 0.004) and ``weight_decay`` (default 0.01); ``run.bash``
runs "ours" with ``--momentum 0.99``). ``--adaptive_momentum`` (``main_with_runtime.py``) raises the momentum with
the stage's delay: ``momentum + delay * (0.99 - momentum) / num_stages``, ``delay`` being the stage's number of
weight versions minus 1.

What could be checked against the paper: its abstract says it modifies NAG's look-ahead step to address the
staleness (with a sublinear convergence proof under a fixed delay), and the paper refers to "the PyTorch
implementation of NAdam" for its experiments; NAdam's update mixes the decayed first moment with the current (here
delayed) gradient, a Nesterov look-ahead along the momentum, which a momentum close to 1 makes long. The paper's own
equations could not be read here, so whether they match NAdam term for term (e.g. NAdam's ``momentum_decay``
schedule of ``beta1``, its bias corrections) is NOT verified; the code has no delay-specific term other than the
adaptive momentum. We reproduce the code, not an independent reading of the equations: this class is exactly
``torch.optim.NAdam(params, lr, betas=(m, beta2), eps, weight_decay, momentum_decay, decoupled_weight_decay=True)``
with ``m`` the (adaptive) momentum.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

#: The momentum the adaptive rule moves towards (AsyncPP's constant).
ADAPTIVE_TARGET = 0.99


def adapted_momentum(momentum: float, delay: int, num_stages: int) -> float:
    """AsyncPP's ``momentum + delay * (0.99 - momentum) / num_stages``."""
    return momentum + delay * (ADAPTIVE_TARGET - momentum) / num_stages


class AsyncNesterov(torch.optim.NAdam):
    """NAdam with decoupled weight decay and momentum ``momentum`` (0.99 by default): AsyncPP's rule.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: the learning rate, as ``torch.optim.NAdam``'s.
        eps: as ``torch.optim.NAdam``'s.
        weight_decay: decoupled, AdamW-style (default: AsyncPP's 0.01).
        momentum_decay: as ``torch.optim.NAdam``'s (default: torch's 0.004).
        momentum: NAdam's ``beta1``, in [0, 1) (the paper recommends 0.99).
        beta2: the second-moment decay, in [0, 1).
        adaptive_momentum: ``None``, or ``(delay, num_stages)``: use ``momentum + delay * (0.99 - momentum) /
            num_stages`` instead (AsyncPP's ``--adaptive_momentum``); the result is :attr:`momentum`. Under 2BW every
            stage has ``delay=1``; with per-stage delays build one optimizer per stage's delay.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.99, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01, momentum_decay: float = 0.004,
                 adaptive_momentum: Optional[tuple[int, int]] = None) -> None:
        _check_unit(momentum, "momentum", "NAdam's beta1; the paper recommends 0.99")
        _check_unit(beta2, "beta2", "the second-moment decay")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("momentum_decay", momentum_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"AsyncNesterov {name} must be a number >= 0, got {value!r}")
        self.base_momentum = float(momentum)
        self.adaptive = adaptive_momentum
        if adaptive_momentum is not None:
            if (not isinstance(adaptive_momentum, (tuple, list)) or len(adaptive_momentum) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in adaptive_momentum)
                    or adaptive_momentum[0] < 0 or adaptive_momentum[1] < 1):
                raise ValueError(f"AsyncNesterov adaptive_momentum must be None or (delay, num_stages), integers with "
                                 f"delay >= 0 and num_stages >= 1, got {adaptive_momentum!r}")
            self.adaptive = (adaptive_momentum[0], adaptive_momentum[1])
            momentum = adapted_momentum(momentum, *self.adaptive)
            _check_unit(momentum, "adaptive momentum", f"from momentum={self.base_momentum} and "
                        f"(delay, num_stages)={self.adaptive}; lower the delay or raise num_stages")
        self.momentum = float(momentum)
        super().__init__(params, lr=lr, betas=(self.momentum, beta2), eps=eps, weight_decay=weight_decay,
                         momentum_decay=momentum_decay, decoupled_weight_decay=True)


def _check_unit(value: Any, name: str, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"AsyncNesterov {name} must be in [0, 1) ({meaning}), got {value!r}")
