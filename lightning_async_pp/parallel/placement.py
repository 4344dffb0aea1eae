"""Putting a stage's layers in place: each process keeps only its own stage's layers in the model.

The other stages' layers are taken out of the module tree (replaced by a :class:`RemoteLayer`) and moved to
the ``meta`` device, so ``model.parameters()``, and therefore the optimizer, see only this stage's parameters,
and no memory is held for them. :func:`restore_layers` puts them back (used on rank 0 to gather the whole model
at the end of training); :func:`reassemble_layers` puts them back as they are (without memory) so that a later
trainer call sees on every process the model the first call saw.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class RemoteLayer(nn.Module):
    """Stands in the model for a layer that lives on another pipeline stage.

    A parameter of that layer which this stage also uses (a tie) stays registered here under its path in the layer,
    so the model lists it under the name it has on one device (``embed.weight``, not the head's alias): anything
    keyed by name (parameter groups, Muon's routing, checkpoints) then agrees on every stage.
    """

    def __init__(self, stage: int, tied: Sequence[tuple[str, nn.Parameter]] = ()) -> None:
        super().__init__()
        self.stage = stage
        for path, p in tied:
            *parents, name = path.split(".")
            holder: nn.Module = self
            for part in parents:
                if part not in holder._modules:
                    holder.add_module(part, nn.Module())
                holder = holder._modules[part]
            holder.register_parameter(name, p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this layer lives on pipeline stage {self.stage}; run it through the pipeline")


def layer_paths(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Each layer's dotted path inside ``root``."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    result = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"pipeline_layers()[{i}] is a {type(layer).__name__}, not a torch.nn.Module")
        if id(layer) not in paths or paths[id(layer)] == "":
            raise ValueError(
                f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of the model; assign every "
                f"layer as an attribute (or inside an nn.ModuleList) so its parameters are saved and trained"
            )
        result.append(paths[id(layer)])
    return result


@dataclass
class Tie:
    """A parameter used by layers on several stages (a tied embedding and output head, say). Each of those stages
    keeps a copy; their gradients are summed before the update, so the copies stay identical."""

    param: nn.Parameter
    stages: list[int]  # sorted, at least two

    @property
    def owner(self) -> int:
        """The stage that counts this parameter once (gradient norms, gathering)."""
        return self.stages[0]


def check_parameters_covered(root: nn.Module, layers: Sequence[nn.Module], stage_of_layer: Sequence[int]) -> list[Tie]:
    """Every parameter must belong to a layer; returns the parameters shared by layers on different stages."""
    stages_of: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for layer, stage in zip(layers, stage_of_layer):
        for p in layer.parameters():
            params[id(p)] = p
            owners = stages_of.setdefault(id(p), [])
            if stage not in owners:
                owners.append(stage)
    orphans = [name for name, p in root.named_parameters() if id(p) not in stages_of]
    if orphans:
        raise ValueError(
            f"parameters outside every pipeline layer would never be trained by the pipeline: {orphans[:5]}"
            f"{' ...' if len(orphans) > 5 else ''}; move them into a module returned by pipeline_layers()"
        )
    return [Tie(params[i], sorted(owners)) for i, owners in stages_of.items() if len(owners) > 1]


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, module)


def remove_other_stages(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], stage_of_layer: Sequence[int], stage: int) -> None:
    own = {id(p) for layer, owner in zip(layers, stage_of_layer) if owner == stage for p in layer.parameters()}
    for layer, path, owner in zip(layers, paths, stage_of_layer):
        if owner != stage:
            tied = [(n, p) for n, p in layer.named_parameters() if id(p) in own]
            _set_submodule(root, path, RemoteLayer(owner, tied))
            # A parameter tied to one of this stage's layers must survive the move to meta: the remote layer gets
            # a stand-in, and the real one goes back when the layer is restored or reassembled.
            for module in layer.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) in own:
                        held = getattr(module, "_pipeline_tied", {})
                        held[name] = p
                        object.__setattr__(module, "_pipeline_tied", held)
                        module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            # Non-persistent buffers (rotary tables, say) are in no state_dict, so gathering could not bring them
            # back: they stay as they are (they are small); everything else leaves memory.
            kept = [(m, n, b) for m in layer.modules() for n, b in m._buffers.items()
                    if b is not None and n in m._non_persistent_buffers_set]
            layer.to(torch.device("meta"))
            for m, n, b in kept:
                m._buffers[n] = b


def _retie(layer: nn.Module) -> None:
    """Give back the real Parameters that :func:`remove_other_stages` replaced by meta stand-ins."""
    for module in layer.modules():
        for name, p in getattr(module, "_pipeline_tied", {}).items():
            module._parameters[name] = p
        object.__setattr__(module, "_pipeline_tied", {})


def reassemble_layers(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str]) -> None:
    """Put every layer back into ``root`` as it is (other stages' layers stay without memory) and re-tie their
    parameters, so the model looks on every process as it did before the last call split it: the ties, global
    names and process groups a new engine derives from it are then the same on all processes."""
    for layer, path in zip(layers, paths):
        if root.get_submodule(path) is not layer:
            _retie(layer)
            _set_submodule(root, path, layer)


def restore_layers(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put every layer back into ``root`` and load ``state`` (full-model keys) into those that were remote."""
    for layer, path in zip(layers, paths):
        if isinstance(root.get_submodule(path), RemoteLayer):
            replace_meta_tensors(layer, lambda t: torch.empty_like(t, device=device))
            layer.to(device)  # the non-persistent buffers kept by remove_other_stages
            prefix = path + "."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            _retie(layer)  # the copies are identical: one Parameter serves both again
            _set_submodule(root, path, layer)


@contextmanager
def parameters_swapped(modules: Sequence[nn.Module],
                       stand_in: Callable[[nn.Parameter], Any]) -> Iterator[dict[int, tuple[nn.Parameter, Any]]]:
    """Within: each parameter ``p`` of ``modules`` for which ``stand_in(p)`` is not ``None`` is replaced by it, one
    stand-in per parameter (a tied one stays one); yields ``{id(p): (p, its stand-in)}``. On leaving, the originals
    are put back, whatever happened inside."""
    owners = [(m, name, p) for module in modules for m in module.modules()
              for name, p in m._parameters.items() if p is not None]
    swapped: dict[int, tuple[nn.Parameter, Any]] = {}
    for _, _, p in owners:
        if id(p) not in swapped:
            new = stand_in(p)
            if new is not None:
                swapped[id(p)] = (p, new)
    try:
        for m, name, p in owners:
            if id(p) in swapped:
                m._parameters[name] = swapped[id(p)][1]
        yield swapped
    finally:
        for m, name, p in owners:
            m._parameters[name] = p


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules created inside get their parameters on the ``meta`` device (no memory) while buffers stay real.

    A buffer computed in ``__init__`` (a rotary or scale table) is set by no ``reset_parameters``; built on meta it
    would come back as uninitialized memory. This is accelerate's ``init_empty_weights(include_buffers=False)``:
    each parameter is moved to meta as it is registered, so at most one is ever allocated."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            moved = nn.Parameter(param.to("meta"), param.requires_grad)
            moved.__dict__.update(param.__dict__)  # attributes libraries set on parameters (HF's init flags)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextmanager
def refusing_loads_onto_meta() -> Iterator[None]:
    """``load_state_dict`` into a module whose tensors are on the ``meta`` device raises instead of copying nothing.

    Inside ``configure_model`` the strategy builds parameters on meta, where ``Tensor.copy_`` is a no-op: a user's
    ``load_state_dict(pretrained)`` there would raise nothing, and the layer's initialization would later replace
    the values it never received. ``assign=True`` is no way out: the parameters it assigns are registered inside
    :func:`parameters_on_meta`, which moves them to meta again."""
    load = nn.Module.load_state_dict

    def load_checked(module: nn.Module, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        dropped = [name for name, t in module.state_dict(keep_vars=True).items()
                   if t.is_meta and name in state_dict and not getattr(state_dict[name], "is_meta", True)]
        if dropped:
            raise RuntimeError(
                f"{type(module).__name__}.load_state_dict() would copy nothing into {dropped[:3]}"
                f"{' ...' if len(dropped) > 3 else ''}: under AsyncPipelineStrategy, configure_model() (and "
                f"trainer.init_module()) builds parameters on the meta device, and each stage initializes its own "
                f"layers later. Start from pretrained weights with HuggingFaceCausalLM.from_pretrained(path) or "
                f"LitGPT.from_checkpoint(dir) (each process reads only its own stage's tensors); for your own model, "
                f"copy the values in init_layer(index, layer), or load them after the Trainer call"
            )
        return load(module, state_dict, strict=strict, assign=assign)

    nn.Module.load_state_dict = load_checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.load_state_dict = load  # type: ignore[method-assign]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def replace_meta_tensors(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every meta tensor of ``module`` by ``make(tensor)``. Parameters are swapped in place
    (``torch.utils.swap_tensors``), so a Parameter shared by several modules stays one object."""
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(make(p), p.requires_grad))
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                sub._buffers[name] = make(b)


@torch.no_grad()
def materialize_layers(layers: Sequence[nn.Module], indices: Sequence[int], device: torch.device,
                       init_layer: Callable[[int, nn.Module], None]) -> None:
    """Give the meta-device tensors of ``layers`` (global indices ``indices``, ascending) memory on ``device`` and
    initialize each such layer with ``init_layer(index, layer)``.

    A parameter is materialized in place (``torch.utils.swap_tensors``), so a Parameter shared by several layers
    stays one object. It is initialized by the first of its layers (in model order); a later layer's initializer
    does not change it: the value then does not depend on which layers this process holds.
    """
    done: set[int] = set()
    for index, layer in zip(indices, layers):
        if not has_meta_tensors(layer):
            done.update(id(p) for p in layer.parameters())
            continue
        replace_meta_tensors(layer, lambda t: torch.empty_like(t, device=device))
        kept = [(p, p.detach().clone()) for p in layer.parameters() if id(p) in done]
        init_layer(index, layer)
        for p, value in kept:
            p.copy_(value)
        done.update(id(p) for p in layer.parameters())
