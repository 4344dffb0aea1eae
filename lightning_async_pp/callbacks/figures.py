"""What the monitors share: per-stage figures reduced across processes with torchmetrics, and when to log.

Across processes each rank holds one stage (of one data-parallel replica, and under tensor parallelism one of
the stage's ``t`` tensor-parallel ranks), while only rank 0's logger writes. :class:`StageFigures` is a
``torchmetrics.Metric`` whose states are per-stage sums (and maxima): every rank adds its own stage's row,
``compute()`` reduces the rows of all ranks (one ``all_gather`` per state on the default process group), and every
rank gets the same table back. On one device there is no process group and nothing is gathered.

The monitors call ``compute()`` only at logging steps, on every rank at the same step: a collective across
stages is a barrier, which 2BW is built to avoid, so it is paid once per ``log_every_n_steps`` and never on a
step where nothing is logged.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torchmetrics import Metric


class StageFigures(Metric):
    """A table of figures per pipeline stage, summed (and counted) over the processes that report a stage.

    ``mean_fields`` are averaged over the reports of a row (data-parallel replicas of one stage); ``max_fields``
    keep the largest value reported. With ``parts=t`` a report comes in ``t`` parts, one from each process that
    holds a share of the stage (its ``t`` tensor-parallel ranks, each reporting the squares of its own shards): the
    mean fields are then summed over the parts and averaged over the reports, so every process's values must be
    its part of the figure, not the whole figure. ``compute()`` returns ``(means, reports, maxima)`` as float64
    tensors of shape ``[rows, len(mean_fields)]``, ``[rows]`` and ``[rows, len(max_fields)]``.
    """

    full_state_update = False

    def __init__(self, rows: int, mean_fields: Sequence[str], max_fields: Sequence[str] = (), parts: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows = int(rows)
        self.parts = int(parts)
        self.mean_fields = list(mean_fields)
        self.max_fields = list(max_fields)
        self.add_state("sums", torch.zeros(self.rows, len(self.mean_fields), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", torch.zeros(self.rows, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state(
            "maxima", torch.full((self.rows, max(1, len(self.max_fields))), float("-inf"), dtype=torch.float64),
            dist_reduce_fx="max",
        )

    def update(self, row: int, values: Mapping[str, float], maxima: Optional[Mapping[str, float]] = None) -> None:
        self.sums[row] += torch.tensor([float(values[f]) for f in self.mean_fields], dtype=torch.float64,
                                       device=self.sums.device)
        self.counts[row] += 1
        for i, field in enumerate(self.max_fields):
            if maxima is not None and field in maxima:
                self.maxima[row, i] = max(float(self.maxima[row, i]), float(maxima[field]))

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        reports = self.counts / self.parts  # every process counts one part of a report
        means = self.sums / reports.clamp(min=1).unsqueeze(1)
        means[self.counts == 0] = float("nan")
        return means, reports, self.maxima.clone()

    def reduce(self) -> dict[int, dict[str, float]]:
        """Reduce across processes and reset; ``{row: {field: value}}`` for every row some process reported.

        Mean fields are also available summed over the row's reports as ``"<field>:sum"``.
        """
        means, counts, maxima = self.compute()
        self.reset()
        # torchmetrics squeezes one-element results to 0-d: restore the table's shape.
        means = means.reshape(self.rows, len(self.mean_fields))
        counts = counts.reshape(self.rows)
        maxima = maxima.reshape(self.rows, -1)
        table: dict[int, dict[str, float]] = {}
        for row in range(self.rows):
            n = float(counts[row])
            if n == 0:
                continue
            figures = {f: float(means[row, i]) for i, f in enumerate(self.mean_fields)}
            figures.update({f"{f}:sum": float(means[row, i]) * n for i, f in enumerate(self.mean_fields)})
            figures.update({f: float(maxima[row, i]) for i, f in enumerate(self.max_fields)})
            table[row] = figures
        return table


def logging_step_due(trainer: Trainer) -> bool:
    """Whether Lightning writes logs at the current training step.

    The same rule as Lightning's own loggers (``(batches_that_stepped + 1) % log_every_n_steps == 0``, which
    ``LearningRateMonitor`` and ``DeviceStatsMonitor`` follow too), without the ``should_stop`` clause: that flag
    can differ between ranks, and the decision must be the same on every rank because a collective follows.
    Evaluate it at ``on_train_batch_start``; it stays valid for the whole batch.
    """
    n = trainer.log_every_n_steps
    if not trainer.loggers or not n or n <= 0:
        return False
    return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % n == 0


def logger_step(trainer: Trainer) -> int:
    """The step Lightning's loggers use for the current batch (``train_loss`` of the same batch has it too)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_to_loggers(trainer: Trainer, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
    """Write ``metrics`` once: from global rank 0's loggers (the other ranks' loggers do not write)."""
    if not metrics or not trainer.is_global_zero:
        return
    step = logger_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def pipeline_strategy(trainer: Trainer, owner: str) -> Any:
    """The trainer's ``AsyncPipelineStrategy``, or a clear error naming ``owner``."""
    from lightning_async_pp.strategy import AsyncPipelineStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, AsyncPipelineStrategy):
        raise TypeError(
            f"{owner} reads the pipeline of AsyncPipelineStrategy; this Trainer uses {type(strategy).__name__}. "
            f"Pass strategy=AsyncPipelineStrategy(...) (or strategy='async_pipeline') to the Trainer"
        )
    return strategy


def logged_pipeline_strategy(trainer: Trainer, owner: str) -> Any:
    """:func:`pipeline_strategy`, for a monitor that logs: also a clear error when the Trainer has no logger."""
    strategy = pipeline_strategy(trainer, owner)
    if not trainer.loggers:
        raise MisconfigurationException(f"Cannot use {owner} with a Trainer that has no logger")
    return strategy
