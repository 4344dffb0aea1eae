#!/usr/bin/env python
"""Before and after a change, on the same machine: Lightning runs of ``pipeline_throughput.py``'s workload from two
(or more) checkouts of this repository, alternating round after round, so that a drift of the machine falls on
both. Each checkout runs its own package and its own benchmark (``PYTHONPATH`` points at it); one JSON line per
run with the median ms per step on rank 0, then the median over rounds.

    git worktree add --detach /tmp/before <commit>
    .venv/bin/python benchmarks/compare_checkouts.py /tmp/before . --rounds 3 --schedules 2bw 1f1b
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Run inside a checkout (argv: the checkout, the schedules, m): its own pipeline_throughput.run_lightning.
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import pipeline_throughput as bench
bench.one_thread()
m = int(sys.argv[2])
cfg = dict(rows=128, steps=bench.CPU_STEPS[0], warmup=bench.CPU_STEPS[1], optimizer="sgd", width=bench.WIDTH,
           accelerator="cpu", m=m)
print(json.dumps({s: bench.run_lightning({**cfg, "schedule": s}, 300)[0]["sec_per_step"] * 1e3 for s in sys.argv[3:]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkouts", nargs="+", help="repository checkouts to compare (a worktree per commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedules", nargs="+", default=["2bw", "1f1b"])
    args = ap.parse_args()
    trees = [str(Path(c).resolve()) for c in args.checkouts]
    for tree in trees:
        if not Path(tree, "benchmarks", "pipeline_throughput.py").is_file():
            ap.error(f"{tree} is not a checkout of this repository (no benchmarks/pipeline_throughput.py)")
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for r in range(args.rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": tree, "PYTHONWARNINGS": "ignore"}
            out = subprocess.run([sys.executable, "-c", _CHILD, tree, str(args.microbatches), *args.schedules],
                                 cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                sys.exit(f"{tree} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps({"round": r + 1, "checkout": tree, **{s: round(v, 1) for s, v in runs[tree][-1].items()}}),
                  flush=True)
    for tree in trees:
        medians = {s: round(statistics.median(run[s] for run in runs[tree]), 1) for s in args.schedules}
        print(json.dumps({"checkout": tree, "median_ms_per_step": medians}))


if __name__ == "__main__":
    main()
