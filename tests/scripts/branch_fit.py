"""A model with a data-dependent branch (tests/test_data_parallel.py): an "expert" that only rows whose first
feature is positive go through, and one that no row ever takes. The data gives positive first features to one
data-parallel replica's rows only, so the other replica never uses the expert.

Run as a script in a subprocess (Lightning's launcher re-executes it for the other ranks), where it trains every
case of ``cfg["cases"]`` in turn in the same processes (one process start for all of them); the test imports
``run`` to train the same cases on one device on both replicas' rows concatenated. Every rank saves
``OUT/rank{r}.pt``: per case, its final state_dict.

Config keys: cases (a list of {"user": the replica whose rows use the expert, "shard_optimizer": bool,
"bucket_bytes": the reducer's bucket size or null for the default}), steps, batch (per replica), microbatches (per
replica), dp (replicas), devices.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import Subset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import ResumableLoader, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule  # noqa: E402
from lightning_async_pp.parallel.data_parallel import GradientReducer  # noqa: E402

SAMPLES = 48


class Routed(nn.Module):
    """``base(x)``, plus ``expert(x)`` on the rows whose first feature is positive, plus ``idle(x)`` on rows whose
    first feature exceeds 1e6 (none): a parameter is used only when its rows exist, as an MoE expert."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base, self.expert, self.idle = nn.Linear(4, width), nn.Linear(4, width), nn.Linear(4, width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.base(x)
        for branch, rows in ((self.expert, x[:, 0] > 0), (self.idle, x[:, 0] > 1e6)):
            index = rows.nonzero().squeeze(1)
            if index.numel():
                h = h.index_add(0, index, branch(x[index]))
        return h


class BranchMLP(PipelineModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Routed(width), nn.Sequential(nn.Tanh(), nn.Linear(width, width)),
                                     nn.Sequential(nn.Tanh(), nn.Linear(width, 1))])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return ((output - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        # Weight decay: a parameter with a zero gradient would still move, one without a gradient does not.
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)


def build_loader(cfg: dict, user: int, devices: int) -> ResumableLoader:
    """Global batch k is rows [k*dp*b, (k+1)*dp*b), replica r takes its r-th block of b rows (on one device with
    batch dp*b and dp times the microbatches, the microbatches are the same). Only replica ``user``'s rows have
    positive first features."""
    x, y = make_dataset(SAMPLES).tensors
    b, dp = cfg.get("batch", 4), cfg.get("dp", 2)
    owner = (torch.arange(SAMPLES) // b) % dp
    x = x.clone()
    x[owner != user, 0] = -x[owner != user, 0].abs()
    dataset: Any = torch.utils.data.TensorDataset(x, y)
    if devices > 1:
        r = int(os.environ.get("LOCAL_RANK", 0)) // (devices // dp)  # the data-parallel rank (PipelineTopology)
        dataset = Subset(dataset, [i for i in range(SAMPLES) if owner[i] == r])
        return ResumableLoader(dataset, b)
    return ResumableLoader(dataset, dp * b)


def run(cfg: dict, devices: int = 1) -> tuple[dict, PipelineModule, L.Trainer]:
    dp, m = cfg.get("dp", 2), cfg.get("microbatches", 2)
    result: dict[str, Any] = {"cases": []}
    default_bytes = GradientReducer.BUCKET_BYTES
    for case in cfg["cases"]:
        L.seed_everything(0, verbose=False)
        model = BranchMLP()
        GradientReducer.BUCKET_BYTES = case.get("bucket_bytes") or default_bytes
        multi = dict(data_parallel_size=dp, shard_optimizer=case.get("shard_optimizer", False)) if devices > 1 else {}
        strategy = AsyncPipelineStrategy("2bw", num_microbatches=m if devices > 1 else dp * m, pipeline_timeout=60.0,
                                         **multi)
        trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=cfg.get("steps", 4), logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, strategy=strategy)
        trainer.fit(model, build_loader(cfg, case["user"], devices))
        GradientReducer.BUCKET_BYTES = default_bytes
        result["cases"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return result, model, trainer


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
