"""The planner's ``--tensor-parallel``: each stage split over ``t`` devices as the Llama plan of
docs/design/tensor-parallel.md, "Tensor parallelism" splits it (Megatron-style column and row parallel matrices,
the vocabulary split, sequence parallelism between them), priced per device.

Per pipeline layer (:func:`tensor_parallel_layer_costs`, equal to ``Shape.layer_costs`` at ``t = 1``): FLOPs,
parameters (the norms' weights stay whole on every rank), the bytes a forward keeps and a backward's transient are
``1 / t``, except what stays whole: the gathered input of each column-parallel matrix (autograd keeps it for the
weight gradient), the rotary tables, the token ids and labels. What crosses a stage boundary is a rank's
sequence shard (``1 / t``). Per block and microbatch the forward runs two all-gathers and two reduce-scatters of
``tokens x hidden`` values over the tensor-parallel group and the backward the same four (the embedding and the
head one more each way), each a ring over ``--tp-gbps``, added to the layer's time (eager DTensor collectives do
not overlap the compute) by :func:`tensor_parallel_collective_seconds`. The engine runs this plan for
``models.Llama``; the table says what it does not run yet.
"""
from __future__ import annotations

import argparse
from typing import Optional

from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides
from lightning_async_pp.pipeline.simulate import simulate
from lightning_async_pp.plan.balanced import LayerCost, MemoryModel, split_and_run_ahead, stage_memory_bytes, stage_peak
from lightning_async_pp.plan.shapes import Shape
from lightning_async_pp.plan.units import fmt_seconds

#: Schedules the table covers: one chunk per device (interleaved and V schedules hold chunks the table does not split).
TP_SCHEDULES = ("2bw", "1f1b", "gpipe", "zb_h1")
NOT_RUN_YET = ("The strategy runs this table's plan for models.Llama (tensor_parallel_size), and a simpler one "
               "(embedding, head, norms and activations whole on every rank) for transformers' Llama and Qwen2 and "
               "modules with their own plan; not yet every option or model "
               "(docs/design/tensor-parallel.md, 'What runs').")


def check_tensor_parallel_shape(shape: Shape, t: int) -> None:
    """``t`` must split the heads, key/value heads, hidden and intermediate sizes, and the sequence (sequence
    parallelism), evenly; the error names the size."""
    check_tensor_parallel_divides(t, {"heads": shape.heads, "kv_heads": shape.kv_heads, "hidden": shape.hidden,
                                      "intermediate": shape.intermediate, "seq_len": shape.seq_len,
                                      "vocab": shape.vocab})


def tensor_parallel_layer_costs(shape: Shape, t: int, *, split_blocks: bool, tokens: int, value_bytes: int,
                                param_bytes: int, backward_ratio: float) -> list[LayerCost]:
    """What one of a stage's ``t`` devices holds and computes per pipeline layer (module docstring); the terms are
    ``Shape.layer_saved_bytes``'s, each divided by ``t`` where the plan splits it."""
    h, v, kv = shape.hidden, value_bytes, shape.kv_dim
    # an RMSNorm: fp32 input, reciprocal RMS and its output split; the output gathered (whole) for the next matrix
    norm = tokens * (4 * h + 4 + v * h) / t + tokens * v * h
    rotary = 2 * v * shape.head_dim * shape.seq_len  # cos and sin per position: every rank, whole
    attention = norm + tokens * (2 * v * h + 2 * v * kv + 4 * shape.heads) / t + rotary
    mlp = norm + tokens * 4 * v * shape.intermediate / t
    saved = shape._per_layer(attention, mlp, split_blocks)
    saved[0] += tokens * 8  # token ids, whole
    saved[-1] += norm + tokens * 4 * shape.vocab / t + tokens * 8  # final norm, split log-probabilities, labels
    # parameters: matrices split, norm weights whole
    att_split, mlp_split = 2 * h * h + 2 * h * kv, 3 * h * shape.intermediate
    params = shape._per_layer(att_split / t + h, mlp_split / t + h, split_blocks)
    matrices = shape._per_layer(att_split / t, mlp_split / t, split_blocks)
    params[0] += shape.vocab * h / t
    params[-1] += shape.vocab * h / t + h
    block = tokens * 2 * v * (shape.intermediate + h) / t
    transient = [block] * len(saved)
    transient[-1] = max(transient[-1], tokens * 8 * shape.vocab / t)
    boundary = round(tokens * h * v / t)
    return [LayerCost(round(f * tokens / t), round(f * tokens * backward_ratio / t), round(n * param_bytes),
                      round(s), input_bytes=boundary, output_bytes=boundary, transient_bytes=round(tr),
                      matrix_param_bytes=round(mx * param_bytes))
            for f, n, s, tr, mx in zip(shape.pipeline_layers(split_blocks), params, saved, transient, matrices)]


def ring_seconds(nbytes: float, t: int, gbps: float, latency_s: float) -> float:
    """One ring all-gather or reduce-scatter of a tensor of ``nbytes`` (whole) over ``t`` ranks: each rank moves
    ``(t - 1) / t`` of it, in ``t - 1`` steps."""
    return 0.0 if t == 1 else (t - 1) / t * nbytes / (gbps * 1e9) + (t - 1) * latency_s


def tensor_parallel_collective_seconds(shape: Shape, t: int, *, split_blocks: bool, tokens: int, value_bytes: int,
                                       gbps: float, latency_s: float) -> tuple[list[float], list[float]]:
    """Seconds of tensor-parallel collectives in each pipeline layer's forward and backward per microbatch:
    per attention or MLP one all-gather (into its column-parallel matrices) and one reduce-scatter (out of its
    row-parallel one) each way; the embedding's reduce-scatter and the head's all-gather (and their backward
    counterparts) once. ``loss_parallel``'s all-reduces of a few values per token are left out."""
    one = ring_seconds(tokens * shape.hidden * value_bytes, t, gbps, latency_s)
    per_layer = shape._per_layer(2 * one, 2 * one, split_blocks)  # a block: attention's two and the MLP's two
    per_layer[0] += one
    per_layer[-1] += one
    return list(per_layer), list(per_layer)


def tensor_parallel_rows(args: argparse.Namespace, shape: Shape, stages: list[int]) -> tuple[list[str], list[dict]]:
    """The tensor-parallel table's Markdown lines and one record per row (``t``, ``p``, ``m``, schedule): the
    balanced split under each schedule's memory with the per-device costs (every stage under
    ``--device-memory-gib`` where some split fits), its simulated step, and the largest device's peak."""
    tokens = args.microbatch_size * shape.seq_len
    rate = args.tflops * 1e12 * args.mfu
    cap = args.device_memory_gib * 2**30
    schedules = [s for s in dict.fromkeys(args.schedules) if s in TP_SCHEDULES]
    rows: list[str] = []
    records: list[dict] = []
    for t in args.tensor_parallel:
        costs = tensor_parallel_layer_costs(shape, t, split_blocks=args.split_blocks, tokens=tokens,
                                            value_bytes=args.bytes_per_value, param_bytes=args.param_bytes,
                                            backward_ratio=args.backward_ratio)
        coll_f, coll_b = tensor_parallel_collective_seconds(shape, t, split_blocks=args.split_blocks, tokens=tokens,
                                                            value_bytes=args.bytes_per_value, gbps=args.tp_gbps,
                                                            latency_s=args.tp_latency_s)
        forward = [c.forward_flops / rate + s for c, s in zip(costs, coll_f)]
        backward = [c.backward_flops / rate + s for c, s in zip(costs, coll_b)]
        comm_s = costs[0].output_bytes / (args.link_gbps * 1e9)  # a rank's sequence shard to its peer
        block_coll = 8 * ring_seconds(tokens * shape.hidden * args.bytes_per_value, t, args.tp_gbps, args.tp_latency_s)
        for p in stages:
            if p > len(costs):
                continue
            for m in args.microbatches:
                for s in schedules:
                    record = _row(args, s, p, m, t, costs, forward, backward, comm_s, cap,
                                  shape.shared_parameters(args.split_blocks, args.param_bytes, t))
                    if record is None:
                        continue
                    record["collectives_per_block_s"] = block_coll
                    records.append(record)
                    rows.append(_format(record, tokens, args))
    return rows, records


def _row(args: argparse.Namespace, s: str, p: int, m: int, t: int, costs: list[LayerCost], forward: list[float],
         backward: list[float], comm_s: float, cap: float, shared: tuple = ()) -> Optional[dict]:
    model = MemoryModel(s, p, m, args.data_parallel, args.shard_optimizer, optimizer=args.optimizer,
                        correction_buffers=args.correction_buffers, param_shared=shared)
    times = [f + b for f, b in zip(forward, backward)]
    memory = lambda i, j, st, mm: stage_memory_bytes(costs, i, j, st, mm)  # noqa: E731
    try:
        counts, used = split_and_run_ahead(times, p, model, memory=memory, memory_cap=cap)
    except ValueError:  # no split fits: show the fastest split and its (too large) peak
        counts, used = split_and_run_ahead(times, p, model, memory=memory)
    stage_f, stage_b, start = [], [], 0
    for c in counts:
        stage_f.append(sum(forward[start : start + c]))
        stage_b.append(sum(backward[start : start + c]))
        start += c
    ahead = {} if s != "2bw" or (used.run_ahead and args.data_parallel == 1) else {"last_ahead": False}
    try:
        result = simulate(s, p, m, stage_f, stage_b, comm_s=comm_s, optimizer_s=args.optimizer_s, steps=args.steps,
                          weight_grad_fraction=args.weight_grad_fraction, **ahead)
    except ValueError as err:  # this (p, m) does not suit the schedule (2bw: m < p)
        if "needs num_microbatches" not in str(err):
            raise
        return None
    peaks, start = [], 0
    for device, c in enumerate(counts):
        peaks.append(stage_peak(costs, start, start + c, device, used, result=result))
        start += c
    device = max(range(p), key=lambda d: peaks[d].total)
    return {"t": t, "p": p, "m": m, "schedule": s, "devices": p * t * args.data_parallel, "layers_per_stage": counts,
            "step_time_s": result.step_time_s, "peak_device": device, "peak": peaks[device],
            "fits": peaks[device].total <= cap}


def _format(r: dict, tokens: int, args: argparse.Namespace) -> str:
    counts = r["layers_per_stage"]
    split = str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}"
    per_device = r["m"] * tokens * args.data_parallel / r["step_time_s"] / r["devices"]
    peak = r["peak"]
    return (f"| {r['t']} | {r['p']} | {r['devices']} | {r['m']} | {r['schedule']} | {split} | "
            f"{fmt_seconds(r['step_time_s'])} | {per_device:,.0f} | {fmt_seconds(r['collectives_per_block_s'])} | "
            f"{peak.weights / 2**30:.2f} | {peak.activations / 2**30:.2f} | {peak.total / 2**30:.2f} | "
            f"{'yes' if r['fits'] else 'no'} |")


def tensor_parallel_section(args: argparse.Namespace, shape: Shape, stages: list[int]) -> tuple[list[str], list[dict]]:
    """The report's tensor-parallel section: a heading, what the numbers assume, the table (or a line saying no
    (p, m) suits the schedules)."""
    rows, records = tensor_parallel_rows(args, shape, stages)
    lines = ["", f"## Tensor parallelism: t devices per stage ({', '.join(map(str, args.tensor_parallel))})", "",
             NOT_RUN_YET, "",
             f"Each stage split over t devices as the Llama plan of docs/design/tensor-parallel.md (column/row "
             f"parallel matrices, the vocabulary split, sequence parallelism between them): per device 1/t of the "
             f"FLOPs, the matrices (norm weights whole), their gradients, optimizer state and stashed version, and "
             f"of the activations, except the gathered input of each column-parallel matrix, the rotary tables, "
             f"token ids and labels (whole). Per block and microbatch 4 all-gathers / reduce-scatters of "
             f"microbatch x hidden values forward and 4 backward, each a ring over {args.tp_gbps:g} GB/s "
             f"(intra-node; --tp-gbps) plus {args.tp_latency_s * 1e6:g} µs per step, not overlapped with compute. "
             f"A stage sends its peer a sequence shard (1/t of the activation) over {args.link_gbps:g} GB/s. The split "
             f"is the balanced one under each schedule's memory, keeping every device under "
             f"{args.device_memory_gib:g} GiB where some split can (--device-memory-gib); *fits*: the largest "
             f"device's peak (by the memory table's account) is under it. Interleaved and V schedules are not "
             f"in this table. *tokens/s/device*: trained tokens per second over all {'devices' if args.data_parallel == 1 else 'devices of all replicas'}.",
             ""]
    if not rows:
        return lines + ["No (p, m) suits the schedules (2bw needs m >= p; p at most the pipeline layers)."], records
    lines += ["| t | p | devices | m | schedule | layers per stage | step | tokens/s/device | TP collectives per block "
              "(fwd+bwd) | weights GiB | activations GiB | peak GiB | fits |",
              "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|", *rows]
    return lines, records


def check_tensor_parallel_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--tensor-parallel`` needs a model shape, and each ``t`` must split it (argparse's error names why)."""
    from dataclasses import replace

    from lightning_async_pp.plan.shapes import MODELS

    if args.model is None and args.hidden is None:
        ap.error("--tensor-parallel needs a model shape (--model NAME, or --hidden --layers --heads ...): it splits "
                 "the shape's matrices")
    base = MODELS.get(args.model) if args.model else None
    fields = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
              "intermediate": args.intermediate, "vocab": args.vocab, "seq_len": args.seq_len}
    if base is None and any(v is None for v in fields.values()):
        return  # CostModel names the missing sizes
    shape = replace(base, **{k: v for k, v in fields.items() if v is not None}) if base else Shape(**fields)  # type: ignore[arg-type]
    for t in args.tensor_parallel:
        try:
            check_tensor_parallel_shape(shape, t)
        except ValueError as err:
            ap.error(f"--tensor-parallel {t}: {err}")
