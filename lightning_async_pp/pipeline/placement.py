"""Putting a stage's layers in place: each process keeps only its own stage's layers in the model.

The other stages' layers are taken out of the module tree (replaced by a parameter-free :class:`RemoteLayer`)
and moved to the ``meta`` device, so ``model.parameters()``, and therefore the optimizer, see only this stage's
parameters, and no memory is held for them. :func:`restore_layers` puts them back (used on rank 0 to gather
the whole model at the end of training).
"""
from __future__ import annotations

from collections.abc import Sequence
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


def check_parameters_covered(root: nn.Module, layers: Sequence[nn.Module], stage_of_layer: Sequence[int]) -> None:
    """Every parameter must belong to a layer, and a parameter shared by layers must stay on one stage."""
    owner: dict[int, int] = {}
    for layer, stage in zip(layers, stage_of_layer):
        for p in layer.parameters():
            if owner.setdefault(id(p), stage) != stage:
                raise ValueError(
                    "a parameter is shared by layers on different pipeline stages "
                    f"({owner[id(p)]} and {stage}); untie it or place those layers on one stage"
                )
    orphans = [name for name, p in root.named_parameters() if id(p) not in owner]
    if orphans:
        raise ValueError(
            f"parameters outside every pipeline layer would never be trained by the pipeline: {orphans[:5]}"
            f"{' ...' if len(orphans) > 5 else ''}; move them into a module returned by pipeline_layers()"
        )


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, module)


def remove_other_stages(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], stage_of_layer: Sequence[int], stage: int) -> None:
    for layer, path, owner in zip(layers, paths, stage_of_layer):
        if owner != stage:
            _set_submodule(root, path, RemoteLayer(owner))
            layer.to(torch.device("meta"))


def restore_layers(root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put every layer back into ``root`` and load ``state`` (full-model keys) into those that were remote."""
    for layer, path in zip(layers, paths):
        if isinstance(root.get_submodule(path), RemoteLayer):
            layer.to_empty(device=device)
            prefix = path + "."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            _set_submodule(root, path, layer)
