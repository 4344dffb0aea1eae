"""A stage's backward split in two, as the zero-bubble schedules need it: the input gradient first (what the
previous stage waits for), the weight gradient later (what nobody waits for).

The graph surgery is torch.distributed.pipelining's (``construct_reverse_graph``, ``get_param_groups`` and
``stage_backward_weight`` from its ``_backward`` module, the code behind ``stage_backward_input`` /
``stage_backward_weight``): the input pass records the gradients arriving at the nodes where the weights'
branches leave the input's path, and the weight pass starts from there, so nothing is computed twice. Two
differences from torch's ``stage_backward_input``, both for exactness (docs/design/schedules.md, "Schedules as data"):

- a weight whose gradient does not pass through the stage's input (a first stage, whose input is token ids,
  or a loss term on a weight alone) is not in any of torch's parameter groups and would get no gradient; such a
  microbatch runs its whole backward in the input pass instead, so every weight gets exactly what ``B`` gives;
- the outputs are not detached in place: they may be the tensors handed to the next stage in this process.

Each weight gradient is the same kernel's result as in the whole backward and is added to the leaf's ``.grad``
in microbatch order, as ``AccumulateGrad`` adds it, so a schedule with split backwards gives the numbers of one
without.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_weight,
)


@dataclass
class PendingWeightGradient:
    """What the weight pass needs: torch's parameter groups with the gradients the input pass recorded."""

    weights: list[Tensor]
    param_groups: list[dict[str, Any]] = field(default_factory=list)


def backward_input(outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor],
                   weights: Sequence[Tensor]) -> PendingWeightGradient:
    """The gradient of ``outputs`` (seeded with ``grads``; ``None`` for a scalar loss) with respect to ``inputs``,
    accumulated into their ``.grad``. Returns what :func:`backward_weight` needs for ``weights``' gradients; when
    the split cannot reach every weight, the whole backward runs here and the weight pass has nothing left."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    needs_grad = [t for t in inputs if t.requires_grad]
    if not pairs:
        return PendingWeightGradient(weights)
    outs = [o for o, _ in pairs]
    seeds = [torch.ones_like(o) if g is None else g for o, g in pairs]
    reverse = construct_reverse_graph([_get_grad_fn_or_grad_acc(o) for o in outs])
    weight_nodes = [_get_grad_fn_or_grad_acc(w) for w in weights]
    reached = [n for n in weight_nodes if n in reverse]  # before get_param_groups: it adds keys to the defaultdict
    groups = get_param_groups([_get_grad_fn_or_grad_acc(t) for t in needs_grad], weight_nodes, reverse) if needs_grad else []
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    if any(n not in covered for n in reached):
        torch.autograd.backward(outs, seeds)  # the whole backward: inputs and every weight, as B
        return PendingWeightGradient(weights)
    handles = []
    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            group["grads"] = [None] * len(group["intermediates"])
            for i, node in enumerate(group["intermediates"]):
                handles.append(node.register_prehook(_recorder(group, i)))
        dinputs = torch.autograd.grad(outs, needs_grad, seeds, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for t, g in zip(needs_grad, dinputs):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g
    return PendingWeightGradient(weights, groups)


def backward_weight(pending: PendingWeightGradient) -> None:
    """The weight gradients the input pass left, added to the weights' ``.grad``; frees the graph."""
    if pending.param_groups:
        stage_backward_weight(pending.weights, pending.param_groups)
    pending.param_groups = []


def _recorder(group: dict[str, Any], i: int):
    def hook(grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        group["grads"][i] = grad_outputs

    return hook
