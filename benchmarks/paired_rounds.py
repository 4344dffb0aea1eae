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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_throughput as bench  # noqa: E402  (sets one thread per process before torch is imported)


def _blocks_worker(rank: int, port: int, cfgs: list[dict], out_dir: str, profile: bool) -> None:
    """Every system in this process pair, in blocks of steps taken in turn (see the module's docstring)."""
    import torch.distributed as dist

    cfg = cfgs[0]
    bench.setup_threads(cfg)
    bench.init_group(rank, port, cfg)
    device = bench.device_of(cfg, rank)
    loops = {"2bw": bench.EngineLoop({**cfg, "schedule": "2bw"}, rank, bench.STAGES, device)}
    for s in bench.TORCH_SCHEDULES:  # each on a group of its own: its traffic never meets another system's
        loops[s] = bench.TorchLoop({**cfg, "schedule": s}, rank, device, group=dist.new_group(backend="gloo"))
    names, k = list(loops), cfg["block_steps"]
    done = {n: 0 for n in names}
    rounds = []
    for b in range(cfg["blocks"] + 1):  # block round 0 warms every system up; not reported
        medians = {}
        for name in names[b % len(names):] + names[: b % len(names)]:
            ends = [time.perf_counter()]
            for _ in range(k):
                loops[name].step(done[name])
                done[name] += 1
                ends.append(time.perf_counter())
            steps = [e - s for s, e in zip(ends[1:], ends[2:])]  # the block's first step is not counted
            medians[name] = statistics.median(steps)
        if b:
            rounds.append(medians)
    dist.barrier()
    Path(out_dir, f"blocks{rank}.json").write_text(json.dumps([rounds]))
    dist.destroy_process_group()


def run_blocks(base: dict, blocks: int, block_steps: int, lightning: bool) -> None:
    # Batches for every step any system takes, plus 2BW's lookahead: warmup + steps + 1 (total_steps).
    cfg = dict(base, blocks=blocks, block_steps=block_steps, warmup=0, steps=(blocks + 1) * block_steps + 1)
    if lightning:  # 2bw under Lightning, torch's schedules run from a callback between its blocks
        rank0 = bench.run_lightning(dict(cfg, schedule="2bw"), bench.CHILD_TIMEOUT * 2)[0]["block_rounds"]
        ours = "lightning/2bw"
    else:
        (rank0, _), = bench.run_pairs(_blocks_worker, [cfg], "blocks", False, bench.CHILD_TIMEOUT * 2)
        ours = "2bw"
    ratios = []
    for i, medians in enumerate(rank0):
        sync = {n: t for n, t in medians.items() if n != ours}
        best = min(sync, key=sync.get)
        ratios.append(sync[best] / medians[ours])
        print(json.dumps({"block_round": i, "ms": {n: round(t * 1e3, 2) for n, t in medians.items()},
                          "fastest": best, "2bw_over_fastest": round(ratios[-1], 3)}), flush=True)
    # Per schedule: the median over rounds of its step over 2bw's in the same round. The fastest schedule is the
    # one with the lowest median step; the round-by-round fastest (the minimum of five noisy times) favours torch.
    paired = {n: statistics.median(r[n] / r[ours] for r in rank0) for n in bench.TORCH_SCHEDULES}
    step = {n: statistics.median(r[n] for r in rank0) for n in bench.TORCH_SCHEDULES}
    for n in bench.TORCH_SCHEDULES:
        print(f"{ours} / {n}: {paired[n]:.3f} (median of {len(rank0)} paired rounds; its median step "
              f"{step[n] * 1e3:.1f} ms, {ours}'s {statistics.median(r[ours] for r in rank0) * 1e3:.1f})", flush=True)
    fastest = min(step, key=step.get)
    print(f"{ours} / torch's fastest synchronous schedule ({fastest}, by median step): {paired[fastest]:.3f}; "
          f"against each round's fastest: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f})", flush=True)


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
    bench.one_thread()
    base = dict(rows=128, steps=bench.CPU_STEPS[0], warmup=bench.CPU_STEPS[1], optimizer="sgd", width=bench.WIDTH,
                accelerator="cpu", m=args.microbatches)
    quiet = bench.Quiet(args.wait_idle, args.retries)
    if args.blocks is not None:
        quiet.wait()
        run_blocks(base, args.blocks, args.block_steps, args.lightning)
        return
    for rnd in range(args.rounds):
        row = {"round": rnd, "load": os.getloadavg()[0]}
        (eng,) = quiet.measure_group(bench._engine_worker, "engine", [dict(base, schedule="2bw")])
        row["2bw"] = (eng[0]["sec_per_step"], bench.others_cpu(eng))
        for pair in quiet.measure_group(bench._torchpp_worker, "torchpp",
                                        [dict(base, schedule=s) for s in bench.TORCH_SCHEDULES]):
            row[pair[0]["schedule"]] = (pair[0]["sec_per_step"], bench.others_cpu(pair))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
