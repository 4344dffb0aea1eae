"""What each pipeline layer costs, and the split of the layers into stages that balances it.

Per layer: forward and backward FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` while the layer runs
on fake tensors (``FakeTensorMode``: shapes only, no memory, nothing computed) for a sample microbatch, the loss counted with the last
layer; the bytes of its parameters, of what its forward keeps for backward (the tensors autograd saves) and of its
input and output. Per stage: its time is its layers' FLOPs (or, with ``layer_cost="measured"``, their seconds
timed by plan/timing.py); its memory is the peak the planner's memory model
(:func:`lightning_async_pp.plan.memory.stage_memory`) walks on the schedule's action order, fed the stage's
bytes (:func:`stage_peak`), the account the planner's memory table prints. The split (:func:`balanced_split`) is
the contiguous one minimising the slowest stage's time with every stage's memory under a cap: an exact dynamic
program over prefix sums. See docs/design/planner.md, "Balanced split".
"""
from __future__ import annotations

import copy
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from lightning_async_pp.parallel.tensor_parallel import layout_hooks_off, local_tensor
from lightning_async_pp.plan.memory import PeakPoint, StageMemory, action_order, order_peak_points, stage_memory

@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer over one microbatch."""

    forward_flops: int
    backward_flops: int
    param_bytes: int
    activation_bytes: int  # what its forward keeps for its backward
    input_bytes: int = 0  # its floating input not among what it keeps: a stage starting here holds it besides
    output_bytes: int = 0  # its floating output not among what it keeps: a stage ending here holds it (sent on)
    transient_bytes: int = 0  # what its backward allocates beyond what it keeps, at its peak (0: not measured)
    matrix_param_bytes: int = 0  # of ``param_bytes``, the hidden matrices' (Muon keeps one momentum for them)
    # a cache-enabled autocast's cached copies of its weights: one set per batch a step's region forwards (and per
    # set a microbatch in flight keeps from an earlier step), whatever the microbatches (memory.peak_points)
    cast_bytes: int = 0

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops


def _attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """Forward FLOPs of attention's two batched products (scores and weighted values), causal mask not discounted;
    grouped-query attention counted per query head."""
    b, h, s_q, d = query[0], query[1], query[-2], query[-1]
    return 2 * b * h * s_q * key[-2] * (d + value[-1])


def _cpu_flash(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _attention_flops(query, key, value)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    return 2 * _attention_flops(query, key, value)  # the gradients of q, k, v and the scores: four products


#: FlopCounterMode counts no FLOPs for the CPU's fused attention kernel (it does for the CUDA ones): count it as the
#: products it stands for, so a layer's cost does not depend on where it is costed.
_CUSTOM_FLOPS: dict[Any, Callable[..., int]] = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward)):
    if hasattr(torch.ops.aten, _name):
        _CUSTOM_FLOPS[getattr(torch.ops.aten, _name)] = _fn


def float_leaves(x: Any) -> list[Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, Tensor) and t.is_floating_point()]


def as_stage_input(x: Any) -> Any:
    """``x`` as a later stage receives it: its floating tensors new leaves that need their gradient (to send
    back); the first layer's input does not, so the costing and the timing call this for later layers only."""
    return tree_map(lambda t: t.detach().requires_grad_(True) if isinstance(t, Tensor) and t.is_floating_point()
                    else t, x)


def _plain_object(value: Any) -> bool:
    """An instance whose attributes a hook's state lives in (not a module, class, function or builtin value)."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, types.FunctionType,
                                                                  types.MethodType, types.ModuleType)))


_CONTAINERS = (dict, list, set)


def _snapshot(obj: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """Every attribute of ``obj`` (a module's ``_parameters`` and ``_buffers`` too), with a shallow copy of the
    contents of each dict, list or set among them (a cache filled in place)."""
    return obj, {k: (v, copy.copy(v) if isinstance(v, _CONTAINERS) else None) for k, v in vars(obj).items()}


def _restore(obj: Any, attrs: dict[str, tuple[Any, Any]]) -> None:
    """Put back what :func:`_snapshot` took: the very objects, a container's contents as they were, an attribute
    the costing added removed (one it set from ``None`` to a tensor is ``None`` again)."""
    now = vars(obj)
    for k in [k for k in now if k not in attrs]:
        del now[k]
    for k, (value, contents) in attrs.items():
        now[k] = value
        if isinstance(value, list):
            value[:] = contents
        elif isinstance(value, (dict, set)):
            value.clear()
            value.update(contents)


@contextmanager
def left_as_they_were(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Costing runs the layers' own code, which may cache what it computes or move a shared table to its input's
    device (an HF model's shared rotary module, litgpt's ``RopeCache``, both held by the layers' forward hooks): on
    fake tensors of another device that cache would keep fake tensors, and the next real forward would fail.
    Every attribute of the layers, their submodules, their hooks and the objects those hold (two levels) is put
    back afterwards, the very objects, and the contents of the dicts, lists and sets among them (caches filled in
    place) as they were, whatever the costing did."""
    modules: dict[int, tuple[Any, dict]] = {}
    objects: dict[int, tuple[Any, dict]] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, nn.Module):
            for m in value.modules():
                if id(m) in modules:
                    continue
                modules[id(m)] = _snapshot(m)
                for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:
                    visit(getattr(hook, "__self__", hook), 0)  # a bound method's object, or the hook object
        elif _plain_object(value) and id(value) not in objects and depth <= 2:
            objects[id(value)] = _snapshot(value)
            for attr in list(vars(value).values()):
                visit(attr, depth + 1)

    for layer in layers:
        visit(layer, 0)
    try:
        yield
    finally:
        for obj, attrs in [*modules.values(), *objects.values()]:
            _restore(obj, attrs)


def _autocast_on(device: torch.device) -> bool:
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device autocast does not know (meta)
        return False


def _storage(t: Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def tensor_leaves(x: Any) -> list[Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, Tensor)]


def layer_costs(layers: Sequence[nn.Module], sample_batch: Any, input_fn: Callable[[Any], Any],
                loss_fn: Callable[[Any, Any], Tensor], device: Optional[torch.device] = None, *,
                checkpointed: Collection[int] = (),
                context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> list[LayerCost]:
    """Run ``sample_batch`` (one microbatch) through ``layers`` one at a time on fake tensors (shapes, no memory:
    ``FakeTensorMode``), counting each layer's forward and backward FLOPs (the last layer's include ``loss_fn``)
    and the bytes its forward saves for backward, inside ``context()``: what training computes in (the
    precision's autocast, under which a matmul keeps bf16 copies of its operands, not fp32 ones).

    A layer in ``checkpointed`` (activation checkpointing: its forward runs again in its backward) keeps only its
    input (less what the layer before already keeps of it); what its forward saves is allocated again in its
    backward (its transient), and its backward's FLOPs include the forward's once more (docs/design/planner.md).

    The layers themselves are not touched: each runs through ``functional_call`` with fake stand-ins for its
    parameters and buffers on ``device`` (default: the CPU), so real and ``meta`` layers are costed alike, and code
    that moves something to its input's device sees the device it will run on; what that code cached or moved is
    put back afterwards (:func:`left_as_they_were`).

    Tensor-parallel layers (DTensor parameters) are costed as one rank runs them: each parameter's stand-in has its
    local shard's shape and the layouts' hooks are off (:func:`layout_hooks_off`), so FLOPs, parameters, optimizer
    state and what the sharded products keep are one rank's; what runs on the whole sequence there (the residual,
    sequence-parallel norms, what crosses a stage boundary) is counted whole, an upper bound
    (docs/design/tensor-parallel.md, "The memory account")."""
    device = torch.device("cpu") if device is None else torch.device(device)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    checkpointed = frozenset(checkpointed)

    def fake(t: Tensor, grad: bool = False) -> Tensor:
        t = local_tensor(t)  # a tensor-parallel parameter: this rank's shard
        return torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=grad)

    costs = []
    kept_before: set[StorageWeakRef] = set()  # the storages the layer before keeps for its own backward
    with left_as_they_were(layers), layout_hooks_off(layers), context(), mode:
        batch = tree_map(lambda t: fake(t) if isinstance(t, Tensor) else t, sample_batch)
        x = input_fn(batch)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            params = {n: fake(p, p.requires_grad) for n, p in layer.named_parameters(remove_duplicate=False)}
            buffers = {n: fake(b) for n, b in layer.named_buffers(remove_duplicate=False)}
            if i > 0:  # a later stage's input needs its gradient (to send back); the first layer's does not
                x = as_stage_input(x)
            inputs = [t for t in float_leaves(x) if t.requires_grad]
            # by storage: a view of a parameter (a linear layer saves its weight transposed) is no activation, and
            # views of one tensor (q, k, v cut from one projection) are counted once
            param_storages = {_storage(p) for p in params.values()}
            saved: dict[StorageWeakRef, int] = {}  # the layer's
            loss_saved: dict[StorageWeakRef, int] = {}  # the loss's (outside a checkpointed layer's recomputation)
            into = [saved]

            def pack(t: Tensor) -> Tensor:
                key = _storage(t)
                if key not in param_storages:
                    into[0][key] = t.untyped_storage().nbytes()
                return t

            with FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS) as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = functional_call(layer, {**params, **buffers}, (x,))
                layer_forward = forward.get_total_flops()
                if last:
                    into[0] = loss_saved
                    out = loss_fn(out, batch)
            cast_bytes = 0
            if _autocast_on(device):
                # A cache-enabled autocast casts each weight leaf once per region and caches the copy: every
                # microbatch's forward keeps the same one. A second forward finds which saved storages are those
                # cached casts. (Lightning's bf16-mixed turns the cache off: none are, each microbatch keeps its own.)
                again: dict[StorageWeakRef, int] = {}
                into[0] = again
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    functional_call(layer, {**params, **buffers}, (x,))
                casts = {k for k in again if k in saved} - {_storage(t) for t in tensor_leaves(x)}  # inputs differ
                cast_bytes = sum(saved.pop(k) for k in casts)
            outputs = [t for t in float_leaves(out) if t.requires_grad]
            wrt = inputs + [p for p in params.values() if p.requires_grad]
            with FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS) as backward:
                if outputs and wrt:
                    torch.autograd.grad(outputs, wrt, grad_outputs=[torch.ones_like(t) for t in outputs],
                                        allow_unused=True)
            seen: set[int] = set()
            param_bytes = 0
            for p in layer.parameters():  # a parameter the layer holds twice counts once
                if id(p) not in seen:
                    seen.add(id(p))
                    param_bytes += local_tensor(p).numel() * p.element_size()
            backward_flops, transient = backward.get_total_flops(), 0
            if i in checkpointed:  # torch.utils.checkpoint keeps the layer's inputs, and runs its forward again
                transient, backward_flops = sum(saved.values()), backward_flops + layer_forward
                # what the layer before keeps is counted there (0 here), and no input is counted again for a stage
                # that starts here
                saved = {_storage(t): 0 if _storage(t) in kept_before else t.untyped_storage().nbytes()
                         for t in tensor_leaves(x)}
            saved.update(loss_saved)
            held = lambda ts: sum(b.untyped_storage().nbytes() for b in {_storage(t): t for t in ts  # noqa: E731
                                                                           if _storage(t) not in saved}.values())
            costs.append(LayerCost(forward.get_total_flops(), backward_flops, param_bytes,
                                   sum(saved.values()), input_bytes=held(float_leaves(x)),
                                   output_bytes=held(float_leaves(out)), transient_bytes=transient,
                                   cast_bytes=cast_bytes))
            kept_before = set(saved)
            x = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)
    return costs


#: What each optimizer keeps per parameter (``optim.Muon`` hands embeddings, the head and norms to AdamW).
OPTIMIZER_STATE_RULES = {"adamw": "two moments per parameter",
                         "muon": "a momentum per hidden matrix, AdamW's two moments for the rest",
                         "sgd": "a momentum per parameter"}


def optimizer_state(optimizer: str, param_bytes: int, matrix_param_bytes: int = 0) -> int:
    """Bytes of ``optimizer``'s state over parameters of ``param_bytes``, ``matrix_param_bytes`` of them in hidden
    matrices (state kept at the parameters' precision)."""
    if optimizer == "adamw":
        return 2 * param_bytes
    if optimizer == "muon":
        return matrix_param_bytes + 2 * (param_bytes - matrix_param_bytes)
    if optimizer == "sgd":
        return param_bytes
    raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE_RULES)}")


@dataclass(frozen=True)
class MemoryModel:
    """How a stage's bytes follow from its layers' under the schedule (see :func:`stage_peak`)."""

    schedule: str = "2bw"
    num_stages: int = 1
    num_microbatches: int = 1
    data_parallel_size: int = 1
    shard_optimizer: bool = False
    run_ahead: bool = True  # 2bw's last stage may run ahead (PipelineConfig.last_stage_run_ahead)
    # The optimizer whose state is counted by rule where ``state_bytes`` is not known (the planner's) and a delay
    # correction's buffers per parameter (ErrorFeedback: 1, and as many transient copies in its update).
    optimizer: str = "adamw"
    correction_buffers: float = 0.0
    virtual_stages: int = 2  # chunks per device under interleaved_1f1b (the planner's)
    # Per layer: the bytes of state the configured optimizer keeps for its parameters, found by the strategy from
    # one step on meta stand-ins (ErrorFeedback's buffer, Muon's momentum, any optimizer's); None: ``optimizer``'s rule
    state_bytes: Optional[tuple[int, ...]] = None
    # Of ``state_bytes``, each parameter several layers hold (a tied weight): its bytes and those layers. Counted in
    # each of them above; a stage holding several keeps it once.
    state_shared: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Likewise of the layers' ``param_bytes`` (:func:`shared_parameters`): a stage holding several of its layers
    # holds the tensor, its gradient and what follows from its bytes once
    param_shared: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def runs_ahead(self, stage: int) -> bool:
        """Whether ``stage`` runs the next batch's first backward before this batch's update (two gradients):
        2BW's last stage, unless switched off or under data parallelism, where the engine never runs ahead
        (docs/design/data-parallel.md, "Data parallelism")."""
        return (self.run_ahead and self.schedule == "2bw" and stage == self.num_stages - 1 and self.num_stages > 1
                and self.data_parallel_size == 1)

    def action_order(self):  # -> SimulationResult
        """The schedule's simulated action order, the walk :func:`stage_peak` prices (as the engine runs it: 2BW's
        last stage runs ahead only where :meth:`runs_ahead` says)."""
        return action_order(*self._order())

    def peak_points(self, stage: int) -> tuple[PeakPoint, ...]:
        """The points of :meth:`action_order` at which ``stage``'s memory is weighed (computed once per model)."""
        return order_peak_points(*self._order(), stage, self.run_ahead and self.data_parallel_size == 1)

    def _order(self) -> tuple:
        ahead = self.runs_ahead(self.num_stages - 1) if self.schedule == "2bw" else None
        return self.schedule, self.num_stages, self.num_microbatches, ahead, self.virtual_stages


def stage_peak(costs: Sequence[LayerCost], start: int, stop: int, stage: int, model: MemoryModel,
               result: Any = None) -> StageMemory:
    """What ``stage`` holds at its peak, by what holds it, when it runs layers ``start:stop``: the planner's
    memory model (:func:`~lightning_async_pp.plan.memory.stage_memory`) walked over ``result`` (a
    ``simulate`` result; default the schedule's action order, :meth:`MemoryModel.action_order`), fed

    - weights: the layers' parameters (and as many bytes of gradient per batch whose gradients exist);
    - kept per microbatch: what the layers' forwards keep, plus the stage's input (received from the stage before)
      and its output (sent to the stage after), which the runtime holds until the backward;
    - a cache-enabled autocast's cached casts of the weights, as many sets as are alive at each point (one per
      batch this step's region forwards, and those microbatches in flight keep from an earlier step: 2 under 2bw);
      Lightning's bf16-mixed caches none, and each microbatch's own copies are among what it keeps;
    - working set of a backward: the kept bytes plus the largest layer's transient; a batch's first backward
      allocates the gradients as it frees activations, so it peaks at the larger of the two;
    - the optimizer's state (``model.state_bytes`` where known, else ``model.optimizer``'s rule) and a
      correction's buffers, split over the replicas under
      ``shard_optimizer``, and the correction's transient copy in the update.

    The balanced split's memory check and the planner's memory table are both this function."""
    layers = costs[start:stop]
    if not layers:
        raise ValueError(f"stage {stage} holds no layers ({start}:{stop})")
    p = model.num_stages
    shards = model.data_parallel_size if model.shard_optimizer and model.data_parallel_size > 1 else 1
    weights = held_once([c.param_bytes for c in costs], start, stop, model.param_shared)
    kept = (sum(c.activation_bytes for c in layers) + (layers[0].input_bytes if stage > 0 else 0)
            + (layers[-1].output_bytes if stage < p - 1 else 0))
    working = kept + max(c.transient_bytes for c in layers)
    correction = round(model.correction_buffers * weights / shards)
    if model.state_bytes is not None:
        state = held_once(model.state_bytes, start, stop, model.state_shared)
    else:
        state = optimizer_state(model.optimizer, weights, sum(c.matrix_param_bytes for c in layers))
    state //= shards
    peak = stage_memory(model.action_order() if result is None else result, stage, weight_bytes=weights,
                        saved_bytes=kept, working_bytes=working, first_working_bytes=max(working, weights),
                        optimizer_state_bytes=state, correction_bytes=correction, update_bytes=correction,
                        cast_bytes=sum(c.cast_bytes for c in layers),
                        run_ahead=model.run_ahead and model.data_parallel_size == 1,
                        points=model.peak_points(stage) if result is None else None)
    return peak


def held_once(per_layer: Sequence[int], start: int, stop: int,
              shared: Collection[tuple[int, Sequence[int]]]) -> int:
    """The bytes of layers ``start:stop`` (``per_layer``), each tensor several of them hold (``shared``: its bytes and
    the layers holding it, counted in each) once."""
    return sum(per_layer[start:stop]) - sum(nbytes * (held - 1) for nbytes, holders in shared
                                            if (held := sum(start <= i < stop for i in holders)) > 1)


def shared_parameters(layers: Sequence[nn.Module]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Each parameter several of ``layers`` hold (a tied embedding and head): its bytes (this rank's shard) and the
    layers holding it, for :attr:`MemoryModel.param_shared`."""
    holders: dict[int, tuple[int, list[int]]] = {}
    for index, layer in enumerate(layers):
        for p in {id(p): p for p in layer.parameters()}.values():
            holders.setdefault(id(p), (local_tensor(p).numel() * p.element_size(), []))[1].append(index)
    return tuple((nbytes, tuple(held)) for nbytes, held in holders.values() if len(held) > 1)


def stage_memory_bytes(costs: Sequence[LayerCost], start: int, stop: int, stage: int, model: MemoryModel) -> float:
    """Bytes ``stage`` holds at its peak when it runs layers ``start:stop`` (:func:`stage_peak`'s total)."""
    return stage_peak(costs, start, stop, stage, model).total


def balanced_split(times: Sequence[float], num_stages: int, *,
                   memory: Optional[Callable[[int, int, int], float]] = None,
                   memory_cap: Optional[float] = None) -> list[int]:
    """Layer counts per stage of the contiguous split of layers costing ``times`` into ``num_stages`` non-empty
    stages whose slowest stage is fastest, every stage's ``memory(start, stop, stage)`` at most ``memory_cap``.

    Exact: ``best[s][j]``, the least slowest-stage time of layers ``0:j`` on stages ``0..s``, is the minimum over
    ``i`` of ``max(best[s-1][i], time(i, j))``; O(stages x layers^2) over prefix sums. Among equally fast splits the
    one with the least largest memory, then the first found, is kept."""
    n = len(times)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"cannot split {n} layer(s) into {num_stages} non-empty stage(s)")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + float(t))
    inf = (float("inf"), float("inf"))

    def fits(i: int, j: int, s: int) -> tuple[bool, float]:
        if memory is None:
            return True, 0.0
        m = memory(i, j, s)
        return (memory_cap is None or m <= memory_cap), m

    # best[s][j] = (slowest time, largest memory) for layers 0:j on stages 0..s; choice[s][j] = start of stage s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    choice = [[-1] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        ok, m = fits(0, j, 0)
        if ok:
            best[0][j] = (prefix[j], m)
    for s in range(1, num_stages):
        for j in range(s + 1, n - (num_stages - 1 - s) + 1):
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                ok, m = fits(i, j, s)
                if not ok:
                    continue
                cand = (max(prev[0], prefix[j] - prefix[i]), max(prev[1], m))
                if cand < best[s][j]:
                    best[s][j], choice[s][j] = cand, i
    if best[num_stages - 1][n] == inf:
        if memory is None or memory_cap is None:
            raise ValueError(f"cannot split {n} layers into {num_stages} stages")
        raise ValueError(
            f"no split of the {n} layers into {num_stages} stages keeps every stage's memory under the cap of "
            f"{memory_cap / 2**30:.3f} GiB: the smallest largest stage peak any split reaches is "
            f"{smallest_peak(n, num_stages, memory) / 2**30:.3f} GiB; raise stage_memory_gib, use more stages or "
            f"activation checkpointing")
    counts, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = choice[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def smallest_peak(num_layers: int, num_stages: int, memory: Callable[[int, int, int], float]) -> float:
    """The least, over the contiguous splits of ``num_layers`` layers into ``num_stages`` non-empty stages, of
    their largest stage ``memory(start, stop, stage)``: the smallest cap some split fits (exact, O(p n^2))."""
    n, inf = num_layers, float("inf")
    low = [[inf] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        low[0][j] = memory(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n - (num_stages - 1 - s) + 1):
            low[s][j] = min((max(low[s - 1][i], memory(i, j, s)) for i in range(s, j) if low[s - 1][i] < inf),
                            default=inf)
    return low[num_stages - 1][n]


def split_and_run_ahead(times: Sequence[float], num_stages: int, model: MemoryModel,
                        memory: Optional[Callable[[int, int, int, MemoryModel], float]] = None,
                        memory_cap: Optional[float] = None,
                        run_ahead: Optional[bool] = None) -> tuple[list[int], MemoryModel]:
    """:func:`balanced_split` under ``model``, and the memory model the split was chosen under.

    ``run_ahead`` None (the default): 2bw's last stage runs ahead where some split fits the cap with its second
    gradient, else not, if a split then fits (docs/design/planner.md, "Run-ahead"); True or False: as given.
    ``memory(start, stop, stage, model)`` is a stage's peak under a memory model."""
    def split(m: MemoryModel) -> list[int]:
        fn = None if memory is None else (lambda i, j, s: memory(i, j, s, m))
        return balanced_split(times, num_stages, memory=fn, memory_cap=memory_cap)

    ahead = replace(model, run_ahead=run_ahead is not False)
    if run_ahead is not None or memory_cap is None or not ahead.runs_ahead(num_stages - 1):
        return split(ahead), ahead
    try:
        return split(ahead), ahead
    except ValueError:
        behind = replace(model, run_ahead=False)
        return split(behind), behind  # a ValueError here: no split fits even with one gradient


@dataclass(frozen=True)
class SplitReport:
    """The split the engine runs, and what the cost model predicts of it (``engine.stats.split``)."""

    method: str  # "balanced", "parameters", "uniform" or "explicit"
    counts: tuple[int, ...]  # layers per stage
    time_share: tuple[float, ...]  # each stage's share of the model's compute (by ``cost``); empty without costs
    memory_bytes: tuple[int, ...]  # each stage's predicted peak; empty without costs
    # 2bw's last stage runs the next batch's first microbatch before its update; None: no stage could
    run_ahead: Optional[bool] = None
    cost: str = "flops"  # what ``time_share`` shares: "flops" (counted) or "measured" (timed on the device)
    layout: str = ""  # the processes' layout in words ("2 stages x 2 tensor-parallel ranks"); "" on one device

    @property
    def imbalance(self) -> Optional[float]:
        """The slowest stage's predicted compute over the mean (1.0: perfectly balanced)."""
        if not self.time_share:
            return None
        return max(self.time_share) * len(self.time_share)

    def describe(self) -> str:
        text = f"partition={self.method!r}: layers per stage {list(self.counts)}"
        if self.layout:
            text = f"{self.layout}, {text}"
        if self.time_share:
            basis = "measured time" if self.cost == "measured" else "FLOPs"
            per = "device" if "tensor-parallel" in self.layout else "stage"
            # the planner's account of tensors (torch.cuda.max_memory_allocated's quantity), not the process's memory
            text += (f"; predicted compute share ({basis}) " + ", ".join(f"{t:.1%}" for t in self.time_share)
                     + f" (slowest/mean {self.imbalance:.2f}); predicted peak of allocated tensors per {per} "
                     + "(weights, gradients, optimizer state, activations; not the process's memory) "
                     + ", ".join(format_bytes(b) for b in self.memory_bytes))
        if self.run_ahead is False:
            text += "; the last stage does not run ahead (one gradient)"
        return text


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def report_for(counts: Sequence[int], method: str, costs: Optional[Sequence[LayerCost]],
               model: MemoryModel, measured_times: Optional[Sequence[float]] = None) -> SplitReport:
    """``measured_times``: each layer's seconds timed on the device, shared instead of its FLOPs."""
    # None where no stage could run ahead (not 2bw, one stage, data parallelism)
    run_ahead = model.run_ahead if replace(model, run_ahead=True).runs_ahead(model.num_stages - 1) else None
    if not costs:
        return SplitReport(method, tuple(counts), (), (), run_ahead)
    weights = [float(c.flops) for c in costs] if measured_times is None else [float(t) for t in measured_times]
    total = sum(weights) or 1.0
    shares, mems, start = [], [], 0
    for s, c in enumerate(counts):
        shares.append(sum(weights[start:start + c]) / total)
        mems.append(round(stage_memory_bytes(costs, start, start + c, s, model)))
        start += c
    return SplitReport(method, tuple(counts), tuple(shares), tuple(mems), run_ahead,
                       cost="flops" if measured_times is None else "measured")
