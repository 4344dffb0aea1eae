"""Compiled pipeline layers (``PipelineConfig.compile``): each layer runs through ``torch.compile``d code that
takes its weights as inputs, so every weight version and microbatch reuses one graph (see docs/design/stages.md,
'Compiled layers').

Layers of one kind (see :func:`layer_kind`: the identical blocks of a transformer) share one compiled function,
so they are traced and compiled once per process, not once per layer. Each kind is its own compile region
(``isolate_recompiles``): its graphs (training; evaluation under ``no_grad`` and under ``inference_mode``; one-row
microbatches) count against its own ``recompile_limit``, not against one limit shared by every compiled module in
the process. The functions are kept for the process's lifetime, so a later engine on the same layers (the next
trainer call) finds its graphs compiled.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn

#: (compile options, layer kind) -> the compiled function every layer of that kind runs through.
_COMPILED: dict[tuple[str, tuple], Callable[[nn.Module, Any], Any]] = {}


class CompiledLayer(nn.Module):
    """``layer`` run through the compiled function of its kind. The layer is this module's one submodule
    (``layer``), so ``functional_call`` on it with names prefixed ``layer.`` swaps a weight version in."""

    def __init__(self, layer: nn.Module, run: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.layer = layer
        self._run = run  # a function, not a module: nothing registered

    def forward(self, x: Any) -> Any:
        return self._run(self.layer, x)


def compile_layers(layers: Sequence[nn.Module], options: Mapping[str, Any]) -> list[CompiledLayer]:
    """Each of ``layers`` wrapped to run compiled with ``torch.compile(**options)``."""
    return [CompiledLayer(layer, _compiled_for(layer, options)) for layer in layers]


def _compiled_for(layer: nn.Module, options: Mapping[str, Any]) -> Callable[[nn.Module, Any], Any]:
    key = (repr(sorted(options.items())), layer_kind(layer))
    if key not in _COMPILED:
        own_region = {"isolate_recompiles": True} if _HAS_ISOLATED_REGIONS else {}  # an older torch: one region
        _COMPILED[key] = torch.compile(_call, **{**own_region, **options})
    return _COMPILED[key]


def layer_kind(layer: nn.Module) -> tuple:
    """Which layers share one compile region: the classes of the layer and its submodules, and the names, shapes,
    dtypes and devices of their parameters and buffers. Only a grouping: whether a graph fits a layer is decided
    by dynamo's guards, so two layers that differ in something else (a flag) get their own graphs in one region."""
    modules = tuple((name, type(m).__module__, type(m).__qualname__) for name, m in layer.named_modules())
    tensors = [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]
    return modules, tuple((name, tuple(t.shape), t.dtype, t.device.type) for name, t in tensors)


def _call(layer: nn.Module, x: Any) -> Any:
    return layer(x)


def _isolated_regions_supported() -> bool:
    import inspect

    return "isolate_recompiles" in inspect.signature(torch.compile).parameters


_HAS_ISOLATED_REGIONS = _isolated_regions_supported()
