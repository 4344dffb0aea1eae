"""Routed-expert MLPs for ``models.Llama(num_experts=E, experts_per_token=k)``: a mixture-of-experts block as
Mixtral and Qwen3-MoE have it (a linear router ``gate``, dropless token-choice top-k over softmax probabilities,
renormalized; ``E`` SwiGLU experts named ``experts.{j}.gate_proj`` ..., as Qwen3-MoE names them), and the router's
load-balancing loss carried to the loss as transformers' MoE families do (models/moe.py's statistics).

On one device every expert runs here; under ``AsyncPipelineStrategy(expert_parallel_size=e)`` the model's
``configure_model`` keeps ``E / e`` of them (``LocalExperts.shard``) and tokens reach the others by all-to-all
(``run_experts``, parallel/expert.py). See docs/design/expert-parallel.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models.moe import router_statistics
from lightning_async_pp.parallel.expert import LocalExperts, route, run_experts

class Expert(nn.Module):
    """One expert: a SwiGLU MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """``num_experts`` experts, ``top_k`` of them per token, chosen by the router ``gate``; returns the weighted sum
    of the chosen experts' outputs (B, T, hidden) and, where ``statistics``, this layer's router statistics for the
    balancing loss (``None`` otherwise)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool = True, statistics: bool = True) -> None:
        super().__init__()
        self.top_k, self.normalize, self.statistics = top_k, normalize, statistics
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = LocalExperts([Expert(hidden_size, intermediate_size) for _ in range(num_experts)])

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: Tensor) -> tuple[Tensor, Optional[dict[str, Tensor]]]:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        weights, chosen = route(logits, self.top_k, self.normalize, tokens.dtype)
        out = run_experts(tokens, weights, chosen, self.experts).view_as(x)
        stats = router_statistics(logits, self.top_k, self.num_experts) if self.statistics else None
        return out, stats


def take_statistics(x: Any) -> tuple[Any, Optional[dict[str, Tensor]]]:
    """A layer's input without the router statistics that ride with it (a block's output is ``(hidden, {...})``
    where the model adds the balancing loss; the hidden state may be a packed microbatch's dict), and those
    statistics (or ``None``)."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], Mapping):
        return x[0], dict(x[1])
    return x, None


def with_statistics(x: Any, statistics: Optional[dict[str, Tensor]]) -> Any:
    """``x`` with the router statistics beside it (unchanged without any)."""
    return x if statistics is None else (x, statistics)


@torch.no_grad()
def init_experts(layer: nn.Module, seed: int, std: float, residual_std: float) -> set[int]:
    """Draw the weights of every held expert under ``layer`` from a generator of its own, seeded by ``seed`` and
    the expert's global index (normal(0, ``std``); ``residual_std`` for ``down_proj``, which writes into the
    residual stream), so an expert's weights do not depend on which experts this process holds. Returns the ids
    of the parameters drawn."""
    drawn: set[int] = set()
    for experts in (m for m in layer.modules() if isinstance(m, LocalExperts)):
        for key, expert in experts.items():
            generator = torch.Generator().manual_seed((seed * 1_000_003 + int(key) + 1) % 2**63)
            for name, p in expert.named_parameters():
                drawn.add(id(p))
                if p.is_meta:
                    continue
                scale = residual_std if name.startswith("down_proj") else std
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, scale, generator=generator))
    return drawn
