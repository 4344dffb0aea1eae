"""ZeRO-1 for a stage's optimizer: its state split across the stage's data-parallel replicas.

The sharding is torch's ``ZeroRedundancyOptimizer``: it assigns each parameter, whole, to one replica (greedily by
size, group by group), steps a local optimizer over that replica's parameters only, and broadcasts every updated
parameter from its owner. Whole parameters keep ``optim.Muon``'s Newton-Schulz on whole matrices, and every
per-parameter state (moments, ``ErrorFeedback``'s buffer) lives on one replica only. See docs/design/data-parallel.md,
"Data parallelism".

The user's optimizer, built by Lightning from ``configure_optimizers``, is kept as the template: the local
optimizer is a new one of the same kind over the owned parameters (:func:`rebuild`), and the
``ZeroRedundancyOptimizer`` is given the template's very parameter-group dicts, so a learning-rate scheduler bound
to the template changes what the local optimizer uses (ZeRO copies the group settings to it before every step).
No Lightning import here.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_async_pp.parallel.tensor_parallel import local_tensor


class StageShardedOptimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over one stage's parameters and its data-parallel group, with the local optimizer
    rebuilt from ``template`` (the optimizer the user configured)."""

    def __init__(self, template: Optimizer, group: Any) -> None:
        if len(template.state) > 0:
            raise ValueError(
                f"shard_optimizer=True shards a fresh optimizer, but this {type(template).__name__} already holds "
                f"state for {len(template.state)} parameter(s); it must not have stepped before training starts"
            )
        self.template = template
        # The template's group dicts themselves: ZeRO's ``param_groups`` are those objects (Optimizer.__init__
        # keeps the dicts it is given), so schedulers and Lightning's LR monitor act on one set of groups.
        super().__init__(template.param_groups, optimizer_class=lambda groups: rebuild(template, groups),
                         process_group=group)

    def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
        """torch's per-parameter broadcast of the parameters ``rank`` updated, with each DTensor parameter's local
        shard moved instead of the DTensor (DTensor has no rule for ``broadcast``; the replicas of one
        tensor-parallel rank hold the same shard shapes: docs/design/tensor-parallel.md)."""
        params = [p for group in self._partition_parameters()[rank] for p in group["params"]]
        if self.parameters_as_bucket_view or not any(isinstance(p, DTensor) for p in params):
            return super()._broadcast_params_from_rank(rank)
        src = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(local_tensor(p).data, src=src, group=self.process_group, async_op=True) for p in params]

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        loss = super().step(closure, **kwargs)
        # An LR scheduler bound to the template counts the template's steps to warn about a wrong call order.
        self.template._opt_called = True  # type: ignore[attr-defined]
        return loss


def rebuild(template: Optimizer, param_groups: list[dict[str, Any]]) -> Optimizer:
    """A new optimizer of ``template``'s kind and settings over ``param_groups`` (which carry every group setting).

    A wrapper that exposes ``wrapped`` and ``rewrap(params, build)`` (``optim.ErrorFeedback``) is rebuilt around a
    rebuilt inner optimizer; any other optimizer is constructed again with the constructor arguments its
    ``defaults`` name (the groups' own keys take precedence, as in any torch optimizer).
    """
    rewrap = getattr(template, "rewrap", None)
    inner = getattr(template, "wrapped", None)
    if rewrap is not None and isinstance(inner, Optimizer):
        return rewrap(param_groups, lambda groups: rebuild(inner, groups))
    cls = type(template)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in template.defaults.items() if k in accepted}
    for name in ("adamw_names",):  # optim.Muon's routing setting, kept as an attribute
        if name in accepted and hasattr(template, name):
            kwargs[name] = getattr(template, name)
    try:
        return cls(param_groups, **kwargs)
    except Exception as err:
        raise TypeError(
            f"shard_optimizer=True builds each replica's optimizer again over its share of the parameters, as "
            f"{cls.__name__}(param_groups, **{sorted(kwargs)}), which failed: {err}. Use a torch.optim optimizer, "
            f"optim.Muon or optim.ErrorFeedback, or shard_optimizer=False"
        ) from err


def shard_optimizers(optimizers: Sequence[Optimizer], group: Any) -> list[Optimizer]:
    """Each of a stage's optimizers sharded across its data-parallel ``group`` (ZeRO-1)."""
    sharded = []
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            sharded.append(optimizer)
            continue
        dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"]}
        if len(dtypes) > 1:
            raise ValueError(
                f"shard_optimizer=True needs one parameter dtype per stage (ZeroRedundancyOptimizer), but this "
                f"stage's optimizer holds {sorted(map(str, dtypes))}"
            )
        sharded.append(StageShardedOptimizer(optimizer, group))
    return sharded


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds this process's state: the local one of a sharded optimizer, else itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def sync_group_settings(optimizer: Optimizer) -> None:
    """The exposed groups' settings to the local optimizer's groups. ZeRO does it only before every step, so after
    a step the local groups hold the settings of the step just taken, not those an LR scheduler has set since:
    done before a checkpoint is written (it must hold the settings of the next step) and after one was loaded
    (so that the local optimizer is complete at once)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        for src, dst in zip(optimizer.param_groups, optimizer.optim.param_groups):
            dst.update({k: v for k, v in src.items() if k != "params"})


def state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of the per-parameter state tensors this process holds for ``optimizer``."""
    local = local_optimizer(optimizer)
    return sum(v.numel() * v.element_size() for entry in local.state.values() for v in entry.values()
               if isinstance(v, torch.Tensor))
