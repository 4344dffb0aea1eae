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
import warnings
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.parallel.tensor_parallel import (as_laid_out, dtensor_spec, local_tensor, loss_context,
                                                          tensor_parallel_group)
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
                        checkpointed: Collection[int] = (),
                        loss_context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> list[float]:
    """Seconds each of ``layers`` takes for one forward and backward of ``sample_batch`` (one microbatch) on
    ``device``: the median of ``repeats`` runs after one warm-up; the last layer's include ``loss_fn``. A later
    layer's input gradient is computed, the first layer's not, as in the pipeline. Each run is inside
    ``context()``, what training runs in (the precision's autocast: bf16 kernels take other times than fp32's); a
    layer in ``checkpointed`` runs under ``torch.utils.checkpoint``, as the stage runs it (its backward recomputes
    its forward); the last layer's run (its loss and backward) inside ``loss_context()`` as well (``loss_parallel``
    under tensor parallelism).

    Tensor-parallel layers (DTensor parameters) run on their shards with their collectives: each parameter's
    stand-in is a local tensor of its shard's shape, laid out as the parameter (the engine's own leaves and views),
    so the ranks of a tensor-parallel group must call this together, with the same layers and sample. Stand-in
    values are drawn from one seed, the same on every rank (a router sends the same tokens to the same experts)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    device = torch.device(device)
    times: list[float] = []
    # the CPU's state always, the device's where it has one of its own
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type), \
            left_as_they_were(layers):  # a hook's shared table moved to the device: put back
        torch.manual_seed(0)
        batch = tree_map(lambda t: _stand_in(t, device) if isinstance(t, Tensor) else t, sample_batch)
        with torch.no_grad():
            x = input_fn(batch)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            stand_ins: dict[int, Tensor] = {}  # a tensor the layer holds twice gets one stand-in (a local leaf)
            views: dict[int, Tensor] = {}  # ... laid out as the tensor (a DTensor view of the leaf, or the leaf)

            def stand_in(t: Tensor, grad: bool, copy: bool = False) -> Tensor:
                if id(t) not in stand_ins:
                    stand_ins[id(t)] = _stand_in(local_tensor(t), device, copy).requires_grad_(grad)
                    views[id(t)] = as_laid_out(stand_ins[id(t)], dtensor_spec(t))
                return views[id(t)]

            state = {n: stand_in(p, p.requires_grad) for n, p in layer.named_parameters(remove_duplicate=False)}
            # buffers copied: a forward may update them in place (BatchNorm's running statistics)
            state.update({n: stand_in(b, False, copy=True) for n, b in layer.named_buffers(remove_duplicate=False)})
            if i > 0:  # a later stage's input needs its gradient (to send back); the first layer's does not
                x = as_stage_input(x)
            wrt = [t for t in float_leaves(x) if t.requires_grad] + [t for t in stand_ins.values() if t.requires_grad]

            def run() -> Any:
                with context(), (loss_context() if last else nullcontext()):
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
            del state, stand_ins, views, out  # this layer's memory goes before the next layer's comes
    return times


def agreed_layer_times(layers: Sequence[nn.Module], sample_batch: Any, input_fn: Callable[[Any], Any],
                       loss_fn: Callable[[Any, Any], Tensor], device: torch.device, *, rank: int, multiprocess: bool,
                       context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                       checkpointed: Collection[int] = ()) -> Optional[list[float]]:
    """``layer_cost="measured"``: the layer times every process splits by, the same on every process (each timing
    its own would choose another split by noise). Rank 0 times each layer (:func:`measure_layer_times`) and every
    process takes its times. Under tensor parallelism (``layers`` hold DTensor parameters) the ranks of rank 0's
    tensor-parallel group time the layers together, each on its shards with the layers' collectives between them,
    and each layer's time is the slowest rank's (an all-reduce max over the group: the stage waits for its slowest
    rank) before rank 0's are broadcast. ``None`` (the FLOPs are used) where a timing rank could not time them, or
    without a sample (``sample_batch`` None, on every process alike). Every process calls this."""
    group = tensor_parallel_group(layers) if multiprocess else None
    timing = rank == 0 or (group is not None and 0 in dist.get_process_group_ranks(group))
    times: Optional[list[float]] = None
    if timing and sample_batch is not None:
        try:
            times = measure_layer_times(layers, sample_batch, input_fn, loss_fn, device, context=context,
                                        checkpointed=checkpointed, loss_context=lambda: loss_context(group is not None))
        except Exception as err:  # out of memory on the device, a layer that needs real weights
            warnings.warn(f"layer_cost='measured' could not time the layers on {device} on rank {rank} "
                          f"({type(err).__name__}: {err}); using their FLOPs instead", stacklevel=4)
    if timing and group is not None and sample_batch is not None:
        times = slowest_over(times, len(layers), group, device)
    if multiprocess:
        box = [times]
        dist.broadcast_object_list(box, src=0)
        times = box[0]
    return times


def slowest_over(times: Optional[list[float]], count: int, group: Any, device: torch.device) -> Optional[list[float]]:
    """Each layer's largest time over ``group``'s ranks (an all-reduce max), or ``None`` when any rank has none."""
    values = torch.zeros(count + 1, dtype=torch.float64, device=device)
    if times is None:
        values[count] = 1.0  # this rank could not time them
    else:
        values[:count] = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return None if values[count].item() > 0 else values[:count].tolist()
