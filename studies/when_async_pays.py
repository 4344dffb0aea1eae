"""When does 2BW pay? The planner's 2bw step time against the fastest synchronous schedule that fits in the same
memory, for the 360M and 10B shapes at p = 4..64, combined with the delay's iso-loss token overhead
(docs/delay-study.md) into the net time to a given loss. Writes the tables of docs/when-async-pays.md.

    .venv/bin/python studies/when_async_pays.py                 # both shapes, p = 4 8 16 32 64, m = 4p
    .venv/bin/python studies/when_async_pays.py --microbatches-per-stage 1    # m = p: the sync schedules' worst
    .venv/bin/python studies/when_async_pays.py --weight-grad-fraction 0.33  # a weight gradient cheaper than I

Costs are the planner's (``lightning-async-pp-plan --model ... --split-blocks``: FLOPs at 400 TFLOP/s x 40% MFU,
bf16 activations over 25 GB/s, backward = 2 x forward, one sequence of 2048 tokens per microbatch). Memory per
device is modelled as: 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and Adam's two
moments) plus 2 more under 2bw (the stashed bf16 version), and 34 x seq x hidden bytes of activations per block
and microbatch in flight (Korthikanti et al. 2022 without the attention-score term, i.e. flash attention), times
the schedule's peak in-flight activations from the simulation. The net speedup over synchronous training to the
same loss is ``speedup / (1 + token overhead)``; break-even is ``speedup - 1``.
"""
from __future__ import annotations

import argparse
from typing import Optional

from lightning_async_pp import plan
from lightning_async_pp.pipeline.simulate import SimulationResult, simulate

SYNC = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zbv")
#: Iso-loss token overheads of 2BW measured in docs/delay-study.md ("The longer horizon over three seeds": 1.05 M
#: parameters, 2000 updates, the mean over seeds 0-2 of the overhead read off each seed's synchronous curve).
OVERHEADS = {"Muon + correction": 0.25, "AdamW (lr 1e-3) + correction": 0.35, "Muon": 2.50}


def memory_gib(shape: plan.Shape, p: int, r: SimulationResult) -> float:
    params = shape.parameters() / p
    weights = params * (16 + (2 if r.weight_versions == 2 else 0))
    activations = 34 * shape.seq_len * shape.hidden * (shape.layers / p) * r.peak_activation_memory
    return (weights + activations) / 2**30


def rows(model: str, stages: list[int], per_stage: int, steps: int, weight_grad_fraction: float) -> list[dict]:
    out = []
    for p in stages:
        m = per_stage * p
        args = plan.parser().parse_args(["--model", model, "--split-blocks", "--stages", str(p),
                                         "--microbatches", str(m)])
        costs = plan.CostModel(args).costs(p)
        if costs is None:
            continue
        shape = plan.MODELS[model]
        results: dict[str, Optional[SimulationResult]] = {}
        for s in ("2bw", *SYNC):
            results[s] = simulate(s, p, m, costs.forward_s, costs.backward_s, comm_s=costs.comm_s, steps=steps,
                                  weight_grad_fraction=weight_grad_fraction)
        two = results["2bw"]
        budget = memory_gib(shape, p, two)
        fits = {s: r for s, r in results.items() if s != "2bw" and memory_gib(shape, p, r) <= budget}
        best = min(fits, key=lambda s: fits[s].step_time_s)
        out.append({"model": model, "p": p, "m": m, "two": two, "best": best, "best_r": fits[best],
                    "mem_2bw": budget, "mem_best": memory_gib(shape, p, fits[best]),
                    "speedup": fits[best].step_time_s / two.step_time_s,
                    "x1f1b": results["1f1b"].step_time_s / two.step_time_s})
    return out


def table(all_rows: list[dict]) -> list[str]:
    head = ["model", "p", "m", "2bw step", "2bw GiB/device", "fastest sync (same memory)", "its step", "its GiB",
            "2bw speedup", "x 1f1b", "break-even overhead"] + [f"net, {k}" for k in OVERHEADS]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 2 + "---:|---:|---|" + "---:|" * (len(head) - 6)]
    for r in all_rows:
        s = r["speedup"]
        lines.append(
            f"| {r['model']} | {r['p']} | {r['m']} | {plan.fmt_seconds(r['two'].step_time_s)} | {r['mem_2bw']:.1f} | "
            f"{r['best']} | {plan.fmt_seconds(r['best_r'].step_time_s)} | {r['mem_best']:.1f} | {s:.3f} | "
            f"{r['x1f1b']:.2f} | {s - 1:.1%} | " + " | ".join(f"{s / (1 + o):.2f}" for o in OVERHEADS.values()) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm-360m", "llama-10b"], choices=sorted(plan.MODELS))
    ap.add_argument("--stages", nargs="+", type=int, default=[4, 8, 16, 32, 64])
    ap.add_argument("--microbatches-per-stage", type=int, default=4, help="m = this x p (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="steps simulated (>= 3)")
    ap.add_argument("--weight-grad-fraction", type=float, default=0.5,
                    help="share of a backward that is the weight gradient (zb_h1, zbv; default 0.5)")
    args = ap.parse_args()
    found = [r for model in args.models
             for r in rows(model, args.stages, args.microbatches_per_stage, args.steps, args.weight_grad_fraction)]
    print("\n".join(table(found)))


if __name__ == "__main__":
    main()
