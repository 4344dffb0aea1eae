"""transformers' tensor-parallel plan of a decoder layer, as ``HuggingFaceCausalLM`` applies it.

The plan comes from the config (``base_model_tp_plan``, its entries under ``layers.*.``; the same attribute in
transformers 4.5x and 5.x). Whether the adapter can apply it exactly is decided by a rule, not a list of families:
the styles it names must be ones torch's column- and row-wise styles implement, and a tiny copy of the config run
split over two simulated ranks must give one device's logits, loss and gradients
(:func:`check_tensor_parallel`). That check also finds the parameters a layer keeps whole but uses on its own
rank's share of the activations (Qwen3's per-head q/k norms): their gradient is a per-rank part of the whole one,
summed over the tensor-parallel ranks in the backward (:func:`sum_gradient_over_ranks`). See
docs/design/tensor-parallel-families.md, "Exact or refused, by a rule".
"""
from __future__ import annotations

import fnmatch
import threading
import types
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models import hf_probe

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


def read_plan(config: Any, t: int, processes: Optional[int] = None,
              read: Optional[Collection[str]] = None) -> dict[str, str]:
    """The kinds of :class:`LayerPlan` from the config's plan, or a :class:`TensorParallelRefusal` naming what is
    missing: no plan, or a style torch's column- and row-wise styles do not implement. Also refused: a ``t`` that
    does not divide the vocabulary, the heads or the MLP's width (the sizes suggested instead also divide
    ``processes``, a pipeline replica's, where known), and a dropout rate above 0 among the config's fields its
    code reads (``read``: every rank would draw one device's mask for its own heads)."""
    from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides, check_tensor_parallel_no_dropout

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
                                  f"model_type {family!r}", processes)
    if read is not None:
        check_tensor_parallel_no_dropout(t, {k: v for k, v in config.to_dict().items()
                                             if ("dropout" in k or "pdrop" in k) and k in read}, f"model_type {family!r}")
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
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides

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


# ---- the check: a tiny copy split over simulated ranks, against the same copy whole ----------------------------------
# Whether a family's tensor-parallel plan is exact: a tiny copy of its config, split over simulated ranks in one
# process, against the same copy whole.
#
# Under tensor parallelism a decoder layer's own code runs on plain local tensors between the plan's matrices
# (torch's styles hand a column-wise matrix's output shard to the attention or the MLP as a plain tensor): that is
# where a family can go wrong silently (an attention that reshapes by its config's head count, a norm over the whole
# width of q, a fused matrix whose rows are not grouped by head). The check runs exactly that code: one thread per
# rank, each with its own copy of the model whose planned matrices hold the rank's slice (torch's even split), the
# collectives of the column- and row-wise styles done between the threads (an all-reduce of a row-wise matrix's
# partial products in the forward and of a column-wise matrix's input gradient in the backward; a gather of a
# ``gathered`` output; the slice of a ``split`` input), and compares the logits, the loss and every parameter's
# gradient with one device's. The embedding and the head run whole here: the adapter splits them over the vocabulary
# with DTensor's own operations, which give the whole result (or fail), whatever the family.
#
# A parameter outside the plan's matrices is **whole** when each rank's gradient is one device's (norms on the
# residual stream, a router), **summed** when the ranks' gradients add up to it (a norm of q applied per head sees
# only its rank's heads): the adapter then sums it over the ranks in the backward. Anything else refuses the family.

#: The simulated tensor-parallel size (the tiny copy has 4 heads, 2 key/value heads and an MLP of 64).
RANKS = 2
#: Logits and loss, as the build-time check (fp32, on the CPU).
TOLERANCE = hf_probe.TOLERANCE
#: Gradients: this much relative to the largest element of one device's gradient of the parameter.
GRADIENT_TOLERANCE = 1e-5
#: Seconds a simulated rank waits for the others at a collective (a rank that failed aborts the wait at once).
WAIT = 120.0


def check_tensor_parallel(adapter_class: type, config: Any, kinds: dict[str, str]) -> tuple[str, ...]:
    """The parameter paths inside a decoder layer whose gradient is summed over the ranks (see the module's
    docstring), or a :class:`TensorParallelRefusal` naming the difference or failure. The global RNG is left as it
    was."""
    family, t = config.model_type, RANKS
    try:
        tiny = hf_probe.tiny_config(config)
        if getattr(tiny, "_attn_implementation", None) not in (None, *hf_probe.CPU_ATTENTION):
            tiny._attn_implementation = "sdpa"
    except Exception as err:
        raise refusal(family, t, f"a tiny copy of its config cannot be made ({type(err).__name__}: {err})") from err
    with torch.device("cpu"), torch.random.fork_rng(devices=[]), hf_probe._float32_default():
        batch = torch.randint(0, tiny.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        try:
            models = [_built(adapter_class, tiny) for _ in range(t + 1)]
        except ValueError as err:  # the adapter's own refusal at t = 1 (what the build-time check says)
            raise refusal(family, t, f"it is not exact on one device either ({err})") from err
        except Exception as err:  # the family's own code, on the tiny sizes
            raise refusal(family, t, f"a tiny copy of its config cannot be built ({type(err).__name__}: "
                                     f"{err})") from err
        try:
            without_mask = _causal_without_mask(models[0], tiny, batch)
            for model in models:
                model._mask_as_upstream(without_mask)
            whole = _run(models[0], batch)
        except Exception as err:
            raise refusal(family, t, f"a tiny copy of its config does not run whole ({type(err).__name__}: "
                                     f"{err})") from err
        group = _Group(t)
        try:
            sliced = [_split(models[1 + r], kinds, r, group) for r in range(t)]
        except ValueError as err:
            raise refusal(family, t, str(err)) from err
        if not sliced[0]:
            raise refusal(family, t, f"its plan ({', '.join(kinds)}) names no matrix of its decoder layers")
        ranks = _run_ranks([lambda r=r: _run(models[1 + r], batch) for r in range(t)], group)
    failed = next((err for err in ranks if isinstance(err, BaseException)), None)
    if failed is not None:
        raise refusal(family, t, f"on a tiny copy of its config split over {t} ranks its decoder layers fail "
                                 f"with {type(failed).__name__}: {' '.join(str(failed).split())[:300]}") from failed
    return _compare(family, whole, ranks, sliced[0])


def _causal_without_mask(model: Any, tiny: Any, batch: Tensor) -> bool:
    """What the build-time check finds (:func:`hf_probe.causal_without_mask`, upstream at ``model``'s weights):
    the layers make their masks so."""
    from transformers import AutoModelForCausalLM

    from lightning_async_pp.parallel.placement import replace_meta_tensors

    upstream = AutoModelForCausalLM.from_config(tiny)
    replace_meta_tensors(upstream, lambda x: torch.empty_like(x, device="cpu"))  # built on meta under the strategy
    upstream.load_state_dict(model.state_dict(), strict=True)
    return hf_probe.causal_without_mask(upstream, batch)


def _built(adapter_class: type, tiny: Any) -> Any:
    from lightning_async_pp.parallel.placement import replace_meta_tensors

    model = adapter_class(tiny, init_seed=0)
    model.check_exact = False
    model.configure_model()
    replace_meta_tensors(model, lambda x: torch.empty_like(x, device="cpu"))
    model.init_weights()
    return model.eval()  # no dropout: the comparison is of the arithmetic


def _run(model: Any, batch: Tensor) -> dict[str, Any]:
    """Logits, loss and gradients of the adapter's pipeline layers on ``batch``."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():  # the caller may build under no_grad; a thread starts with grad mode on anyway
        x = model.pipeline_input(batch)
        for layer in model.pipeline_layers():
            x = layer(x)
        loss = model.pipeline_loss(x, batch)
        loss.backward()
    router_loss = getattr(model, "_router_loss", None)
    logits = router_loss.split(x)[0] if router_loss is not None else x
    return {"logits": logits.detach(), "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _compare(family: str, whole: dict[str, Any], ranks: list[dict[str, Any]], dims: dict[str, int]) -> tuple[str, ...]:
    t = len(ranks)
    for r, run in enumerate(ranks):
        gap = max((run["logits"] - whole["logits"]).abs().max().item(), (run["loss"] - whole["loss"]).abs().item())
        if not gap <= TOLERANCE:
            raise refusal(family, t, f"on a tiny copy of its config split over {t} ranks, rank {r}'s logits or loss "
                                     f"are {gap:.3g} from one device's: its decoder layers do not run on a rank's "
                                     f"shards as the plan assumes")
    summed = set()
    for name, expected in whole["grads"].items():
        got = [run["grads"].get(name) for run in ranks]
        if any(g is None for g in got):
            raise refusal(family, t, f"on a tiny copy of its config split over {t} ranks, {name} gets no gradient "
                                     f"on some rank")
        bound = GRADIENT_TOLERANCE * max(1.0, expected.abs().max().item())
        if name in dims:  # the ranks' slices, side by side
            parts = torch.cat(got, dim=dims[name])
            if parts.shape == expected.shape and (parts - expected).abs().max().item() <= bound:
                continue
        elif all(g.shape == expected.shape and (g - expected).abs().max().item() <= bound for g in got):
            continue  # whole on every rank
        elif _layer_path(name) is not None and (sum(got) - expected).abs().max().item() <= bound:
            summed.add(_layer_path(name))  # each rank's part: summed over the ranks in the backward
            continue
        raise refusal(family, t, f"on a tiny copy of its config split over {t} ranks, the gradient of {name} is "
                                 f"neither one device's on every rank nor their sum (an activation the plan leaves "
                                 f"whole meets each rank's shards, and nothing sums its gradient)")
    return tuple(sorted(summed))


def _layer_path(name: str) -> Optional[str]:
    """``self_attn.q_norm.weight`` for ``model.layers.3.self_attn.q_norm.weight``; None outside the layers."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return ".".join(parts[3:])
    return None


# ---- the simulated ranks --------------------------------------------------------------------------------------------
class _Group:
    """The ranks' meeting point: each hands in a tensor and gets every rank's, in rank order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=WAIT)
        self._slots: list[Any] = [None] * size

    def exchange(self, rank: int, x: Tensor) -> list[Tensor]:
        self._slots[rank] = x
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()  # nobody writes the next exchange before all have read this one
        return parts

    def sum(self, rank: int, x: Tensor) -> Tensor:
        parts = self.exchange(rank, x)
        total = parts[0].clone()
        for part in parts[1:]:
            total = total + part  # rank order: the same sum on every rank
        return total

    def abort(self) -> None:
        self._barrier.abort()


class _AllReduce(torch.autograd.Function):  # a row-wise matrix's output: partial products summed
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: _Group, rank: int) -> Tensor:
        return group.sum(rank, x.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad, None, None


class _Copy(torch.autograd.Function):  # a column-wise matrix's whole input: its gradient summed
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: _Group, rank: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return ctx.group.sum(ctx.rank, grad.contiguous()), None, None


class _Gather(torch.autograd.Function):  # a gathered column-wise output: every rank's slice side by side
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: _Group, rank: int) -> Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        return torch.cat(group.exchange(rank, x.detach()), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


class _Split(torch.autograd.Function):  # a split row-wise input: the rank's share of the whole
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: _Group, rank: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        width = x.shape[-1] // group.size
        return x.narrow(-1, rank * width, width).clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return torch.cat(ctx.group.exchange(ctx.rank, grad.contiguous()), dim=-1), None, None


def _split(model: Any, kinds: dict[str, str], rank: int, group: _Group) -> dict[str, int]:
    """Give ``model``'s planned matrices rank ``rank``'s slices and the styles' collectives; the sliced parameters'
    names and split dimensions."""
    sliced: dict[str, int] = {}
    t = group.size
    for index, layer in enumerate(model.model.layers):
        for key, kind in kinds.items():
            for path, module in resolve(layer, key):
                if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
                    raise ValueError(f"its plan splits {path} ({key}: {kind}), a {type(module).__name__}, not a "
                                     f"plain nn.Linear")
                dim = split_dim(kind)
                size = module.weight.shape[dim]
                if size % t:
                    raise ValueError(f"its plan splits {path}'s {size} {'rows' if dim == 0 else 'columns'} over "
                                     f"{t} ranks unevenly")
                share = slice(size // t * rank, size // t * (rank + 1))
                prefix = f"model.layers.{index}.{path}."
                # In place (``.data``): a Parameter registered under the strategy's build would go to meta.
                weight = module.weight.data
                module.weight.data = (weight[share] if dim == 0 else weight[:, share]).clone()
                sliced[prefix + "weight"] = dim
                if module.bias is not None and dim == 0:
                    module.bias.data = module.bias.data[share].clone()
                    sliced[prefix + "bias"] = 0
                module.forward = types.MethodType(_FORWARDS[kind](group, rank), module)
    return sliced


def _forwards() -> dict[str, Any]:
    def colwise(group: _Group, rank: int) -> Any:
        return lambda self, x: F.linear(_Copy.apply(x, group, rank), self.weight, self.bias)

    def colwise_gathered(group: _Group, rank: int) -> Any:
        return lambda self, x: _Gather.apply(F.linear(_Copy.apply(x, group, rank), self.weight, self.bias), group, rank)

    def rowwise(group: _Group, rank: int, split: bool = False) -> Any:
        def forward(self: nn.Linear, x: Tensor) -> Tensor:
            out = _AllReduce.apply(F.linear(_Split.apply(x, group, rank) if split else x, self.weight), group, rank)
            return out if self.bias is None else out + self.bias  # a replicated bias, added once
        return forward

    return {"colwise": colwise, "colwise_gathered": colwise_gathered, "rowwise": rowwise,
            "rowwise_split": lambda group, rank: rowwise(group, rank, split=True)}


_FORWARDS = _forwards()


def _run_ranks(runs: list[Any], group: _Group) -> list[Any]:
    """Each of ``runs`` in its own thread (they meet at the collectives); each one's result or exception. A rank
    that fails aborts the others' waits."""
    results: list[Any] = [None] * len(runs)

    def run(rank: int) -> None:
        try:
            results[rank] = runs[rank]()
        except BaseException as err:  # noqa: BLE001 - reported by the caller, naming the family
            results[rank] = err
            group.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The first failure is the cause; the others only saw the aborted wait.
    first = next((r for r in results
                  if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError)), None)
    return [first if isinstance(r, BaseException) and first is not None else r for r in results]
