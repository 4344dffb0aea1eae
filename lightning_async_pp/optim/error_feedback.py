"""``ErrorFeedback``: the one-step-delay correction around any ``torch.optim.Optimizer``.

Under a constant one-step gradient delay (PipeDream-2BW) the update ``u_k`` is computed from weights one
step old. Error feedback extrapolates with the change between consecutive updates (Zmushko et al., 2026):

    W_{k+1} = W_k - u_k - c (u_k - u_{k-1}),      no correction at the first update,

where ``u_k`` is the wrapped optimizer's whole update (learning rate, weight decay, everything it does). ``c`` may
differ per parameter group (e.g. 1 for AdamW groups and 0 for Muon's, as RamTorch's delayed optimizers default).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

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
      update, and for ``c == 0``, nothing is added (with 0 the wrapper *is* the wrapped optimizer for those
      parameters: no buffer, no copy). Parameters without a gradient are left alone, their buffer unchanged.
    - ``c`` is per parameter group (:meth:`group_coefficient`): the group's own ``coefficient`` key if it has one;
      else, for a group tagged ``use_muon: True`` (``optim.Muon``'s Muon part), ``muon_coefficient`` if given;
      else the constructor's ``coefficient``. Group keys travel in ``state_dict()["param_groups"]``, so a
      checkpoint keeps them.
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

    def __init__(self, params: Iterable[Any], optimizer: OptimizerCallable, coefficient: float = 1.0,
                 muon_coefficient: Optional[float] = None) -> None:
        _check_coefficient(coefficient, "coefficient")
        if muon_coefficient is not None:
            _check_coefficient(muon_coefficient, "muon_coefficient")
        wrapped = optimizer(params)
        if not isinstance(wrapped, Optimizer):
            raise TypeError(
                "ErrorFeedback's `optimizer` must build a torch.optim.Optimizer from the parameters, "
                f"but {optimizer!r} returned {type(wrapped).__qualname__}: {wrapped!r}"
            )
        self.wrapped = wrapped
        self.coefficient = float(coefficient)
        self.muon_coefficient = None if muon_coefficient is None else float(muon_coefficient)
        # Optimizer.__setstate__ sets up hooks and step profiling without adding groups: the groups are the wrapped ones.
        Optimizer.__setstate__(self, {"defaults": wrapped.defaults})
        for index, group in enumerate(self.param_groups):  # bad group coefficients fail here, not at the first step
            self.group_coefficient(group, index)

    def group_coefficient(self, group: dict[str, Any], index: Optional[int] = None) -> float:
        """The correction coefficient ``c`` of one parameter group (see the class docstring for the order)."""
        if "coefficient" in group:
            where = "parameter group" + (f" {index}" if index is not None else "")
            return _check_coefficient(group["coefficient"], f"coefficient of {where}")
        if group.get("use_muon") and self.muon_coefficient is not None:
            return self.muon_coefficient
        return self.coefficient

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
        corrected = []  # (param, c) of the parameters with a gradient in groups with c > 0
        for index, group in enumerate(self.param_groups):
            c = self.group_coefficient(group, index)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if c > 0:
                    corrected.append((p, c))
                elif p in self.state:
                    self.state[p].pop(PREV_UPDATE, None)  # c = 0 keeps no buffer (a group set to 0 mid-run)
        if not corrected:
            self.wrapped.step()
            return loss
        updates = [p.detach().clone() for p, _ in corrected]  # W_k now; u_k = W_k - W_k' after the wrapped step
        self.wrapped.step()
        for (param, c), update in zip(corrected, updates):
            update.sub_(param)
            state = self.state[param]
            prev = state.get(PREV_UPDATE)
            if prev is not None:
                param.add_(prev.sub_(update), alpha=c)  # W_k' - c (u_k - u_{k-1})
            state[PREV_UPDATE] = update
        return loss

    def rewrap(self, params: Iterable[Any], optimizer: OptimizerCallable) -> "ErrorFeedback":
        """The same correction around ``optimizer(params)``, e.g. over one replica's share of the parameters
        (``shard_optimizer=True``): the buffer then exists only for those parameters."""
        return type(self)(params, optimizer=optimizer, coefficient=self.coefficient, muon_coefficient=self.muon_coefficient)

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
        muon = "" if self.muon_coefficient is None else f", muon_coefficient={self.muon_coefficient}"
        return f"ErrorFeedback(coefficient={self.coefficient}{muon}, optimizer={self.wrapped!r})"


def _check_coefficient(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # also rejects NaN
        raise ValueError(f"ErrorFeedback {what} must be >= 0, got {value!r} (a number; 0 means no correction)")
    return float(value)
