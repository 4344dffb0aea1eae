"""Lightning's own callbacks under the strategy: those it cannot run exactly are refused at setup (before any
training) with the reason (the model summary of the whole model is taken by ``_lightning.summarize_within``).

Every public callback of ``lightning.pytorch.callbacks`` is either exact under the strategy (the numbers of plain
Lightning or one device, on 1 and 2 processes) or refused here; ``tests/test_callback_sweep.py`` checks both for
each of them and writes the table in docs/callbacks.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    GradientAccumulationScheduler,
    ModelPruning,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
    ThroughputMonitor,
    WeightAveraging,
)


def refusal(callback: Any, *, processes: int, num_stages: int) -> Optional[str]:
    """Why ``callback`` cannot run exactly on ``processes`` processes holding pipelines of ``num_stages`` stages,
    and what to do instead; ``None`` where it can."""
    name = type(callback).__name__
    if isinstance(callback, ModelPruning):
        return (f"{name} re-registers each pruned weight as '<name>_orig' with a mask that a forward pre-hook "
                f"applies, after the pipeline has taken the weights into its weight versions: the pipeline would go "
                f"on training the unpruned weights. Prune before fit (torch.nn.utils.prune, then prune.remove) or "
                f"after it")
    if isinstance(callback, GradientAccumulationScheduler):
        factors = {epoch: factor for epoch, factor in sorted(callback.scheduling.items()) if factor != 1}
        if factors:
            return (f"{name} would accumulate gradients over several batches (factors {factors} by epoch), which "
                    f"the pipeline does not do (accumulate_grad_batches must stay 1); raise num_microbatches and the "
                    f"batch size instead")
    if isinstance(callback, BatchSizeFinder):
        return (f"{name} retrains with other batch sizes, which Lightning supports under no distributed strategy "
                f"(this one derives from DDPStrategy); find the batch size with plain Lightning (one device, no "
                f"strategy) and pass it, a multiple of num_microbatches")
    if processes > 1 and isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
        return (f"{name} averages a copy of the whole model, but on {processes} processes each process's module "
                f"holds only its own stage's layers, so the copy would be paired with the wrong parameters. Run it on "
                f"one process (AsyncPipelineStrategy(num_stages=...) with devices=1), or average saved checkpoints "
                f"after training")
    if processes > 1 and isinstance(callback, OnExceptionCheckpoint):
        return (f"{name} saves when training fails, but across processes a checkpoint is written by every stage "
                f"together, and once one stage has failed the others stop at its report (it may be gone), so the "
                f"save cannot complete. Save periodically instead (ModelCheckpoint(every_n_train_steps=..., "
                f"save_last=True)) and resume with ckpt_path='last'")
    if processes > 1 and num_stages > 1 and isinstance(callback, ThroughputMonitor):
        return (f"{name} multiplies one device's samples per second by the world size ({processes}), but the "
                f"{num_stages} stages of a pipeline process the same samples, so its global figures would be "
                f"{num_stages}x too high; use lightning_async_pp.callbacks.PipelineMonitor (throughput per pipeline)")
    return None


def check_callbacks(callbacks: Iterable[Any], *, processes: int, num_stages: int) -> None:
    """Raise ``ValueError`` naming every callback that :func:`refusal` refuses."""
    reasons = [reason for c in callbacks if (reason := refusal(c, processes=processes, num_stages=num_stages))]
    if reasons:
        raise ValueError("AsyncPipelineStrategy cannot run these callbacks exactly: " + "; ".join(reasons))


def check_resume(callbacks: Iterable[Any]) -> None:
    """Refuse to resume a fit with a ``WeightAveraging`` callback (``EMAWeightAveraging``): Lightning's callback
    saves the averaged weights as the model's ``state_dict`` and the current ones under ``current_model_state``,
    and on loading reads ``state_dict`` back to restore its average, which the strategy's checkpoints keep with the
    weight versions instead; the load stopped with a KeyError, after the model had taken the averaged weights."""
    names = sorted({type(c).__name__ for c in callbacks if isinstance(c, WeightAveraging)})
    if names:
        raise ValueError(f"AsyncPipelineStrategy cannot resume a fit with {', '.join(names)}: the strategy restores "
                         f"the weights itself and the callback could not restore its average nor the current "
                         f"weights. Resume without it (a new average starts)")
