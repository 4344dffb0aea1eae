"""The planner's costs: the command line's per-layer, per-stage or model-shape costs turned into per-stage seconds
for any number of stages (:class:`CostModel`, splitting layers as the engine's ``partition="balanced"`` does), the
data-parallel reduction's seconds, the tied weight's reduction as :func:`simulate` arguments, and each device's
peak memory on a simulated timeline (:func:`device_memory`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from lightning_async_pp.pipeline.schedule import check_schedule, chunks_per_device, device_of
from lightning_async_pp.pipeline.simulate import SimulationResult
from lightning_async_pp.plan.balanced import (LayerCost, MemoryModel, balanced_split, held_once, optimizer_state,
                                              smallest_peak, split_and_run_ahead, stage_memory_bytes, stage_peak)
from lightning_async_pp.plan.memory import StageMemory
from lightning_async_pp.plan.partition import _balanced_counts
from lightning_async_pp.plan.shapes import MODELS, Shape


DEFAULT_STAGES = (2, 4, 8, 16, 32, 64)


@dataclass
class Costs:
    """Per-stage seconds for one ``p``, and how the layers were split."""

    forward_s: list[float]
    backward_s: list[float]
    comm_s: float
    layers_per_stage: Optional[list[int]]
    dp_reduce_s: list[float] = field(default_factory=list)  # per stage; empty without data parallelism
    gradient_bytes: list[int] = field(default_factory=list)  # per stage, from a shape


class CostModel:
    """Turns the command line's costs into per-stage seconds for any ``p`` (``None`` where ``p`` cannot be split)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shape: Optional[Shape] = None
        self.layer_forward: list[float] = []  # seconds of forward per pipeline layer and microbatch
        self.fixed_stages: Optional[int] = None
        self.comm_s = args.comm_s if args.comm_s is not None else 0.0
        self._splits: dict[tuple[int, int, str], tuple[list[int], bool, Optional[float]]] = {}
        if args.stage_forward_s:
            self.fixed_stages = len(args.stage_forward_s)
            self.stage_backward = args.stage_backward_s or [args.backward_ratio * f for f in args.stage_forward_s]
            if len(self.stage_backward) != self.fixed_stages:
                raise ValueError(f"--stage-backward-s needs {self.fixed_stages} values (one per stage, as "
                                 f"--stage-forward-s), got {len(self.stage_backward)}")
        elif args.forward_s is not None:
            if args.layers is None:
                raise ValueError("--forward-s is the forward time of one layer: give the number of layers (--layers)")
            self.layer_forward = [args.forward_s] * args.layers
            self.backward_ratio = (args.backward_s / args.forward_s) if args.backward_s is not None else args.backward_ratio
        else:
            base = MODELS[args.model] if args.model else None
            fields = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                      "intermediate": args.intermediate, "vocab": args.vocab, "seq_len": args.seq_len}
            if base is None:
                missing = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is None]
                if missing:
                    raise ValueError("give costs: --model NAME, or a shape (missing " + ", ".join(missing) +
                                     "), or --layers with --forward-s, or --stage-forward-s")
                self.shape = Shape(**fields)  # type: ignore[arg-type]
            else:
                self.shape = replace(base, **{k: v for k, v in fields.items() if v is not None})
            rate = args.tflops * 1e12 * args.mfu
            tokens = args.microbatch_size * self.shape.seq_len
            self.layer_forward = [f * tokens / rate for f in self.shape.pipeline_layers(args.split_blocks)]
            self.backward_ratio = args.backward_ratio
            if args.comm_s is None:
                self.comm_s = self.activation_bytes() / (args.link_gbps * 1e9)

    def activation_bytes(self) -> int:
        """Bytes of one microbatch's activation (and of its gradient) crossing a stage boundary."""
        assert self.shape is not None
        return self.args.microbatch_size * self.shape.seq_len * self.shape.hidden * self.args.bytes_per_value

    def stages(self, candidates: Optional[Sequence[int]]) -> list[int]:
        if self.fixed_stages is not None:
            return [self.fixed_stages]
        return list(candidates or DEFAULT_STAGES)

    def dp_reduction(self, p: int, counts: Optional[list[int]]) -> tuple[list[float], list[int]]:
        """Seconds of each stage's ring all-reduce over ``--data-parallel`` replicas, and its gradient bytes."""
        args, r = self.args, self.args.data_parallel
        if r <= 1:
            return [], []
        if args.dp_reduce_s is not None:
            return [args.dp_reduce_s] * p, []
        if self.shape is None or counts is None:
            raise ValueError("--data-parallel needs each stage's reduction time: give --dp-reduce-s, or a model shape "
                             "(whose gradient bytes per stage the plan computes)")
        per_layer = self.shape.layer_parameters(args.split_blocks)
        shared = self.shape.shared_parameters(args.split_blocks)  # a stage holding both ends reduces the tie once
        nbytes, start = [], 0
        for c in counts:
            nbytes.append(held_once(per_layer, start, start + c, shared) * args.grad_bytes)
            start += c
        gbps = args.dp_gbps if args.dp_gbps is not None else args.link_gbps
        ring = lambda b: 2 * (r - 1) / r * b / (gbps * 1e9) + 2 * (r - 1) * args.dp_latency_s  # noqa: E731
        return [ring(b) for b in nbytes], nbytes

    def memory_model(self, p: int, m: int, schedule: str) -> MemoryModel:
        """What the balanced split's memory cap is checked against for ``schedule``: the memory table's account
        (``plan.balanced.stage_peak``) under that schedule's action order, as the engine running it checks it."""
        args = self.args
        shared = () if self.shape is None else self.shape.shared_parameters(args.split_blocks, args.param_bytes)
        return MemoryModel(schedule, p, m, args.data_parallel, args.shard_optimizer, optimizer=args.optimizer,
                           correction_buffers=args.correction_buffers, virtual_stages=args.virtual_stages,
                           param_shared=shared)

    def run_ahead(self, p: int, m: int) -> bool:
        """Whether 2bw's last stage runs the next batch's first microbatch before its update (a second gradient):
        ``--last-stage-run-ahead``, where ``auto`` turns it off only where no split fits ``--stage-memory-gib``
        with it and one fits without (as the engine decides)."""
        return self._split_and_run_ahead(p, m, "2bw")[1]

    def over_cap(self, p: int, m: int, schedule: str) -> Optional[float]:
        """``None`` where some split of ``p`` stages keeps every device of ``schedule`` under ``--stage-memory-gib``
        (or no cap is given); else the smallest largest peak (bytes) any split reaches: the split used is then one
        that reaches it, and the report marks the schedule's rows as over the cap."""
        return self._split_and_run_ahead(p, m, schedule)[2]

    def _split_and_run_ahead(self, p: int, m: int, schedule: str) -> tuple[list[int], bool, Optional[float]]:
        key = (p, m, schedule)
        if key not in self._splits:
            self._splits[key] = self._choose_split(p, m, schedule)
        return self._splits[key]

    def _choose_split(self, p: int, m: int, schedule: str) -> tuple[list[int], bool, Optional[float]]:
        choice = {"auto": None, "on": True, "off": False}[getattr(self.args, "last_stage_run_ahead", "auto")]
        if self.fixed_stages is not None or p > len(self.layer_forward):  # costs per stage given: no split to choose
            return [], choice is not False, None
        try:
            check_schedule(schedule, p, m)
        except ValueError:  # the schedule is refused at (p, m): its rows say so, no memory to weigh
            return balanced_split(self.layer_forward, p), choice is not False, None
        model = self.memory_model(p, m, schedule)
        if self.shape is None:
            counts, used = split_and_run_ahead(self.layer_forward, p, model, run_ahead=choice)
            return counts, used.run_ahead, None
        layers = self.layer_costs()
        memory = lambda i, j, s, mm: stage_memory_bytes(layers, i, j, s, mm)  # noqa: E731
        cap = self.args.stage_memory_gib * 2**30 if self.args.stage_memory_gib is not None else None
        try:
            counts, used = split_and_run_ahead(self.layer_forward, p, model, memory=memory, memory_cap=cap,
                                               run_ahead=choice)
            return counts, used.run_ahead, None
        except ValueError:
            if cap is None:
                raise
        # No split fits: the one nearest to fitting (its largest peak the least; 2bw without the run-ahead's second
        # gradient unless it was asked for), marked over the cap where it is reported.
        least_model = replace(model, run_ahead=choice is True)
        fn = lambda i, j, s: memory(i, j, s, least_model)  # noqa: E731
        least = smallest_peak(len(self.layer_forward), p, fn)
        return balanced_split(self.layer_forward, p, memory=fn, memory_cap=least), least_model.run_ahead, least

    def split(self, p: int, m: int, method: str = "balanced", schedule: str = "2bw") -> list[int]:
        """Layers per stage by ``method``: ``balanced`` (``plan.balanced.balanced_split``: the slowest stage's
        forward and backward least, every device's memory under ``schedule`` under ``--stage-memory-gib``, as the
        engine running ``schedule`` splits), ``parameters`` or ``uniform``."""
        n = len(self.layer_forward)
        if method == "uniform":
            return _balanced_counts([1] * n, p)
        if method == "parameters":
            if self.shape is None:
                return _balanced_counts([1] * n, p)
            return _balanced_counts(self.shape.layer_parameters(self.args.split_blocks), p)
        return self._split_and_run_ahead(p, m, schedule)[0]

    def layer_costs(self) -> list[LayerCost]:
        assert self.shape is not None
        args = self.args
        return self.shape.layer_costs(args.split_blocks, args.microbatch_size * self.shape.seq_len,
                                      args.bytes_per_value, args.param_bytes, self.backward_ratio)

    def costs(self, p: int, m: int = 1, counts: Optional[list[int]] = None, schedule: str = "2bw") -> Optional[Costs]:
        """Per-stage seconds of ``counts`` (default: ``schedule``'s balanced split); ``None`` where ``p`` is more
        stages than layers."""
        if self.fixed_stages is not None:
            return Costs(list(self.args.stage_forward_s), list(self.stage_backward), self.comm_s, None,
                         self.dp_reduction(p, None)[0])
        if p > len(self.layer_forward):
            return None
        if counts is None:
            counts = self.split(p, m, schedule=schedule)
        forward, start = [], 0
        for c in counts:
            forward.append(sum(self.layer_forward[start : start + c]))
            start += c
        reduce_s, nbytes = self.dp_reduction(p, counts)
        return Costs(forward, [self.backward_ratio * f for f in forward], self.comm_s, counts, reduce_s, nbytes)


def tied_kwargs(args: argparse.Namespace, schedule: str, p: int) -> dict:
    """``--tied-reduce-s``: the devices of the model's first and last layer hold one tied parameter (an embedding
    tied to the head) whose gradient they sum before each update, so their updates wait for each other's whole
    step. Under ``zbv`` both ends of the V are on device 0: nothing crosses devices."""
    first = device_of(schedule, 0, p)
    last = device_of(schedule, p * chunks_per_device(schedule, args.virtual_stages) - 1, p)
    if args.tied_reduce_s is None or first == last:
        return {}
    return {"tied_stages": (first, last), "tied_reduce_s": args.tied_reduce_s}


def device_memory(shape: Shape, counts: list[int], result: SimulationResult, *, tokens: int, value_bytes: int,
                  param_bytes: int, optimizer: str = "adamw", correction_buffers: float = 0.0,
                  split_blocks: bool = False, data_parallel: int = 1, shard_optimizer: bool = False,
                  run_ahead: bool = True) -> list[StageMemory]:
    """Each device's peak by :func:`~lightning_async_pp.plan.memory.stage_memory`, the shape's pipeline layers
    split by ``counts`` (a chunked schedule's device holds the same share in chunks), microbatches of ``tokens``.
    With ``data_parallel > 1`` the engine does not run 2BW's next batch ahead of the update (one gradient, not
    two; docs/design/data-parallel.md, "Data parallelism"), and ``shard_optimizer`` (ZeRO-1) splits the optimizer state and the
    correction's buffer over the replicas. ``run_ahead`` False: 2BW's last stage does not run ahead either way."""
    layers = shape.layer_costs(split_blocks, tokens, value_bytes, param_bytes, 1.0)
    if sum(counts) != len(layers):
        raise ValueError(f"counts {counts} split {sum(counts)} layers; the shape has {len(layers)}")
    model = MemoryModel(result.schedule, len(counts), result.num_microbatches, data_parallel, shard_optimizer,
                        run_ahead=run_ahead, optimizer=optimizer, correction_buffers=correction_buffers,
                        param_shared=shape.shared_parameters(split_blocks, param_bytes))
    out, start = [], 0
    for device, count in enumerate(counts):
        # the account the balanced split checks its cap against (plan.balanced.stage_peak), on this timeline
        out.append(stage_peak(layers, start, start + count, device, model, result=result))
        start += count
    return out


def optimizer_state_bytes(optimizer: str, params: Sequence[int], matrices: Sequence[int], param_bytes: int) -> int:
    """Bytes of ``optimizer``'s state over layers of ``params`` parameters, ``matrices`` of them in hidden matrices
    (``plan.balanced.optimizer_state``, :data:`OPTIMIZER_STATE_RULES`)."""
    return optimizer_state(optimizer, sum(params) * param_bytes, sum(matrices) * param_bytes)
