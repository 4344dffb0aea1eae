"""The planner's ``--expert-parallel``: a shape whose MLPs are routed experts (``--experts``, or ``--model
qwen3-30b-a3b``) with each stage's experts split over ``e`` of its ``data_parallel x tensor_parallel`` ranks, as
``AsyncPipelineStrategy(expert_parallel_size=e)`` splits them (docs/design/expert-parallel.md), priced per device.

Per pipeline layer (:func:`expert_parallel_layer_costs`, equal to ``Shape.layer_costs`` at ``t = e = 1``): the
attention, the norms, the embedding and the head as ``--tensor-parallel`` prices them (plan/tensor.py: split over
``t``); each MoE layer's router whole on every rank, its routed experts whole, ``E / e`` of them per rank, and a
shared expert split over ``t``. So a rank's parameters, both 2BW versions of them, their gradients, the optimizer's
state and a correction's buffers count ``1 / e`` of the experts. A rank routes its share of the microbatch's tokens
(``1 / t``: the sequence shard), and with balanced routing its experts receive as many token copies as it sends,
``tokens / t x top-k``: the experts' FLOPs and kept activations per rank are ``1 / t`` of one device's, whatever
``e``. Per MoE layer and microbatch the forward runs two all-to-alls over the expert group (dispatch and combine)
and the backward two (their gradients), each moving the ``(e - 1) / e`` of a rank's ``tokens / t x top-k x hidden``
values that leave it over ``--ep-gbps``, plus ``--ep-latency-s``; the forward one more latency for the exchange of
the split sizes (the one host read per MoE layer and microbatch). Not overlapped with compute, as the engine runs
them. Routing imbalance is not modelled: a rank whose experts receive more tokens computes (and waits) longer.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from lightning_async_pp.parallel.mesh import expert_size_message
from lightning_async_pp.plan.balanced import LayerCost
from lightning_async_pp.plan.shapes import Shape, shape_from_args
from lightning_async_pp.plan.tensor import (TP_SCHEDULES, _row, tensor_parallel_collective_seconds,
                                            tensor_parallel_layer_costs)
from lightning_async_pp.plan.units import fmt_seconds


def expert_parallel_layer_costs(shape: Shape, t: int, e: int, *, split_blocks: bool, tokens: int, value_bytes: int,
                                param_bytes: int, backward_ratio: float) -> list[LayerCost]:
    """What one device of a stage split over ``t`` tensor-parallel ranks, with its experts split over ``e``,
    holds and computes per pipeline layer (module docstring)."""
    h, v = shape.hidden, value_bytes
    dense = replace(shape, experts=0, intermediate=0, expert_intermediate=0, shared_intermediate=0)
    base = tensor_parallel_layer_costs(dense, t, split_blocks=split_blocks, tokens=tokens, value_bytes=v,
                                       param_bytes=param_bytes, backward_ratio=backward_ratio)
    si = shape.shared_intermediate
    shared = 3 * h * si / t + h if si else 0  # the shared expert split as a dense MLP, its gate whole
    matrices = h * shape.experts + shape.expert_parameters() / e + shared
    mlp = shape._per_layer(0, 1, split_blocks)  # 1 where a pipeline layer holds a block's MLP
    flops = shape.mlp_flops() * tokens / t
    saved = shape.routed_saved_bytes(tokens / t, v)
    transient = tokens * 2 * v * (shape.active_intermediate + h) / t
    costs = []
    for i, (c, moe) in enumerate(zip(base, mlp)):
        tr = max(transient, tokens * 8 * shape.vocab / t) if i == len(base) - 1 else transient
        costs.append(replace(c, forward_flops=c.forward_flops + round(moe * flops),
                             backward_flops=c.backward_flops + round(moe * flops * backward_ratio),
                             param_bytes=c.param_bytes + round(moe * matrices * param_bytes),
                             matrix_param_bytes=c.matrix_param_bytes + round(moe * matrices * param_bytes),
                             activation_bytes=c.activation_bytes + round(moe * saved), transient_bytes=round(tr)))
    return costs


def all_to_all_seconds(shape: Shape, t: int, e: int, *, tokens: int, value_bytes: int, gbps: float,
                       latency_s: float) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls per microbatch, forward and backward (module docstring)."""
    if e == 1:
        return 0.0, 0.0
    leaving = (e - 1) / e * tokens / t * shape.experts_per_token * shape.hidden * value_bytes
    one = leaving / (gbps * 1e9) + latency_s
    return 2 * one + latency_s, 2 * one


def expert_parallel_rows(args: argparse.Namespace, shape: Shape, stages: list[int]) -> tuple[list[str], list[dict]]:
    """The table's Markdown lines and one record per (``t``, ``e``, ``p``, ``m``, schedule): the balanced split
    under each schedule's memory with the per-device costs (every stage under ``--device-memory-gib`` where some
    split fits), its simulated step, and the largest device's peak and expert weights."""
    tokens = args.microbatch_size * shape.seq_len
    rate = args.tflops * 1e12 * args.mfu
    cap = args.device_memory_gib * 2**30
    schedules = [s for s in dict.fromkeys(args.schedules) if s in TP_SCHEDULES]
    rows: list[str] = []
    records: list[dict] = []
    for t in args.tensor_parallel or [1]:
        coll_f, coll_b = tensor_parallel_collective_seconds(shape, t, split_blocks=args.split_blocks, tokens=tokens,
                                                            value_bytes=args.bytes_per_value, gbps=args.tp_gbps,
                                                            latency_s=args.tp_latency_s)
        for e in args.expert_parallel or [1]:
            costs = expert_parallel_layer_costs(shape, t, e, split_blocks=args.split_blocks, tokens=tokens,
                                                value_bytes=args.bytes_per_value, param_bytes=args.param_bytes,
                                                backward_ratio=args.backward_ratio)
            a2a_f, a2a_b = all_to_all_seconds(shape, t, e, tokens=tokens, value_bytes=args.bytes_per_value,
                                              gbps=args.ep_gbps, latency_s=args.ep_latency_s)
            mlp = shape._per_layer(0, 1, args.split_blocks)
            forward = [c.forward_flops / rate + s + moe * a2a_f for c, s, moe in zip(costs, coll_f, mlp)]
            backward = [c.backward_flops / rate + s + moe * a2a_b for c, s, moe in zip(costs, coll_b, mlp)]
            comm_s = costs[0].output_bytes / (args.link_gbps * 1e9)
            expert_bytes = shape.expert_parameters() / e * args.param_bytes  # per MoE layer, on one rank
            for p in stages:
                if p > len(costs):
                    continue
                for m in args.microbatches:
                    for s in schedules:
                        record = _row(args, s, p, m, t, costs, forward, backward, comm_s, cap,
                                      shape.shared_parameters(args.split_blocks, args.param_bytes, t))
                        if record is None:
                            continue
                        start = sum(record["layers_per_stage"][: record["peak_device"]])
                        held = sum(mlp[start : start + record["layers_per_stage"][record["peak_device"]]])
                        record.update(e=e, r=args.data_parallel, all_to_all_per_layer_s=a2a_f + a2a_b,
                                      expert_bytes=held * expert_bytes)
                        records.append(record)
                        rows.append(_format(record, tokens, args))
    return rows, records


def _format(r: dict, tokens: int, args: argparse.Namespace) -> str:
    counts = r["layers_per_stage"]
    split = str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}"
    per_device = r["m"] * tokens * args.data_parallel / r["step_time_s"] / r["devices"]
    peak, gib = r["peak"], 2**30
    return (f"| {r['p']} | {r['t']} | {r['e']} | {r['r']} | {r['devices']} | {r['m']} | {r['schedule']} | {split} | "
            f"{fmt_seconds(r['step_time_s'])} | {per_device:,.0f} | {fmt_seconds(r['all_to_all_per_layer_s'])} | "
            f"{r['expert_bytes'] / gib:.2f} | {peak.weights / gib:.2f} | {peak.activations / gib:.2f} | "
            f"{peak.total / gib:.2f} | {'yes' if r['fits'] else 'no'} |")


def expert_parallel_section(args: argparse.Namespace, shape: Shape, stages: list[int]) -> tuple[list[str], list[dict]]:
    """The report's expert-parallel section: a heading, what the numbers assume, the table (or a line saying no
    (p, m) suits the schedules)."""
    rows, records = expert_parallel_rows(args, shape, stages)
    es = ", ".join(map(str, args.expert_parallel or [1]))
    routed = shape.layers * shape.expert_parameters()
    lines = ["", f"## Expert parallelism: experts split over e ranks of a stage ({es})", "",
             f"{shape.layers} MoE layers of {shape.experts} experts {shape.expert_width} wide, "
             f"{shape.experts_per_token} per token" + (f", a shared expert {shape.shared_intermediate} wide"
                                                        if shape.shared_intermediate else "")
             + f": {routed / 1e9:.2f} B of the model's {shape.parameters() / 1e9:.2f} B parameters in routed experts. "
             f"Each stage on t x {args.data_parallel} devices (--tensor-parallel x --data-parallel), its experts split "
             f"over e of them (e divides both; the strategy's expert_parallel_size): per device 1/e of the experts, "
             f"of both 2BW versions, their gradients and optimizer state; the router whole; the rest as the "
             f"tensor-parallel table splits it. A device routes 1/t of a microbatch's tokens; per MoE layer and "
             f"microbatch 2 all-to-alls forward and 2 backward, each moving the (e-1)/e of tokens/t x top-k x hidden "
             f"values that leave the device over {args.ep_gbps:g} GB/s (--ep-gbps) plus "
             f"{args.ep_latency_s * 1e6:g} µs (--ep-latency-s), and the split sizes' exchange forward, not overlapped "
             f"with compute; routing assumed balanced. *fits*: the largest device's peak is under "
             f"{args.device_memory_gib:g} GiB (--device-memory-gib); *experts GiB*: the expert weights that device "
             f"holds (one version); *tokens/s/device*: trained tokens per second over all devices. The strategy runs "
             f"expert parallelism for models.Llama(num_experts=...) without tensor parallelism (t = 1) yet "
             f"(docs/design/expert-parallel.md).", ""]
    if not rows:
        return lines + ["No (p, m) suits the schedules (2bw needs m >= p; p at most the pipeline layers)."], records
    lines += ["| p | t | e | r | devices | m | schedule | layers per stage | step | tokens/s/device | all-to-all per "
              "MoE layer (fwd+bwd) | experts GiB | weights GiB | activations GiB | peak GiB | fits |",
              "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|", *rows]
    return lines, records


def check_expert_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A routed shape needs its experts per token; each ``e`` of ``--expert-parallel`` must divide each MoE
    layer's experts and, with each tensor-parallel size, the ranks of a stage (argparse's error names why)."""
    shape = shape_from_args(args) if args.model is not None or args.hidden is not None else None
    if shape is None or not shape.experts:
        if args.expert_parallel:
            ap.error("--expert-parallel needs a shape with routed experts (--model qwen3-30b-a3b, or --experts N "
                     "--experts-per-token K with a shape)")
        return
    if not 1 <= shape.experts_per_token <= shape.experts:
        ap.error(f"--experts-per-token must be between 1 and the {shape.experts} experts, got "
                 f"{shape.experts_per_token or 'none'}")
    if args.shard_optimizer and any(e > 1 for e in args.expert_parallel or []):
        ap.error("--shard-optimizer with --expert-parallel above 1: the strategy refuses shard_optimizer=True with "
                 "expert_parallel_size > 1 yet")
    for e in args.expert_parallel or []:
        if shape.experts % e:
            valid = [d for d in range(1, shape.experts + 1) if shape.experts % d == 0]
            ap.error(f"--expert-parallel {e}: expert_parallel_size={e} does not divide the {shape.experts} experts of "
                     f"each MoE layer; use one of {valid}")
        for t in args.tensor_parallel or [1]:
            if (args.data_parallel * t) % e:
                ap.error(f"--expert-parallel {e}: {expert_size_message(e, args.data_parallel, t)} (--data-parallel "
                         f"{args.data_parallel}, --tensor-parallel {t})")
