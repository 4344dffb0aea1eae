"""SLURM's auto-requeue at a step boundary: ``SLURMEnvironment(auto_requeue=True)`` with
``AsyncPipelineStrategy``.

Lightning's own handler saves the hpc checkpoint inside the SIGUSR1 handler, on every rank, wherever each one is:
under 2BW that is in the middle of a step (a half-done batch, a lookahead in flight on some stages and not on
others), and the collective save can wait on a stage that is blocked in a transfer. Here the handler only sets a
flag; at the next step boundary the stages agree on one step (:class:`~.pipeline.comm.StepAgreement`), and there
every stage saves the hpc checkpoint, rank 0 asks SLURM to requeue the job, and training stops. See
docs/design/checkpoints.md, "Faults".
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_async_pp.pipeline.comm import StepAgreement
from lightning_async_pp.strategy import _lightning

log = logging.getLogger(__name__)


class RequeueAtStepBoundary:
    """Installed by the strategy's ``setup`` when fitting under ``SLURMEnvironment(auto_requeue=True)``."""

    def __init__(self, trainer: Any, agreement: StepAgreement) -> None:
        self.trainer, self.agreement = trainer, agreement
        # Lightning registers its signal handlers after the strategy's setup: it registers this one instead of its
        # own saving handler.
        _lightning.replace_requeue_handler(trainer, lambda signum, frame: agreement.request())

    @classmethod
    def install(cls, trainer: Any, environment: Any, store: Any, data_parallel_size: int) -> Optional["RequeueAtStepBoundary"]:
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return None
        # Processes are at most 2 steps apart within a pipeline, 5 across replicas (StepAgreement).
        agreement = StepAgreement(store, margin=3 if data_parallel_size == 1 else 6)
        # An earlier fit in this job that ended before its agreed step left the keys behind: a fresh start.
        agreement.clear(trainer.is_global_zero)
        trainer.strategy.barrier("requeue-install")
        return cls(trainer, agreement)

    def at_step_boundary(self, num_updates: int) -> None:
        """Every stage calls it before each training step (``num_updates`` batches trained)."""
        if not self.agreement.due(num_updates):
            return
        trainer = self.trainer
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.save_checkpoint(_lightning.hpc_save_path(trainer))  # collective: every stage is at this step
        # With async_checkpoint the save only started: the job is requeued (and soon killed) once it is in place.
        trainer.strategy.finish_pending_save()
        trainer.strategy.barrier("requeue")
        self.agreement.clear(trainer.is_global_zero)
        if trainer.is_global_zero:
            requeue_job()
        trainer.should_stop = True


def requeue_job() -> None:
    """``scontrol requeue`` this SLURM job (an array job's own task), as Lightning's handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"not a SLURM job id: {job!r}")
    result = subprocess.call(["scontrol", "requeue", job])
    if result == 0:
        log.info(f"Requeued SLURM job {job}")
    else:
        log.warning(f"Requeuing SLURM job {job} failed with exit code {result}")
