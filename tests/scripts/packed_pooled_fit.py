"""Trains on packed rows (documents of 1..7 tokens) one model after another in one process pair, with the receive
buffers pooled as on CUDA (``StageLink.REUSE_BUFFERS_ON_CPU``); every rank saves what it saw to ``OUT/rank{r}.pt``.

Run by tests/test_packed_documents.py; the test imports ``run`` for the same runs on one device.

Config keys: runs (a list of {"model": "llama" | "hf", "schedule": ..., "per_document": attention document by
document whatever it costs (else these tiny documents go through the mask)}), pooled (the receive buffers pooled),
steps, dp (``data_parallel_size``: replica ``r`` trains on rows ``r::dp`` in batches of 8, the one-device run on the
replicas' batches together, 8 x dp rows in 4 x dp microbatches), skip_document_ends (default on).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import script_main  # noqa: E402
from llama_fit import packed_rows, token_rows  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import HuggingFaceCausalLM, Llama, packing  # noqa: E402
from lightning_async_pp.pipeline.comm import StageLink  # noqa: E402

HF_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def build_model(name: str, skip_document_ends: bool = True) -> L.LightningModule:
    if name == "llama":
        return Llama("tiny", vocab_size=256, max_seq_len=64, lr=3e-3, skip_document_ends=skip_document_ends)
    return HuggingFaceCausalLM(HF_LLAMA, lr=3e-3, init_seed=0, skip_document_ends=skip_document_ends)


def run(cfg: dict, devices: int) -> tuple[dict, Any, L.Trainer]:
    saved = StageLink.REUSE_BUFFERS_ON_CPU, packing.CALL_COST_PAIRS  # the test's own process runs this too
    try:
        return _run(cfg, devices)
    finally:
        StageLink.REUSE_BUFFERS_ON_CPU, packing.CALL_COST_PAIRS = saved


def _run(cfg: dict, devices: int) -> tuple[dict, Any, L.Trainer]:
    StageLink.REUSE_BUFFERS_ON_CPU = bool(cfg.get("pooled")) and devices > 1
    result: dict[str, Any] = {"runs": []}
    steps, dp = cfg.get("steps", 4), cfg.get("dp", 1)
    rows = packed_rows(token_rows(max(32, 8 * dp * steps), 16))
    if devices > 1 and dp > 1:
        # Shard by data-parallel rank (rows r::dp, what the strategy's distributed_sampler_kwargs say), before the
        # Trainer exists: the launcher set LOCAL_RANK. The replicas' k-th batches together are the one-device run's.
        rows = rows[int(os.environ.get("LOCAL_RANK", 0)) // (devices // dp)::dp]
    per_replica = dp if devices == 1 else 1  # one device: the replicas' batches in one
    loader = DataLoader(rows, batch_size=8 * per_replica, shuffle=False, drop_last=True)
    for spec in cfg["runs"]:
        packing.CALL_COST_PAIRS = 0 if spec.get("per_document") else 10**12
        L.seed_everything(0, verbose=False)
        model = build_model(spec["model"], cfg.get("skip_document_ends", True))
        kwargs: dict[str, Any] = {"num_stages": 2} if devices == 1 else {"data_parallel_size": dp}
        strategy = AsyncPipelineStrategy(schedule=spec["schedule"], num_microbatches=4 * per_replica,
                                         pipeline_timeout=60.0, **kwargs)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            use_distributed_sampler=False)
        trainer.fit(model, loader)
        record: dict[str, Any] = {"reused": sum(getattr(link, "buffers_reused", 0) for link in _links(trainer))}
        if trainer.is_global_zero:
            record["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        result["runs"].append(record)
    return result, None, trainer


def _links(trainer: L.Trainer) -> list:
    runtime = getattr(trainer.strategy.engine, "runtime", None)
    link = getattr(runtime, "link", None)
    return [link] if link is not None else []


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
