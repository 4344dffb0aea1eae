"""A tiny copy of a transformers config (same family, same switches, small sizes), and the adapter's build-time
check on it: its pipeline layers against the upstream ``forward`` and loss at the same weights.

The check is what makes "exact or refused" a property of ``HuggingFaceCausalLM`` rather than of a list of known
families: whatever a family (or a new transformers release) does outside the decoder layers that the adapter does
not reproduce shows up as a difference on the tiny copy, and the adapter refuses the model before training (see
docs/design/adapters.md, 'Adapters of upstream models').

The same tiny copy split over two simulated ranks decides whether the config's tensor-parallel plan is exact
(:func:`check_tensor_parallel`; docs/design/tensor-parallel-families.md).
"""
from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models.hf_config import refusal, resolve, split_dim
from lightning_async_pp.parallel.placement import replace_meta_tensors

#: Config fields shrunk in the tiny copy, by what they size (the names used across transformers' families).
WIDTHS = ("hidden_size", "n_embd", "d_model", "embed_dim")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "multi_query_group_num", "num_kv_heads")
FFN = ("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size",
       "expert_intermediate_size", "ffn_hidden_size", "intermediate_size_mlp")
HEAD_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_head_dim")  # not qk_head_dim: a sum
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TINY = dict(width=32, layers=2, heads=4, kv_heads=2, ffn=64, head_dim=8, experts=4, experts_per_token=2, vocab=256,
            positions=128, window=8, rank=16)


def tiny_config(config: Any, layers: int = TINY["layers"]) -> Any:
    """A config of the same family and switches as ``config`` with small sizes: width 32, ``layers`` layers, at most
    4 heads with the config's kind of attention (multi-head, multi-query or groups of 2: :func:`_tiny_heads`; the
    width 8 per head where there are fewer), head dim 8, FFN 64, 4 experts (2 per token), vocabulary 256,
    sliding windows of 8, per-frequency rope factors (longrope) for the head dim 8. Token ids outside the vocabulary become ``None``. Built with the config's class so that
    fields derived in its constructor (``layer_types``, ...) follow the new sizes."""
    fields = config.to_dict()
    tiny: dict[str, Any] = {}

    def shrink(names: tuple[str, ...], value: int) -> None:
        for name in names:
            if isinstance(fields.get(name), int) and not isinstance(fields.get(name), bool) and fields[name] > value:
                tiny[name] = value

    heads = _tiny_heads(fields, tiny)
    # The width as the tiny heads need it where the family derives its head dim from the width (and checks that
    # the heads divide it): ``heads x`` the tiny head dim (32 for 4 heads).
    shrink(WIDTHS, TINY["head_dim"] * heads if heads else TINY["width"])
    shrink(LAYERS, layers)
    shrink(FFN, TINY["ffn"])
    shrink(HEAD_DIMS, TINY["head_dim"])
    # Some families' defaults leave these to be derived (and do not derive them): set them as the sizes say.
    if "head_dim" in fields and fields["head_dim"] is None:
        tiny["head_dim"] = TINY["head_dim"]
    if isinstance(fields.get("qk_head_dim"), int):  # DeepSeek: the sum of its parts
        tiny["qk_head_dim"] = tiny.get("qk_nope_head_dim", fields.get("qk_nope_head_dim", 0)) + tiny.get(
            "qk_rope_head_dim", fields.get("qk_rope_head_dim", 0))
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None:
        tiny["num_key_value_heads"] = TINY["kv_heads"] if not heads or heads % TINY["kv_heads"] == 0 else heads
    shrink(EXPERTS, TINY["experts"])
    shrink(("num_experts_per_tok", "moe_topk", "moe_k", "top_k"), TINY["experts_per_token"])
    shrink(("n_group", "topk_group", "n_shared_experts", "num_shared_experts"), 1)
    shrink(("kv_lora_rank", "q_lora_rank"), TINY["rank"])
    shrink(("vocab_size",), TINY["vocab"])
    shrink(("max_position_embeddings", "n_positions"), TINY["positions"])
    for name in ("sliding_window", "attention_window", "attention_chunk_size"):
        if isinstance(fields.get(name), int) and fields[name] > TINY["window"]:
            tiny[name] = TINY["window"]
    if isinstance(fields.get("layer_types"), list) and any(name in tiny for name in LAYERS):
        # One layer of each kind the config has (sliding and full attention, ...), then the first ones.
        kinds = list(dict.fromkeys(fields["layer_types"]))
        chosen = kinds + fields["layer_types"][: max(0, layers - len(kinds))]
        tiny["layer_types"] = chosen
        for name in LAYERS:
            if name in tiny:
                tiny[name] = len(chosen)
    _shrink_rope_factors(fields, tiny)
    vocab = tiny.get("vocab_size", fields.get("vocab_size"))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        value = fields.get(name)
        ids = value if isinstance(value, list) else [value]
        if vocab is not None and any(isinstance(i, int) and i >= vocab for i in ids):
            tiny[name] = None
    fields.update(tiny)
    for name in ("architectures", "_name_or_path", "transformers_version", "model_type"):
        fields.pop(name, None)
    attn = getattr(config, "_attn_implementation", None)
    made = type(config)(**fields)
    if attn is not None:
        made._attn_implementation = attn
    return made


def _tiny_heads(fields: dict[str, Any], tiny: dict[str, Any]) -> Optional[int]:
    """Shrinks the heads and key/value heads into ``tiny`` keeping the attention's kind: multi-head (as many
    key/value heads as heads) stays multi-head, multi-query (one) multi-query, grouped-query (groups of several)
    grouped-query; at most 4 heads, groups of 2. A config whose key/value heads do not divide its heads keeps both,
    so the tiny copy fails as the model would. Returns the tiny copy's heads (``None``: the family names none)."""
    def first(names: tuple[str, ...]) -> Optional[str]:
        return next((n for n in names if isinstance(fields.get(n), int) and not isinstance(fields[n], bool)), None)

    heads_name, kv_name = first(HEADS), first(KV_HEADS)
    if heads_name is None:
        return None
    heads = fields[heads_name]
    kv = fields[kv_name] if kv_name is not None else None
    if kv is None or kv < 1 or heads % kv != 0:
        new_heads, new_kv = (min(heads, TINY["heads"]), None) if kv is None else (heads, kv)
    elif kv == heads or kv == 1:
        new_heads = min(heads, TINY["heads"])
        new_kv = new_heads if kv == heads else 1
    else:  # groups of heads / kv > 1 query heads per key/value head
        new_heads, new_kv = (heads, kv) if heads <= TINY["heads"] else (TINY["heads"], TINY["heads"] // 2)
    if new_heads != heads:
        tiny[heads_name] = new_heads
    if kv_name is not None and new_kv is not None and new_kv != kv:
        tiny[kv_name] = new_kv
    return new_heads


#: Rope parameter lists with one entry per rotary frequency (longrope: Phi-3 128k, Phi-3.5, Phi-4-mini).
ROPE_FACTORS = ("short_factor", "long_factor")


def _shrink_rope_factors(fields: dict[str, Any], tiny: dict[str, Any]) -> None:
    """Per-frequency rope factors (``rope_scaling`` in transformers 4.x, ``rope_parameters`` in 5.x, possibly one
    dict per layer type) cut to the tiny head's ``rotary_dim / 2`` frequencies, evenly spread over the original
    ones (the family validates their length against the head size)."""
    width = tiny.get("hidden_size", fields.get("hidden_size"))
    heads = tiny.get("num_attention_heads", fields.get("num_attention_heads"))
    head_dim = tiny.get("head_dim", fields.get("head_dim"))
    if not isinstance(head_dim, int):
        if not (isinstance(width, int) and isinstance(heads, int) and heads):
            return
        head_dim = width // heads

    def shrunk(rope: Any) -> Any:
        if not isinstance(rope, dict):
            return rope
        if not any(isinstance(rope.get(name), list) for name in ROPE_FACTORS):
            return {k: shrunk(v) for k, v in rope.items()}  # one rope dict per layer type
        partial = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor")) or 1.0
        frequencies = int(head_dim * partial) // 2
        out = dict(rope)
        for name in ROPE_FACTORS:
            factors = rope.get(name)
            if isinstance(factors, list) and len(factors) > frequencies:
                out[name] = [factors[i * len(factors) // frequencies] for i in range(frequencies)]
        return out

    for name in ("rope_scaling", "rope_parameters"):
        if isinstance(fields.get(name), dict):
            rope = shrunk(fields[name])
            if rope != fields[name]:
                tiny[name] = rope


#: The largest difference of logits (fp32) and loss the check accepts.
TOLERANCE = 1e-5
#: Attention implementations the check runs as they are (others, such as flash attention, run as SDPA on the CPU).
CPU_ATTENTION = ("eager", "sdpa")


#: The seed both models' random draws start from in the training-mode comparison.
TRAIN_SEED = 0


def check_exact(adapter_class: type, config: Any) -> bool:
    """Raises ``ValueError`` unless ``adapter_class`` on a tiny copy of ``config`` gives the upstream logits and
    training loss (``model(ids, labels=ids).loss``) at the same weights, on the CPU, in eval mode and in training
    mode with both models' random draws started from one seed: work upstream does outside the decoder layers only
    while training (an embedding dropout) changes the training-mode numbers (the config's dropout rates are kept).
    The global RNG is left as it was. Returns :func:`causal_without_mask`, which the adapter's layers follow."""
    import torch
    from transformers import AutoModelForCausalLM

    name = f"model_type {config.model_type!r}"
    try:
        tiny = tiny_config(config)
        if getattr(tiny, "_attn_implementation", None) not in (None, *CPU_ATTENTION):
            tiny._attn_implementation = "sdpa"
    except Exception as err:  # the family's own config validation
        raise ValueError(f"HuggingFaceCausalLM cannot check {name} on a tiny copy of its config "
                         f"({type(err).__name__}: {err}), so it is refused") from err
    with torch.device("cpu"), torch.random.fork_rng(devices=[]), _float32_default():
        try:
            ours = adapter_class(tiny, init_seed=0)  # built here, on the meta device
            ours.check_exact = False
            ours.configure_model()  # the adapter's own refusals (ValueError) name what they cannot do
        except ValueError:
            raise
        except Exception as err:  # the family's own code, on the tiny sizes
            raise ValueError(f"HuggingFaceCausalLM cannot check {name} on a tiny copy of its config: building it "
                             f"fails with {type(err).__name__}: {err}; the model is refused") from err
        name = f"{type(ours.model).__name__} ({name})"
        try:
            upstream = AutoModelForCausalLM.from_config(tiny)
            # Under the strategy's build, parameters are created on the meta device: give them memory here.
            for module in (ours, upstream):
                replace_meta_tensors(module, lambda t: torch.empty_like(t, device="cpu"))
            ours.init_weights()
            upstream.load_state_dict(ours.state_dict(), strict=True)
            length = min(16, getattr(tiny, "max_position_embeddings", None) or 16)  # the adapter refuses longer rows
            batch = torch.randint(0, tiny.vocab_size, (2, length + 1), generator=torch.Generator().manual_seed(0))
            without_mask = causal_without_mask(upstream, batch)
            ours._mask_as_upstream(without_mask)
            runs = {mode: _both(ours, upstream, batch, training) for mode, training in (("", False), (" in training mode", True))}
        except Exception as err:
            raise ValueError(f"HuggingFaceCausalLM cannot run {name} as pipeline layers: on a tiny copy of its "
                             f"config they fail with {type(err).__name__}: {err}") from err
        for mode, (x, loss, expected) in runs.items():
            if not isinstance(x, torch.Tensor) or x.shape != expected.logits.shape:
                raise ValueError(f"HuggingFaceCausalLM cannot run {name} as pipeline layers: they give "
                                 f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}, not the logits "
                                 f"{tuple(expected.logits.shape)}")
            logits = (x - expected.logits).abs().max().item()
            loss_gap = (loss - expected.loss).abs().item()
            if not logits <= TOLERANCE or not loss_gap <= TOLERANCE:
                raise ValueError(
                    f"HuggingFaceCausalLM refuses {name}: on a tiny copy of its config the pipeline layers give "
                    f"logits {logits:.3g} and a loss {loss_gap:.3g} away from the upstream forward at the same "
                    f"weights{mode or ''}{' (random draws from one seed)' if mode else ''}: the family does work "
                    f"outside its decoder layers (or in its loss){' while training' if mode else ''} that the "
                    f"adapter does not reproduce")
    return without_mask


def causal_without_mask(upstream: Any, batch: Any) -> bool:
    """Whether ``upstream``'s forward makes its masks with a cache, and is causal without one. Seen on two tokens
    (inside any sliding window): its first decoder layer then gets no mask only with a cache (SDPA then runs its
    causal kernel; without a cache transformers checks the positions for packed sequences and always builds the
    mask), and its logits must not change when a third token is appended. The adapter's layers then make their
    masks alike, and the check compares them so; a family that attends to later tokens without a mask keeps the
    mask, and the check refuses it."""
    import torch

    masks: list[Any] = []
    hook = upstream.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    try:
        upstream.eval()
        with torch.no_grad():
            shorter = upstream(batch[:, :2]).logits
            longer = upstream(batch[:, :3]).logits[:, :2]
    finally:
        hook.remove()
    return bool(masks) and masks[0] is None and bool((shorter - longer).abs().max() <= TOLERANCE)


def _both(ours: Any, upstream: Any, batch: Any, training: bool) -> tuple[Any, Any, Any]:
    """The adapter's pipeline layers (logits, loss) and upstream's output on ``batch``, both in training or eval
    mode, each run's random draws from :data:`TRAIN_SEED`."""
    import torch

    ours.train(training), upstream.train(training)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        torch.manual_seed(TRAIN_SEED)
        x = ours.pipeline_input(batch)
        for layer in ours.pipeline_layers():
            x = layer(x)
        loss = ours.pipeline_loss(x, batch)
        torch.manual_seed(TRAIN_SEED)
        # Upstream on what the adapter reads: the first T tokens in, the next T as targets (the router's
        # balancing term, when the config asks for it, is over exactly those tokens: models/moe.py).
        expected = upstream(batch[:, :-1], labels=batch[:, :-1], shift_labels=batch[:, 1:].contiguous())
        router_loss = getattr(ours, "_router_loss", None)
        if router_loss is not None:
            x = router_loss.split(x)[0]  # the logits; the router statistics went into the loss
    return x, loss, expected


@contextlib.contextmanager
def _float32_default() -> Iterator[None]:
    """The check runs in fp32 whatever the caller's precision context (Lightning's module init sets a default dtype)."""
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


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
        tiny = tiny_config(config)
        if getattr(tiny, "_attn_implementation", None) not in (None, *CPU_ATTENTION):
            tiny._attn_implementation = "sdpa"
    except Exception as err:
        raise refusal(family, t, f"a tiny copy of its config cannot be made ({type(err).__name__}: {err})") from err
    with torch.device("cpu"), torch.random.fork_rng(devices=[]), _float32_default():
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
    """What the build-time check finds (:func:`causal_without_mask`, upstream at ``model``'s weights):
    the layers make their masks so."""
    from transformers import AutoModelForCausalLM

    from lightning_async_pp.parallel.placement import replace_meta_tensors

    upstream = AutoModelForCausalLM.from_config(tiny)
    replace_meta_tensors(upstream, lambda x: torch.empty_like(x, device="cpu"))  # built on meta under the strategy
    upstream.load_state_dict(model.state_dict(), strict=True)
    return causal_without_mask(upstream, batch)


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
