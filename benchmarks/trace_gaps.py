"""Where a stage's time goes between its spans: the bare engine's 2bw on two processes, traced, and the time
between consecutive spans of each stage grouped by what came before and after (``backward->recv`` is the work
after a backward up to the next wait for an activation: sending the input gradient, posting receives).

    .venv/bin/python benchmarks/trace_gaps.py [--rows-per-microbatch 128] [--microbatches 4]

Reuses ``pipeline_throughput.py``'s workload and engine loop (which drives ``PipelineEngine``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_throughput as pt  # noqa: E402  (puts the repository root on sys.path)
from benchmarks import harness  # noqa: E402

_span_costs = harness.span_costs


def span_costs_with_gaps(spans: list, rank: int, steps: int) -> dict:
    costs = _span_costs(spans, rank, steps)
    own = sorted((s for s in spans if s.stage == rank), key=lambda s: s.start)
    gaps: dict[str, list[float]] = {}
    for a, b in zip(own, own[1:]):
        gaps.setdefault(f"{a.name}->{b.name}", []).append((b.start - a.end) * 1e3)
    costs["gaps"] = {k: (len(v), sum(v) / steps, statistics.median(v)) for k, v in gaps.items()}
    costs["span_ms"] = {n: sum(s.end - s.start for s in own if s.name == n) / steps * 1e3
                        for n in ("forward", "backward", "recv", "send", "optimizer")}
    return costs


def worker(rank: int, port: int, cfgs: list, out_dir: str, profile: bool) -> None:
    harness.span_costs = span_costs_with_gaps  # in the spawned process too (the engine worker calls it there)
    pt._engine_worker(rank, port, cfgs, out_dir, profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-per-microbatch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="2bw", choices=pt.SCHEDULES)
    args = parser.parse_args()
    cfg = {"rows": args.rows_per_microbatch, "steps": 20, "warmup": 5, "optimizer": "sgd", "m": args.microbatches,
           "schedule": args.schedule, "accelerator": "cpu", "width": 512, "trace": True}
    for result in pt.run_pairs(worker, [cfg], "engine", False, pt.CHILD_TIMEOUT)[0]:
        c, step = result["costs"], result["sec_per_step"] * 1e3
        spans = ", ".join(f"{n} {v:.2f}" for n, v in c["span_ms"].items())
        print(f"stage {result['rank']}: {step:.1f} ms/step (median); per step, ms: {spans}")
        for key, (count, per_step, median) in sorted(c["gaps"].items(), key=lambda kv: -kv[1][1]):
            print(f"    {key:<22} {per_step:6.2f} ms/step  ({count} gaps, median {median:.3f} ms)")


if __name__ == "__main__":
    main()
