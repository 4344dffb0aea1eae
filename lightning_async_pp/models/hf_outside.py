"""Work a transformers causal LM does outside its decoder layers, reproduced on the adapter's first and last
pipeline layers (the token embedding and the head) by forward hooks, so the modules, their classes and their
state_dict keys stay the upstream ones (see docs/design/adapters.md, 'Adapters of upstream models').

Each kind is recognized in the installed transformers' own code (the base model's and the causal LM's
``forward``), so a release that moves the work into a module (transformers 5 scales Gemma's embedding inside
``GemmaScaledWordEmbedding``) is not done twice. What no kind here covers is caught by the build-time check on a
tiny copy of the config (``hf_probe``), which refuses the model.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class OutsideWork:
    """One kind: where it happens ("embedding" or "head"), the code that shows it in the upstream ``forward``,
    and the function of (output, config) that reproduces it; ``train_only``: done in training mode only (dropout),
    as upstream's ``training=self.training``."""

    name: str
    where: str
    marker: str
    apply: Callable[[Tensor, Any], Tensor]
    active: Callable[[Any], bool] = lambda config: True
    train_only: bool = False


def _softcap(logits: Tensor, config: Any) -> Tensor:
    cap = config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


KINDS = (
    # Gemma, Gemma2, VaultGemma (4.x): hidden_states * torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)
    OutsideWork("embedding x sqrt(hidden_size)", "embedding", "normalizer",
                lambda h, c: h * torch.tensor(c.hidden_size**0.5, dtype=h.dtype)),
    OutsideWork("embedding x embedding_multiplier", "embedding", "embedding_multiplier",
                lambda h, c: h * c.embedding_multiplier),
    # StarCoder2: nn.functional.dropout(hidden_states, p=self.embedding_dropout, training=self.training), after the
    # embedding (the same call, so the same draws from the generator the pipeline seeds for the first stage).
    OutsideWork("embedding dropout", "embedding", "self.embedding_dropout",
                lambda h, c: torch.nn.functional.dropout(h, p=c.embedding_dropout, training=True), train_only=True),
    OutsideWork("logits / logits_scaling", "head", "logits_scaling", lambda x, c: x / c.logits_scaling),
    OutsideWork("logits x logit_scale", "head", "self.logit_scale", lambda x, c: x * c.logit_scale),
    OutsideWork("final_logit_softcapping", "head", "final_logit_softcapping", _softcap,
                active=lambda c: getattr(c, "final_logit_softcapping", None) is not None),
)


def outside_work(base: nn.Module, causal_lm: nn.Module, config: Any) -> list[OutsideWork]:
    """The kinds the installed upstream classes do (and the config switches on)."""
    sources = {"embedding": _source(type(base).forward), "head": _source(type(causal_lm).forward)}
    return [kind for kind in KINDS if kind.marker in sources[kind.where] and kind.active(config)]


def _source(function: Callable) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


class UpstreamCall:
    """Whether the base model's own ``forward`` is running (a user calling ``adapter.model(...)``): then it does its
    work itself and the embedding hook must not do it again."""

    def __init__(self, base: nn.Module) -> None:
        self.depth = 0
        base.register_forward_pre_hook(self._enter)
        base.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1


def attach(kinds: list[OutsideWork], embedding: nn.Module, head: nn.Module, base: nn.Module, config: Any) -> None:
    """Forward hooks doing ``kinds`` on the embedding's and the head's outputs (in the upstream order)."""
    on_embedding = [k for k in kinds if k.where == "embedding"]
    on_head = [k for k in kinds if k.where == "head"]
    if on_embedding:
        upstream = UpstreamCall(base)

        def embed_hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
            if upstream.depth:
                return None
            for kind in on_embedding:
                if module.training or not kind.train_only:
                    output = kind.apply(output, config)
            return output

        embedding.register_forward_hook(embed_hook)
    if on_head:
        def head_hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            for kind in on_head:
                if module.training or not kind.train_only:
                    output = kind.apply(output, config)
            return output

        head.register_forward_hook(head_hook)
