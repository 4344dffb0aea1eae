"""``OptimizerWrapper``: the shared plumbing of the delay corrections that wrap another optimizer.

A correction (``ErrorFeedback``, ``DelayCompensation``) is a ``torch.optim.Optimizer`` around the one
``optimizer(params)`` builds. Its parameter groups, per-parameter state and defaults are the wrapped optimizer's
own objects, so LR schedulers, Lightning's device moves and checkpoints act on what the wrapped optimizer uses, and a
correction's buffers live in the wrapped optimizer's per-parameter state (``state_dict`` carries them, cast to each
parameter's dtype and device like any moment; ``shard_optimizer=True`` shards them with the moments).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch.optim import Optimizer


class OptimizerWrapper(Optimizer):
    """Base of the corrections: builds ``optimizer(params)`` and delegates groups, state and (de)serialization to it.

    Subclasses implement ``step``, :meth:`group_coefficient` and :meth:`rewrap`, and set their settings before
    calling this constructor (it checks every group's coefficient). ``optimizer`` is typed ``OptimizerCallable`` so that
    LightningCLI/jsonargparse turn a nested ``class_path``/``init_args`` into a partial that takes the parameters.
    """

    def __init__(self, params: Iterable[Any], optimizer: OptimizerCallable) -> None:
        wrapped = optimizer(params)
        if not isinstance(wrapped, Optimizer):
            raise TypeError(
                f"{type(self).__name__}'s `optimizer` must build a torch.optim.Optimizer from the parameters, "
                f"but {optimizer!r} returned {type(wrapped).__qualname__}: {wrapped!r}"
            )
        self.wrapped = wrapped
        # Optimizer.__setstate__ sets up hooks and step profiling without adding groups: the groups are the wrapped ones.
        Optimizer.__setstate__(self, {"defaults": wrapped.defaults})
        for index, group in enumerate(self.param_groups):  # bad group coefficients fail here, not at the first step
            self.group_coefficient(group, index)

    def group_coefficient(self, group: dict[str, Any], index: Optional[int] = None) -> float:
        """The correction's coefficient for one parameter group (subclasses: their own rule)."""
        raise NotImplementedError

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

    def rewrap(self, params: Iterable[Any], optimizer: OptimizerCallable) -> "OptimizerWrapper":
        """The same correction around ``optimizer(params)``, e.g. over one replica's share of the parameters
        (``shard_optimizer=True``): the buffers then exist only for those parameters."""
        raise NotImplementedError

    @staticmethod
    def evaluate_closure(closure: Any) -> Any:
        """``closure()`` with gradients enabled (steps run under ``no_grad``), or None: what ``step`` returns."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; each parameter's entry also holds the correction's buffers."""
        return self.wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:  # keep the wrapped optimizer when pickled or deep-copied
        return self.__dict__.copy()


def check_coefficient(value: Any, what: str, owner: str, meaning: str = "0 means no correction") -> float:
    """``value`` as a float if it is a number >= 0, else a ValueError naming ``what`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # also rejects NaN
        raise ValueError(f"{owner} {what} must be >= 0, got {value!r} (a number; {meaning})")
    return float(value)


def group_coefficient(group: dict[str, Any], index: Optional[int], default: float, owner: str) -> float:
    """A parameter group's own ``coefficient`` key (checked), else ``default``."""
    if "coefficient" in group:
        where = "parameter group" + (f" {index}" if index is not None else "")
        return check_coefficient(group["coefficient"], f"coefficient of {where}", owner)
    return default
