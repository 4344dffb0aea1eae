"""Whether a family's tensor-parallel plan is exact: a tiny copy of its config, split over simulated ranks in one
process, against the same copy whole.

Under tensor parallelism a decoder layer's own code runs on plain local tensors between the plan's matrices
(torch's styles hand a column-wise matrix's output shard to the attention or the MLP as a plain tensor): that is
where a family can go wrong silently (an attention that reshapes by its config's head count, a norm over the whole
width of q, a fused matrix whose rows are not grouped by head). The check runs exactly that code: one thread per
rank, each with its own copy of the model whose planned matrices hold the rank's slice (torch's even split), the
collectives of the column- and row-wise styles done between the threads (an all-reduce of a row-wise matrix's
partial products in the forward and of a column-wise matrix's input gradient in the backward; a gather of a
``gathered`` output; the slice of a ``split`` input), and compares the logits, the loss and every parameter's
gradient with one device's. The embedding and the head run whole here: the adapter splits them over the vocabulary
with DTensor's own operations, which give the whole result (or fail), whatever the family.

A parameter outside the plan's matrices is **whole** when each rank's gradient is one device's (norms on the
residual stream, a router), **summed** when the ranks' gradients add up to it (a norm of q applied per head sees
only its rank's heads): the adapter then sums it over the ranks in the backward. Anything else refuses the family.
"""
from __future__ import annotations

import threading
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models import hf_probe
from lightning_async_pp.models.hf_tensor_parallel import refusal, resolve, split_dim

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

    from lightning_async_pp.pipeline.placement import replace_meta_tensors

    upstream = AutoModelForCausalLM.from_config(tiny)
    replace_meta_tensors(upstream, lambda x: torch.empty_like(x, device="cpu"))  # built on meta under the strategy
    upstream.load_state_dict(model.state_dict(), strict=True)
    return hf_probe.causal_without_mask(upstream, batch)


def _built(adapter_class: type, tiny: Any) -> Any:
    from lightning_async_pp.pipeline.placement import replace_meta_tensors

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
