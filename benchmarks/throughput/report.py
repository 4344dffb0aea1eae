"""The tables ``pipeline_throughput.py`` prints: throughput per system, ratios against peers measured in the same
run, the targets round by round, the paired blocks, where 2bw's wall time goes under Lightning, peak memory, and
the ``--profile``, ``--predict`` and ``--compile`` reports."""
from __future__ import annotations

import argparse
import statistics
from typing import Callable, Optional

from benchmarks.harness import others_cpu
from benchmarks.throughput.profiling import _trim_profile
from benchmarks.throughput.workload import ONE_PROCESS_SCHEDULES, SCHEDULES, STAGES, TORCH_SCHEDULES, ENGINE_SCHEDULES


def _rate(key: str, procs: list[dict], rows: int) -> float:
    """Samples per second: rank 0's step clock for a pipeline, the sum of both for two independent processes."""
    if key.startswith("ceiling"):
        return sum(rows / r["sec_per_step"] for r in procs)
    return rows / procs[0]["sec_per_step"]


def _throughput_table(lines: list[str], systems: list[tuple[str, str]], results: dict, ms: list[int], *,
                      baseline: str, ms_digits: int, peak: Optional[tuple[str, Callable[[list], str]]] = None) -> None:
    """One row per ``(label, key)`` system: samples/s, ms per step, the ratio to ``single`` (column ``baseline``),
    ``peak`` (a column name and a cell from the run's processes) if given, and others' CPU; per m."""
    runs, rows = results["runs"], results["config"]["rows"]
    rate = lambda key, m: _rate(key, runs[key], rows * m)  # noqa: E731
    columns = ["samples/s", "ms/step", baseline] + ([peak[0]] if peak else []) + ["others' CPU"]
    lines.append("| system | " + " | ".join(f"m={m}: " + " | ".join(columns) for m in ms) + " |")
    lines.append("|---|" + "---:|" * len(columns) * len(ms))
    for label, key in systems:
        cells = []
        for m in ms:
            k = f"{key}/m{m}"
            r = rate(k, m)
            cell = [f"{r:,.0f}", f"{rows * m / r * 1e3:.{ms_digits}f}", f"{r / rate(f'single/m{m}', m):.2f}x"]
            cell += [peak[1](runs[k])] if peak else []
            cells.append(" | ".join(cell + [f"{others_cpu(runs[k]):.0%}"]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")


def _ratio_table(lines: list[str], results: dict, ms: list[int]) -> Callable[..., None]:
    """Starts the ratios section; returns ``ratio_row(label, num, den, target, scale=...)``, which adds the row of
    ``num``'s rate over ``den``'s (times ``scale(m)``) per m."""
    runs, rows = results["runs"], results["config"]["rows"]
    rate = lambda key, m: _rate(key, runs[key], rows * m)  # noqa: E731
    lines.append("\n## Ratios against peers measured in this run\n")
    lines.append("| ratio | " + " | ".join(f"m={m}" for m in ms) + " | target |")
    lines.append("|---|" + "---:|" * len(ms) + "---|")

    def ratio_row(label: str, num: str, den: str, target: str, scale: Callable[[int], float] = lambda m: 1.0) -> None:
        vals = [rate(f"{num}/m{m}", m) / rate(f"{den}/m{m}", m) * scale(m) for m in ms]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {target} |")

    return ratio_row


def fastest_synchronous(results: dict, m: int) -> str:
    """The key of torch's fastest schedule at ``m`` in this run."""
    runs, rows = results["runs"], results["config"]["rows"]
    return max((f"torch/{s}" for s in TORCH_SCHEDULES), key=lambda k: _rate(k, runs[f"{k}/m{m}"], rows * m))


def fastest_row(lines: list[str], results: dict, ms: list[int], label: str, num: str, target: str) -> None:
    """A ratio row against torch's fastest synchronous schedule, per m (named in the cell)."""
    runs, rows = results["runs"], results["config"]["rows"]
    cells = []
    for m in ms:
        best = fastest_synchronous(results, m)
        ratio = _rate(f"{num}/m{m}", runs[f"{num}/m{m}"], rows * m) / _rate(best, runs[f"{best}/m{m}"], rows * m)
        cells.append(f"{ratio:.2f} ({best.split('/')[1].removeprefix('Schedule')})")
    lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")


def cuda_report(results: dict, args: argparse.Namespace, two: bool) -> str:
    ms = args.microbatches
    lines = ["## Throughput on CUDA (samples/s from the median steady-state step time on rank 0)\n",
             "Every step ends with `torch.cuda.synchronize()` before its time is taken. *vs one GPU*: against the "
             "whole model in one process on one GPU, whole batch at once. The engine with both stages on one GPU "
             "cannot overlap them: its ratio to one GPU is the engine's overhead (1.00 = none). *peak GPU MiB*: "
             "`torch.cuda.max_memory_allocated` of rank 0's device.\n"]
    systems = [("one GPU, whole batch (baseline)", "single"),
               ("one GPU, m microbatches accumulated", "single_mb")]
    systems += [(f"{s} (bare engine, {STAGES} stages on one GPU)", f"engine1/{s}") for s in SCHEDULES]
    if two:
        systems.append((f"{STAGES} independent processes, one GPU each (sum)", "ceiling"))
        if not args.no_engine:
            systems += [(f"**{s}** (bare engine, {STAGES} GPUs, NCCL)", f"engine/{s}") for s in ENGINE_SCHEDULES]
        systems += [(f"torch {s} ({STAGES} GPUs, NCCL)", f"torch/{s}") for s in TORCH_SCHEDULES]
    _throughput_table(lines, systems, results, ms, baseline="vs one GPU", ms_digits=2,
                      peak=("peak GPU MiB", lambda procs: f"{procs[0]['cuda_peak_mib']:,.0f}"))
    ratio_row = _ratio_table(lines, results, ms)
    for s in SCHEDULES:
        ratio_row(f"{s} bare engine, {STAGES} stages on one GPU / one GPU (engine overhead)", f"engine1/{s}", "single",
                  "1.00 = no overhead")
    ratio_row("one GPU, microbatched / one GPU (cost of the microbatches' smaller matrices)", "single_mb", "single", "-")
    if two:
        if not args.no_engine:
            fastest_row(lines, results, ms, "2bw bare engine / torch's fastest synchronous schedule", "engine/2bw", "-")
            ratio_row("2bw bare engine / torch Schedule1F1B", "engine/2bw", "torch/Schedule1F1B", "-")
            ratio_row("1f1b bare engine / torch Schedule1F1B", "engine/1f1b", "torch/Schedule1F1B", "-")
            ratio_row("gpipe bare engine / torch ScheduleGPipe", "engine/gpipe", "torch/ScheduleGPipe", "-")
            ratio_row(f"2bw bare engine ({STAGES} GPUs) / one GPU", "engine/2bw", "single", "-")
        ratio_row(f"{STAGES} independent processes / one GPU (ceiling)", "ceiling", "single", "-")
        ratio_row(f"{STAGES} x (one GPU, microbatched) / one GPU (no-overhead pipeline)", "single_mb", "single", "-",
                  scale=lambda m: float(STAGES))
    else:
        lines.append(f"\n(one GPU: the {STAGES}-process runs over NCCL were skipped; they need {STAGES} GPUs)")
    lines.append("\nLightning (`Trainer` with `AsyncPipelineStrategy`) is not measured on CUDA by this benchmark.")
    return "\n".join(lines)


def round_targets(runs: dict, cfg: dict, m: int) -> list[tuple[str, float, str]]:
    """Issue 33's targets at ``m`` as one round measured them: ``(label, value, target)``."""
    rows = cfg["rows"] * m
    rate = lambda key: _rate(f"{key}/m{m}", runs[f"{key}/m{m}"], rows)  # noqa: E731
    best = fastest_synchronous({"runs": runs, "config": cfg}, m)
    out = [("2bw (Lightning) / torch's fastest synchronous schedule", rate("lightning/2bw") / rate(best), ">= 1.1"),
           ("2bw (Lightning) / one process, microbatched", rate("lightning/2bw") / rate("single_mb"), ">= 1.9")]
    out += [(f"{s} bare engine in one process / plain loop, steps in turn", runs[f"onedev/{s}/m{m}"][0]["paired_ratio"],
             ">= 0.95") for s in ONE_PROCESS_SCHEDULES]
    return out


def rounds_table(lines: list[str], results: dict, ms: list[int]) -> None:
    """The targets round by round, each ratio within its round (both sides measured minutes apart at most), and
    their median: the machine's speed drifts between rounds, a ratio inside a round much less."""
    rounds, cfg = results["rounds"], results["config"]
    lines.append(f"\n## Targets round by round ({len(rounds)} rounds; each ratio between systems of the same round)\n")
    lines.append("| m | ratio | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median | target |")
    lines.append("|---:|---|" + "---:|" * (len(rounds) + 1) + "---|")
    for m in ms:
        per_round = [round_targets(r, cfg, m) for r in rounds]
        fastest = [fastest_synchronous({"runs": r, "config": cfg}, m).split("/")[1].removeprefix("Schedule")
                   for r in rounds]
        for j, (label, _, target) in enumerate(per_round[0]):
            vals = [pr[j][1] for pr in per_round]
            if j == 0:  # which schedule was torch's fastest, round by round
                label += " (" + ", ".join(fastest) + ")"
            lines.append(f"| {m} | {label} | " + " | ".join(f"{v:.2f}" for v in vals)
                         + f" | {statistics.median(vals):.2f} | {target} |")


def paired_table(lines: list[str], paired: dict, ms: list[int]) -> None:
    """2bw (Lightning) against each of torch's schedules, paired a second apart (:func:`run_paired_blocks`)."""
    lines.append("\n## 2bw (Lightning) against torch's schedules, paired a second apart\n")
    lines.append("Both in one process pair, blocks of 6 steps in turn (12 block rounds, the first step of each block "
                 "not counted): the median over rounds of the schedule's step over 2bw's in the same round. The "
                 "host's drift between runs minutes apart does not enter these ratios.\n")
    lines.append("| m | " + " | ".join(s.removeprefix("Schedule") for s in TORCH_SCHEDULES)
                 + " | against the fastest (lowest median step) | target |")
    lines.append("|---:|" + "---:|" * (len(TORCH_SCHEDULES) + 1) + "---|")
    for m in ms:
        res = paired[str(m)]
        cells = [f"{res['paired'][s]:.2f}" for s in TORCH_SCHEDULES]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {res['paired'][res['fastest']]:.2f} "
                     f"({res['fastest'].removeprefix('Schedule')}) | >= 1.1 |")


def report(results: dict, args: argparse.Namespace) -> str:
    runs, cfg = results["runs"], results["config"]
    lines = []
    lines.append("## Throughput (samples/s from the median steady-state step time on rank 0)\n")
    lines.append("*others' CPU*: share of the machine's CPU time used by processes other than the measured ones during "
                 "the timed window (0% on an otherwise idle machine).\n")
    systems = [("one process, whole batch (baseline)", "single"),
               ("one process, m microbatches accumulated", "single_mb"),
               ("one process, microbatched, split where the stages meet", "single_split"),
               ("the same, the last stage's backward split in input and weight passes (zb_h1's)", "single_split_bw"),
               ("2 independent processes (sum)", "ceiling")]
    systems += [(f"**{s}** (Lightning)", f"lightning/{s}") for s in SCHEDULES]
    systems += [(f"{s} (bare engine, both stages in one process)", f"onedev/{s}") for s in ONE_PROCESS_SCHEDULES]
    if not args.no_engine:
        systems += [(f"{s} (bare engine)", f"engine/{s}") for s in ENGINE_SCHEDULES]
    systems += [(f"torch {s}", f"torch/{s}") for s in TORCH_SCHEDULES]
    ms = args.microbatches
    _throughput_table(lines, systems, results, ms, baseline="vs 1 process", ms_digits=1)
    ratio_row = _ratio_table(lines, results, ms)
    fastest_row(lines, results, ms, "2bw (Lightning) / torch's fastest synchronous schedule", "lightning/2bw", ">= 1.1")
    ratio_row("2bw (Lightning) / torch Schedule1F1B", "lightning/2bw", "torch/Schedule1F1B", ">= 1.3")
    ratio_row("1f1b (Lightning) / torch Schedule1F1B", "lightning/1f1b", "torch/Schedule1F1B", "-")
    ratio_row("gpipe (Lightning) / torch ScheduleGPipe", "lightning/gpipe", "torch/ScheduleGPipe", "-")
    ratio_row("2bw (Lightning) / one process", "lightning/2bw", "single", ">= 1.6")
    ratio_row("2 independent processes / one process (ceiling)", "ceiling", "single", "-")
    ratio_row("2 x (one process, microbatched) / one process (no-overhead pipeline)", "single_mb", "single", "-",
              scale=lambda m: 2.0)
    # The engine's per-microbatch compute against a plain loop's, no transfers: steps in turn, medians over rounds.
    for label, key, target in [("plain loop split where the stages meet", "single_split", "-"),
                               ("the same with zb_h1's split backward", "single_split_bw", "-")] + [
            (f"{s} bare engine in one process", f"onedev/{s}", ">= 0.95") for s in ONE_PROCESS_SCHEDULES]:
        vals = [statistics.median(r[f"{key}/m{m}"][0]["paired_ratio"] for r in results["rounds"]) for m in ms]
        lines.append(f"| {label} / one process, microbatched (plain loop), steps in turn | "
                     + " | ".join(f"{v:.2f}" for v in vals) + f" | {target} |")
    if "zb_h1" in ONE_PROCESS_SCHEDULES:  # zb_h1 against the plain loop with the same split backward
        vals = [statistics.median(r[f"onedev/zb_h1/m{m}"][0]["paired_ratio_split_bw"] for r in results["rounds"])
                for m in ms]
        lines.append("| zb_h1 bare engine in one process / the plain loop with zb_h1's split backward, steps in turn | "
                     + " | ".join(f"{v:.2f}" for v in vals) + " | - |")
    if not args.no_engine:
        fastest_row(lines, results, ms, "2bw bare engine / torch's fastest synchronous schedule", "engine/2bw", "-")
        ratio_row("2bw bare engine / torch Schedule1F1B", "engine/2bw", "torch/Schedule1F1B", "-")
        ratio_row("zb_h1 bare engine / torch Schedule1F1B", "engine/zb_h1", "torch/Schedule1F1B", "-")
        ratio_row("2bw Lightning / 2bw bare engine", "lightning/2bw", "engine/2bw", "-")

    if len(results["rounds"]) > 1:
        rounds_table(lines, results, ms)
    if "paired" in results:
        paired_table(lines, results["paired"], ms)

    lines.append("\n## 2bw under Lightning: where each stage's wall time goes (steady state, per step)\n")
    lines.append("Fractions of the wall time between consecutive step ends. *in engine, other* is the engine's own "
                 "Python and scheduling outside forward/backward and waits (the step's actions, sends, receives "
                 "posted, weight-version copy); *outside engine* is Lightning's loop, data loading, hooks and "
                 "logging. Target: *busy incl. optimizer* >= 0.9 on the critical (busiest) stage.\n")
    lines.append("| m | stage | ms/step | fwd+bwd (busy) | optimizer | busy incl. optimizer | comm wait | "
                 "in engine, other | outside engine | peak RSS MiB |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in ms:
        for r in runs[f"lightning/2bw/m{m}"]:
            t, wall = r["times"], r["mean_sec_per_step"]  # means over the same steps as the breakdown
            outside = max(0.0, wall - t["total"])
            lines.append(
                f"| {m} | {r['rank']} | {wall * 1e3:.1f} | {t['compute'] / wall:.3f} | {t['optimizer'] / wall:.3f} | "
                f"{(t['compute'] + t['optimizer']) / wall:.3f} | {t['comm_wait'] / wall:.3f} | {t['idle'] / wall:.3f} | "
                f"{outside / wall:.3f} | {r['rss_mib']:.0f} |"
            )

    lines.append("\n## Peak RSS per process (MiB)\n")
    lines.append("Mostly the interpreter with torch (about 560 MiB after `import torch` here) and Lightning (about 200 "
                 "MiB more); the model is 1 MiB of weights per layer. The bare-engine and torch rows run their "
                 "schedules one after another in the same two processes, so a later row's peak includes the "
                 "earlier ones'.\n")
    lines.append("| system | " + " | ".join(f"m={m} rank 0 / rank 1" for m in ms) + " |")
    lines.append("|---|" + "---:|" * len(ms))
    lines.append("| one process (each of the 2 independent runs, fresh processes) | " + " | ".join(
        " / ".join(f"{r['rss_mib']:.0f}" for r in runs[f"ceiling/m{m}"]) for m in ms) + " |")
    for label, key in systems[4:]:  # after the one-process rows and the ceiling (above)
        lines.append(f"| {label} | " + " | ".join(
            " / ".join(f"{r['rss_mib']:.0f}" for r in runs[f"{key}/m{m}"]) for m in ms) + " |")

    if "profile" in results:
        lines.append(profile_report(results["profile"], cfg, args.microbatches[0]))
    return "\n".join(lines)


def profile_report(prof: dict, cfg: dict, m: int) -> str:
    lines = [f"\n## Main-thread CPU per step by kind (m={m}, ms, cProfile timed with thread_time)\n"]
    lines.append("CPU time of the process's main thread, so waits cost nothing and other processes on the machine "
                 "do not inflate it. *kernels*: torch's C++ calls (forward kernels, the whole autograd backward, "
                 "optimizer math); *p2p calls*: posting and completing isend/irecv; *python*: everything else (the "
                 "schedule, runtime bookkeeping, Lightning's loop). Profiling inflates *python* (roughly 2x).\n")
    lines.append("| system | stage | kernels | p2p calls | python | of which optimizer step |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for key, pair in prof.items():
        for r in pair:
            c = r["cpu_profile"]
            lines.append(f"| {key} | {r['rank']} | {c['kernels']:.1f} | {c['p2p_calls']:.1f} | {c['python']:.1f} | "
                         f"{c['optimizer']:.1f} |")
    lines.append(f"\n## Where the wall time goes per step while profiled (m={m}, ms)\n")
    lines.append("| system | stage | wall | fwd+bwd compute | p2p wait | optimizer | everything else |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for r in prof["torch/Schedule1F1B"]:
        s, wall = r["split"], r["mean_sec_per_step"]
        compute = s["fwd_pure"] + s["bwd_pure"]
        lines.append(f"| torch Schedule1F1B | {r['rank']} | {wall * 1e3:.1f} | {compute * 1e3:.1f} | "
                     f"{s['p2p_wait'] * 1e3:.1f} | {r['optimizer_s'] * 1e3:.1f} | "
                     f"{(wall - compute - s['p2p_wait'] - r['optimizer_s']) * 1e3:.1f} |")
    for key in ("engine/1f1b", "engine/2bw", "lightning/2bw"):
        for r in prof[key]:
            t, wall = r["times"], r["mean_sec_per_step"]
            where = "bare engine" if key.startswith("engine") else "Lightning, profiled"
            lines.append(f"| ours {key.split('/')[1]} ({where}) | {r['rank']} | {wall * 1e3:.1f} | "
                         f"{t['compute'] * 1e3:.1f} | {t['comm_wait'] * 1e3:.1f} | {t['optimizer'] * 1e3:.1f} | "
                         f"{(wall - t['compute'] - t['comm_wait'] - t['optimizer']) * 1e3:.1f} |")
    lines.append("\ntorch's wrappers: forward_one_chunk / backward_one_chunk around the pure module forward / "
                 "stage_backward (ms per step, rank 0 then rank 1): " + "; ".join(
                     f"fwd {r['split']['fwd_chunk'] * 1e3:.1f} vs {r['split']['fwd_pure'] * 1e3:.1f}, "
                     f"bwd {r['split']['bwd_chunk'] * 1e3:.1f} vs {r['split']['bwd_pure'] * 1e3:.1f}, "
                     f"posting p2p {r['split']['p2p_post'] * 1e3:.2f}" for r in prof["torch/Schedule1F1B"]))
    for key, pair in prof.items():
        for r in pair:
            lines.append(f"\n### cProfile, {key}, rank {r['rank']} (main-thread CPU seconds over the timed steps)\n")
            lines.append("```\n" + _trim_profile(r["profile"]) + "\n```")
    return "\n".join(lines)



def compile_report(rows: list[dict]) -> str:
    lines = ["## Eager vs compiled layers (bare engine, ms per step on rank 0, median of the timed steps)\n",
             "| where | m | schedule | eager ms/step | compiled ms/step | eager / compiled | others' CPU (eager, compiled) |",
             "|---|---:|---|---:|---:|---:|---|"]
    index = {(r["where"], r["m"], r["schedule"], r["compile"]): r for r in rows}
    for (where, m, schedule, compiled), eager in index.items():
        if compiled:
            continue
        comp = index[(where, m, schedule, True)]
        lines.append(f"| {where} | {m} | {schedule} | {eager['sec_per_step'] * 1e3:.2f} | "
                     f"{comp['sec_per_step'] * 1e3:.2f} | {eager['sec_per_step'] / comp['sec_per_step']:.2f}x | "
                     f"{eager['others_cpu']:.0%}, {comp['others_cpu']:.0%} |")
    return "\n".join(lines)


def predict_report(rows: list[dict], cfg: dict) -> str:
    lines = ["## Predicted vs measured, p=2 (bare engine, traced)\n",
             f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps per run, {cfg['rows']} rows per microbatch. Costs "
             "fed to the planner: each stage's mean forward / backward / optimizer span from the trace of the timed "
             "steps, and half the median round trip of one activation between the two processes. *compute only* "
             "uses just these; *+ engine overhead* adds each stage's own work per action (the step's time outside "
             "compute, waits and optimizer, over 2m actions) and per step (outside the engine's step). Measured: "
             "rank 0's mean time between step ends over the same steps.\n",
             "| m | schedule | fwd / bwd stage 0 (ms) | fwd / bwd stage 1 (ms) | transfer (ms) | measured ms/step | "
             "predicted, compute only | predicted / measured | predicted, + engine overhead | predicted / measured | "
             "others' CPU |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c0, c1 = r["costs"]
        lines.append(
            f"| {r['m']} | {r['schedule']} | {c0['forward_s'] * 1e3:.2f} / {c0['backward_s'] * 1e3:.2f} | "
            f"{c1['forward_s'] * 1e3:.2f} / {c1['backward_s'] * 1e3:.2f} | {c0['transfer_s'] * 1e3:.3f} | "
            f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['predicted_s'] / r['measured_s']:.2f} | "
            f"{r['predicted_with_overhead_s'] * 1e3:.1f} | {r['predicted_with_overhead_s'] / r['measured_s']:.2f} | "
            f"{r['others_cpu']:.0%} |")
    return "\n".join(lines)
