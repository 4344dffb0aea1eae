"""Each pipeline layer's forward and backward timed on the device it will run on (``layer_cost="measured"``).

FLOPs (plan/balanced.py) leave out what does not multiply: memory-bound work, per-call overhead, kernels slower
than their count. Timing sees all of it. One layer at a time gets real tensors on the device, runs one sample
microbatch forward and backward (the loss with the last layer) a few times, and is dropped before the next: never
more than one layer's parameters and one microbatch's activations in memory. The layers themselves are not touched:
each runs through ``functional_call`` on stand-ins for its parameters and buffers (its own values where it has any,
random ones where it was built on the ``meta`` device), and the random state is restored afterwards, so a run
with measured costs draws what the same split given explicitly draws. See docs/design/planner.md, "Balanced split".
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.plan.balanced import as_stage_input, float_leaves, left_as_they_were


def _stand_in(t: Tensor, device: torch.device, copy: bool = False) -> Tensor:
    """``t`` on ``device`` as a new autograd leaf: its values where it has any (its storage on its own device
    unless ``copy``), else (``meta``) random values of its shape: timing depends on shapes, not values."""
    if t.device.type != "meta":
        return t.detach().to(device, copy=copy)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return out.normal_(0.0, 0.02) if out.is_floating_point() else out.zero_()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_layer_times(layers: Sequence[nn.Module], sample_batch: Any, input_fn: Callable[[Any], Any],
                        loss_fn: Callable[[Any, Any], Tensor], device: torch.device, *, repeats: int = 3,
                        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                        checkpointed: Collection[int] = ()) -> list[float]:
    """Seconds each of ``layers`` takes for one forward and backward of ``sample_batch`` (one microbatch) on
    ``device``: the median of ``repeats`` runs after one warm-up; the last layer's include ``loss_fn``. A later
    layer's input gradient is computed, the first layer's not, as in the pipeline. Each run is inside
    ``context()``, what training runs in (the precision's autocast: bf16 kernels take other times than fp32's); a
    layer in ``checkpointed`` runs under ``torch.utils.checkpoint``, as the stage runs it (its backward recomputes
    its forward)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    device = torch.device(device)
    times: list[float] = []
    # the CPU's state always, the device's where it has one of its own
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type), \
            left_as_they_were(layers):  # a hook's shared table moved to the device: put back
        batch = tree_map(lambda t: _stand_in(t, device) if isinstance(t, Tensor) else t, sample_batch)
        with torch.no_grad():
            x = input_fn(batch)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            stand_ins: dict[int, Tensor] = {}  # a tensor the layer holds twice gets one stand-in

            def stand_in(t: Tensor, grad: bool, copy: bool = False) -> Tensor:
                if id(t) not in stand_ins:
                    stand_ins[id(t)] = _stand_in(t, device, copy).requires_grad_(grad)
                return stand_ins[id(t)]

            state = {n: stand_in(p, p.requires_grad) for n, p in layer.named_parameters(remove_duplicate=False)}
            # buffers copied: a forward may update them in place (BatchNorm's running statistics)
            state.update({n: stand_in(b, False, copy=True) for n, b in layer.named_buffers(remove_duplicate=False)})
            if i > 0:  # a later stage's input needs its gradient (to send back); the first layer's does not
                x = as_stage_input(x)
            wrt = [t for t in float_leaves(x) if t.requires_grad] + [t for t in stand_ins.values() if t.requires_grad]

            def run() -> Any:
                with context():
                    if i in checkpointed:
                        out = checkpoint(functional_call, layer, state, (x,), use_reentrant=False)
                    else:
                        out = functional_call(layer, state, (x,))
                    loss = loss_fn(out, batch) if last else out
                    outputs = [t for t in float_leaves(loss) if t.requires_grad]
                    if outputs and wrt:
                        torch.autograd.grad(outputs, wrt, grad_outputs=[torch.ones_like(t) for t in outputs],
                                            allow_unused=True)
                return out

            out = run()  # warm-up: lazy initialisation, allocator growth, kernel selection
            runs = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                run()
                _synchronize(device)
                runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs))
            x = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)
            del state, stand_ins, out  # this layer's memory goes before the next layer's comes
    return times
