#!/usr/bin/env python
"""partition="balanced" against "parameters", "uniform" and every explicit split, on 2 processes through Lightning.

The model is models.Llama at SmolLM-135M's width and vocabulary (hidden 576, 9/3 heads, MLP 1536, vocabulary
49152, tied embedding and head) with ``--layers`` decoder layers (12); batch 4 x 256 tokens, m=2, AdamW, fp32, gloo
on CPU. One process pair runs every configuration as a Trainer of its own (one ``fit`` each), the configurations
taken in turn round after round, so that the machine's drift spreads over all of them; each fit's first step is not
counted. Prints, per schedule (2bw, 1f1b), each split's median seconds per step over the rounds, its ratio to the
fastest explicit split, the balanced split's ratio to "parameters", and the planner's prediction of the same
splits (``lightning-async-pp-plan``'s cost model: FLOPs only).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/balanced_split.py            # every split point, 3 rounds
    PYTHONPATH=$PWD .venv/bin/python benchmarks/balanced_split.py --quick    # 5 split points, 1 round, 3 steps
    PYTHONPATH=$PWD .venv/bin/python benchmarks/balanced_split.py --rounds 2 --named balanced parameters \
        --points 8 9 10 11 12 13                                               # BENCHMARKS.md's run (14 min)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/balanced_split.py --layers 30 --rounds 2 \
        --named balanced parameters --points 18 19 20 21 22 24                  # and at 30 layers (26 min)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/balanced_split.py --rounds 2 --named balanced measured \
        --points 11 12 13                                                       # layer_cost="measured" (BENCHMARKS.md)

Lightning's launcher re-executes this script for rank 1; both ranks run the same list of fits.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402

from benchmarks.harness import resident_mib, step_recorder  # noqa: E402


def fit_once(args: argparse.Namespace, schedule: str, partition: Any) -> tuple[float, tuple[int, ...]]:
    torch.manual_seed(0)
    model = Llama("smollm-135m", vocab_size=49152, num_layers=args.layers, max_seq_len=args.seq)
    g = torch.Generator().manual_seed(1)
    rows = list(torch.randint(0, 49152, (args.batch * (args.steps + 1), args.seq + 1), generator=g))
    loader = DataLoader(rows, batch_size=args.batch, drop_last=True)
    timer = step_recorder()  # median_step(): the first step (and setup) not counted
    cost = "flops"
    if partition == "measured":  # the balanced split by each layer timed on rank 0 (layer_cost="measured")
        partition, cost = "balanced", "measured"
    strategy = AsyncPipelineStrategy(schedule, num_microbatches=args.microbatches, partition=partition,
                                     pipeline_timeout=600.0, gather_final_weights=False, layer_cost=cost)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    trainer.fit(model, loader)
    return timer.median_step(), strategy.engine.stats.split.counts


def predicted(args: argparse.Namespace, schedule: str, counts: tuple[int, ...]) -> float:
    """The planner's step for these layers per stage (its layers are the blocks: the embedding goes with the first,
    the head with the last)."""
    from lightning_async_pp.plan import CostModel, parser
    from lightning_async_pp.pipeline.simulate import simulate

    plan_args = parser().parse_args(["--model", "smollm-135m", "--layers", str(args.layers), "--seq-len", str(args.seq),
                                     "--microbatch-size", str(args.batch // args.microbatches), "--schedules", schedule])
    model = CostModel(plan_args)
    blocks = [counts[0] - 1, counts[1] - 1]
    if min(blocks) < 1:
        return float("nan")
    c = model.costs(2, args.microbatches, blocks)
    assert c is not None
    return simulate(schedule, 2, args.microbatches, c.forward_s, c.backward_s, comm_s=c.comm_s, steps=6).step_time_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 split points around the balanced one, 1 round, 3 steps")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", default=["2bw", "1f1b"])
    ap.add_argument("--points", nargs="+", type=int, default=None,
                    help="first-stage layer counts of the explicit splits to try (default: every one)")
    ap.add_argument("--named", nargs="+", default=None,
                    help="the named partitions to try (default: balanced, parameters, uniform; also: measured, the "
                         "balanced split by measured layer times)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 3
    n = args.layers + 2  # the embedding, the blocks, the head
    named = ["balanced", "parameters", "uniform"]
    points = list(range(1, n))
    if args.quick:
        points = [p for p in range(n - 5, n) if p >= 1]
    points, named = args.points or points, args.named or named
    configs = [(s, m) for s in args.schedules for m in named] + [(s, [k, n - k]) for s in args.schedules for k in points]
    times: dict[tuple[str, str], list[float]] = {}
    splits: dict[tuple[str, str], tuple[int, ...]] = {}
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    # The pair's first fit pays one-off costs (a --quick run once measured its first fit 2.8x slower than the same
    # split later): run one first, not counted.
    fit_once(args, args.schedules[0], "balanced")
    for r in range(args.rounds):
        for schedule, partition in configs:
            key = (schedule, str(partition))
            seconds, counts = fit_once(args, schedule, partition)
            # A finished Trainer and its model reference each other (plain Lightning alike): without a collection
            # here each fit's weights and optimizer state stay resident until Python's oldest generation is
            # collected, about 1 GiB per fit at this shape (the first quiet run was killed for memory at fit 17).
            gc.collect()
            times.setdefault(key, []).append(seconds)
            splits[key] = counts
            if rank0:
                print(f"round {r} {schedule} {partition}: {list(counts)} {seconds:.3f} s/step; this process "
                      f"{resident_mib():.0f} MiB resident after the fit", file=sys.stderr, flush=True)
    if not rank0:
        return
    print(f"\nSmolLM-135M width, {args.layers} layers, batch {args.batch} x {args.seq} tokens, m={args.microbatches}, "
          f"2 processes (gloo, CPU), {args.rounds} round(s), {args.steps} steps per fit (first not counted)")
    for schedule in args.schedules:
        med = {k[1]: statistics.median(v) for k, v in times.items() if k[0] == schedule}
        explicit = {k: v for k, v in med.items() if k.startswith("[")}
        best = min(explicit, key=explicit.get)
        print(f"\n{schedule}: | split | layers per stage | s/step | x fastest explicit | planner's step (FLOPs) |")
        for name, seconds in med.items():
            counts = splits[(schedule, name)]
            print(f"  | {name} | {list(counts)} | {seconds:.3f} | {seconds / explicit[best]:.3f} | "
                  f"{predicted(args, schedule, counts) * 1e3:.1f} ms |")
        for name in (n for n in ("balanced", "measured") if n in med):
            print(f"  {name} / fastest explicit ({best}): {med[name] / explicit[best]:.3f}"
                  + (f"; parameters / {name}: {med['parameters'] / med[name]:.3f}" if "parameters" in med else ""))


if __name__ == "__main__":
    main()
