"""What the configured optimizer keeps per pipeline layer, for the split's memory account (docs/design/planner.md,
"Balanced split").

The optimizers are built only after the split (each stage over its own parameters), so the split cannot read their
state. Instead the module's ``configure_optimizers()`` is run once over ``meta`` stand-ins of its parameters (no
memory, nothing computed; the model's own parameters are put back untouched), each optimizer steps once on zero
``meta`` gradients, and the tensors it then keeps per parameter are counted: AdamW's two moments, Muon's momentum
for hidden matrices, ErrorFeedback's buffer beside what it wraps, any optimizer's own."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from lightning_async_pp.parallel.placement import parameters_swapped
from lightning_async_pp.parallel.tensor_parallel import local_tensor
from lightning_async_pp.strategy import _lightning


class LayerOptimizerState(NamedTuple):
    """What the configured optimizer keeps, per layer (``per_layer``: a parameter several layers hold counted in
    each) and, for each parameter several layers hold (a tied weight), its bytes and those layers (``shared``): a
    stage holding two of them keeps the state once (:class:`~lightning_async_pp.plan.balanced.MemoryModel`)."""

    per_layer: tuple[int, ...]
    shared: tuple[tuple[int, tuple[int, ...]], ...] = ()


def optimizer_state_per_layer(module: Any, layers: Sequence[nn.Module]) -> Optional[LayerOptimizerState]:
    """What ``module.configure_optimizers()``'s optimizers keep after a step for the parameters of ``layers``
    (call with every layer in the module's tree: another stage's placeholder holds none of its parameters);
    ``None`` (the account then assumes AdamW) where that cannot be found on ``meta`` stand-ins, with a warning
    naming why."""
    def meta_stand_in(p: nn.Parameter) -> nn.Parameter:  # of its local shard's shape (tensor parallelism: the
        # state this rank keeps); a parameter held twice (tied) gets one
        return nn.Parameter(torch.empty(local_tensor(p).shape, dtype=p.dtype, device="meta"), p.requires_grad)

    try:
        with parameters_swapped([module], meta_stand_in) as swapped, torch.random.fork_rng(devices=[]):
            # fork_rng: a configure_optimizers that draws leaves no trace
            optimizers = _lightning.configure_optimizers(module)
            for _, stand_in in swapped.values():
                stand_in.grad = torch.zeros_like(stand_in) if stand_in.requires_grad else None
            for optimizer in optimizers:
                optimizer.step()
    except Exception as err:  # an optimizer that cannot step on meta tensors, a configure_optimizers needing values
        warnings.warn(f"the split's memory account could not find what the configured optimizer keeps "
                      f"({type(err).__name__}: {err}); it assumes AdamW's two moments per parameter", stacklevel=3)
        return None
    stand_ins = {original: stand_in for original, (_, stand_in) in swapped.items()}
    per_parameter: dict[int, int] = {}
    for optimizer in optimizers:
        for original, stand_in in stand_ins.items():
            state = optimizer.state.get(stand_in, {}) if hasattr(optimizer.state, "get") else {}
            per_parameter[original] = per_parameter.get(original, 0) + sum(
                t.numel() * t.element_size() for t in _tensors(state))
    holders: dict[int, list[int]] = {}  # parameter -> the layers holding it
    for index, layer in enumerate(layers):
        for i in {id(p) for p in layer.parameters()}:
            holders.setdefault(i, []).append(index)
    per_layer = [0] * len(layers)
    for i, held_by in holders.items():
        for index in held_by:
            per_layer[index] += per_parameter.get(i, 0)
    shared = tuple((per_parameter[i], tuple(held_by)) for i, held_by in holders.items()
                   if len(held_by) > 1 and per_parameter.get(i, 0))
    return LayerOptimizerState(tuple(per_layer), shared)


def _tensors(state: Any) -> list[Tensor]:
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []
