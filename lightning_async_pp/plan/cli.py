"""The ``lightning-async-pp-plan`` command line: its arguments (:func:`parser`) and :func:`main`, which prints
:func:`~lightning_async_pp.plan.report.plan`'s report."""
from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence

from lightning_async_pp.pipeline.schedule import PLANNER_SCHEDULES
from lightning_async_pp.plan.balanced import OPTIMIZER_STATE_RULES
from lightning_async_pp.plan.costs import DEFAULT_STAGES
from lightning_async_pp.plan.report import plan
from lightning_async_pp.plan.shapes import MODELS
from lightning_async_pp.plan.tensor import check_tensor_parallel_args


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-async-pp-plan",
        description="Predict step time, bubble and in-flight activations of 2bw and the synchronous schedules "
                    "(1f1b, gpipe, zb_h1, interleaved_1f1b, zbv) by simulating their action lists.",
        epilog="Examples: lightning-async-pp-plan --layers 8 --forward-s 0.0012 --stages 2 4 8 --microbatches 4 8; "
               "lightning-async-pp-plan --model smollm-360m --split-blocks --stages 2 4 8 16 32 64 --microbatches 64 128",
    )
    ap.add_argument("--schedules", nargs="+", choices=PLANNER_SCHEDULES, default=list(PLANNER_SCHEDULES))
    ap.add_argument("--virtual-stages", type=_positive_int, default=2,
                    help="model chunks per device under interleaved_1f1b (default 2)")
    ap.add_argument("--weight-grad-fraction", type=_open_fraction, default=0.5,
                    help="share of a backward that is the weight gradient, for zb_h1 and zbv (default 0.5)")
    ap.add_argument("--stages", "-p", nargs="+", type=_positive_int,
                    help="numbers of stages (default 2 4 8 16 32 64; with --stage-forward-s: their count)")
    ap.add_argument("--microbatches", "-m", nargs="+", type=_positive_int, default=[8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=6, help="training steps simulated (>= 3; first and last not counted)")
    ap.add_argument("--trace", help="write the timelines as a Chrome trace here (several: one file per schedule, p, m)")
    ap.add_argument("--figure", help="draw the timelines as a PNG here, as PipelineMonitor draws an executed step "
                                     "(several: one file per schedule, p, m; needs matplotlib)")
    c = ap.add_argument_group("costs per layer or per stage (seconds per microbatch)")
    c.add_argument("--forward-s", type=_non_negative, help="forward time of one layer")
    c.add_argument("--backward-s", type=_non_negative, help="backward time of one layer (default: --backward-ratio x forward)")
    c.add_argument("--stage-forward-s", nargs="+", type=_non_negative, help="forward time of each stage (fixes p)")
    c.add_argument("--stage-backward-s", nargs="+", type=_non_negative, help="backward time of each stage")
    c.add_argument("--comm-s", type=_non_negative, help="transfer time of one activation or gradient between stages "
                   "(default 0, or computed from the model shape and --link-gbps)")
    c.add_argument("--optimizer-s", type=_non_negative, default=0.0, help="optimizer update per stage and step (default 0)")
    c.add_argument("--backward-ratio", type=_positive, default=2.0, help="backward / forward time (default 2)")
    c.add_argument("--tied-reduce-s", type=_non_negative,
                   help="the first and last stage share a tied weight (embedding and head) whose gradient they "
                        "all-reduce in this many seconds before every update (default: no tie)")
    s = ap.add_argument_group("costs from a model shape")
    s.add_argument("--model", choices=sorted(MODELS), help="a preset shape (the flags below override its fields)")
    s.add_argument("--layers", type=_positive_int, help="layers (blocks of a shape, or identical layers with --forward-s)")
    for name in ("hidden", "heads", "kv-heads", "intermediate", "vocab", "seq-len"):
        s.add_argument(f"--{name}", type=_positive_int)
    s.add_argument("--split-blocks", action="store_true",
                   help="attention and MLP as separate pipeline layers (twice the layers, for p above the block count)")
    s.add_argument("--microbatch-size", type=_positive_int, default=1, help="sequences per microbatch (default 1)")
    s.add_argument("--tflops", type=_positive, default=400.0, help="accelerator peak TFLOP/s (default 400, bf16)")
    s.add_argument("--mfu", type=_fraction, default=0.4, help="share of the peak reached (default 0.4)")
    s.add_argument("--link-gbps", type=_positive, default=25.0, help="link bandwidth between stages, GB/s (default 25)")
    s.add_argument("--bytes-per-value", type=_positive_int, default=2, help="bytes per activation value (default 2)")
    s.add_argument("--param-bytes", type=_positive_int, default=4,
                   help="bytes per parameter and per gradient value, for the memory table (default 4: fp32, as "
                        "bf16-mixed keeps them)")
    s.add_argument("--correction-buffers", type=_non_negative, default=0.0,
                   help="a delay correction's buffers per parameter, for the memory table (default 0; ErrorFeedback 1)")
    s.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_RULES), default="adamw",
                   help="whose state the memory table counts (default adamw)")
    s.add_argument("--stage-memory-gib", type=_positive,
                   help="the balanced split keeps every stage's predicted peak under this many GiB (as the strategy's "
                        "stage_memory_gib)")
    s.add_argument("--last-stage-run-ahead", choices=["auto", "on", "off"], default="auto",
                   help="2bw's last stage runs the next batch's first microbatch before its update, holding a second "
                        "gradient (as the strategy's last_stage_run_ahead): auto (default) turns it off only where "
                        "no split fits --stage-memory-gib with it")
    d = ap.add_argument_group("data parallelism (a second table)")
    d.add_argument("--data-parallel", "-r", type=_positive_int, default=1, help="replicas of each stage (default 1)")
    d.add_argument("--dp-gbps", type=_positive, help="bandwidth of the replicas' link, GB/s (default --link-gbps)")
    d.add_argument("--dp-latency-s", type=_non_negative, default=5e-6, help="latency per ring step (default 5 µs)")
    d.add_argument("--grad-bytes", type=_positive_int, default=4, help="bytes per gradient value (default 4, fp32)")
    d.add_argument("--dp-buckets", type=_positive_int, default=8, help="buckets the overlapped reduction uses (default 8)")
    d.add_argument("--dp-reduce-s", type=_non_negative, help="seconds of one stage's reduction (without a model shape)")
    d.add_argument("--shard-optimizer", action="store_true",
                   help="ZeRO-1 (the strategy's shard_optimizer=True): the memory table splits each stage's optimizer "
                        "state and correction buffer over its replicas")
    t = ap.add_argument_group("tensor parallelism (a further table; the strategy does not run it yet)")
    t.add_argument("--tensor-parallel", "-t", nargs="+", type=_positive_int,
                   help="devices per stage: a table of each (pipeline, tensor) layout's step, memory per device and "
                        "whether it fits --device-memory-gib (needs a model shape)")
    t.add_argument("--tp-gbps", type=_positive, default=300.0,
                   help="bus bandwidth of the tensor-parallel group's all-gathers and reduce-scatters, GB/s "
                        "(default 300: intra-node NVLink, somewhat below what NCCL's all-gather reaches on an H100 node)")
    t.add_argument("--tp-latency-s", type=_non_negative, default=10e-6, help="latency per ring step (default 10 µs)")
    t.add_argument("--device-memory-gib", type=_positive, default=76.0,
                   help="memory a device offers a stage, GiB (default 76: an 80 GB GPU less its CUDA context, "
                        "NCCL's buffers and fragmentation)")
    return ap


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _non_negative(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _open_fraction(text: str) -> float:
    value = _non_negative(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(f"--steps must be >= 3, got {args.steps}")
    modes = [args.stage_forward_s is not None, args.forward_s is not None,
             args.model is not None or args.hidden is not None]
    if sum(modes) > 1:
        ap.error("give one source of costs: --stage-forward-s, or --layers with --forward-s, or a model shape")
    if args.stage_forward_s is not None and args.stages not in (None, [len(args.stage_forward_s)]):
        ap.error(f"--stage-forward-s gives the costs of {len(args.stage_forward_s)} stages; --stages {args.stages} "
                 f"disagrees (leave it out)")
    if args.stages is None:
        args.stages = list(DEFAULT_STAGES)
    if args.tensor_parallel:
        check_tensor_parallel_args(ap, args)
    try:
        lines, _ = plan(args)
    except ValueError as err:  # a cost simulate() rejects, named there
        ap.error(str(err))
    print("\n".join(lines))

