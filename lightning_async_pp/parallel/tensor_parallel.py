"""DTensor parameters in the engine: what the engine keeps per parameter is the parameter's **local tensor**
(this tensor-parallel rank's shard), and these helpers are the only place that tells a DTensor parameter from a
plain one. See docs/design/tensor-parallel-shards.md, "Weights, gradients and optimizer state per shard".
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_async_pp.parallel.placement import parameters_swapped

#: What a DTensor parameter's leaf is wrapped with for the forward: (mesh, placements, global shape, stride).
DTensorSpec = tuple[Any, tuple[Any, ...], Any, tuple[int, ...]]


def local_tensor(t: Tensor) -> Tensor:
    """The tensor that holds ``t``'s values on this process: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_whole(p: Tensor) -> bool:
    """Whether ``p`` holds its whole value on this process: a plain tensor, or a DTensor replicated on every mesh
    dimension (a sequence-parallel norm's weight), whose gradient is then whole and equal on every rank."""
    return not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)


def dropout_in_split_layers(layers: Sequence[nn.Module]) -> dict[str, float]:
    """In each layer a tensor-parallel plan splits (one holding a parameter that is not whole, :func:`is_whole`),
    every dropout that draws: a dropout module's ``p``, or a float attribute named ``*dropout*`` (the probability a
    module hands its attention function), above 0; keyed ``"pipeline_layers()[i].path.p"`` (for
    :func:`~lightning_async_pp.parallel.mesh.check_tensor_parallel_no_dropout`)."""
    found: dict[str, float] = {}
    for index, layer in enumerate(layers):
        if all(is_whole(p) for p in layer.parameters()):
            continue
        for path, module in layer.named_modules():
            where = f"pipeline_layers()[{index}]" + (f".{path}" if path else "")
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                found[f"{where}.p"] = module.p
            for name, value in vars(module).items():
                if "dropout" in name and isinstance(value, float) and value > 0:
                    found[f"{where}.{name}"] = value
    return found


def point_at(p: Tensor, storage: Tensor) -> None:
    """Make parameter ``p`` hold ``storage`` (a plain tensor of its local shape) without copying, so that an
    in-place update of ``p`` writes ``storage``. ``p.data = storage`` would replace a DTensor parameter's wrapper
    but leave its local tensor where it was (torch 2.14): the local tensor itself is re-pointed (torch-private
    ``_local_tensor``; tests/test_tensor_parallel.py fails if torch changes it)."""
    if isinstance(p, DTensor):
        p._local_tensor.data = storage
    else:
        p.data = storage


def dtensor_spec(p: Tensor) -> Optional[DTensorSpec]:
    """How to wrap a local shard of ``p`` as ``p`` is laid out (``None`` for a plain parameter)."""
    if not isinstance(p, DTensor):
        return None
    return (p.device_mesh, tuple(p.placements), p.shape, p.stride())


def as_laid_out(local: Tensor, spec: Optional[DTensorSpec]) -> Tensor:
    """``local`` as its parameter is laid out: a DTensor view of it (no copy, no communication; autograd flows back
    to ``local`` as a plain gradient of its shape) or ``local`` itself."""
    if spec is None:
        return local
    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def parameter_grad(p: Tensor, grad: Optional[Tensor]) -> Optional[Tensor]:
    """The ``.grad`` an optimizer expects on ``p`` for the engine's local gradient ``grad``: a DTensor view of it
    for a DTensor parameter."""
    if grad is None:
        return None
    return as_laid_out(grad, dtensor_spec(p))


@contextmanager
def whole_parameters(module: nn.Module) -> Iterator[None]:
    """Within: each DTensor parameter of ``module`` is a plain parameter of its global shape, so that an
    initialization rule (or a file's values) written into it gives one device's values; on leaving, each rank's
    shard takes its slice of them (no communication). A parameter shared by two submodules stays one."""
    def whole_stand_in(p: nn.Parameter) -> Optional[nn.Parameter]:
        if not isinstance(p, DTensor):
            return None
        return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device), p.requires_grad)

    with parameters_swapped([module], whole_stand_in) as swapped:
        yield
    with torch.no_grad():
        for p, whole_p in swapped.values():
            p.to_local().copy_(own_slice(whole_p.detach(), p.device_mesh, p.placements).to_local())


def own_slice(full: Tensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """The whole tensor ``full`` as a DTensor of ``mesh`` and ``placements`` whose local tensor is this rank's slice
    of it (``src_data_rank=None``: each rank cuts its own slice of the ``full`` it holds, no communication)."""
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def laid_out_like(full: Tensor, like: Tensor) -> Tensor:
    """The whole tensor ``full`` laid out as ``like``: for a DTensor ``like``, this rank's slice of it as a DTensor
    of ``like``'s mesh and placements (:func:`own_slice`); else ``full``."""
    return own_slice(full, like.device_mesh, like.placements) if isinstance(like, DTensor) else full


def lay_out(tensors: dict[str, Any], layouts: Mapping[str, DTensorSpec]) -> dict[str, Any]:
    """``tensors`` with each key of ``layouts`` that is a whole (plain) tensor turned into a DTensor laid out so:
    this process keeps its own slice (:func:`own_slice`), as a checkpoint's whole tensors load into shards."""
    for key, (mesh, placements, _, _) in layouts.items():
        value = tensors.get(key)
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            tensors[key] = own_slice(value, mesh, placements)
    return tensors


def is_one_block(placements: Sequence[Any]) -> bool:
    """Whether a rank's shard under ``placements`` is one block of the global tensor, as
    ``torch.distributed.checkpoint`` records a shard (an offset and a shape). Not so under a strided placement
    (``models.GPT``'s fused qkv matrix: each rank holds its heads' q, k and v rows)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return not any(isinstance(p, _StridedShard) for p in placements)


def in_blocks(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` with each DTensor whose shard is not one block (:func:`is_one_block`) gathered whole, replicated
    (a collective over its mesh: every tensor-parallel rank of a stage calls it with the same keys in the same
    order), which DCP writes once."""
    from torch.distributed.tensor import Replicate

    return {k: v.redistribute(placements=[Replicate()] * v.device_mesh.ndim)
            if isinstance(v, DTensor) and not is_one_block(v.placements) else v for k, v in flat.items()}


def whole_value(t: Tensor) -> Tensor:
    """``t``'s global value as a plain tensor, differentiably: a DTensor's (gathered over its mesh: a collective;
    a replicated one's local tensor, no communication), else ``t`` itself. The loss of logits split over the
    vocabulary comes back replicated."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every DTensor gathered whole (:func:`whole_value`): collective over its mesh, so every
    tensor-parallel rank of a stage calls it with the same keys in the same order."""
    return {k: whole_value(v) if isinstance(v, Tensor) else v for k, v in values.items()}


def is_tensor_parallel_hook(hook: Any) -> bool:
    """A module hook that torch's ``parallelize_module`` registered (``distribute_module``'s input and output
    redistributions): its code lives under ``torch/distributed/tensor/`` (a plain function, a bound method or a
    ``functools.partial`` of one), or one of those made to act inside a mapping (:class:`OnMappingEntry`)."""
    if isinstance(hook, OnMappingEntry):
        return True
    func = getattr(hook, "func", hook)  # functools.partial
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    return (getattr(func, "__module__", "") or "").startswith("torch.distributed.tensor") or (
        code is not None and _LAYOUT_CODE in code.co_filename)


_LAYOUT_CODE = os.path.join("torch", "distributed", "tensor", "")


class OnMappingEntry:
    """A layout hook of torch's (a forward pre-hook or forward hook that ``parallelize_module`` registered), made to
    act on one entry of a mapping where the module takes or gives one: a packed microbatch's token ids going into
    the embedding, its hidden state coming out, while the positions beside them pass untouched (whole on every
    rank: each rank attends over the whole sequence, its own heads, and needs every document's bounds). A tensor
    goes through the hook as before."""

    def __init__(self, hook: Any, key: str, pre: bool) -> None:
        self.hook, self.key, self.pre = hook, key, pre

    def __call__(self, module: nn.Module, args: tuple, *output: Any) -> Any:
        if self.pre:
            if args and isinstance(args[0], Mapping) and self.key in args[0]:
                made = self.hook(module, (args[0][self.key], *args[1:]))
                made = made if made is not None else (args[0][self.key],)
                made = made if isinstance(made, tuple) else (made,)
                return ({**args[0], self.key: made[0]}, *made[1:])
            return self.hook(module, args)
        (out,) = output
        if isinstance(out, Mapping) and self.key in out:
            made = self.hook(module, args, out[self.key])
            return {**out, self.key: out[self.key] if made is None else made}
        return self.hook(module, args, out)


def layout_hooks_on_entries(module: nn.Module, takes: Optional[str], gives: Optional[str]) -> None:
    """Make the layout hooks ``parallelize_module`` registered on ``module`` itself (not its children) act on entry
    ``takes`` of a mapping it is called with and entry ``gives`` of a mapping it returns (:class:`OnMappingEntry`;
    ``None``: that side as it was). Each keeps its place among the module's hooks."""
    for hooks, key, pre in ((module._forward_pre_hooks, takes, True), (module._forward_hooks, gives, False)):
        if key is None:
            continue
        for name, hook in list(hooks.items()):
            if is_tensor_parallel_hook(hook) and not isinstance(hook, OnMappingEntry):
                hooks[name] = OnMappingEntry(hook, key, pre)


def undo_tensor_parallelism(modules: Iterable[nn.Module], device: torch.device) -> bool:
    """Make ``modules`` plain one-device modules again: every DTensor parameter becomes a plain parameter of its
    whole shape on ``device`` (empty: load the gathered values next) and the hooks of ``parallelize_module`` are
    removed. A parameter shared by several modules stays one object. True if anything was tensor-parallel."""
    replaced: dict[int, nn.Parameter] = {}
    for sub in (s for module in modules for s in module.modules()):
        # A remote layer holds the parameters it shares with this stage (a tied head's matrix) aside, to be given
        # back when it is restored (placement.remove_other_stages): they must become the same plain one.
        for params in (sub._parameters, getattr(sub, "_pipeline_tied", {})):
            for name, p in list(params.items()):
                if isinstance(p, DTensor):
                    if id(p) not in replaced:
                        replaced[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                       p.requires_grad)
                    params[name] = replaced[id(p)]
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            for key in [k for k, h in hooks.items() if is_tensor_parallel_hook(h)]:
                del hooks[key]
                for extra in (sub._forward_pre_hooks_with_kwargs, sub._forward_hooks_with_kwargs,
                              sub._forward_hooks_always_called):
                    extra.pop(key, None)
    return bool(replaced)


def tensor_parallel_group(modules: Iterable[nn.Module]) -> Any:
    """The process group of the mesh ``modules``' DTensor parameters are laid out on (this rank's tensor-parallel
    group), or ``None`` when they have none."""
    for module in modules:
        for p in module.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh.get_group()
    return None


def loss_context(tensor_parallel: bool) -> AbstractContextManager[Any]:
    """What the last stage's loss and its backward run in: ``loss_parallel()`` under tensor parallelism (a
    cross-entropy of logits split over the vocabulary reduces a max and a sum of exponentials over the shards
    instead of gathering the logits; torch needs the backward inside it too), nothing otherwise."""
    if not tensor_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


@contextmanager
def layout_hooks_off(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Within: the layers run as their shards' own program, on plain local tensors. The forward hooks that
    ``parallelize_module`` registered (torch's, which turn inputs and outputs into DTensors and redistribute them)
    are taken off and put back afterwards; every other hook stays."""
    taken: list[tuple[dict, dict]] = []  # each hook dict with a layout hook, as it was (its order kept)
    for layer in layers:
        for m in layer.modules():
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                if any(is_tensor_parallel_hook(h) for h in hooks.values()):
                    taken.append((hooks, dict(hooks)))
                    for key in [k for k, h in hooks.items() if is_tensor_parallel_hook(h)]:
                        del hooks[key]
    try:
        yield
    finally:
        for hooks, before in taken:
            hooks.clear()
            hooks.update(before)


@contextmanager
def meta_tensors_set_aside(module: nn.Module) -> Iterator[None]:
    """Within: each meta tensor of ``module`` is a placeholder of its shape holding no memory (a DTensor laid out as
    it, for a DTensor), so that code moving the module (Lightning's teardown moves it to the CPU) runs after a setup
    that failed before materializing; afterwards the meta tensors are back, for a later setup to materialize.
    Parameters are swapped in place (``torch.utils.swap_tensors``), so each stays one object."""
    def placeholder(t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        return as_laid_out(torch.empty((), dtype=local.dtype).expand(local.shape), dtensor_spec(t))

    params: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p.is_meta and id(p) not in params:
                meta = nn.Parameter(placeholder(p), p.requires_grad)
                torch.utils.swap_tensors(p, meta)  # p holds the placeholder, meta what p held
                params[id(p)] = (p, meta)
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                sub._buffers[name] = placeholder(b)
                buffers.append((sub, name, b))
    try:
        yield
    finally:
        for p, meta in params.values():
            torch.utils.swap_tensors(p, meta)
        for sub, name, b in buffers:
            sub._buffers[name] = b
