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

from lightning_async_pp.optim.wrapper import OptimizerWrapper, check_coefficient, group_coefficient

#: Key of the correction buffer (``u_{k-1}``) in ``state[p]``, and so in ``state_dict()["state"][i]``.
PREV_UPDATE = "prev_update"


class ErrorFeedback(OptimizerWrapper):
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
        self.coefficient = check_coefficient(coefficient, "coefficient", "ErrorFeedback")
        self.muon_coefficient = (None if muon_coefficient is None
                                 else check_coefficient(muon_coefficient, "muon_coefficient", "ErrorFeedback"))
        super().__init__(params, optimizer)  # checks every group's coefficient

    def group_coefficient(self, group: dict[str, Any], index: Optional[int] = None) -> float:
        """The correction coefficient ``c`` of one parameter group (see the class docstring for the order)."""
        default = self.muon_coefficient if group.get("use_muon") and self.muon_coefficient is not None else self.coefficient
        return group_coefficient(group, index, default, "ErrorFeedback")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Evaluate ``closure`` once, step the wrapped optimizer, then add ``-c (u_k - u_{k-1})``."""
        loss = self.evaluate_closure(closure)
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

    def __repr__(self) -> str:
        muon = "" if self.muon_coefficient is None else f", muon_coefficient={self.muon_coefficient}"
        return f"ErrorFeedback(coefficient={self.coefficient}{muon}, optimizer={self.wrapped!r})"
