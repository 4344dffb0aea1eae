#!/usr/bin/env python
"""Paired rounds on CPU: the bare engine's 2bw, then each of torch's synchronous schedules, at one m, round after
round, with ``pipeline_throughput.py``'s own workers, waits and disturbance check. Prints one JSON line per
round (seconds per step on rank 0 and others' CPU share per system); BENCHMARKS.md reads 2bw's ratio to the
fastest synchronous schedule of each round from them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/paired_rounds.py --rounds 3 --microbatches 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_throughput as bench  # noqa: E402  (sets one thread per process before torch is imported)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--wait-idle", type=float, default=30.0)
    ap.add_argument("--retries", type=int, default=2)
    args = ap.parse_args()
    bench.one_thread()
    base = dict(rows=128, steps=bench.CPU_STEPS[0], warmup=bench.CPU_STEPS[1], optimizer="sgd", width=bench.WIDTH,
                accelerator="cpu", m=args.microbatches)
    quiet = bench.Quiet(args.wait_idle, args.retries)
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
