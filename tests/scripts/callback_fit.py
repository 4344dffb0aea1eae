"""Lightning's built-in callbacks under the strategy (tests/test_callback_sweep.py): one run per callback case.

Every case trains the same small model (helpers.TinyLM, 4 layers, a ``backbone`` = its first layer) on the same
data with one callback set up by ``CASES[case["callback"]]``, then records what that callback decides or logs
(its "observables") and, on rank 0, the final weights. The test runs each case three ways: plain Lightning (no
strategy), the strategy on one process (2 stages in it) and the strategy on 2 processes, and compares.

Run as a script in a subprocess (Lightning's launcher re-executes it for the other ranks): ``cases`` (name ->
config) all run in one launch, each result saved under its name; the test also imports ``run`` for the
one-process runs. A case whose fit is refused records the error's message instead.

Case config keys: callback (a name in CASES), schedule, stages (per pipeline, default 2), dp (data_parallel_size
across processes; its shard is rows r::dp, and one process trains on the replicas' batches concatenated, see
``concatenated_dataset``), strategy (False: plain Lightning).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch import callbacks as cb
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import TinyLM, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

SAMPLES, BATCH, MICROBATCHES, EPOCHS = 32, 4, 2, 3  # 8 batches an epoch


class SweepLM(TinyLM):
    """TinyLM whose optimizer takes only the trainable parameters (as a fine-tuning user's does), with a step
    learning-rate schedule (so LearningRateMonitor has something to show), a validation loss and a prediction."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.lr = 0.1  # the attribute LearningRateFinder tunes

    @property
    def backbone(self) -> torch.nn.Module:  # BackboneFinetuning's contract; a property: no second module path
        return self.layers[0]

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class MemoryLogger(Logger):
    """Keeps every logged scalar: ``metrics[name] = [(step, value), ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for name, value in metrics.items():
            self.metrics.setdefault(name, []).append((step, float(value)))


class FreezeFirstLayerUntilEpoch1(cb.BaseFinetuning):
    """BaseFinetuning as its docs show it: the first layer frozen in setup, unfrozen (a new parameter group) at
    epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.layers[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.layers[0], optimizer, lr=0.05)


class FreezeFirstStageUntilEpoch1(FreezeFirstLayerUntilEpoch1):
    """The same on a partition whose first stage is the first layer alone: that stage has nothing to train until
    epoch 1, and its output, which the next stage receives, needs no gradient until then."""


class ToggleRequiresGrad(cb.Callback):
    """A plain callback that sets ``requires_grad`` of whole layers at the start of given steps (mid-epoch):
    ``changes`` maps a global step to ``{layer index: requires_grad}``; the optimizer holds every parameter."""

    def __init__(self, changes: dict[int, dict[int, bool]]) -> None:
        self.changes = changes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for index, trainable in self.changes.get(trainer.global_step, {}).items():
            pl_module.layers[index].requires_grad_(trainable)


class KeepPredictions(cb.BasePredictionWriter):
    """A prediction writer that keeps what it was asked to write."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list[Any] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append(None if prediction is None else prediction.detach().cpu().clone())


class StepClockTimer(cb.Timer):
    """Lightning's Timer on a clock that advances one second per training step, so that it stops at a known step."""

    def time_elapsed(self, stage=None) -> float:
        return float(self._trainer.global_step) if getattr(self, "_trainer", None) is not None else 0.0

    def on_fit_start(self, trainer, *args, **kwargs) -> None:
        self._trainer = trainer
        super().on_fit_start(trainer, *args, **kwargs)


def _recording_summary(base: type) -> cb.ModelSummary:
    """``base`` (ModelSummary or RichModelSummary) keeping the figures it prints."""

    class Recording(base):
        printed: dict = {}

        def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs):
            self.printed.update(total=total_parameters, trainable=trainable_parameters)
            return base.summarize(summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs)

    Recording.__name__ = base.__name__
    return Recording()


class FailAtStep(cb.Callback):
    """Raises after the given step's update (for OnExceptionCheckpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected failure after step {self.step}")


def _metrics(names: Callable[[str], bool]) -> Callable:
    return lambda trainer, callbacks, logger: {n: v for n, v in logger.metrics.items() if names(n)}


def _stopped(trainer, callbacks, logger) -> dict:
    return {"global_step": trainer.global_step, "epoch": trainer.current_epoch}


def _checkpoints(trainer, callbacks, logger) -> dict:
    checkpoint = callbacks[0]
    return {"best_score": float(checkpoint.best_model_score), "best": Path(checkpoint.best_model_path).name,
            "kept": sorted(Path(p).name for p in checkpoint.best_k_models)}


def _early_stopping(trainer, callbacks, logger) -> dict:
    return {**_stopped(trainer, callbacks, logger), "best_score": float(callbacks[0].best_score),
            "stopped_epoch": callbacks[0].stopped_epoch}


def _lambda_calls(trainer, callbacks, logger) -> dict:
    return {"calls": callbacks[0].calls}


def _recording_lambda() -> cb.LambdaCallback:
    calls: list = []
    callback = cb.LambdaCallback(
        on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: calls.append(
            (trainer.global_step, batch_idx, round(float(outputs["loss"]), 6))),
        on_train_epoch_start=lambda trainer, module: calls.append(("epoch", trainer.current_epoch)))
    callback.calls = calls
    return callback


def _summary(trainer, callbacks, logger) -> dict:
    return {"printed": dict(callbacks[0].printed) if trainer.is_global_zero else None}


def _spikes(trainer, callbacks, logger) -> dict:
    return {**_stopped(trainer, callbacks, logger), "bad_batches": list(callbacks[0].bad_batches)}


def _lr_finder(trainer, callbacks, logger) -> dict:
    found = callbacks[0].optimal_lr
    return {"suggestion": found.suggestion(), "losses": [round(x, 6) for x in found.results["loss"]]}


def _throughput(trainer, callbacks, logger) -> dict:
    """The step counts it logs, and its whole-job samples per second over one device's: the number of model
    replicas that process distinct samples (1 for one pipeline, however many stages)."""
    metrics = logger.metrics
    counts = {n: v for n, v in metrics.items() if n.endswith(("/samples", "/batches"))}
    rates = [(a[1], b[1]) for a, b in zip(metrics.get("train/samples_per_sec", []),
                                          metrics.get("train/device/samples_per_sec", []))]
    return {**counts, "replicas": sorted({round(g / d, 6) for g, d in rates}) or [1.0]}


#: case name -> tmp folder -> (the callbacks, Trainer keyword arguments, what to observe besides the final weights,
#: which every case compares: observe(trainer, callbacks, logger) or None). BasePredictionWriter's case also predicts
#: after fit (see run()).
CASES: dict[str, Callable[[Path], tuple[list, dict, Optional[Callable]]]] = {
    "BaseFinetuning": lambda tmp: ([FreezeFirstLayerUntilEpoch1()], {}, None),
    "BackboneFinetuning": lambda tmp: ([cb.BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)], {}, None),
    "ModelPruning": lambda tmp: ([cb.ModelPruning("l1_unstructured", amount=0.3, verbose=0)], {}, None),
    "StochasticWeightAveraging": lambda tmp: ([cb.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)], {},
                                              None),
    "EMAWeightAveraging": lambda tmp: ([cb.EMAWeightAveraging(decay=0.8)], {}, None),
    "WeightAveraging": lambda tmp: ([cb.WeightAveraging()], {}, None),
    "GradientAccumulationScheduler": lambda tmp: ([cb.GradientAccumulationScheduler({0: 1})], {}, None),
    "GradientAccumulationScheduler(factor 2)": lambda tmp: ([cb.GradientAccumulationScheduler({1: 2})], {}, None),
    "LearningRateMonitor": lambda tmp: ([cb.LearningRateMonitor("step")], {"log_every_n_steps": 1},
                                        _metrics(lambda n: n.startswith("lr-"))),
    "EarlyStopping": lambda tmp: ([cb.EarlyStopping("val_loss", min_delta=0.02, patience=0)], {}, _early_stopping),
    "ModelCheckpoint": lambda tmp: ([cb.ModelCheckpoint(tmp / "ckpt", monitor="val_loss", save_top_k=2)],
                                    {"enable_checkpointing": True}, _checkpoints),
    # Fails after step 5 (saved on the exception), then a second fit resumes from that checkpoint, which Lightning
    # picks up by itself (see run()).
    "OnExceptionCheckpoint": lambda tmp: ([cb.OnExceptionCheckpoint(tmp / "on_exception"), FailAtStep(5)],
                                          {"enable_checkpointing": True}, _stopped),
    "Timer": lambda tmp: ([StepClockTimer(duration=timedelta(seconds=5), interval="step")], {}, _stopped),
    "ThroughputMonitor": lambda tmp: ([cb.ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0))],
                                      {"log_every_n_steps": 1}, _throughput),
    "DeviceStatsMonitor": lambda tmp: ([cb.DeviceStatsMonitor()], {"log_every_n_steps": 1}, None),
    "BatchSizeFinder": lambda tmp: ([cb.BatchSizeFinder(max_trials=2)], {}, None),
    "LearningRateFinder": lambda tmp: ([cb.LearningRateFinder(num_training_steps=16, early_stop_threshold=None)], {}, _lr_finder),
    "ModelSummary": lambda tmp: ([_recording_summary(cb.ModelSummary)], {"enable_model_summary": True}, _summary),
    "RichModelSummary": lambda tmp: ([_recording_summary(cb.RichModelSummary)], {"enable_model_summary": True},
                                     _summary),
    "TQDMProgressBar": lambda tmp: ([cb.TQDMProgressBar()], {"enable_progress_bar": True}, None),
    "RichProgressBar": lambda tmp: ([cb.RichProgressBar()], {"enable_progress_bar": True}, None),
    "LambdaCallback": lambda tmp: ([_recording_lambda()], {}, _lambda_calls),
    "BasePredictionWriter": lambda tmp: ([KeepPredictions()], {}, None),
    # Any rise of the loss after 2 batches is a spike here: it stops training with TrainingSpikeException.
    "SpikeDetection": lambda tmp: ([cb.SpikeDetection(warmup=2, atol=0.0, rtol=0.0,
                                                      exclude_batches_path=str(tmp / "skip.json"))], {}, _spikes),
}


#: Freezing and unfreezing layers, by a BaseFinetuning subclass or a plain callback (tests/test_callback_sweep.py,
#: the freezing test): the same contract as CASES; a case's "partition" gives the strategy's.
FREEZING_CASES: dict[str, Callable[[Path], tuple[list, dict, Optional[Callable]]]] = {
    # The second stage's first activation needs no gradient; from epoch 1 on they all do.
    "BaseFinetuning(whole first stage)": lambda tmp: ([FreezeFirstStageUntilEpoch1()], {}, None),
    # Layers 0-2 (the first stage of [2, 2] and the layer after its boundary) frozen from the first step until
    # step 5, the first stage alone from step 11 until 17 (mid-epoch), the last layer from step 19 on.
    "requires_grad toggled mid-epoch": lambda tmp: ([ToggleRequiresGrad(
        {0: {0: False, 1: False, 2: False}, 5: {0: True, 1: True, 2: True}, 11: {0: False, 1: False},
         17: {0: True, 1: True}, 19: {3: False}})], {}, None),
}


def dataset_for(dp: int):
    """The data-parallel rank's shard (rows r::dp) of the sweep's data; all of it for one pipeline."""
    dataset = make_dataset(SAMPLES)
    if dp == 1:
        return dataset
    dp_rank = int(os.environ.get("LOCAL_RANK", 0)) * dp // int(os.environ.get("WORLD_SIZE", dp))
    return Subset(dataset, list(range(dp_rank, SAMPLES, dp)))


def concatenated_dataset(dp: int):
    """One device's data for ``dp`` replicas: batch k is replica 0's batch k, then replica 1's, ..."""
    shards = [list(range(r, SAMPLES, dp)) for r in range(dp)]
    order = [i for k in range(len(shards[0]) // BATCH) for s in shards for i in s[BATCH * k: BATCH * (k + 1)]]
    return Subset(make_dataset(SAMPLES), order)


def _strategy(case: dict, devices: int, dp: int) -> AsyncPipelineStrategy:
    stages = case.get("stages", 2)
    return AsyncPipelineStrategy(
        case.get("schedule", "2bw"), num_microbatches=MICROBATCHES * (dp if devices == 1 else 1),
        num_stages=stages if devices == 1 else None, data_parallel_size=dp if devices > 1 else 1,
        partition=case.get("partition", [4 // stages] * stages), pipeline_timeout=60.0)


def run(case: dict, devices: int, tmp: Path) -> dict:
    """One fit (then a predict for the prediction writer) of ``case``; what this rank saw."""
    L.seed_everything(0, verbose=False)
    callbacks, trainer_kwargs, observe = {**CASES, **FREEZING_CASES}[case["callback"]](tmp)
    dp = case.get("dp", 1)
    data = dataset_for(dp) if devices > 1 else (concatenated_dataset(dp) if dp > 1 else make_dataset(SAMPLES))
    batch = BATCH * dp if devices == 1 else BATCH
    logger = MemoryLogger()
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=devices, max_epochs=EPOCHS, logger=logger,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  num_sanity_val_steps=0, callbacks=callbacks, use_distributed_sampler=False,
                                  default_root_dir=str(tmp))
    kwargs.update(trainer_kwargs)
    if case.get("strategy", True):
        kwargs["strategy"] = _strategy(case, devices, dp)
    model = SweepLM()
    trainer = L.Trainer(**kwargs)
    loader = DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)
    val_loader = DataLoader(make_dataset(8, seed=2), batch_size=4)
    result: dict[str, Any] = {}
    try:
        trainer.fit(model, loader, val_loader)
    except Exception as err:  # noqa: BLE001 - a refusal, or the failure the callback acts on
        result["error"] = f"{type(err).__name__}: {err}"
    if case["callback"] == "OnExceptionCheckpoint" and "injected failure" in result.get("error", ""):
        # Resume: a new model and Trainer with the same OnExceptionCheckpoint, which Lightning resumes from.
        result["observed_at_failure"] = observe(trainer, trainer.callbacks, logger)
        L.seed_everything(0, verbose=False)
        model, kwargs["callbacks"] = SweepLM(), [callbacks[0]]
        kwargs["strategy"] = _strategy(case, devices, dp) if case.get("strategy", True) else "auto"
        trainer = L.Trainer(**kwargs)
        trainer.fit(model, loader, val_loader)
        del result["error"]
    if "error" not in result or case["callback"] == "SpikeDetection":
        if observe is not None:
            result["observed"] = observe(trainer, trainer.callbacks[:len(callbacks)], logger)
        if trainer.is_global_zero or "error" in result:
            # After a failed fit no stage's weights were gathered: each rank saves its own stage's.
            result["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if case["callback"] == "BasePredictionWriter" and "error" not in result:
            trainer.predict(model, DataLoader(make_dataset(8, seed=3), batch_size=4))
            result["observed"] = {"written": callbacks[0].written if trainer.is_global_zero else None}
    result["rank"] = trainer.global_rank
    return result


def run_cases(cfg: dict, devices: int) -> tuple[dict, Any, Any]:
    """Every case of ``cfg["cases"]`` in these processes, one after the other; ``script_main``'s contract."""
    results, rank = {}, 0
    for name, case in cfg["cases"].items():
        tmp = Path(cfg.get("root", ".")) / name.replace(" ", "_").replace("(", "").replace(")", "")
        results[name] = run(case, devices, tmp)
        rank = results[name]["rank"]
    return {"cases": results}, None, type("RankOnly", (), {"global_rank": rank})()


def main() -> None:
    script_main(run_cases)


if __name__ == "__main__":
    main()
