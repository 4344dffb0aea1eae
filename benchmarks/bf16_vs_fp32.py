#!/usr/bin/env python
"""bf16 against fp32 under 2BW on one device: training losses and the memory of the weights and the stash.

The tiny GPT (``models.GPT``: 4 blocks, width 128, 4 heads, 128-byte sequences, its own AdamW at ``--lr``,
default 3e-4 as the model's) trains for ``--steps`` steps with
``Trainer(strategy=AsyncPipelineStrategy("2bw", num_stages=2), precision=...)`` on windows of the Python standard library's sources (the same windows, in the same order, for every precision),
then ``trainer.validate`` gives the loss on held-out windows. Memory is counted from the tensors the engine
holds: the parameters (``W_k``), the stash (``W_{k-1}``) and the optimizer state.

Run: ``.venv/bin/python benchmarks/bf16_vs_fp32.py`` (a few minutes on CPU; prints a Markdown table, writes
``--out`` as JSON). See BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.data.corpus import encode, stdlib_files
from lightning_async_pp.models import GPT

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def corpus_windows(count: int, block_size: int, seed: int, max_bytes: int = 4_000_000) -> torch.Tensor:
    """``count`` random windows of ``block_size + 1`` bytes of the standard library's sources."""
    data = b"".join(path.read_bytes() for path in stdlib_files()[:400])[:max_bytes]
    tokens = encode(data)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - block_size - 1, (count,), generator=g)
    return torch.stack([tokens[s : s + block_size + 1] for s in starts.tolist()]).long()


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(precision: str, args: argparse.Namespace, train: torch.Tensor, val: torch.Tensor) -> dict:
    L.seed_everything(0, verbose=False)
    model = GPT(block_size=args.block_size, n_layer=4, n_head=4, n_embd=128, learning_rate=args.lr)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2)
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder])
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=False))
    seconds = time.perf_counter() - start
    engine = strategy.engine
    optimizer_state = [t for s in trainer.optimizers[0].state.values() for t in s.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0]
    held = {
        "parameter_bytes": nbytes(engine.params),
        "stash_bytes": engine.stats.stash_nbytes,
        "optimizer_state_bytes": nbytes(optimizer_state),
        # the parameters' and the stash's (W_{k-1}) dtypes
        "dtypes": sorted({str(p.dtype) for p in engine.params}
                         | {str(t.dtype) for st in engine.stats.stages for t in st.version(engine.stats.batch_index - 1)}),
    }
    val_loss = trainer.validate(model, DataLoader(val, batch_size=args.batch), verbose=False)[0]["val_loss"]
    return {"precision": precision, "losses": recorder.losses, "val_loss": float(val_loss), "seconds": seconds, **held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", default="bf16_vs_fp32.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train = corpus_windows(args.steps * args.batch, args.block_size, seed=1)
    val = corpus_windows(8 * args.batch, args.block_size, seed=2)
    rows = [run(p, args, train, val) for p in PRECISIONS]
    Path(args.out).write_text(json.dumps(rows, indent=1))
    fp32 = torch.tensor(rows[0]["losses"])
    kib = 1024
    print(f"tiny GPT, 2bw on one device (2 stages, 4 microbatches), batch {args.batch} x {args.block_size}, "
          f"{args.steps} steps, AdamW lr {args.lr:g}")
    print("| precision | loss step 1 | mean loss last 10 steps | mean abs diff vs fp32 | max abs diff vs fp32 "
          "| held-out loss | parameters (KiB) | stash (KiB) | optimizer state (KiB) | weight dtype | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        losses = torch.tensor(row["losses"])
        diff = (losses - fp32).abs()
        print(f"| {row['precision']} | {losses[0]:.4f} | {losses[-10:].mean():.4f} | {diff.mean():.4f} | {diff.max():.4f} "
              f"| {row['val_loss']:.4f} | {row['parameter_bytes'] / kib:.0f} | {row['stash_bytes'] / kib:.0f} "
              f"| {row['optimizer_state_bytes'] / kib:.0f} | {', '.join(row['dtypes'])} | {row['seconds']:.0f} |")


if __name__ == "__main__":
    main()
