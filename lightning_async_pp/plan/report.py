"""The planner's report: the Markdown tables (step and bubble per schedule, the split, memory per device, data
parallelism) from the simulated schedules, and the simulated timelines as a Chrome trace or a PNG, as
``PipelineMonitor`` writes and draws an executed step."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from lightning_async_pp.pipeline.simulate import SimulationResult, simulate
from lightning_async_pp.plan.balanced import OPTIMIZER_STATE_RULES
from lightning_async_pp.plan.costs import CostModel, Costs, device_memory, tied_kwargs
from lightning_async_pp.plan.memory import StageMemory
from lightning_async_pp.plan.tensor import tensor_parallel_section
from lightning_async_pp.plan.units import fmt_count, fmt_seconds


def label(schedule: str, args: argparse.Namespace) -> str:
    return f"interleaved_1f1b (v={args.virtual_stages})" if schedule == "interleaved_1f1b" else schedule


def trace_path(base: str, schedule: str, p: int, m: int, several: bool) -> str:
    if not several:
        return base
    path = Path(base)
    return str(path.with_name(f"{path.stem}-{schedule}-p{p}-m{m}{path.suffix or '.json'}"))


def optimizer_fraction(result: SimulationResult) -> float:
    """The share of the steady-state step a device spends in its optimizer update (mean over devices): the
    figure reported beside the bubble, which counts the update as work (``PipelineMonitor`` reports the same
    as ``pipeline/optimizer_fraction``). Each device runs one update per step."""
    if result.step_time_s <= 0:
        return 0.0
    return sum(result.optimizer_s) / len(result.optimizer_s) / result.step_time_s


def simulated_spans(result: SimulationResult) -> list:
    """The simulated timelines as the spans ``PipelineMonitor`` records: one process per stage, clock offset 0."""
    from lightning_async_pp.trace import ProcessSpans

    window = (0.0, result.makespan_s)
    return [
        ProcessSpans(rank=s, replica=0, stages=[s], clock_offset=0.0, window=window, steps=(0, result.steps - 1),
                     spans=[(s, span.op, span.start, span.end,
                             {"batch": span.batch, "step": span.step} if span.microbatch is None else
                             {"batch": span.batch, "microbatch": span.microbatch, "step": span.step})
                            for span in timeline])
        for s, timeline in enumerate(result.timelines)
    ]


def write_trace(result: SimulationResult, path: str) -> str:
    """The simulated timelines as the Chrome trace ``PipelineMonitor`` writes: one track per stage."""
    from lightning_async_pp.trace import write_chrome_trace

    return write_chrome_trace(path, simulated_spans(result), other_data={"simulated": {
        "schedule": result.schedule, "num_stages": result.num_stages, "num_microbatches": result.num_microbatches,
        "step_time_s": result.step_time_s, "bubble_fraction": result.bubble_fraction,
        "optimizer_fraction": optimizer_fraction(result),
        "peak_activations": result.peak_activations, "forward_s": result.forward_s, "backward_s": result.backward_s,
        "comm_s": result.comm_s, "optimizer_s": result.optimizer_s,
    }})


def write_figure(result: SimulationResult, path: str) -> str:
    """The simulated timelines drawn as ``PipelineMonitor`` draws an executed step (a row per stage), as a PNG."""
    from lightning_async_pp.trace import schedule_figure

    title = (f"simulated {result.schedule}: {result.num_stages} stages, {result.num_microbatches} microbatches, "
             f"{result.steps} steps; step {fmt_seconds(result.step_time_s)}, bubble {result.bubble_fraction:.0%}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    schedule_figure(simulated_spans(result), title=title).savefig(path)
    return path


def plan(args: argparse.Namespace) -> tuple[list[str], list[dict]]:
    """The report's lines and one record per (p, m) with every simulated schedule's result."""
    model = CostModel(args)
    schedules = list(dict.fromkeys(args.schedules))
    lines = [f"# Pipeline plan (simulated from the engine's action lists, {args.steps} steps, steady state)", ""]
    if model.shape is not None:
        sh = model.shape
        lines += [
            f"Model: hidden {sh.hidden}, {sh.layers} blocks, {sh.heads} heads ({sh.kv_heads} key/value), intermediate "
            f"{sh.intermediate}, vocabulary {sh.vocab}, sequence {sh.seq_len}: {fmt_count(sh.parameters())} "
            f"parameters; {'attention and MLP as separate pipeline layers' if args.split_blocks else 'one pipeline layer per block'}.",
            f"Forward FLOPs per token: attention {sh.attention_flops() / 1e6:.1f} M + MLP {sh.mlp_flops() / 1e6:.1f} M "
            f"per block, head {sh.head_flops() / 1e6:.1f} M; backward = {args.backward_ratio:g} x forward.",
            f"Microbatch: {args.microbatch_size} x {sh.seq_len} tokens; accelerator {args.tflops:g} TFLOP/s at "
            f"{args.mfu:.0%} MFU; one block's forward {fmt_seconds(sum(model.layer_forward[:len(model.layer_forward) // sh.layers]))} "
            f"per microbatch; activation {model.activation_bytes() / 2**20:.2f} MiB per microbatch over "
            f"{args.link_gbps:g} GB/s = {fmt_seconds(model.comm_s)} per transfer; optimizer "
            f"{fmt_seconds(args.optimizer_s)} per step.",
        ]
    elif model.fixed_stages is not None:
        lines.append(f"Per-stage costs: forward {args.stage_forward_s} s, backward {model.stage_backward} s, "
                     f"transfer {model.comm_s:g} s, optimizer {args.optimizer_s:g} s.")
    else:
        lines.append(f"{args.layers} layers of forward {args.forward_s:g} s, backward "
                     f"{args.forward_s * model.backward_ratio:g} s per microbatch; transfer {model.comm_s:g} s, "
                     f"optimizer {args.optimizer_s:g} s.")
    if args.tied_reduce_s is not None:
        lines.append(f"A tied weight on the devices of the first and the last layer: its gradient is summed in "
                     f"{fmt_seconds(args.tied_reduce_s)} before every update, which waits for both devices' steps "
                     f"(zbv holds both ends on device 0).")
    lines += ["", "*bubble*: share of the steady-state step a device neither computes nor updates its weights (mean "
              "over devices; the definition of PipelineMonitor's pipeline/bubble_fraction); *optimizer*: the share it "
              "spends in the optimizer's update, apart from the bubble; *x 1f1b*: 1f1b's step "
              "time / this one's; *x best sync*: the fastest synchronous schedule's step time / 2bw's; *peak act.*: "
              "the most activations a device holds, in microbatches of its share of the model (a split backward frees "
              "them with its weight gradient); *weights*: copies of its share of the weights a device holds (2bw "
              "stashes a second version; interleaved and zbv hold the same share in several chunks).", ""]
    head = ["p", "m", "layers per stage", "schedule", "step", "bubble", "optimizer", "x 1f1b", "x best sync", "peak act.",
            "weights"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * 3 + "---|" + "---:|" * (len(head) - 4)]

    records: list[dict] = []
    memory_lines: list[str] = []
    dp_lines: list[str] = []
    written: list[str] = []
    figures: list[str] = []
    several = len(model.stages(args.stages)) * len(args.microbatches) * len(schedules) > 1
    split_lines: list[str] = []
    behind: list[str] = []  # (p, m) where 2bw's last stage does not run ahead
    over: list[str] = []  # (schedule, p, m) where no split keeps every device under --stage-memory-gib
    for p in model.stages(args.stages):
        for m in args.microbatches:
            planned = list(dict.fromkeys([*schedules, "1f1b"]))
            # each schedule on the balanced split under its own memory model (the one the engine running it picks)
            per = {s: model.costs(p, m, schedule=s) for s in planned}
            costs = per[schedules[0]]
            if costs is None:
                lines.append(f"| {p} | {m} | - | - | more stages than the {len(model.layer_forward)} pipeline layers"
                             + (" (--split-blocks doubles them)" if model.shape and not args.split_blocks else "")
                             + " |" + " |" * (len(head) - 5))
                continue
            results: dict[str, Optional[SimulationResult]] = {}
            refused: dict[str, str] = {}
            for s in planned:
                c = per[s]
                assert c is not None
                try:
                    # as the engine runs it: 2bw's last stage runs ahead with one pipeline only
                    ahead = ({} if s != "2bw" or (model.run_ahead(p, m) and args.data_parallel == 1)
                             else {"last_ahead": False})
                    results[s] = simulate(s, p, m, c.forward_s, c.backward_s, comm_s=c.comm_s,
                                          optimizer_s=args.optimizer_s, steps=args.steps, **ahead,
                                          virtual_stages=args.virtual_stages,
                                          weight_grad_fraction=args.weight_grad_fraction, **tied_kwargs(args, s, p))
                except ValueError as err:  # this (p, m) does not suit the schedule (2bw: m < p; interleaved: m % p)
                    if "needs num_microbatches" not in str(err) and "multiple of" not in str(err):
                        raise
                    results[s] = None
                    refused[s] = "needs m >= p" if s == "2bw" else "needs m a multiple of p"
                    continue
                if args.trace and s in schedules:
                    written.append(write_trace(results[s], trace_path(args.trace, s, p, m, several)))
                if args.figure and s in schedules:
                    figures.append(write_figure(results[s], trace_path(args.figure, s, p, m, several)))
            base = results["1f1b"]
            assert base is not None
            sync = {s: r for s, r in results.items() if r is not None and s != "2bw"}
            best = min(sync, key=lambda s: sync[s].step_time_s)  # type: ignore[union-attr]
            counts = costs.layers_per_stage
            for s in schedules:
                r = results[s]
                split = split_cell(per[s].layers_per_stage, model.over_cap(p, m, s) if r is not None else None)  # type: ignore[union-attr]
                if r is None:
                    lines.append(f"| {p} | {m} | {split} | {label(s, args)} | {refused[s]} | - | - | - | - | - | - |")
                    continue
                versus = f"{sync[best].step_time_s / r.step_time_s:.2f} ({label(best, args)})" if s == "2bw" else "-"
                weights = "2 versions" if r.weight_versions == 2 else "1" if r.chunks == 1 else f"1 in {r.chunks} chunks"
                lines.append(f"| {p} | {m} | {split} | {label(s, args)} | {fmt_seconds(r.step_time_s)} | "
                             f"{r.bubble_fraction:.1%} | {optimizer_fraction(r):.1%} | {base.step_time_s / r.step_time_s:.2f} | {versus} | "
                             f"{r.peak_activation_memory:.3g} | {weights} |")
            records.append({"p": p, "m": m, "layers_per_stage": counts, "best_sync": best,
                            "results": {s: r for s, r in results.items() if s in schedules},
                            "schedule_splits": {s: per[s].layers_per_stage for s in schedules},  # type: ignore[union-attr]
                            "over_cap": {s: model.over_cap(p, m, s) for s in schedules
                                         if results[s] is not None and model.over_cap(p, m, s) is not None}})
            for s, least in records[-1]["over_cap"].items():
                over.append(f"{label(s, args)} at p = {p}, m = {m} (the least largest peak of any split: "
                            f"{least / 2**30:.2f} GiB)")
            if "2bw" in schedules and p > 1 and args.data_parallel == 1 and not model.run_ahead(p, m):
                behind.append(f"p = {p}, m = {m}")
            if counts is not None and model.shape is not None:  # identical layers: every method splits alike
                rows, records[-1]["splits"] = split_rows(args, model, p, m, results, schedules)
                split_lines += rows
            if model.shape is not None and counts is not None:
                tokens = args.microbatch_size * model.shape.seq_len
                memory = {s: device_memory(model.shape, per[s].layers_per_stage, results[s], tokens=tokens,  # type: ignore
                                           value_bytes=args.bytes_per_value, param_bytes=args.param_bytes,
                                           optimizer=args.optimizer,
                                           correction_buffers=args.correction_buffers, split_blocks=args.split_blocks,
                                           data_parallel=args.data_parallel, shard_optimizer=args.shard_optimizer,
                                           run_ahead=model.run_ahead(p, m))
                          for s in schedules if results[s] is not None}
                records[-1]["memory"] = memory
                memory_lines += [memory_row(p, m, label(s, args), per_device, s in records[-1]["over_cap"])
                                 for s, per_device in memory.items()]
            if costs.dp_reduce_s:
                dp = dp_row(args, p, m, per, [s for s in schedules if results[s] is not None])
                dp_lines.append(dp[0])
                records[-1]["data_parallel"] = dp[1]
    if over:
        lines += ["", f"**Over the cap**: no split keeps every device under --stage-memory-gib "
                  f"{args.stage_memory_gib:g} for " + "; ".join(over) + ". Those rows (marked *over cap*) use the "
                  "split nearest to fitting; the engine would refuse them: more stages, fewer microbatches in "
                  "flight, activation checkpointing or a larger cap."]
    if behind:
        lines += ["", "2bw's last stage does not run the next batch ahead of its update at "
                  + "; ".join(behind) + (": no split fits --stage-memory-gib with its second gradient"
                                         if args.last_stage_run_ahead == "auto" else " (--last-stage-run-ahead off)")
                  + "; its step is simulated and its memory counted that way."]
    if split_lines:
        lines += ["", "## Split: balanced against parameters and uniform", "",
                  "Layers per stage and the simulated step of each way to split them: *balanced* (what "
                  "`partition=\"balanced\"`, the engine's default, picks from the same per-layer costs: the slowest "
                  "stage's forward and backward least"
                  + (f", every stage's predicted memory under {args.stage_memory_gib:g} GiB" if args.stage_memory_gib
                     else "") + "), *parameters* (parameter counts balanced) and *uniform* (layer counts); "
                  "*x balanced*: this split's step / the balanced one's. The tables above use the balanced split, each "
                  "schedule its own (its memory weighed on its own action order).", "",
                  "| p | m | schedule | split | layers per stage | step | x balanced |",
                  "|---:|---:|---|---|---|---:|---:|", *split_lines]
    if memory_lines:
        lines += ["", "## Memory per device (peak, GiB)", "",
                  f"The device with the largest peak, by what holds it (`plan.memory.stage_memory` over the "
                  f"simulated timeline): parameters and gradients at {args.param_bytes} bytes each, "
                  f"the optimizer's state as {args.optimizer} keeps it ({OPTIMIZER_STATE_RULES[args.optimizer]}), "
                  f"{args.correction_buffers:g} correction buffers per parameter (ErrorFeedback 1) and as many "
                  f"transient copies in its update; "
                  f"activations at {args.bytes_per_value} bytes per value as transformers' Llama layers keep them "
                  f"under SDPA's causal kernel (in one dtype throughout; under autocast each matmul also keeps a "
                  f"bf16 copy of its input), a microbatch's input and output, and its "
                  f"backward's largest transient, an estimate; a batch's first backward allocates its gradients as it "
                  f"frees activations (the larger of the two counts)"
                  + (f"; with {args.data_parallel} replicas the engine runs no batch ahead, so one gradient"
                     if args.data_parallel > 1 else "")
                  + (f"; optimizer state and correction split over the {args.data_parallel} replicas (ZeRO-1)"
                     if args.shard_optimizer and args.data_parallel > 1 else "")
                  + ". The engine prints its own account at setup (the same function, `cost.stage_peak`), fed what "
                  "its layers keep as costed on fake tensors in the run's precision (a block at 4 bytes per value "
                  "keeps what these formulas say), the configured optimizer's state, and no backward transient: "
                  "for a small model this table's larger figure is mostly the head's transient (the loss's "
                  "gradients, 8 x vocabulary bytes per token). docs/guide/planning.md, \"Memory\".", "",
                  "| p | m | schedule | device | weights | versions | gradients | optimizer state | correction | "
                  "activations | total |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|", *memory_lines]
    if dp_lines:
        r = args.data_parallel
        gbps = args.dp_gbps if args.dp_gbps is not None else args.link_gbps
        lines += ["", f"## Data parallel: {r} replicas per stage", "",
                  f"Each stage's gradient ({args.grad_bytes} bytes per parameter) is all-reduced over its {r} replicas "
                  f"(ring: 2 (r-1)/r x bytes / {gbps:g} GB/s + 2 (r-1) x {fmt_seconds(args.dp_latency_s)}), on a link "
                  f"of its own. Step time (and, in brackets, the reduction time per step not hidden, the slowest "
                  f"stage's) with the reduction *after* the step's last action, *overlapped* from the last backward "
                  f"in {args.dp_buckets} buckets (what the engine does), and for 2bw *deferred* until batch k+2's first "
                  f"forward (not done inside Lightning's loop; see docs/design/data-parallel.md, \"Data parallelism\").", ""]
        head = ["p", "m", "gradient / stage (max)", "reduction (max)"]
        for s in schedules:
            head += [f"{s} after", f"{s} overlapped"] + (["2bw deferred"] if s == "2bw" else [])
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)] + dp_lines
    if getattr(args, "tensor_parallel", None) and model.shape is not None:
        tp_lines, tp_records = tensor_parallel_section(args, model.shape, model.stages(args.stages))
        lines += tp_lines
        records.append({"tensor_parallel": tp_records})
    if written:
        lines += ["", f"Timelines (Chrome trace) written to {written[0]}"
                  + (f" and {len(written) - 1} more files beside it" if len(written) > 1 else "")]
    if figures:
        lines += ["", f"Timelines (PNG) drawn to {figures[0]}"
                  + (f" and {len(figures) - 1} more files beside it" if len(figures) > 1 else "")]
    return lines, records


def split_cell(counts: Optional[list[int]], over: Optional[float] = None) -> str:
    """The main table's *layers per stage*: the count, or the range where stages differ; *over cap* where no split
    fits ``--stage-memory-gib`` (``over``: the least largest peak, bytes)."""
    text = "-" if counts is None else (str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}")
    return text if over is None else f"{text} (over cap)"


def split_rows(args: argparse.Namespace, model: CostModel, p: int, m: int,
               results: dict[str, Optional[SimulationResult]], schedules: list[str]) -> tuple[list[str], dict]:
    """Rows of the split table: each schedule simulated on the balanced split (its own: the memory cap is checked
    under its action order), the parameters and the uniform split. The record's balanced ``layers_per_stage`` is
    the first schedule's; each schedule's is in ``layers_per_stage_by_schedule``."""
    rows, record = [], {}
    for method in ("balanced", "parameters", "uniform"):
        listed = [s for s in schedules if s in ("2bw", "1f1b", "gpipe", "zb_h1") and results.get(s) is not None]
        by_schedule = {s: model.split(p, m, method, schedule=s) for s in schedules}
        record[method] = {"layers_per_stage": by_schedule[schedules[0]]}
        if method == "balanced":
            record[method]["layers_per_stage_by_schedule"] = by_schedule
        for s in listed:
            counts = by_schedule[s]
            costs = model.costs(p, m, counts)
            assert costs is not None
            r = results[s] if method == "balanced" else simulate(
                s, p, m, costs.forward_s, costs.backward_s, comm_s=costs.comm_s, optimizer_s=args.optimizer_s,
                steps=args.steps, weight_grad_fraction=args.weight_grad_fraction, **tied_kwargs(args, s, p))
            assert r is not None
            base = results[s]
            assert base is not None
            record[method][s] = r.step_time_s
            rows.append(f"| {p} | {m} | {s} | {method} | {counts} | {fmt_seconds(r.step_time_s)} | "
                        f"{r.step_time_s / base.step_time_s:.2f} |")
    return rows, record


def memory_row(p: int, m: int, schedule: str, per_device: list[StageMemory], over_cap: bool = False) -> str:
    device = max(range(len(per_device)), key=lambda d: per_device[d].total)
    peak = per_device[device]
    gib = [f"{b / 2**30:.2f}" for b in (peak.weights, peak.versions, peak.gradients, peak.optimizer_state,
                                         peak.correction, peak.activations, peak.total)]
    if over_cap:
        gib[-1] += " (over cap)"
    return f"| {p} | {m} | {schedule} | {device} | " + " | ".join(gib) + " |"


def dp_row(args: argparse.Namespace, p: int, m: int, per: dict[str, Optional[Costs]],
           schedules: list[str]) -> tuple[str, dict]:
    """One row of the data-parallel table and its results: every schedule (on its own split: ``per``) with each
    placement of the reduction; the gradient and reduction columns are the largest over the schedules' splits."""
    split = [c for c in per.values() if c is not None]
    grads = [max(c.gradient_bytes) for c in split if c.gradient_bytes]
    cells = [str(p), str(m), f"{max(grads) / 2**30:.2f} GiB" if grads else "-",
             fmt_seconds(max(max(c.dp_reduce_s) for c in split))]
    results: dict[str, SimulationResult] = {}
    for s in args.schedules:
        if s not in schedules:
            cells += ["-", "-"] + (["-"] if s == "2bw" else [])
            continue
        costs = per[s]
        assert costs is not None
        for mode in ("none", "backward") + (("deferred",) if s == "2bw" else ()):
            r = results[f"{s}/{mode}"] = simulate(
                s, p, m, costs.forward_s, costs.backward_s, comm_s=costs.comm_s, optimizer_s=args.optimizer_s,
                steps=max(args.steps, 4), dp_reduce_s=costs.dp_reduce_s, dp_overlap=mode, dp_buckets=args.dp_buckets,
                **tied_kwargs(args, s, p))
            cells.append(f"{fmt_seconds(r.step_time_s)} ({fmt_seconds(max(r.dp_exposed_s))})")
    return "| " + " | ".join(cells) + " |", results
