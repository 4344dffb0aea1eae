"""``ExpertMonitor``: the tokens each expert of a mixture-of-experts model receives, and the imbalance per layer, in
the logger."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_async_pp.callbacks.figures import (log_to_loggers, logged_pipeline_strategy, logging_step_due,
                                                   pipeline_strategy)


class ExpertMonitor(Callback):
    """Log how a mixture-of-experts model's router spreads its tokens, under ``experts/``, at every logging step
    (Lightning's ``log_every_n_steps``), over the steps since the previous one:

    - ``experts/<layer>/tokens/expert{j}`` (``per_expert=True``): the token copies expert ``j`` of the MoE layer
      ``<layer>`` (``blocks.1.mlp``) received per step (a token routed to ``k`` experts counts once at each);
    - ``experts/<layer>/imbalance``: the most an expert of the layer received over the mean of its experts (1.0:
      perfectly balanced; at most ``E / k``, every token routed to the same ``k`` of the ``E`` experts);
    - ``experts/imbalance``: the largest over layers.

    Counted in trained microbatches only (a microbatch counts when its backward runs: not validation, nor the
    recomputation of activation checkpointing), on the experts of ``models.Llama(num_experts=...)`` (their
    ``LocalExperts``). Every figure is the whole run's, what one device logs on the same batches: under data
    parallelism the replicas' counts add up, and under expert parallelism each rank counts what its own experts
    receive from the whole expert group. Cost: nothing per step (the counts add up on the device in the backward);
    at a logging step one ``all_reduce`` of ``layers x experts`` numbers over every process and one host read.

    Args:
        per_expert: also log every expert's count (``layers x experts`` scalars), not only the imbalances.
    """

    def __init__(self, per_expert: bool = True) -> None:
        self.per_expert = per_expert
        self.metrics: dict[str, float] = {}  # the figures of the last logging step, as logged
        self._layers: dict[str, int] = {}
        self._last: Tensor | None = None  # the counts at the previous logging step, (layers, max experts)
        self._steps = 0
        self._due = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        logged_pipeline_strategy(trainer, type(self).__name__)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stats = pipeline_strategy(trainer, type(self).__name__).engine.stats
        self._layers = stats.expert_layers()
        if not self._layers:
            rank_zero_warn(f"{type(self).__name__}: {type(pl_module).__name__} has no routed experts (LocalExperts, as "
                           f"models.Llama(num_experts=...) holds them); nothing is logged")
        self._last, self._steps = self._counts(trainer), 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._due = bool(self._layers) and logging_step_due(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._steps += 1
        if not self._due:
            return
        self._due = False
        counts = self._counts(trainer)  # every rank at the same step: a collective
        assert self._last is not None
        window, self._last, self._steps = (counts - self._last) / self._steps, counts, 0
        metrics = figures(self._layers, window.cpu(), self.per_expert)
        self.metrics = metrics
        log_to_loggers(trainer, metrics)

    def _counts(self, trainer: Trainer) -> Tensor:
        """The whole model's counts so far, summed over every process: ``(layers, most experts)``, float64."""
        strategy = trainer.strategy
        mine = strategy.engine.stats.expert_tokens()
        table = torch.zeros(len(self._layers), max(self._layers.values(), default=0), dtype=torch.float64,
                            device=strategy.root_device)
        for row, name in enumerate(self._layers):
            if name in mine:
                table[row, : self._layers[name]] = mine[name].to(table.device, torch.float64)
        if strategy.is_multiprocess and dist.is_initialized() and self._layers:
            dist.all_reduce(table)
        return table


def figures(layers: dict[str, int], counts: Tensor, per_expert: bool) -> dict[str, float]:
    """The logged figures from ``counts`` (a row per layer of ``layers``, tokens per expert)."""
    out: dict[str, float] = {}
    worst = 0.0
    for row, (name, n) in enumerate(layers.items()):
        tag = f"experts/{name.removesuffix('.experts')}"
        received = counts[row, :n]
        mean = float(received.mean())
        imbalance = float(received.max()) / mean if mean > 0 else 0.0
        out[f"{tag}/imbalance"] = imbalance
        worst = max(worst, imbalance)
        if per_expert:
            out.update({f"{tag}/tokens/expert{j}": float(v) for j, v in enumerate(received.tolist())})
    out["experts/imbalance"] = worst
    return out
