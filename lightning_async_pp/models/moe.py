"""The load-balancing loss of transformers mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) under the
pipeline.

Upstream (``load_balancing_loss_func`` in each family's modeling file) adds ``router_aux_loss_coef * aux`` to the
training loss when the config has ``output_router_logits=True``, with

    aux = E * sum_{j, e} mean_n[top-j choice of row n is e] * mean_n softmax(z_n)_e

over the rows ``n`` of every MoE layer's router logits ``z`` concatenated (E experts, j < top_k). It is a product of
two means over all layers together, so it does not split into per-layer terms; but its sufficient statistics do
add up layer by layer: per expert, the count of rows routed to it at each top-k rank (``expert_counts``, (top_k,
E), no gradient) and the sum of its router probabilities (``expert_prob_sums``, (E,), carries the gradient). Every
layer sees the same rows, so the number of rows is ``expert_counts[0].sum()``.

Each decoder layer called by the pipeline therefore returns ``(hidden_states, statistics)`` (a tuple and a dict of
tensors: what crosses a stage boundary), adding its router's statistics to those it received; the final norm and
the head pass them on, so the last layer's output is ``(logits, statistics)`` and ``pipeline_loss`` adds the term.
With ``m`` microbatches the pipeline's batch loss is the mean of the microbatch losses, each with its own term: as
upstream run on each microbatch and averaged (gradient accumulation); exact against the whole batch at ``m = 1``.
See docs/design/adapters.md, 'Adapters of upstream models'.

Packed rows (models/packing.py): the hidden state crossing a boundary is then ``{hidden, positions}`` and the
statistics ride beside it; routing is per token, so the term over a packed microbatch's tokens is upstream's on its
documents as a padded batch with their attention mask (which excludes the padding): docs/design/data.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models import packing

#: Families whose router logits the adapter reads, by ``model_type``: the MoE block's class (its output's element
#: ``index`` is the router logits, ``(rows, E)``) when the model class does not name it in ``_can_record_outputs``
#: (transformers 4.x's older modeling files).
ROUTER_OUTPUTS = {
    "mixtral": ("MixtralSparseMoeBlock", 1),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", 1),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", 1),
    "olmoe": ("OlmoeSparseMoeBlock", 1),
}


def adds_router_loss(config: Any) -> bool:
    """Whether upstream's training loss has the load-balancing term: the config asks for the router logits."""
    return bool(getattr(config, "output_router_logits", False))


def check_router_loss_supported(config: Any) -> None:
    """Refuse, before anything is built, a config whose upstream loss has a balancing term the adapter cannot add."""
    if adds_router_loss(config) and config.model_type not in ROUTER_OUTPUTS:
        raise ValueError(
            f"HuggingFaceCausalLM cannot train model_type {config.model_type!r} with output_router_logits=True: its "
            f"router's load-balancing loss is not reproduced under the pipeline (supported: "
            f"{', '.join(sorted(ROUTER_OUTPUTS))}); set output_router_logits=False to train without it"
        )


def router_statistics(router_logits: Tensor, top_k: int, num_experts: int) -> dict[str, Tensor]:
    """One layer's share of the sufficient statistics of upstream's balancing loss (see the module docstring)."""
    probs = F.softmax(router_logits.float(), dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    # (top_k, E): rows whose rank-j choice is e; counted in place (a one-hot would be rows x top_k x E)
    counts = probs.new_zeros(top_k, num_experts).scatter_add_(1, chosen.T, probs.new_ones(top_k, chosen.shape[0]))
    return {"expert_counts": counts, "expert_prob_sums": probs.sum(dim=0)}


def add_statistics(a: Optional[dict[str, Tensor]], b: Optional[dict[str, Tensor]]) -> Optional[dict[str, Tensor]]:
    if a is None or b is None:
        return b if a is None else a
    return {key: a[key] + b[key] for key in a}


def balancing_loss(statistics: dict[str, Tensor]) -> Tensor:
    """Upstream's ``load_balancing_loss_func`` (without a mask) from the summed statistics of every MoE layer."""
    counts, prob_sums = statistics["expert_counts"], statistics["expert_prob_sums"]
    # Every row has exactly one rank-0 choice. With no rows every count is 0, and so is the term: clamping keeps
    # that without a host sync (a Python comparison on a GPU tensor waits for the device, per microbatch).
    rows = counts[0].sum().clamp_min(1)
    return torch.sum(counts / rows * (prob_sums / rows).unsqueeze(0)) * counts.shape[1]


def _router_class(upstream: nn.Module, config: Any) -> tuple[str, int]:
    recorder = (getattr(type(upstream.model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is not None and getattr(recorder, "target_class", None) is not None:
        return recorder.target_class.__name__, recorder.index
    return ROUTER_OUTPUTS[config.model_type]


class _Carried:
    """Pre/post forward hooks of one pipeline layer: the pre-hook takes ``(hidden, statistics)`` apart (the layer's
    upstream code sees the hidden state alone) and the post-hook puts the layer's output back together with the
    statistics plus those its routers produced during the call. A call the upstream way (keyword arguments, as
    ``model.forward`` makes it) is left alone."""

    def __init__(self, routes: bool, top_k: int, num_experts: int) -> None:
        self.routes, self.top_k, self.num_experts = routes, top_k, num_experts
        self.calls: list[tuple[bool, Optional[dict[str, Tensor]]]] = []  # one per call in progress
        self.router_logits: list[Tensor] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if kwargs or len(args) != 1:
            self.calls.append((False, None))
            return None
        (x,) = args
        carried = None
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], dict):
            x, carried = x
        self.calls.append((True, carried))
        self.router_logits.clear()
        return (x,), kwargs

    def record_router(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.router_logits.append(output[index])
        return hook

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        pipelined, carried = self.calls.pop()
        logits, self.router_logits = self.router_logits, []
        if not pipelined:
            return None
        if isinstance(output, tuple):  # transformers 4.x's older decoder layers return (hidden_states, ...)
            output = output[0]
        if self.routes:
            for z in logits:
                carried = add_statistics(carried, router_statistics(z, self.top_k, self.num_experts))
            if carried is None:  # a dense layer before any MoE layer: start from zeros
                # a packed microbatch's hidden state rides with its positions (models/packing.py)
                device = (output[packing.HIDDEN] if isinstance(output, Mapping) else output).device
                carried = {"expert_counts": torch.zeros(self.top_k, self.num_experts, device=device),
                           "expert_prob_sums": torch.zeros(self.num_experts, device=device)}
        return output if carried is None else (output, carried)


class RouterLoss:
    """The balancing term of one adapted model: hooks on its pipeline layers (:meth:`attach`), the term added to
    the language-model loss (:meth:`loss`), and its value per training batch for the logger (:meth:`take_logged`).

    The value logged is the mean over the batch's microbatches of upstream's ``aux_loss`` (without the
    coefficient), recorded by the training losses only (evaluation runs without gradients)."""

    def __init__(self, upstream: nn.Module, config: Any) -> None:
        self.coefficient = float(config.router_aux_loss_coef)
        self.top_k, self.num_experts = int(upstream.num_experts_per_tok), int(upstream.num_experts)
        self.router_class, self.index = _router_class(upstream, config)
        self._logged: list[Tensor] = []

    def attach(self, blocks: list[nn.Module], after_blocks: list[nn.Module]) -> None:
        """Decoder ``blocks`` add their routers' statistics; ``after_blocks`` (norm, head) pass them on. The
        pre-hooks go first (before the hooks that fill in the blocks' other inputs), the post-hooks last."""
        for module, routes in [*((b, True) for b in blocks), *((m, False) for m in after_blocks)]:
            carried = _Carried(routes, self.top_k, self.num_experts)
            module.register_forward_pre_hook(carried.before, with_kwargs=True, prepend=True)
            module.register_forward_hook(carried.after, with_kwargs=True)
            if routes:
                for sub in module.modules():
                    if type(sub).__name__ == self.router_class:
                        sub.register_forward_hook(carried.record_router(self.index))

    def split(self, output: Any) -> tuple[Tensor, Optional[dict[str, Tensor]]]:
        """The logits and the statistics of the last layer's output."""
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict):
            return output
        return output, None

    def loss(self, statistics: Optional[dict[str, Tensor]]) -> Tensor:
        """``router_aux_loss_coef * aux`` of one microbatch (recorded for the logger)."""
        if statistics is None:
            raise RuntimeError("the model's config has output_router_logits=True but the last pipeline layer's output "
                               "carries no router statistics")
        aux = balancing_loss(statistics)
        if torch.is_grad_enabled():
            self._logged.append(aux.detach())
        return self.coefficient * aux

    def take_logged(self) -> Optional[Tensor]:
        """The mean aux loss recorded since the last call (``None`` if this process computed no loss)."""
        logged, self._logged = self._logged, []
        return torch.stack(logged).mean() if logged else None
