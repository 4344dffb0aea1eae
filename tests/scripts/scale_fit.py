"""Large-model paths on tiny models (tests/test_scale.py): layers built in ``configure_model``, sharded and
single-file checkpoints saved in one layout and resumed in another, consolidation.

Run as a script in a subprocess (Lightning's launcher re-executes it for the other ranks); the tests also import
``run`` to do the same on one device in their own process. Every rank saves ``OUT/rank{r}.pt``: what it held after
setup (its materialized parameters, the names left on the meta device) and, on rank 0, the final state_dict.

Config keys: model ("mlp" | "llama"), steps, batch, microbatches, schedule, strategy_kwargs, devices, seed,
checkpoint_dir + save_every (a checkpoint every that many steps, all kept), resume_from, dp (data-parallel
replicas, for the data split), lr_gamma (the mlp's learning rate times this after every update: ExponentialLR).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import Subset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import ResumableLoader, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402

SAMPLES = 64


class ConfiguredMLP(PipelineModule):
    """A regression MLP whose layers are created in ``configure_model`` (initialized by ``init_layer``'s default)."""

    def __init__(self, width: int = 8, depth: int = 4, lr_gamma: Optional[float] = None) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.lr_gamma = lr_gamma  # an ExponentialLR stepped every update: each learning rate derived from the last
        self.layers = None

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        w = self.width
        self.layers = nn.ModuleList([nn.Linear(4, w), *(nn.Sequential(nn.Tanh(), nn.Linear(w, w)) for _ in range(self.depth - 2)),
                                     nn.Sequential(nn.Tanh(), nn.Linear(w, 1))])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return ((output - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        if self.lr_gamma is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def build_model(cfg: dict) -> PipelineModule:
    if cfg.get("model", "mlp") == "llama":
        return Llama("tiny", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                     intermediate_size=24, lr=0.01, init_seed=cfg.get("seed", 0))
    return ConfiguredMLP(lr_gamma=cfg.get("lr_gamma"))


def build_loader(cfg: dict) -> ResumableLoader:
    """Batches in order, resumable mid-epoch (a checkpoint keeps the position). With ``dp`` replicas of batch
    ``b``, global batch k is rows [k*dp*b, (k+1)*dp*b) and replica r takes the r-th block of b rows: on one device
    with batch dp*b and dp times the microbatches, the microbatches are the same."""
    if cfg.get("model", "mlp") == "llama":
        dataset = torch.randint(0, 32, (SAMPLES, 9), generator=torch.Generator().manual_seed(1))  # rows of tokens
    else:
        dataset = make_dataset(SAMPLES)
    b, dp = cfg.get("batch", 8), cfg.get("dp", 1)
    if dp > 1:
        world = cfg.get("devices", 2)
        r = int(os.environ.get("LOCAL_RANK", 0)) // (world // dp)  # the data-parallel rank (PipelineTopology)
        rows = [k * dp * b + r * b + i for k in range(SAMPLES // (dp * b)) for i in range(b)]
        dataset = Subset(dataset, rows)
    return ResumableLoader(dataset, b)


class RecordSetup(L.Callback):
    """What this process holds once the strategy is set up."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}

    def on_fit_start(self, trainer: L.Trainer, module: PipelineModule) -> None:
        params = dict(module.named_parameters(remove_duplicate=False))
        self.held = {
            "materialized": {n: p.detach().clone() for n, p in params.items() if not p.is_meta},
            "meta": sorted(n for n, p in params.items() if p.is_meta),
        }


def build_trainer(cfg: dict, devices: int, strategy: bool = True) -> tuple[L.Trainer, RecordSetup]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    record = RecordSetup()
    callbacks: list = [record]
    if cfg.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], every_n_train_steps=cfg.get("save_every", 3),
                                         save_top_k=-1))
    kwargs = dict(accelerator=cfg.get("accelerator", "cpu"), devices=devices, max_steps=cfg["steps"], logger=False,
                  enable_checkpointing=bool(cfg.get("checkpoint_dir")), callbacks=callbacks, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    if strategy:
        kwargs["strategy"] = AsyncPipelineStrategy(schedule=cfg.get("schedule", "2bw"),
                                                   num_microbatches=cfg.get("microbatches", 4), pipeline_timeout=60.0,
                                                   **cfg.get("strategy_kwargs", {}))
    return L.Trainer(**kwargs), record


def run(cfg: dict, devices: int = 1, strategy: bool = True) -> tuple[dict, PipelineModule, L.Trainer]:
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    model = build_model(cfg)
    trainer, record = build_trainer(cfg, devices, strategy)
    trainer.fit(model, build_loader(cfg), ckpt_path=cfg.get("resume_from"))
    result: dict[str, Any] = {"held": record.held, "global_step": trainer.global_step}
    if strategy:
        result["batch_index"] = trainer.strategy.engine.stats.batch_index  # the engine's update count
    if trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result, model, trainer


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
