"""transformers' tensor-parallel plan of a decoder layer, as ``HuggingFaceCausalLM`` applies it.

The plan comes from the config (``base_model_tp_plan``, its entries under ``layers.*.``; the same attribute in
transformers 4.5x and 5.x). Whether the adapter can apply it exactly is decided by a rule, not a list of families:
the styles it names must be ones torch's column- and row-wise styles implement, and a tiny copy of the config run
split over two simulated ranks must give one device's logits, loss and gradients
(``hf_tensor_parallel_check``). That check also finds the parameters a layer keeps whole but uses on its own
rank's share of the activations (Qwen3's per-head q/k norms): their gradient is a per-rank part of the whole one,
summed over the tensor-parallel ranks in the backward (:func:`sum_gradient_over_ranks`). See
docs/design/tensor-parallel.md, "Models with a plan".
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

#: The plan's prefix of the decoder layers' entries.
LAYERS_PREFIX = "layers.*."
#: transformers' style names (``integrations/tensor_parallel.py``, 4.5x and 5.x spellings) and what they are here:
#: a column-wise matrix gives its output's shard, or (``gathered``) the whole output gathered over the ranks; a
#: row-wise one takes its input's shard, or (``split``) the whole input and keeps its share, and all-reduces its
#: partial products into the whole output.
STYLES = {"colwise": "colwise", "rowwise": "rowwise",
          "colwise_rep": "colwise_gathered", "colwise_gather_output": "colwise_gathered",
          "rowwise_rep": "rowwise_split", "rowwise_split_input": "rowwise_split"}
#: Styles that leave a module's parameters whole; the check measures whether their gradient needs the sum over
#: ranks (transformers 5 names Qwen3's q/k norms so).
WHOLE_STYLES = ("replicated_with_grad_allreduce",)


class TensorParallelRefusal(ValueError):
    """A family the adapter cannot split exactly; ``reason`` is the short why (the family table's cell)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def refusal(family: str, t: int, reason: str, advice: str = "use tensor_parallel_size=1") -> TensorParallelRefusal:
    return TensorParallelRefusal(f"HuggingFaceCausalLM: tensor_parallel_size={t} is not supported for model_type "
                                 f"{family!r}: {reason}; {advice}", reason)


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer gets: ``kinds`` maps each plan key (a module path inside the layer, ``*`` matching any
    child, as torch's ``parallelize_module`` reads it) to ``colwise``, ``rowwise``, ``colwise_gathered`` or
    ``rowwise_split``; ``summed`` names the parameters (paths inside the layer) kept whole whose gradient is summed
    over the tensor-parallel ranks."""

    kinds: Mapping[str, str]
    summed: tuple[str, ...] = ()

    def styles(self) -> dict[str, Any]:
        """torch's ``ParallelStyle`` of each plan key."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        made = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
                "colwise_gathered": lambda: ColwiseParallel(output_layouts=Replicate()),
                "rowwise_split": lambda: RowwiseParallel(input_layouts=Replicate())}
        return {key: made[kind]() for key, kind in self.kinds.items()}


def layer_entries(config: Any) -> dict[str, str]:
    """The config's plan entries under the decoder layers, by path inside a layer (transformers' style names)."""
    upstream = getattr(config, "base_model_tp_plan", None) or {}
    return {k[len(LAYERS_PREFIX):]: v for k, v in upstream.items() if k.startswith(LAYERS_PREFIX)}


def read_plan(config: Any, t: int) -> dict[str, str]:
    """The kinds of :class:`LayerPlan` from the config's plan, or a :class:`TensorParallelRefusal` naming what is
    missing: no plan, or a style torch's column- and row-wise styles do not implement. Also refused: a ``t`` that
    does not divide the vocabulary, the heads or the MLP's width."""
    from lightning_async_pp.pipeline.mesh import check_tensor_parallel_divides

    family = config.model_type
    entries = layer_entries(config)
    if not entries:
        raise refusal(family, t, "transformers has no tensor-parallel plan for its decoder layers (its config's "
                                 "base_model_tp_plan names none)")
    other = {k: v for k, v in entries.items() if v not in STYLES and v not in WHOLE_STYLES}
    if other:
        shown = ", ".join(f"{k}: {v}" for k, v in list(other.items())[:4]) + (", ..." if len(other) > 4 else "")
        raise refusal(family, t, f"its plan has styles the adapter does not apply ({shown}; it applies "
                                 f"{', '.join(sorted(set(STYLES) | set(WHOLE_STYLES)))})")
    check_tensor_parallel_divides(t, {"vocab_size": config.vocab_size,
                                      "num_attention_heads": getattr(config, "num_attention_heads", None),
                                      "num_key_value_heads": getattr(config, "num_key_value_heads", None),
                                      "intermediate_size": getattr(config, "intermediate_size", None)},
                                  f"model_type {family!r}")
    return {k: STYLES[v] for k, v in entries.items() if v in STYLES}


def resolve(layer: nn.Module, key: str) -> Iterator[tuple[str, nn.Module]]:
    """The submodules of ``layer`` that plan key ``key`` names (each dotted part matched against child names with
    ``fnmatch``, as ``parallelize_module`` does), with their paths; none where the layer lacks them (a dense layer
    of a model whose other layers hold experts)."""
    found = [("", layer)]
    for part in key.split("."):
        found = [(f"{path}.{name}" if path else name, child) for path, module in found
                 for name, child in module.named_children() if fnmatch.fnmatchcase(name, part)]
    return iter(found)


def split_dim(kind: str) -> int:
    """The dimension of a planned ``nn.Linear``'s weight that its kind splits: rows (outputs) for column-wise."""
    return 0 if kind.startswith("colwise") else 1


def parallelize_layer(layer: nn.Module, mesh: Any, plan: LayerPlan, where: str) -> None:
    """Apply ``plan`` to one decoder layer over ``mesh``: torch's column- and row-wise styles on the planned
    matrices (each checked to split evenly over the ranks: torch would shard an uneven one unevenly), and the summed
    parameters replicated with their gradient summed over the ranks."""
    from lightning_async_pp.pipeline.mesh import check_tensor_parallel_divides
    from torch.distributed.tensor.parallel import parallelize_module

    styles = plan.styles()
    resolved = {}
    for key, kind in plan.kinds.items():
        for path, module in resolve(layer, key):
            check_tensor_parallel_divides(mesh.size(), {f"{path}.weight dimension {split_dim(kind)}":
                                                        module.weight.shape[split_dim(kind)]}, where)
            resolved[path] = styles[key]
    parallelize_module(layer, mesh, resolved)
    by_module: dict[str, list[str]] = {}
    for name in plan.summed:
        path, _, leaf = name.rpartition(".")
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue  # a layer of another kind
        by_module.setdefault(path, []).append(leaf)
    for path, names in by_module.items():
        sum_gradient_over_ranks(layer.get_submodule(path), names, mesh)


def sum_gradient_over_ranks(module: nn.Module, names: list[str], mesh: Any) -> None:
    """Make ``module``'s parameters ``names`` replicated DTensors (whole on every rank, as a norm's weight) that its
    forward uses as plain local tensors whose gradient is marked partial: each rank's is the part its own shard of
    the activations contributes (Qwen3's q norm sees this rank's heads), and the backward of the DTensor view the
    engine wraps each weight in (``DTensor.from_local``) sums them over the ranks."""
    from torch.distributed.tensor import DTensor, Replicate

    present = [n for n in names if isinstance(module._parameters.get(n), nn.Parameter)]
    for name in present:
        p = module._parameters[name]
        if not isinstance(p, DTensor):
            module._parameters[name] = nn.Parameter(
                DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False), p.requires_grad)
    hook = LocalWithSummedGradient(tuple(present))
    module.register_forward_pre_hook(hook.enter)
    module.register_forward_hook(hook.leave, always_call=True)


class LocalWithSummedGradient:
    """Forward hooks that hand the module its replicated parameters as local tensors for the call
    (``to_local(grad_placements=(Partial(),))``) and put the DTensors back after it. A parameter that is not a
    DTensor (the memory account's stand-ins, a model made whole again by the gather) is left alone."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._held: list[dict[str, Any]] = []  # one per call in progress (a recomputation nests none, but be safe)

    def enter(self, module: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import DTensor, Partial

        held = {}
        for name in self.names:
            p = module._parameters.get(name)
            if isinstance(p, DTensor):
                held[name] = p
                module._parameters[name] = p.to_local(grad_placements=(Partial(),))
        self._held.append(held)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._held:
            module._parameters.update(self._held.pop())
