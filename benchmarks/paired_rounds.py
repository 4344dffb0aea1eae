#!/usr/bin/env python
"""2bw against torch's synchronous schedules on CPU, paired so that the host's drift in speed cancels.

Rounds (the default): the bare engine's 2bw, then each of torch's synchronous schedules, at one m, round after
round, with ``pipeline_throughput.py``'s own workers, waits and disturbance check (each system in a process pair
of its own, about 30 s per round). Prints one JSON line per round (seconds per step on rank 0 and others' CPU
share per system); BENCHMARKS.md reads 2bw's ratio to the fastest synchronous schedule of each round from them.

``--blocks N``: every system in one process pair instead (torch's schedules each on a process group of their
own), taking blocks of ``--block-steps`` steps in turn, N blocks each, the order rotating from block to block.
The first step of a block is not counted (the other rank may still be finishing the previous system's step).
Prints one JSON line per block round (each system's median step time on rank 0 in its block), then per schedule
the median over rounds of its step time over 2bw's in the same round: systems a second apart see the same machine.
``--lightning`` runs 2bw through ``Trainer(strategy=AsyncPipelineStrategy(...))`` instead, as ``make bench`` does,
and torch's schedules from a callback between its blocks, in the same two processes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/paired_rounds.py --rounds 3 --microbatches 4
    PYTHONPATH=$PWD .venv/bin/python benchmarks/paired_rounds.py --blocks 12 --microbatches 4 [--lightning]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import Quiet, one_thread, others_cpu  # noqa: E402
# benchmarks.throughput sets one thread per process before torch is imported.
from benchmarks.throughput.pairing import run_paired_blocks  # noqa: E402
from benchmarks.throughput.systems import _engine_worker, _torchpp_worker  # noqa: E402
from benchmarks.throughput.workload import CPU_STEPS, TORCH_SCHEDULES, WIDTH  # noqa: E402


def run_blocks(base: dict, blocks: int, block_steps: int, lightning: bool) -> None:
    res = run_paired_blocks(base, blocks, block_steps, lightning)
    ours = res["ours"]
    for i, medians in enumerate(res["rounds"]):
        sync = {n: t for n, t in medians.items() if n != ours}
        best = min(sync, key=sync.get)
        print(json.dumps({"block_round": i, "ms": {n: round(t * 1e3, 2) for n, t in medians.items()},
                          "fastest": best, "2bw_over_fastest": round(sync[best] / medians[ours], 3)}), flush=True)
    for n in TORCH_SCHEDULES:
        print(f"{ours} / {n}: {res['paired'][n]:.3f} (median of {len(res['rounds'])} paired rounds; its median step "
              f"{res['step'][n] * 1e3:.1f} ms, {ours}'s {res['ours_step'] * 1e3:.1f})", flush=True)
    print(f"{ours} / torch's fastest synchronous schedule ({res['fastest']}, by median step): "
          f"{res['paired'][res['fastest']]:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--blocks", type=int, help="every system in one process pair, this many blocks each (see above)")
    ap.add_argument("--block-steps", type=int, default=6, help="steps per block, the first not counted (default 6)")
    ap.add_argument("--lightning", action="store_true", help="with --blocks: 2bw under Lightning instead of the bare engine")
    ap.add_argument("--wait-idle", type=float, default=30.0)
    ap.add_argument("--retries", type=int, default=2)
    args = ap.parse_args()
    if args.blocks is not None and (args.blocks < 1 or args.block_steps < 3):
        ap.error(f"--blocks must be >= 1 and --block-steps >= 3, got {args.blocks} and {args.block_steps}")
    one_thread()
    base = dict(rows=128, steps=CPU_STEPS[0], warmup=CPU_STEPS[1], optimizer="sgd", width=WIDTH,
                accelerator="cpu", m=args.microbatches)
    quiet = Quiet(args.wait_idle, args.retries)
    if args.blocks is not None:
        quiet.wait()
        run_blocks(base, args.blocks, args.block_steps, args.lightning)
        return
    for rnd in range(args.rounds):
        row = {"round": rnd, "load": os.getloadavg()[0]}
        (eng,) = quiet.measure_group(_engine_worker, "engine", [dict(base, schedule="2bw")])
        row["2bw"] = (eng[0]["sec_per_step"], others_cpu(eng))
        for pair in quiet.measure_group(_torchpp_worker, "torchpp",
                                        [dict(base, schedule=s) for s in TORCH_SCHEDULES]):
            row[pair[0]["schedule"]] = (pair[0]["sec_per_step"], others_cpu(pair))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
