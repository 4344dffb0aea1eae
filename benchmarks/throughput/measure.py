"""Measuring ``pipeline_throughput.py``'s systems: a round of every system at every m (:func:`measure_round`),
the median round (:func:`median_runs`), and the ``--predict`` and ``--compile`` runs."""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch

from benchmarks.harness import CHILD_TIMEOUT, Quiet, median_round, others_cpu, wall_time_line, write_json
from benchmarks.throughput.pairing import run_interleaved
from benchmarks.throughput.report import _rate, compile_report
from benchmarks.throughput.systems import _engine_worker, _torchpp_worker, run_ceiling, run_engine, run_lightning, run_single
from benchmarks.throughput.workload import (
    DEPTH, ENGINE_SCHEDULES, ONE_PROCESS_SCHEDULES, SCHEDULES, STAGES, TORCH_SCHEDULES,
)


def print_run(m: int, key: str, res: list[dict], rows: int, detail: str, digits: int = 1) -> None:
    """One line of the progress a run prints as each system finishes: its step time, rate and ``detail``."""
    sec = rows / _rate(key, res, rows)
    print(f"  m={m} {key.split('/m')[0]:<26} {sec * 1e3:8.{digits}f} ms/step {rows / sec:9.0f} samples/s   {detail}",
          flush=True)



def measure_peers(args: argparse.Namespace, cfg: dict, m: int, quiet: "Quiet",
                  record: "Callable[[str, list[dict]], None]") -> None:
    """The engine's schedules (unless ``--no-engine``), then torch's, each group measured in turn on 2 processes."""
    groups = [("torch", _torchpp_worker, "torchpp", TORCH_SCHEDULES)]
    if not args.no_engine:
        groups.insert(0, ("engine", _engine_worker, "engine", ENGINE_SCHEDULES))
    for prefix, worker, name, schedules in groups:
        for pair in quiet.measure_group(worker, name, [{**cfg, "schedule": s} for s in schedules]):
            record(f"{prefix}/{pair[0]['schedule']}/m{m}", pair)


def measure_round(args: argparse.Namespace, base: dict, quiet: "Quiet") -> dict[str, list[dict]]:
    """Every system at every ``--microbatches``, once: ``{"<system>/m<m>": [result per process]}``."""
    runs: dict[str, list[dict]] = {}
    for m in args.microbatches:
        cfg = {**base, "m": m}
        rows = cfg["rows"] * m

        def record(key: str, res: list[dict]) -> None:
            runs[key] = res
            extra = f"   plain loop / engine, paired steps {res[0]['paired_ratio']:.3f}" if "paired_ratio" in res[0] else ""
            print_run(m, key, res, rows, f"others' CPU {others_cpu(res):5.1%}{extra}")

        record(f"single/m{m}", quiet.measure(lambda: [run_single(cfg)]))
        # The engine's stages in this one process on the same microbatches, against the plain loop, steps in turn.
        mixed = quiet.measure_keyed(lambda: run_interleaved(cfg, ONE_PROCESS_SCHEDULES))
        record(f"single_mb/m{m}", mixed["single_mb"])
        record(f"single_split/m{m}", mixed["single_split"])
        record(f"single_split_bw/m{m}", mixed["single_split_bw"])
        for schedule in ONE_PROCESS_SCHEDULES:
            record(f"onedev/{schedule}/m{m}", mixed[schedule])
        if args.only_engines:
            for pair in quiet.measure_group(_engine_worker, "engine", [{**cfg, "schedule": s} for s in ENGINE_SCHEDULES]):
                record(f"engine/{pair[0]['schedule']}/m{m}", pair)
            for pair in quiet.measure_group(_torchpp_worker, "torchpp", [{**cfg, "schedule": s} for s in TORCH_SCHEDULES]):
                record(f"torch/{pair[0]['schedule']}/m{m}", pair)
            continue
        record(f"ceiling/m{m}", quiet.measure(lambda: run_ceiling(cfg, CHILD_TIMEOUT)))
        for schedule in SCHEDULES:
            record(f"lightning/{schedule}/m{m}", quiet.measure(lambda: run_lightning({**cfg, "schedule": schedule}, CHILD_TIMEOUT)))
        measure_peers(args, cfg, m, quiet, record)
    return runs


def median_runs(rounds: list[dict[str, list[dict]]], rows: int) -> dict[str, list[dict]]:
    """Per system, the run of the round with the median rate (the lower middle one of an even count)."""
    if not rounds:
        return {}
    return {key: median_round([r[key] for r in rounds], lambda res: _rate(key, res, rows)) for key in rounds[0]}



def run_predict(base: dict, microbatches: list[int], quiet: "Quiet") -> list[dict]:
    """Each schedule on the bare engine, traced; the planner's prediction from the traced costs."""
    from lightning_async_pp.pipeline.simulate import simulate

    rows = []
    for m in microbatches:
        cfg = {**base, "m": m}
        for pair in quiet.measure_group(_engine_worker, "engine", [{**cfg, "schedule": s, "trace": True} for s in SCHEDULES]):
            costs = [r["costs"] for r in pair]
            schedule = pair[0]["schedule"]
            fwd, bwd = [c["forward_s"] for c in costs], [c["backward_s"] for c in costs]
            opt, comm = [c["optimizer_s"] for c in costs], costs[0]["transfer_s"]
            compute_only = simulate(schedule, STAGES, m, fwd, bwd, comm_s=comm, optimizer_s=opt)
            # The engine's own work per action (inside the step, outside compute and waits) and per step (outside
            # the step: the weight-version copy, setting gradients), as the stages measured them.
            per_action = [r["times"]["idle"] / (2 * m) for r in pair]
            per_step = [max(0.0, r["mean_sec_per_step"] - r["times"]["total"]) for r in pair]
            with_overhead = simulate(schedule, STAGES, m, [f + o for f, o in zip(fwd, per_action)],
                                     [b + o for b, o in zip(bwd, per_action)], comm_s=comm,
                                     optimizer_s=[o + e for o, e in zip(opt, per_step)])
            rows.append({"m": m, "schedule": schedule, "costs": costs, "per_action_s": per_action,
                         "per_step_s": per_step, "measured_s": pair[0]["mean_sec_per_step"],
                         "measured_median_s": pair[0]["sec_per_step"], "others_cpu": others_cpu(pair),
                         "predicted_s": compute_only.step_time_s, "predicted_bubble": compute_only.bubble_fraction,
                         "predicted_with_overhead_s": with_overhead.step_time_s})
            r = rows[-1]
            print(f"  m={m} {schedule:<6} measured {r['measured_s'] * 1e3:7.1f} ms/step, predicted "
                  f"{r['predicted_s'] * 1e3:7.1f} (compute only), {r['predicted_with_overhead_s'] * 1e3:7.1f} "
                  f"(+ engine overhead)   others' CPU {r['others_cpu']:5.1%}", flush=True)
    return rows


#: The schedules measured eager against compiled (zb_h1's split backward does not take compiled layers).
COMPILE_SCHEDULES = SCHEDULES


def run_compile_comparison(args: argparse.Namespace, cuda: bool) -> None:
    """``--compile``: each schedule on the bare engine with eager and with compiled layers, side by side."""
    started = time.perf_counter()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cuda" if cuda else "cpu"}
    two = not cuda or torch.cuda.device_count() >= STAGES
    where = ["one process, both stages on cuda:0"] if cuda else []
    where += [f"{STAGES} processes" + (", one GPU each (NCCL)" if cuda else " (gloo, 1 thread each)")] if two else []
    print(f"# eager vs compiled layers (bare engine): {DEPTH} x [Linear({args.width},{args.width}) + GELU], "
          f"{STAGES} stages, {args.rows_per_microbatch} rows per microbatch, optimizer {args.optimizer}, "
          f"{args.warmup} warmup (compilation included) + {args.steps} timed steps, torch {torch.__version__}; "
          f"{'; '.join(where)}; load average before start {os.getloadavg()[0]:.2f}", flush=True)
    quiet = Quiet(args.wait_idle, args.retries)
    rows = []
    for m in args.microbatches:
        cfgs = [{**base, "m": m, "schedule": s, "compile": c} for s in COMPILE_SCHEDULES for c in (False, True)]
        measured: list[tuple[str, dict, list[dict]]] = []
        if cuda:
            for cfg in cfgs:
                def one_gpu(cfg: dict = cfg) -> list[dict]:
                    try:
                        return [run_engine(cfg, 0, 1)]
                    finally:
                        torch.cuda.empty_cache()
                measured.append(("one GPU", cfg, quiet.measure(one_gpu)))
        if two:
            for cfg, pair in zip(cfgs, quiet.measure_group(_engine_worker, "engine", cfgs)):
                measured.append((f"{STAGES} processes", cfg, pair))
        for where_run, cfg, res in measured:
            rows.append({"where": where_run, "m": m, "schedule": cfg["schedule"], "compile": cfg["compile"],
                         "sec_per_step": res[0]["sec_per_step"], "others_cpu": others_cpu(res)})
            print(f"  m={m} {where_run:<12} {cfg['schedule']:<6} {'compiled' if cfg['compile'] else 'eager':<9}"
                  f"{res[0]['sec_per_step'] * 1e3:9.2f} ms/step   others' CPU {rows[-1]['others_cpu']:5.1%}",
                  flush=True)
    print()
    print(compile_report(rows))
    print(wall_time_line(started))
    write_json(args.json, {"config": base, "compile": rows})
