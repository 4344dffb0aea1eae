"""Settings of the delay corrections that must agree with the pipeline they run under, checked before training.

``DelayCompensation`` and ``PipeMareLR`` are told the delay (they cannot read it from the engine, so that they also
work without one); a value that is not the pipeline's would compensate against the wrong version or rescale the
learning rate by the wrong ``tau``, silently. ``PipeMareLR`` counts its steps as updates, so it must be stepped once
per update (Lightning's ``interval: "step"``). The strategy calls :func:`check_corrections` in ``setup``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lightning_async_pp.optim.delay_compensation import DelayCompensation
from lightning_async_pp.optim.pipemare import PipeMareLR


def check_corrections(optimizers: Iterable[Any], scheduler_configs: Iterable[Any], delays: Sequence[int]) -> None:
    """Raise ``ValueError`` for a correction whose delay is not the pipeline's (when every stage has one delay,
    ``delays``) or a ``PipeMareLR`` not stepped per update. ``scheduler_configs`` are Lightning's
    ``LRSchedulerConfig``s (``scheduler``, ``interval``)."""
    delay = delays[0] if len(set(delays)) == 1 else None  # per-stage delays (research variants): not checked
    for optimizer in optimizers:
        while optimizer is not None:  # ErrorFeedback(DelayCompensation(...)): every wrapper of the chain
            if isinstance(optimizer, DelayCompensation) and delay is not None and optimizer.delay != delay:
                raise ValueError(f"DelayCompensation(delay={optimizer.delay}) under a pipeline whose gradients are "
                                 f"{delay} update(s) stale: set delay={delay} (0 turns the compensation off)")
            optimizer = getattr(optimizer, "wrapped", None)
    for config in scheduler_configs:
        scheduler = config.scheduler
        if not isinstance(scheduler, PipeMareLR):
            continue
        if config.interval != "step":
            raise ValueError(f"PipeMareLR counts updates: give it with interval 'step' (got {config.interval!r}), "
                             f"e.g. return {{'optimizer': opt, 'lr_scheduler': {{'scheduler': sched, 'interval': 'step'}}}}")
        if delay is not None and max(scheduler.delay, 1) != max(delay, 1):
            raise ValueError(f"PipeMareLR(delay={scheduler.delay}) under a pipeline whose gradients are {delay} "
                             f"update(s) stale: set delay={max(delay, 1)}")
