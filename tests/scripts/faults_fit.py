"""Runs that are killed or requeued and resumed (tests/test_faults.py): scale_fit.py's model and resumable loader,
``ModelCheckpoint(every_n_train_steps=..., save_last=True)`` and a resume from ``ckpt_path``.

Started by ``torchrun`` (the elastic environment) or as SLURM tasks (SLURM variables set by the test), or imported
by the tests to run on one device in their own process. Rank 0 saves ``OUT/rank0.pt``: the final weights, the
checkpoint Lightning resolved (``trainer.ckpt_path``) and the restart count it ran under.

Config keys: steps, devices, checkpoint_dir, save_every, resume ("last", a path or None), root_dir (the Trainer's
``default_root_dir``, where SLURM's hpc checkpoints go), kill ({"rank": r, "step": k}: SIGKILL there, on the first
attempt only), usr1 ({rank: step}: the process sends itself SIGUSR1 at the start of that step), slurm (use
``SLURMEnvironment(auto_requeue=True)``), strategy_kwargs.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import script_main  # noqa: E402
from scale_fit import ConfiguredMLP, build_loader  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 on the first attempt; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Faults(L.Callback):
    """Kills this process (SIGKILL, first attempt only) or sends it SIGUSR1 at the start of a chosen step."""

    def __init__(self, cfg: dict) -> None:
        self.kill = cfg.get("kill")
        self.usr1 = {int(r): s for r, s in cfg.get("usr1", {}).items()}

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        rank = trainer.global_rank
        if self.kill and restart_count() == 0 and rank == self.kill["rank"] and trainer.global_step == self.kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.usr1.get(rank) == trainer.global_step:
            os.kill(os.getpid(), signal.SIGUSR1)


def build_trainer(cfg: dict, devices: int) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    callbacks: list = [Faults(cfg)]
    if cfg.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], every_n_train_steps=cfg.get("save_every", 2),
                                         save_last=cfg.get("save_last", True), save_top_k=cfg.get("save_top_k", 1)))
    strategy = AsyncPipelineStrategy(num_microbatches=4, pipeline_timeout=cfg.get("pipeline_timeout", 20.0),
                                     **cfg.get("strategy_kwargs", {}))
    return L.Trainer(accelerator="cpu", devices=devices, max_steps=cfg["steps"], logger=False,
                     enable_checkpointing=bool(cfg.get("checkpoint_dir")), callbacks=callbacks,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, strategy=strategy, default_root_dir=cfg.get("root_dir"),
                     plugins=[SLURMEnvironment(auto_requeue=True)] if cfg.get("slurm") else None)


def run(cfg: dict, devices: int = 1) -> tuple[dict, Any, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = ConfiguredMLP()
    trainer = build_trainer(cfg, devices)
    trainer.fit(model, build_loader(cfg), ckpt_path=cfg.get("resume"))
    result: dict[str, Any] = {"global_step": trainer.global_step, "restart_count": restart_count(),
                              "ckpt_path": trainer.ckpt_path}
    if trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result, model, trainer


def exit_without_finalizing() -> None:
    """Ends the process as it would end, less the interpreter's finalization: the exit handlers run (the process
    groups destroyed, the traffic recorder's records closed), the output is flushed, then ``os._exit(0)``. Freeing
    every imported module's objects took about 3 s of CPU per process, once per task of each launch here."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    script_main(run)  # an exception exits as before (traceback, exit code 1), finalization included
    exit_without_finalizing()
