"""``lightning-async-pp-plan``: what a pipeline would do, predicted from the engine's own action lists.

For each number of stages ``p`` and microbatches ``m`` it simulates ``2bw`` beside every synchronous schedule
(``1f1b``, ``gpipe``, ``zb_h1``, ``interleaved_1f1b``, ``zbv``;
:func:`lightning_async_pp.pipeline.simulate.simulate`) and prints a Markdown table with one row per schedule:
steady-state step time, bubble, speedup over ``1f1b`` (and, for 2bw, over the fastest synchronous schedule),
peak activations and weight copies per device. The costs come from one of:

- ``--layers L --forward-s X [--backward-s Y]``: ``L`` identical layers, ``X`` seconds of forward per layer and
  microbatch (measured, e.g. from a ``PipelineMonitor`` trace); the layers are split as evenly as they go;
- ``--stage-forward-s a b ... [--stage-backward-s ...]``: seconds per microbatch of each stage (fixes ``p``);
- a model shape (``--model smollm-360m`` or ``llama-10b``, or ``--hidden --layers --heads --kv-heads
  --intermediate --vocab --seq-len``): FLOPs per layer, an accelerator rate (``--tflops`` x ``--mfu``) and a
  link bandwidth (``--link-gbps``) give the times; blocks are split as the engine's ``partition="balanced"`` splits
  them (``pipeline.cost.balanced_split``: the slowest stage least, every stage's memory under
  ``--stage-memory-gib``), and a *Split* table sets that split against ``"parameters"`` and ``"uniform"``.

A shape also gives a table of each schedule's peak memory per device (:func:`device_memory`: the memory model,
``pipeline.memory.stage_memory``, fed the shape's per-layer parameters and activations, ``--param-bytes``,
``--optimizer``, ``--correction-buffers``, ``--bytes-per-value``).

``--data-parallel R`` adds a table of the data-parallel gradient reduction (each stage's gradient all-reduced
over its ``R`` replicas with a ring: ``2 (R-1)/R`` x its bytes over ``--dp-gbps``, plus ``2 (R-1)`` latencies)
with no overlap, overlapped from the last backward (what the engine does), and, for 2BW, deferred to batch
``k+2``'s first forward; a shape gives each stage's gradient bytes, other cost sources take ``--dp-reduce-s``.

``--trace PATH`` writes the simulated timelines as the Chrome trace ``PipelineMonitor`` writes (open it at
https://ui.perfetto.dev); ``--figure PATH`` draws them as a PNG, as ``PipelineMonitor`` draws an executed step.
See docs/guide/planning.md and BENCHMARKS.md "Predicted beyond this machine".
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from lightning_async_pp.pipeline.cost import (OPTIMIZER_STATE_RULES, LayerCost, MemoryModel, optimizer_state,
                                              split_and_run_ahead, stage_memory_bytes, stage_peak)
from lightning_async_pp.pipeline.memory import StageMemory
from lightning_async_pp.pipeline.partition import _balanced_counts
from lightning_async_pp.pipeline.schedule import PLANNER_SCHEDULES, check_schedule, chunks_per_device, device_of
from lightning_async_pp.pipeline.simulate import SimulationResult, simulate


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, tied embedding and head, or, with
    ``tied=False``, an embedding and a head of their own: the stages hold the same bytes either way)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq_len: int
    tied: bool = True

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    def attention_flops(self) -> int:
        """Forward FLOPs per token of one block's attention: the q, k, v, o projections (2 FLOPs per weight) and
        the scores and weighted values, 4 * seq_len * hidden (causal masking not discounted)."""
        h = self.hidden
        return 2 * (2 * h * h + 2 * h * self.kv_dim) + 4 * self.seq_len * h

    def mlp_flops(self) -> int:
        """Forward FLOPs per token of one block's SwiGLU MLP: three hidden x intermediate matrices."""
        return 2 * 3 * self.hidden * self.intermediate

    def head_flops(self) -> int:
        """Forward FLOPs per token of the output projection (the loss's softmax is negligible)."""
        return 2 * self.hidden * self.vocab

    def parameters(self) -> int:
        h = self.hidden
        block = 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h
        return self.layers * block + self.vocab * h * (1 if self.tied else 2) + h

    def layer_parameters(self, split_blocks: bool) -> list[int]:
        """Parameters of each pipeline layer, as :meth:`pipeline_layers` splits them. The tied embedding/head is
        held (and its gradient reduced) by the first and by the last layer's stage; the final norm goes last."""
        h = self.hidden
        attention, mlp = 2 * h * h + 2 * h * self.kv_dim + h, 3 * h * self.intermediate + h
        params = self._per_layer(attention, mlp, split_blocks)
        params[0] += self.vocab * h
        params[-1] += self.vocab * h + h
        return params

    def layer_matrix_parameters(self, split_blocks: bool) -> list[int]:
        """Of :meth:`layer_parameters`, those in the blocks' hidden matrices (the projections: what Muon
        orthogonalizes); the rest are the embedding, the head and the norms."""
        h = self.hidden
        attention, mlp = 2 * h * h + 2 * h * self.kv_dim, 3 * h * self.intermediate
        return self._per_layer(attention, mlp, split_blocks)

    def layer_saved_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """Bytes each pipeline layer keeps for its backward over a microbatch of ``tokens`` (whole sequences), as
        transformers' Llama layers do under SDPA's causal kernel (``HuggingFaceCausalLM``; a test counts them):
        an RMSNorm its input in fp32, the reciprocal RMS (fp32) and two tensors of ``value_bytes``; attention the
        rotated queries and its output, the rotated keys and the values, a log-sum-exp per head (fp32) and the
        rotary cos and sin once per position; the SwiGLU MLP four intermediate-wide tensors; the embedding the
        token ids; the last layer the final norm, the head's input and the loss's log-probabilities (fp32)."""
        h, v = self.hidden, value_bytes
        norm = tokens * (4 * h + 4 + 2 * v * h)
        rotary = 2 * v * self.head_dim * self.seq_len  # cos and sin, once per position
        attention = norm + tokens * (2 * v * h + 2 * v * self.kv_dim + 4 * self.heads) + rotary
        mlp = norm + tokens * 4 * v * self.intermediate
        saved = self._per_layer(attention, mlp, split_blocks)
        saved[0] += tokens * 8
        saved[-1] += tokens * (4 * h + 4 + 2 * v * h + 4 * self.vocab + 8)
        return saved

    def layer_transient_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """What each pipeline layer's backward allocates beyond what it keeps, at its peak (an estimate): a block's
        MLP and attention gradients, about ``2 (intermediate + hidden)`` values per token; the last layer the
        loss's gradients of the log-probabilities and of the logits, ``8 x vocab`` bytes per token."""
        v = value_bytes
        block = tokens * 2 * v * (self.intermediate + self.hidden)
        transient = [block] * (self.layers * (2 if split_blocks else 1))
        transient[-1] = max(transient[-1], tokens * 8 * self.vocab)
        return transient

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _per_layer(self, attention: int, mlp: int, split_blocks: bool) -> list[int]:
        """A block's attention and MLP amounts as pipeline layers: one per block, or (``split_blocks``) two."""
        return [n for _ in range(self.layers) for n in ((attention, mlp) if split_blocks else (attention + mlp,))]

    def pipeline_layers(self, split_blocks: bool) -> list[int]:
        """Forward FLOPs per token of each pipeline layer: one per block (``split_blocks``: attention and MLP
        apart). The embedding (a lookup, no FLOPs) goes with the first layer, the head with the last."""
        flops = self._per_layer(self.attention_flops(), self.mlp_flops(), split_blocks)
        flops[-1] += self.head_flops()
        return flops

    def layer_costs(self, split_blocks: bool, tokens: int, value_bytes: int, param_bytes: int,
                    backward_ratio: float) -> list[LayerCost]:
        """Each pipeline layer as ``pipeline.cost`` weighs it, for the balanced split and the memory table alike
        (what the engine counts with ``FlopCounterMode`` on the built-in Llama; a test compares the FLOPs): FLOPs
        over ``tokens``, parameter bytes (and those in hidden matrices), the bytes its forward keeps
        (:meth:`layer_saved_bytes`), its input and output (one activation, ``tokens x hidden`` values, each: held
        by a stage that starts or ends at it) and its backward's transient (:meth:`layer_transient_bytes`)."""
        boundary = tokens * self.hidden * value_bytes
        return [LayerCost(round(f * tokens), round(f * tokens * backward_ratio), n * param_bytes, saved,
                          input_bytes=boundary, output_bytes=boundary, transient_bytes=transient,
                          matrix_param_bytes=matrices * param_bytes)
                for f, n, saved, transient, matrices in zip(
                    self.pipeline_layers(split_blocks), self.layer_parameters(split_blocks),
                    self.layer_saved_bytes(split_blocks, tokens, value_bytes),
                    self.layer_transient_bytes(split_blocks, tokens, value_bytes),
                    self.layer_matrix_parameters(split_blocks))]


#: ``smollm-360m``: the paper's 360M model (SmolLM-360M). ``llama-10b``: a Llama-style 10B shape (Llama-2-13B's
#: width with 32 blocks, multi-head attention; 10.3B parameters with the tied embedding). ``smollm-135m``:
#: SmolLM-135M. ``llama-3-8b``: Llama-3-8B (vocabulary 128256, embedding and head apart, sequence 8192).
MODELS: dict[str, Shape] = {
    "smollm-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, seq_len=2048),
    "llama-3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                        seq_len=8192, tied=False),
    "smollm-360m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, vocab=49152, seq_len=2048),
    "llama-10b": Shape(hidden=5120, layers=32, heads=40, kv_heads=40, intermediate=13824, vocab=32000, seq_len=2048),
}


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
        nbytes, start = [], 0
        for c in counts:
            nbytes.append(sum(per_layer[start : start + c]) * args.grad_bytes)
            start += c
        gbps = args.dp_gbps if args.dp_gbps is not None else args.link_gbps
        ring = lambda b: 2 * (r - 1) / r * b / (gbps * 1e9) + 2 * (r - 1) * args.dp_latency_s  # noqa: E731
        return [ring(b) for b in nbytes], nbytes

    def memory_model(self, p: int, m: int) -> MemoryModel:
        """What the balanced split's memory cap is checked against: the memory table's account
        (``pipeline.cost.stage_peak``) under 2bw if it is planned and runs at this ``(p, m)``, else under 1f1b (or
        gpipe, if it alone is planned)."""
        args = self.args
        schedule = "gpipe" if args.schedules == ["gpipe"] else "1f1b"
        if "2bw" in args.schedules:
            try:
                check_schedule("2bw", p, m)
                schedule = "2bw"
            except ValueError:  # m < p: 2bw is refused here, its table row too
                pass
        return MemoryModel(schedule, p, m, args.data_parallel, args.shard_optimizer, optimizer=args.optimizer,
                           correction_buffers=args.correction_buffers, virtual_stages=args.virtual_stages)

    def run_ahead(self, p: int, m: int) -> bool:
        """Whether 2bw's last stage runs the next batch's first microbatch before its update (a second gradient):
        ``--last-stage-run-ahead``, where ``auto`` turns it off only where no split fits ``--stage-memory-gib``
        with it and one fits without (as the engine decides)."""
        return self._split_and_run_ahead(p, m)[1]

    def _split_and_run_ahead(self, p: int, m: int) -> tuple[list[int], bool]:
        choice = {"auto": None, "on": True, "off": False}[getattr(self.args, "last_stage_run_ahead", "auto")]
        if self.fixed_stages is not None or p > len(self.layer_forward):  # costs per stage given: no split to choose
            return [], choice is not False
        memory, cap = None, None
        if self.shape is not None:
            layers = self.layer_costs()
            memory = lambda i, j, s, mm: stage_memory_bytes(layers, i, j, s, mm)  # noqa: E731
            if self.args.stage_memory_gib is not None:
                cap = self.args.stage_memory_gib * 2**30
        counts, used = split_and_run_ahead(self.layer_forward, p, self.memory_model(p, m), memory=memory,
                                           memory_cap=cap, run_ahead=choice)
        return counts, used.run_ahead

    def split(self, p: int, m: int, method: str = "balanced") -> list[int]:
        """Layers per stage by ``method``: ``balanced`` (``pipeline.cost.balanced_split``: the slowest stage's
        forward and backward least, every stage's memory under ``--stage-memory-gib``, as the engine splits),
        ``parameters`` or ``uniform``."""
        n = len(self.layer_forward)
        if method == "uniform":
            return _balanced_counts([1] * n, p)
        if method == "parameters":
            if self.shape is None:
                return _balanced_counts([1] * n, p)
            return _balanced_counts(self.shape.layer_parameters(self.args.split_blocks), p)
        return self._split_and_run_ahead(p, m)[0]

    def layer_costs(self) -> list[LayerCost]:
        assert self.shape is not None
        args = self.args
        return self.shape.layer_costs(args.split_blocks, args.microbatch_size * self.shape.seq_len,
                                      args.bytes_per_value, args.param_bytes, self.backward_ratio)

    def costs(self, p: int, m: int = 1, counts: Optional[list[int]] = None) -> Optional[Costs]:
        if self.fixed_stages is not None:
            return Costs(list(self.args.stage_forward_s), list(self.stage_backward), self.comm_s, None,
                         self.dp_reduction(p, None)[0])
        if p > len(self.layer_forward):
            return None
        if counts is None:
            counts = self.split(p, m)
        forward, start = [], 0
        for c in counts:
            forward.append(sum(self.layer_forward[start : start + c]))
            start += c
        reduce_s, nbytes = self.dp_reduction(p, counts)
        return Costs(forward, [self.backward_ratio * f for f in forward], self.comm_s, counts, reduce_s, nbytes)


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


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
            f"{sh.intermediate}, vocabulary {sh.vocab}, sequence {sh.seq_len}: {sh.parameters() / 1e9:.2f} B "
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
    for p in model.stages(args.stages):
        for m in args.microbatches:
            costs = model.costs(p, m)
            if costs is None:
                lines.append(f"| {p} | {m} | - | - | more stages than the {len(model.layer_forward)} pipeline layers"
                             + (" (--split-blocks doubles them)" if model.shape and not args.split_blocks else "")
                             + " |" + " |" * (len(head) - 5))
                continue
            results: dict[str, Optional[SimulationResult]] = {}
            refused: dict[str, str] = {}
            for s in dict.fromkeys([*schedules, "1f1b"]):
                try:
                    # as the engine runs it: 2bw's last stage runs ahead with one pipeline only
                    ahead = ({} if s != "2bw" or (model.run_ahead(p, m) and args.data_parallel == 1)
                             else {"last_ahead": False})
                    results[s] = simulate(s, p, m, costs.forward_s, costs.backward_s, comm_s=costs.comm_s,
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
            split = "-" if counts is None else (str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}")
            for s in schedules:
                r = results[s]
                if r is None:
                    lines.append(f"| {p} | {m} | {split} | {label(s, args)} | {refused[s]} | - | - | - | - | - | - |")
                    continue
                versus = f"{sync[best].step_time_s / r.step_time_s:.2f} ({label(best, args)})" if s == "2bw" else "-"
                weights = "2 versions" if r.weight_versions == 2 else "1" if r.chunks == 1 else f"1 in {r.chunks} chunks"
                lines.append(f"| {p} | {m} | {split} | {label(s, args)} | {fmt_seconds(r.step_time_s)} | "
                             f"{r.bubble_fraction:.1%} | {optimizer_fraction(r):.1%} | {base.step_time_s / r.step_time_s:.2f} | {versus} | "
                             f"{r.peak_activation_memory:.3g} | {weights} |")
            records.append({"p": p, "m": m, "layers_per_stage": counts, "best_sync": best,
                            "results": {s: r for s, r in results.items() if s in schedules}})
            if "2bw" in schedules and p > 1 and args.data_parallel == 1 and not model.run_ahead(p, m):
                behind.append(f"p = {p}, m = {m}")
            if counts is not None and model.shape is not None:  # identical layers: every method splits alike
                rows, records[-1]["splits"] = split_rows(args, model, p, m, results, schedules)
                split_lines += rows
            if model.shape is not None and counts is not None:
                tokens = args.microbatch_size * model.shape.seq_len
                memory = {s: device_memory(model.shape, counts, results[s], tokens=tokens,
                                           value_bytes=args.bytes_per_value, param_bytes=args.param_bytes,
                                           optimizer=args.optimizer,
                                           correction_buffers=args.correction_buffers, split_blocks=args.split_blocks,
                                           data_parallel=args.data_parallel, shard_optimizer=args.shard_optimizer,
                                           run_ahead=model.run_ahead(p, m))
                          for s in schedules if results[s] is not None}
                records[-1]["memory"] = memory
                memory_lines += [memory_row(p, m, label(s, args), per_device) for s, per_device in memory.items()]
            if costs.dp_reduce_s:
                dp = dp_row(args, p, m, costs, [s for s in schedules if results[s] is not None])
                dp_lines.append(dp[0])
                records[-1]["data_parallel"] = dp[1]
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
                  "*x balanced*: this split's step / the balanced one's. The tables above use the balanced split.", "",
                  "| p | m | schedule | split | layers per stage | step | x balanced |",
                  "|---:|---:|---|---|---|---:|---:|", *split_lines]
    if memory_lines:
        lines += ["", "## Memory per device (peak, GiB)", "",
                  f"The device with the largest peak, by what holds it (`pipeline.memory.stage_memory` over the "
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
                  + ". docs/guide/planning.md, \"Memory\".", "",
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
    if written:
        lines += ["", f"Timelines (Chrome trace) written to {written[0]}"
                  + (f" and {len(written) - 1} more files beside it" if len(written) > 1 else "")]
    if figures:
        lines += ["", f"Timelines (PNG) drawn to {figures[0]}"
                  + (f" and {len(figures) - 1} more files beside it" if len(figures) > 1 else "")]
    return lines, records


def device_memory(shape: Shape, counts: list[int], result: SimulationResult, *, tokens: int, value_bytes: int,
                  param_bytes: int, optimizer: str = "adamw", correction_buffers: float = 0.0,
                  split_blocks: bool = False, data_parallel: int = 1, shard_optimizer: bool = False,
                  run_ahead: bool = True) -> list[StageMemory]:
    """Each device's peak by :func:`~lightning_async_pp.pipeline.memory.stage_memory`, the shape's pipeline layers
    split by ``counts`` (a chunked schedule's device holds the same share in chunks), microbatches of ``tokens``.
    With ``data_parallel > 1`` the engine does not run 2BW's next batch ahead of the update (one gradient, not
    two; docs/design/data-parallel.md, "Data parallelism"), and ``shard_optimizer`` (ZeRO-1) splits the optimizer state and the
    correction's buffer over the replicas. ``run_ahead`` False: 2BW's last stage does not run ahead either way."""
    layers = shape.layer_costs(split_blocks, tokens, value_bytes, param_bytes, 1.0)
    if sum(counts) != len(layers):
        raise ValueError(f"counts {counts} split {sum(counts)} layers; the shape has {len(layers)}")
    model = MemoryModel(result.schedule, len(counts), result.num_microbatches, data_parallel, shard_optimizer,
                        run_ahead=run_ahead, optimizer=optimizer, correction_buffers=correction_buffers)
    out, start = [], 0
    for device, count in enumerate(counts):
        # the account the balanced split checks its cap against (pipeline.cost.stage_peak), on this timeline
        out.append(stage_peak(layers, start, start + count, device, model, result=result))
        start += count
    return out


def optimizer_state_bytes(optimizer: str, params: Sequence[int], matrices: Sequence[int], param_bytes: int) -> int:
    """Bytes of ``optimizer``'s state over layers of ``params`` parameters, ``matrices`` of them in hidden matrices
    (``pipeline.cost.optimizer_state``, :data:`OPTIMIZER_STATE_RULES`)."""
    return optimizer_state(optimizer, sum(params) * param_bytes, sum(matrices) * param_bytes)


def split_rows(args: argparse.Namespace, model: CostModel, p: int, m: int,
               results: dict[str, Optional[SimulationResult]], schedules: list[str]) -> tuple[list[str], dict]:
    """Rows of the split table: each schedule simulated on the balanced, parameters and uniform splits."""
    rows, record = [], {}
    for method in ("balanced", "parameters", "uniform"):
        counts = model.split(p, m, method)
        costs = model.costs(p, m, counts)
        assert costs is not None
        record[method] = {"layers_per_stage": counts}
        for s in schedules:
            if s not in ("2bw", "1f1b", "gpipe", "zb_h1") or results.get(s) is None:
                continue
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


def memory_row(p: int, m: int, schedule: str, per_device: list[StageMemory]) -> str:
    device = max(range(len(per_device)), key=lambda d: per_device[d].total)
    peak = per_device[device]
    gib = [f"{b / 2**30:.2f}" for b in (peak.weights, peak.versions, peak.gradients, peak.optimizer_state,
                                         peak.correction, peak.activations, peak.total)]
    return f"| {p} | {m} | {schedule} | {device} | " + " | ".join(gib) + " |"


def tied_kwargs(args: argparse.Namespace, schedule: str, p: int) -> dict:
    """``--tied-reduce-s``: the devices of the model's first and last layer hold one tied parameter (an embedding
    tied to the head) whose gradient they sum before each update, so their updates wait for each other's whole
    step. Under ``zbv`` both ends of the V are on device 0: nothing crosses devices."""
    first = device_of(schedule, 0, p)
    last = device_of(schedule, p * chunks_per_device(schedule, args.virtual_stages) - 1, p)
    if args.tied_reduce_s is None or first == last:
        return {}
    return {"tied_stages": (first, last), "tied_reduce_s": args.tied_reduce_s}


def dp_row(args: argparse.Namespace, p: int, m: int, costs: Costs, schedules: list[str]) -> tuple[str, dict]:
    """One row of the data-parallel table and its results: every schedule with each placement of the reduction."""
    cells = [str(p), str(m), f"{max(costs.gradient_bytes) / 2**30:.2f} GiB" if costs.gradient_bytes else "-",
             fmt_seconds(max(costs.dp_reduce_s))]
    results: dict[str, SimulationResult] = {}
    for s in args.schedules:
        if s not in schedules:
            cells += ["-", "-"] + (["-"] if s == "2bw" else [])
            continue
        for mode in ("none", "backward") + (("deferred",) if s == "2bw" else ()):
            r = results[f"{s}/{mode}"] = simulate(
                s, p, m, costs.forward_s, costs.backward_s, comm_s=costs.comm_s, optimizer_s=args.optimizer_s,
                steps=max(args.steps, 4), dp_reduce_s=costs.dp_reduce_s, dp_overlap=mode, dp_buckets=args.dp_buckets,
                **tied_kwargs(args, s, p))
            cells.append(f"{fmt_seconds(r.step_time_s)} ({fmt_seconds(max(r.dp_exposed_s))})")
    return "| " + " | ".join(cells) + " |", results


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
    try:
        lines, _ = plan(args)
    except ValueError as err:  # a cost simulate() rejects, named there
        ap.error(str(err))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
