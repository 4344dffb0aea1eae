"""``pipeline_throughput.py``'s command line: the CPU measurements (:func:`main`) and the CUDA ones
(:func:`main_cuda`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch

from benchmarks import throughput
from benchmarks.harness import CHILD_TIMEOUT, Quiet, one_thread, others_cpu, run_pairs, wall_time_line, write_json
from benchmarks.throughput.measure import (measure_peers, measure_round, median_runs, print_run, run_compile_comparison,
                                           run_predict)
from benchmarks.throughput.pairing import run_paired_blocks
from benchmarks.throughput.report import cuda_report, predict_report, profile_report, report
from benchmarks.throughput.systems import (
    _engine_worker, _torchpp_worker, lightning_child, run_ceiling, run_engine, run_lightning, run_single,
)
from benchmarks.throughput.workload import (
    CPU_STEPS, CUDA_STEPS, CUDA_WIDTH, DEPTH, SCHEDULES, STAGES, WIDTH,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=throughput.__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="microbatches per batch (m)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: every system, one thread per process, gloo; cuda: one process on cuda:0 and, with "
                             "2+ GPUs, the 2-process runs over NCCL (one GPU per process), no Lightning runs")
    parser.add_argument("--steps", type=int, help=f"timed steady-state steps per run (default {CPU_STEPS[0]} on CPU, "
                                                  f"{CUDA_STEPS[0]} on CUDA)")
    parser.add_argument("--warmup", type=int, help=f"untimed steps before the timed ones (default {CPU_STEPS[1]} on "
                                                   f"CPU, {CUDA_STEPS[1]} on CUDA)")
    parser.add_argument("--width", type=int, help=f"features of every layer (default {WIDTH} on CPU, {CUDA_WIDTH} on CUDA)")
    parser.add_argument("--rows-per-microbatch", type=int, default=128, help="samples in one microbatch")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--quick", action="store_true", help="m=4 only, fewer steps, no engine-only runs (on CUDA: kept)")
    parser.add_argument("--no-engine", action="store_true", help="skip the bare-engine (no Lightning) runs (on CUDA: the 2-GPU ones)")
    parser.add_argument("--only-engines", action="store_true",
                        help="measure only one process, the bare engine and torch's schedules (no Lightning); no report")
    parser.add_argument("--predict", action="store_true",
                        help="only the bare engine's schedules, traced: the planner's predicted step time vs the measured one")
    parser.add_argument("--compile", action="store_true",
                        help="only the bare engine's schedules, eager layers against compiled ones (compile=True)")
    parser.add_argument("--profile", action="store_true", help="also profile one stage of torch 1F1B and ours")
    parser.add_argument("--profile-only", action="store_true", help="only the profiles (at the first --microbatches)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every system this many times, in turn; the tables show each system's median "
                             "round and the targets each round's ratios (on CPU)")
    parser.add_argument("--no-paired", action="store_true",
                        help="skip 2bw (Lightning) against torch's schedules in blocks of steps in turn in one process "
                             "pair (about 1.5 minutes per m; skipped with --quick)")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--wait-idle", type=float, default=20.0,
                        help="before each measurement wait up to this many seconds for the machine to be idle")
    parser.add_argument("--retries", type=int, default=1,
                        help="measure again (keeping the least disturbed) when other processes used > 5%% of the CPUs")
    parser.add_argument("--child", choices=("lightning",), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child == "lightning":
        lightning_child(json.loads(args.config), args.out_dir)
        return
    cuda = args.accelerator == "cuda"
    default_steps, default_warmup = CUDA_STEPS if cuda else CPU_STEPS
    args.steps = default_steps if args.steps is None else args.steps
    args.warmup = default_warmup if args.warmup is None else args.warmup
    args.width = (CUDA_WIDTH if cuda else WIDTH) if args.width is None else args.width
    if args.quick:
        args.microbatches, args.steps, args.warmup = [4], min(args.steps, 10), min(args.warmup, 3)
        args.no_engine = args.no_engine or not cuda  # on CUDA the bare engine stands in for Lightning: kept
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error(f"--warmup, --steps and --rounds must be >= 1, got {args.warmup}, {args.steps} and {args.rounds}")
    if args.width < 1 or args.rows_per_microbatch < 1:
        parser.error(f"--width and --rows-per-microbatch must be >= 1, got {args.width} and {args.rows_per_microbatch}")
    if cuda:
        for flag in ("predict", "profile", "profile_only"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} measures on CPU only; drop it or use --accelerator cpu")
        if not torch.cuda.is_available():
            sys.exit(f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                     f"{torch.version.cuda or 'none'}); run on a machine with an NVIDIA GPU, or with --accelerator cpu")
        if args.compile:
            run_compile_comparison(args, cuda=True)
            return
        main_cuda(args)
        return

    one_thread()
    started = time.perf_counter()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cpu"}
    load = os.getloadavg()[0]
    print(f"# pipeline throughput: {DEPTH} x [Linear({args.width},{args.width}) + GELU], {STAGES} stages, "
          f"{args.rows_per_microbatch} rows per microbatch, optimizer {args.optimizer}, "
          f"{args.warmup} warmup + {args.steps} timed steps, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"1 thread per process, load average before start {load:.2f}", flush=True)

    results: dict[str, Any] = {"config": base, "load_before": load, "runs": {}}
    runs = results["runs"]
    quiet = Quiet(args.wait_idle, args.retries)
    if args.compile:
        run_compile_comparison(args, cuda=False)
        return
    if args.predict:
        results["predict"] = run_predict(base, args.microbatches, quiet)
        print()
        print(predict_report(results["predict"], base))
        print(wall_time_line(started))
        write_json(args.json, results)
        return
    rounds: list[dict[str, list[dict]]] = []
    for rnd in range(0 if args.profile_only else args.rounds):
        if args.rounds > 1:
            print(f"# round {rnd + 1} of {args.rounds}", flush=True)
        rounds.append(measure_round(args, base, quiet))
    results["rounds"] = rounds
    runs.update(median_runs(rounds, base["rows"]))
    if not (args.quick or args.no_paired or args.only_engines or args.profile_only):
        # The >= 1.1 target, measured so that the host's drift cancels: 2bw under Lightning and torch's schedules
        # in one process pair, blocks of steps in turn.
        results["paired"] = {}
        for m in args.microbatches:
            quiet.wait()
            res = results["paired"][str(m)] = run_paired_blocks({**base, "m": m})
            print(f"  m={m} paired blocks: 2bw (Lightning) / torch's fastest ({res['fastest']}) "
                  f"{res['paired'][res['fastest']]:.3f}", flush=True)

    if args.profile or args.profile_only:
        m = args.microbatches[0]
        cfg = {**base, "m": m}
        prof: dict[str, Any] = {}
        for (r0, r1) in run_pairs(_torchpp_worker, [{**cfg, "schedule": "Schedule1F1B"}], "torchpp", True, CHILD_TIMEOUT):
            prof["torch/Schedule1F1B"] = [r0, r1]
        for (r0, r1) in run_pairs(_engine_worker, [{**cfg, "schedule": s} for s in ("1f1b", "2bw")], "engine", True,
                                  CHILD_TIMEOUT):
            prof[f"engine/{r0['schedule']}"] = [r0, r1]
        prof["lightning/2bw"] = quiet.measure(lambda: run_lightning({**cfg, "schedule": "2bw", "profile": True}, CHILD_TIMEOUT))
        results["profile"] = prof

    if args.only_engines:
        write_json(args.json, results)
        return
    print()
    print(report(results, args) if not args.profile_only else profile_report(results["profile"], base, m))
    print(wall_time_line(started))
    write_json(args.json, results)


def main_cuda(args: argparse.Namespace) -> None:
    """The CUDA measurements: one process on ``cuda:0`` (the whole model; the engine with both stages), and with
    two or more GPUs the 2-process pairs over NCCL, one GPU per process. Lightning's runs are not measured."""
    started = time.perf_counter()
    ngpu = torch.cuda.device_count()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cuda"}
    load = os.getloadavg()[0]
    gpus = ", ".join(f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}"
                     f" GiB)" for i in range(ngpu))
    tf32 = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
    print(f"# pipeline throughput on CUDA: {DEPTH} x [Linear({args.width},{args.width}) + GELU], {STAGES} stages, "
          f"{args.rows_per_microbatch} rows per microbatch, fp32 (TF32 matmul {tf32}), optimizer {args.optimizer}, "
          f"{args.warmup} warmup + {args.steps} timed steps, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{ngpu} GPU(s): {gpus}; {os.cpu_count()} CPUs, load average before start {load:.2f}", flush=True)
    two = ngpu >= STAGES
    if not two:
        print(f"  only {ngpu} GPU: the {STAGES}-process runs (NCCL needs one GPU per process) are skipped", flush=True)
    print("  Lightning runs are not measured on CUDA (bare engine and torch's schedules only)", flush=True)

    results: dict[str, Any] = {"config": base, "load_before": load, "gpus": gpus, "runs": {}}
    runs = results["runs"]
    quiet = Quiet(args.wait_idle, args.retries)

    def in_process(run: Callable[[], dict]) -> list[dict]:
        try:
            return [run()]
        finally:
            torch.cuda.empty_cache()  # give the GPU back before the next run (or the spawned processes) starts

    for m in args.microbatches:
        cfg = {**base, "m": m}
        rows = cfg["rows"] * m

        def record(key: str, res: list[dict]) -> None:
            runs[key] = res
            peak = " / ".join(f"{r['cuda_peak_mib']:,.0f}" for r in res)
            print_run(m, key, res, rows, f"peak GPU memory {peak} MiB   others' CPU {others_cpu(res):5.1%}", digits=2)

        record(f"single/m{m}", quiet.measure(lambda: in_process(lambda: run_single(cfg))))
        record(f"single_mb/m{m}", quiet.measure(lambda: in_process(lambda: run_single(cfg, microbatched=True))))
        for schedule in SCHEDULES:
            one = {**cfg, "schedule": schedule}
            record(f"engine1/{schedule}/m{m}", quiet.measure(lambda: in_process(lambda: run_engine(one, 0, 1))))
        if not two:
            continue
        record(f"ceiling/m{m}", quiet.measure(lambda: run_ceiling(cfg, CHILD_TIMEOUT)))
        measure_peers(args, cfg, m, quiet, record)

    print()
    print(cuda_report(results, args, two))
    print(wall_time_line(started))
    write_json(args.json, results)
