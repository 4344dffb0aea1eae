"""Putting a stage's layers in place: each process keeps only its own stage's layers in the model.

The other stages' layers are taken out of the module tree (replaced by a parameter-free :class:`RemoteLayer`)
and moved to the ``meta`` device, so ``model.parameters()``, and therefore the optimizer, see only this stage's
parameters, and no memory is held for them. :func:`restore_layers` puts them back (used on rank 0 to gather
the whole model at the end of training).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class RemoteLayer(nn.Module):
    """Stands in the model for a layer that lives on another pipeline stage."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

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
            _set_submodule(root, path, RemoteLayer(owner))
            # A parameter tied to one of this stage's layers must survive the move to meta: the remote layer gets
            # a stand-in, and the real one goes back when the layer is restored.
            for module in layer.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) in own:
                        tied = getattr(module, "_pipeline_tied", {})
                        tied[name] = p
                        object.__setattr__(module, "_pipeline_tied", tied)
                        module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            layer.to(torch.device("meta"))


def restore_layers(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put every layer back into ``root`` and load ``state`` (full-model keys) into those that were remote."""
    for layer, path in zip(layers, paths):
        if isinstance(root.get_submodule(path), RemoteLayer):
            layer.to_empty(device=device)
            prefix = path + "."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            for module in layer.modules():  # re-tie: the copies are identical, one Parameter serves both again
                for name, p in getattr(module, "_pipeline_tied", {}).items():
                    module._parameters[name] = p
                object.__setattr__(module, "_pipeline_tied", {})
            _set_submodule(root, path, layer)


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
