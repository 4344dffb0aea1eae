"""Trains a tiny PipelineModule with AsyncPipelineStrategy in several processes; rank 0 saves the final weights.

Run by the multi-process tests in a subprocess with a timeout (Lightning's launcher re-executes this script for
the other ranks, which would re-run a whole pytest session if the test itself were the script).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import ResumableLoader, TinyLM, make_dataset  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="JSON: schedule, stages, dp, microbatches, steps, ...")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = json.loads(args.config)
    torch.set_num_threads(1)
    if cfg.get("check_exit"):
        # Registered before fit, so it runs after the handlers fit registers (atexit runs them last-in first-out).
        rank = os.environ.get("LOCAL_RANK", "0")
        atexit.register(lambda: Path(f"exit_{rank}.txt").write_text(  # in the test's tmp_path (the cwd)
            "initialized" if torch.distributed.is_initialized() else "destroyed"))
    if cfg.get("reuse_buffers"):
        from lightning_async_pp.pipeline.comm import StageLink

        StageLink.REUSE_BUFFERS_ON_CPU = True  # what CUDA does: the pools, checked here with gloo
    host_reads = _count_host_reads() if cfg.get("count_host_reads") else None
    model = TinyLM(**cfg.get("model", {}), optimizer=cfg.get("optimizer", "sgd"), fail_at=cfg.get("fail_at"))
    if cfg.get("perturb_replicas") and int(os.environ.get("LOCAL_RANK", 0)) >= cfg["stages"]:
        with torch.no_grad():  # a replica that initialized differently: setup must give it the first replica's
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    if cfg.get("example_batch"):  # one microbatch, for partition="balanced" to cost the layers on
        model.pipeline_example_batch = (torch.zeros(cfg["batch"] // cfg["microbatches"], 4),
                                        torch.zeros(cfg["batch"] // cfg["microbatches"], 1))
    if cfg.get("slow_on_rank0") is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        # This layer sleeps in every forward in rank 0's process only: timings differ by process on purpose.
        model.layers[cfg["slow_on_rank0"]].register_forward_pre_hook(lambda module, args: time.sleep(0.03))
    monitor_logger, monitors = _monitoring(cfg)
    strategy = AsyncPipelineStrategy(
        schedule=cfg["schedule"], num_microbatches=cfg["microbatches"],
        data_parallel_size=cfg.get("dp", 1), partition=cfg.get("partition", "parameters"),
        pipeline_timeout=cfg.get("timeout", 60.0), sync_from_step=cfg.get("sync_from_step"),
        shard_optimizer=cfg.get("shard_optimizer", False), layer_cost=cfg.get("layer_cost", "flops"),
    )
    dataset = make_dataset(cfg.get("samples", 64))
    dp = cfg.get("dp", 1)
    if dp > 1:
        # Shard by data-parallel rank only (rows r::dp), as the strategy's distributed_sampler_kwargs say; the
        # launcher sets LOCAL_RANK in the processes it starts, so the shard is known before the Trainer exists.
        dp_rank = int(os.environ.get("LOCAL_RANK", 0)) // cfg["stages"]
        dataset = Subset(dataset, list(range(dp_rank, len(dataset), dp)))
    if cfg.get("resumable"):
        loader = ResumableLoader(dataset, batch_size=cfg["batch"])
    else:
        loader = DataLoader(dataset, batch_size=cfg["batch"], shuffle=False, drop_last=True)
    callbacks = []
    if cfg.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], save_last=True, every_n_train_steps=cfg["save_every"],
                                         save_top_k=-1 if cfg.get("keep_checkpoints") else 1))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=cfg["stages"] * cfg.get("dp", 1), max_steps=cfg["steps"],
        logger=monitor_logger, enable_checkpointing=bool(callbacks), callbacks=callbacks + monitors,
        log_every_n_steps=cfg.get("log_every_n_steps", 50), enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, gradient_clip_val=cfg.get("clip"),
        num_sanity_val_steps=0, limit_val_batches=cfg.get("val_batches", 0),
        val_check_interval=cfg.get("val_every", cfg["steps"]) if cfg.get("val_batches") else None,
    )
    trainer.fit(model, loader, loader if cfg.get("val_batches") else None, ckpt_path=cfg.get("resume_from"))
    if cfg.get("reuse_buffers"):
        link = trainer.strategy.engine.runtime.link
        with open(f"buffers_reused_{trainer.global_rank}.txt", "w") as f:  # in the test's tmp_path (the cwd)
            f.write(str(link.buffers_reused))
    if cfg.get("report_split"):
        with open(f"split_{trainer.global_rank}.json", "w") as f:  # in the test's tmp_path (the cwd)
            split = trainer.strategy.engine.stats.split
            json.dump({"method": split.method, "counts": split.counts, "cost": split.cost}, f)
    if host_reads is not None:
        with open(f"host_reads_{trainer.global_rank}.json", "w") as f:  # in the test's tmp_path (the cwd)
            json.dump(host_reads, f)
    if cfg.get("report_optimizer_state"):
        from lightning_async_pp.parallel.zero import state_nbytes

        with open(f"optimizer_state_{trainer.global_rank}.txt", "w") as f:  # in the test's tmp_path (the cwd)
            f.write(str(sum(state_nbytes(o) for o in trainer.strategy.optimizers)))
    if trainer.is_global_zero:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.out)
        print("SAMPLER_KWARGS", json.dumps(trainer.strategy.distributed_sampler_kwargs))
        if "val_loss" in trainer.callback_metrics:
            print("VAL_LOSS", trainer.callback_metrics["val_loss"].item())
        if monitor_logger:
            print("LOG_DIR", monitor_logger.log_dir)
        for callback in monitors:
            if getattr(callback, "trace_file", None):
                print("TRACE_FILE", callback.trace_file)


def _count_host_reads() -> list:
    """Per training step, the reads of a tensor's value on the host inside the runtime's step (on CUDA each one
    waits for the device): ``[[step, count, [callers]], ...]``. Fingerprint checks are deferred as on CUDA."""
    import traceback

    from lightning_async_pp.pipeline.runtime import PipelineRuntime

    PipelineRuntime.DEFER_CHECKS_ON_CPU = True
    steps: list = []
    inside = [False]

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside[0]:
                steps[-1][1] += 1
                frame = traceback.extract_stack(limit=3)[0]
                steps[-1][2].append(f"{name} at {os.path.basename(frame.filename)}:{frame.lineno}")
            return original(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        counting(name)
    train_batch = PipelineRuntime.train_batch

    def counted(self, *args, **kwargs):
        steps.append([self.batch_index, 0, []])
        inside[0] = True
        try:
            return train_batch(self, *args, **kwargs)
        finally:
            inside[0] = False
    PipelineRuntime.train_batch = counted
    return steps


def _monitoring(cfg: dict) -> tuple:
    """cfg["monitors"] = {"staleness": {kwargs}, "pipeline": {kwargs}}: attach those monitors and a TensorBoard
    logger under ./lightning_logs (rank 0 prints LOG_DIR and TRACE_FILE). Without it: no logger, no callbacks."""
    monitors = cfg.get("monitors")
    if not monitors:
        return False, []
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_async_pp.callbacks import PipelineMonitor, StalenessMonitor

    callbacks = []
    if "staleness" in monitors:
        callbacks.append(StalenessMonitor(**monitors["staleness"]))
    if "pipeline" in monitors:
        callbacks.append(PipelineMonitor(**monitors["pipeline"]))
    return TensorBoardLogger(save_dir=os.getcwd(), name="lightning_logs"), callbacks


if __name__ == "__main__":
    main()
