"""``ErrorFeedback``: the one-step-delay correction around any ``torch.optim.Optimizer``.

Under a constant one-step gradient delay (PipeDream-2BW) the update ``u_k`` is computed from weights one
step old. Error feedback extrapolates with the change between consecutive updates (Zmushko et al., 2026):

    W_{k+1} = W_k - u_k - c (u_k - u_{k-1}),      no correction at the first update,

where ``u_k`` is the wrapped optimizer's whole update (learning rate, weight decay, everything it does).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch.optim import Optimizer

#: Key of the correction buffer (``u_{k-1}``) in ``state[p]``, and so in ``state_dict()["state"][i]``.
PREV_UPDATE = "prev_update"


class ErrorFeedback(Optimizer):
    """Wrap the optimizer that ``optimizer(params)`` builds with the correction ``-c (u_k - u_{k-1})``.

    Guarantees:

    - The wrapped optimizer (:attr:`wrapped`) steps once per :meth:`step`, at the weights the wrapper left,
      so its moments advance once per step; ``u_k`` is the change its step makes to each parameter.
    - Then each parameter with a gradient becomes ``W_k - u_k - c (u_k - u_{k-1})``; on a parameter's first
      update, and for ``coefficient == 0``, nothing is added (with 0 the wrapper *is* the wrapped optimizer:
      no buffer, no copy). Parameters without a gradient are left alone, their buffer unchanged.
    - Persistent state: exactly one parameter-sized buffer per parameter, ``state[p]["prev_update"]``
      (= ``u_{k-1}``), kept *inside the wrapped optimizer's per-parameter state*. So ``state_dict`` /
      ``load_state_dict`` (the wrapped optimizer's, delegated) carry it, cast to each parameter's dtype and
      device like any moment. During :meth:`step` a transient copy of the parameters exists (``u_k`` cannot
      be recovered from the new weights and one buffer alone); it becomes the new buffer.
    - ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects, so LR schedulers
      and Lightning's device moves act on what the wrapped optimizer uses.
    - ``step(closure)`` evaluates the closure once, before the wrapped step (optimizers that must re-evaluate
      the closure themselves, such as LBFGS, are not supported).

    ``optimizer`` is typed ``OptimizerCallable`` so that LightningCLI/jsonargparse turn a nested
    ``class_path``/``init_args`` into a partial that takes the parameters.
    """

    def __init__(self, params: Iterable[Any], optimizer: OptimizerCallable, coefficient: float = 1.0) -> None:
        if not coefficient >= 0:  # also rejects NaN
            raise ValueError(f"ErrorFeedback coefficient must be >= 0, got {coefficient!r}")
        wrapped = optimizer(params)
        if not isinstance(wrapped, Optimizer):
            raise TypeError(
                "ErrorFeedback's `optimizer` must build a torch.optim.Optimizer from the parameters, "
                f"but {optimizer!r} returned {type(wrapped).__qualname__}: {wrapped!r}"
            )
        self.wrapped = wrapped
        self.coefficient = float(coefficient)
        # Optimizer.__setstate__ sets up hooks and step profiling without adding groups: the groups are the wrapped ones.
        Optimizer.__setstate__(self, {"defaults": wrapped.defaults})

    # The wrapped optimizer may replace these objects (torch's load_state_dict does), so always read through.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.wrapped.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.wrapped.state

    @state.setter
    def state(self, value: Any) -> None:
        self.wrapped.state = value

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Evaluate ``closure`` once, step the wrapped optimizer, then add ``-c (u_k - u_{k-1})``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.coefficient == 0:
            self.wrapped.step()
            return loss
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        updates = [p.detach().clone() for p in params]  # W_k now; u_k = W_k - W_k' after the wrapped step
        self.wrapped.step()
        for param, update in zip(params, updates):
            update.sub_(param)
            state = self.state[param]
            prev = state.get(PREV_UPDATE)
            if prev is not None:
                param.add_(prev.sub_(update), alpha=self.coefficient)  # W_k' - c (u_k - u_{k-1})
            state[PREV_UPDATE] = update
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; each parameter's entry also holds ``prev_update``."""
        return self.wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:  # keep the wrapped optimizer when pickled or deep-copied
        return self.__dict__.copy()

    def __repr__(self) -> str:
        return f"ErrorFeedback(coefficient={self.coefficient}, optimizer={self.wrapped!r})"
