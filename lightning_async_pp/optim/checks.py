"""Settings of the delay corrections that must agree with the pipeline they run under, checked before training.

``DelayCompensation`` and ``PipeMareLR`` are told the delay (they cannot read it from the engine, so that they also
work without one); a value that is not the pipeline's would compensate against the wrong version or rescale the
learning rate by the wrong ``tau``, silently. ``PipeMareLR`` counts its steps as updates, so it must be stepped once
per update (Lightning's ``interval: "step"``, ``frequency: 1``). ``WeightPrediction`` needs a delayed stage to act on and is not defined
together with ``DelayCompensation`` (which compensates against the version it records, not the predicted one the
gradient was taken on). The strategy calls :func:`check_corrections` in ``setup``, and :func:`set_step_delay` before
every update, so that a synchronous update (``sync_steps``, ``sync_from_step``) is not compensated as a stale one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

from lightning_async_pp.optim.delay_compensation import DelayCompensation
from lightning_async_pp.optim.pipemare import PipeMareLR
from lightning_async_pp.optim.weight_prediction import WeightPrediction, prediction_scales


def set_step_delay(optimizers: Iterable[Any], delay: Optional[int]) -> None:
    """Tell every ``DelayCompensation`` in the optimizers' chains the realized delay of the coming update (``None``:
    unknown, e.g. stages with different delays: each uses its own ``delay``)."""
    for optimizer in optimizers:
        while optimizer is not None:
            if isinstance(optimizer, DelayCompensation):
                optimizer.step_delay = delay
            optimizer = getattr(optimizer, "wrapped", None)


def check_corrections(optimizers: Iterable[Any], scheduler_configs: Iterable[Any], delays: Sequence[int]) -> None:
    """Raise ``ValueError`` for a correction whose delay is not the pipeline's (when every stage has one delay,
    ``delays``) or a ``PipeMareLR`` not stepped once per update. ``scheduler_configs`` are Lightning's
    ``LRSchedulerConfig``s (``scheduler``, ``interval``, ``frequency``)."""
    delay = delays[0] if len(set(delays)) == 1 else None  # per-stage delays (research variants): not checked
    optimizers = list(optimizers)
    for optimizer in optimizers:
        chain = []
        while optimizer is not None:  # ErrorFeedback(DelayCompensation(...)): every wrapper of the chain
            chain.append(optimizer)
            if isinstance(optimizer, DelayCompensation) and delay is not None and optimizer.delay != delay:
                raise ValueError(f"DelayCompensation(delay={optimizer.delay}) under a pipeline whose gradients are "
                                 f"{delay} update(s) stale: set delay={delay} (0 turns the compensation off)")
            optimizer = getattr(optimizer, "wrapped", None)
        predicting = [o for o in chain if isinstance(o, WeightPrediction) and prediction_scales([o])]
        compensating = [o for o in chain if isinstance(o, DelayCompensation) and o.delay > 0]
        if predicting and compensating:
            raise ValueError(f"{chain[0]!r} combines WeightPrediction with DelayCompensation, which is not defined: "
                             f"DelayCompensation compensates against the version it recorded, but the gradient is "
                             f"taken on the predicted one. Use one of them (ErrorFeedback combines with either)")
    if prediction_scales(optimizers) and max(delays) == 0:
        raise ValueError(f"WeightPrediction under a synchronous pipeline (delay {list(delays)}): no batch runs on an "
                         f"older version, so there is nothing to predict. Use schedule='2bw' (or a delay >= 1), or "
                         f"drop WeightPrediction (scale=0 turns it off)")
    for config in scheduler_configs:
        scheduler = config.scheduler
        if not isinstance(scheduler, PipeMareLR):
            continue
        if config.interval != "step":
            raise ValueError(f"PipeMareLR counts updates: give it with interval 'step' (got {config.interval!r}), "
                             f"e.g. return {{'optimizer': opt, 'lr_scheduler': {{'scheduler': sched, 'interval': 'step'}}}}")
        if config.frequency != 1:
            raise ValueError(f"PipeMareLR counts updates: give it with frequency 1 (got {config.frequency}; it would "
                             f"count one step per {config.frequency} updates and follow its factor that much slower)")
        if delay is not None and max(scheduler.delay, 1) != max(delay, 1):
            raise ValueError(f"PipeMareLR(delay={scheduler.delay}) under a pipeline whose gradients are {delay} "
                             f"update(s) stale: set delay={max(delay, 1)}")
