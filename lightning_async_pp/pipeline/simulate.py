"""Predict a pipeline's step time by running the engine's own action lists against given costs.

``simulate`` is a discrete-event simulation of ``steps`` consecutive training steps. Each stage runs, in order,
exactly the lists :func:`~lightning_async_pp.pipeline.schedule.step_actions` returns, called as
:class:`~lightning_async_pp.pipeline.runtime.PipelineRuntime` calls it across processes (2BW carries its
lookahead forwards from one step into the next), then its optimizer update:

- a forward of microbatch ``j`` of batch ``b`` on stage ``s > 0`` starts once stage ``s`` is free and stage
  ``s-1``'s forward of the same microbatch ended ``comm_s`` earlier (the activation's transfer);
- a backward on stage ``s < p-1`` waits likewise for stage ``s+1``'s backward of the same microbatch;
- each stage's optimizer update (``optimizer_s``) runs after the last action of its step's list;
- with data-parallel replicas (``dp_reduce_s``), the update also waits for the stage's gradient reduction (see
  :func:`simulate` for the three placements ``dp_overlap`` models).

A split backward (``zb_h1``, ``zbv``) runs as its input gradient ``I`` (what the neighbour waits for, priced
``(1 - weight_grad_fraction) x backward_s``) and its weight gradient ``W`` (the rest, waited for by nobody).
``interleaved_1f1b`` and ``zbv`` hold several model chunks per device; each chunk costs its share of the
device's ``forward_s``/``backward_s``, so every schedule is priced on the same per-device costs, and a hand-over
between two chunks on one device costs no transfer.

Nothing here knows what a schedule looks like: a new schedule in ``schedule.py`` is simulated as it is run.
Transfers overlap compute (a stage is not busy while its activation travels) and a link carries any number of
transfers at once; what a stage does between actions in a real run (Python, posting receives) is not modelled
unless folded into the costs. No Lightning and no torch here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Optional, Union

from lightning_async_pp.pipeline.schedule import (
    PLANNER_SCHEDULES, Action, check_schedule, chunks_per_device, device_of, interleaved_actions, step_actions,
    validate_actions, virtual_stage, zbv_actions,
)

Seconds = Union[float, Sequence[float]]

#: Span names, the same as the engine's trace spans (and so the Chrome trace ``PipelineMonitor`` writes).
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


@dataclass(frozen=True)
class SimSpan:
    """One piece of simulated work on one stage."""

    stage: int
    op: str  # forward, backward, optimizer
    batch: int  # the training batch (step index k for this step's batch, k + 1 for 2BW's lookahead)
    microbatch: Optional[int]  # None for the optimizer update
    start: float
    end: float
    step: int  # the step whose action list ran it
    action: str = ""  # F, B, I (input gradient), W (weight gradient); "" for the update
    chunk: int = 0  # the device's model chunk (interleaved_1f1b, zbv)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SimulationResult:
    """What :func:`simulate` predicts. Times in seconds; "steady state" excludes the first and the last step."""

    schedule: str
    num_stages: int
    num_microbatches: int
    steps: int
    step_time_s: float  # steady-state time per training step (between the ends of consecutive updates)
    bubble_fraction: float  # steady state, mean over stages: share of the step a stage is idle
    stage_bubble_fractions: list[float]
    peak_activations: list[int]  # per stage: most (chunk) forwards whose backward (its W, if split) has not run
    timelines: list[list[SimSpan]]  # per stage, in time order
    step_ends: list[list[float]]  # [stage][step]: when that stage's optimizer update of the step ended
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)  # per boundary s -> s+1
    optimizer_s: list[float] = field(default_factory=list)
    dp_reduce_s: list[float] = field(default_factory=list)  # per stage: its gradient's reduction over the replicas
    dp_overlap: str = "none"
    dp_exposed_s: list[float] = field(default_factory=list)  # per stage, steady state: reduction not hidden, per step
    dp_spans: list[list[SimSpan]] = field(default_factory=list)  # per stage: the reductions (on their own link)
    chunks: int = 1  # model chunks per device
    weight_versions: int = 1  # copies of its weights a device holds: 2 under 2bw (the stashed version)
    tied_stages: tuple[int, ...] = ()  # stages whose updates wait for a tied parameter's summed gradient
    tied_reduce_s: float = 0.0

    @property
    def peak_activation_memory(self) -> float:
        """The most activations any device holds, in microbatches of the device's whole share of the model (a
        chunk's forward holds ``1/chunks`` of one): the number to compare across schedules."""
        return max(self.peak_activations) / self.chunks

    @property
    def makespan_s(self) -> float:
        """From the first forward to the last update of all simulated steps."""
        return max(ends[-1] for ends in self.step_ends)

    @property
    def spans(self) -> list[SimSpan]:
        return sorted((s for tl in self.timelines for s in tl), key=lambda s: (s.start, s.stage))

    def step_spans(self, stage: int, step: int) -> list[SimSpan]:
        """The spans one step's action list (and its update) ran on ``stage``."""
        return [s for s in self.timelines[stage] if s.step == step]


def simulate(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    forward_s: Seconds,
    backward_s: Seconds,
    *,
    comm_s: Seconds = 0.0,
    optimizer_s: Seconds = 0.0,
    steps: int = 6,
    dp_reduce_s: Seconds = 0.0,
    dp_overlap: str = "backward",
    dp_buckets: int = 4,
    virtual_stages: int = 2,
    weight_grad_fraction: float = 0.5,
    tied_stages: Sequence[int] = (),
    tied_reduce_s: float = 0.0,
    last_ahead: Optional[bool] = None,
) -> SimulationResult:
    """Simulate ``steps`` training steps of ``schedule`` on ``num_stages`` stages with ``num_microbatches``.

    Args:
        forward_s, backward_s: seconds of one microbatch's forward / backward on a stage: one number for every
            stage, or one per stage.
        comm_s: seconds from the end of a forward (backward) on one stage until its activation (gradient) is
            available on the neighbour: one number, or one per boundary (``num_stages - 1`` of them).
        optimizer_s: seconds of a stage's optimizer update after its step: one number, or one per stage.
        steps: training steps to simulate (at least 3): the first warms the pipeline up, the last drains it
            (the end of training starts no lookahead); the steady state is measured over the ones between.
        dp_reduce_s: seconds to reduce one stage's whole gradient across its data-parallel replicas (one number
            or one per stage); each stage has its own link for it, beside the pipeline's transfers.
        dp_overlap: where that reduction runs. ``"none"``: after the stage's last action of the step, before its
            update. ``"backward"`` (what the runtime does): in ``dp_buckets`` equal buckets, each started as the
            batch's last backward on the stage passes its layers (bucket ``i`` of ``n`` is ready ``i/n`` of the
            way through it), one after another on the link; the update waits for the last. ``"deferred"``: as
            ``"backward"``, but under 2BW the update of batch ``k`` is put off until just before the stage's first
            forward of batch ``k+2`` (the first to read ``W_{k+1}``; batch ``k+1`` reads ``W_k``), so the next
            step's early work hides the reduction. Within Lightning's loop the update of batch ``k`` runs in
            step ``k`` (before its schedulers and checkpoints), so the runtime does not do this; the planner
            shows what it would buy. Synchronous schedules have no such slack: there it is ``"backward"``.
        virtual_stages: model chunks per device under ``interleaved_1f1b`` (``zbv`` always has 2).
        weight_grad_fraction: the share of a backward that is the weight gradient, for the split backward of
            ``zb_h1`` and ``zbv`` (between 0 and 1, exclusive).
        tied_stages: the stages that hold one tied parameter (an embedding tied to the head: ``(0, p - 1)``). The
            engine sums its gradient over them before each update (an all-reduce after the step's last backward,
            ``tied_reduce_s`` seconds), so each of them starts its update only when all of them finished the step:
            under 2BW the last stage then waits for the first stage's last backward every step, less the
            next batch's first forward and backward that it runs before its update (``last_ahead``).
        last_ahead: under 2BW the last stage runs the next batch's first microbatch before its update
            (``schedule.step_actions``). ``None``: as the engine does, which is without data parallelism
            (``dp_reduce_s`` all 0) only.
    """
    p, m, fwd, bwd, comm, opt = check_inputs(
        schedule, num_stages, num_microbatches, forward_s, backward_s, comm_s, optimizer_s, steps
    )
    check_schedule(schedule, p, m, valid=PLANNER_SCHEDULES, virtual_stages=virtual_stages)
    if not (isinstance(weight_grad_fraction, Real) and not isinstance(weight_grad_fraction, bool)
            and 0 < float(weight_grad_fraction) < 1):
        raise ValueError(f"weight_grad_fraction must be a number between 0 and 1 (exclusive): the share of a "
                         f"backward that is the weight gradient; got {weight_grad_fraction!r}")
    chunks = chunks_per_device(schedule, virtual_stages)
    last_vs = p * chunks - 1
    wf = float(weight_grad_fraction)
    reduce_s = _seconds("dp_reduce_s", dp_reduce_s, p, "stage", positive=False)
    if dp_overlap not in DP_OVERLAPS:
        raise ValueError(f"dp_overlap must be one of {', '.join(map(repr, DP_OVERLAPS))}, got {dp_overlap!r}")
    if not _is_int(dp_buckets) or dp_buckets < 1:
        raise ValueError(f"dp_buckets must be a positive integer, got {dp_buckets!r}")

    tied, tied_s = _check_tied(tied_stages, tied_reduce_s, p)
    deferred = dp_overlap == "deferred" and uses_lookahead(schedule, True) and any(r > 0 for r in reduce_s)
    if last_ahead is None:
        last_ahead = not any(r > 0 for r in reduce_s)
    if deferred and steps < 4:
        raise ValueError(f"dp_overlap='deferred' needs steps >= 4 (the last two steps' updates are not deferred), got {steps}")
    # Each stage's work over all steps: its step lists as the runtime runs them, each followed by the update.
    work: list[list[tuple[int, Optional[str], int, int, int]]] = []  # (step, op or None, batch, mb, chunk)
    for s in range(p):
        items: list[tuple[int, Optional[str], int, int, int]] = []
        run: list[Action] = []  # the device's whole run, batches numbered absolutely, for validation
        carried_in = False
        for k in range(steps):
            lookahead = uses_lookahead(schedule, next_batch_exists=k + 1 < steps)
            if schedule == "interleaved_1f1b":
                actions = interleaved_actions(s, p, m, virtual_stages)
            elif schedule == "zbv":
                actions = zbv_actions(s, p, m)
            else:
                actions = step_actions(schedule, s, p, m, carried_in=carried_in, lookahead=lookahead,
                                       last_ahead=bool(last_ahead))
            for a in actions:
                items.append((k, a.op, k + a.batch, a.microbatch, a.chunk))
                run.append(Action(a.op, k + a.batch, a.microbatch, a.chunk))
            items.append((k, None, k, -1, 0))
            carried_in = lookahead
        validate_actions(schedule, [run], m, virtual_stages=virtual_stages, batches=range(steps))
        if deferred:
            items = _defer_updates(items)
        work.append(items)
    # Per stage and step: where the step's last backward of its own batch and its last action sit in the work list.
    last_b: list[dict[int, int]] = [{} for _ in range(p)]
    last_action: list[dict[int, int]] = [{} for _ in range(p)]
    for s in range(p):
        for i, (k, op, b, _, _) in enumerate(work[s]):
            if op is not None:
                last_action[s][k] = i
                if op in ("B", "W") and b == k:  # a split backward's gradient is final after its weight pass
                    last_b[s][k] = i
    marks: dict[tuple[int, int], float] = {}  # (stage, work index) -> (start, end) of the last backward / action
    dp_spans: list[list[SimSpan]] = [[] for _ in range(p)]
    exposed: list[dict[int, float]] = [{} for _ in range(p)]

    def transfer(a: int, b: int) -> float:
        """Seconds from one device to another: none within a device; a wrap-around (interleaved, last device to
        first) costs the slowest boundary's."""
        if a == b:
            return 0.0
        return comm[min(a, b)] if abs(a - b) == 1 else max(comm)

    # (F or G, virtual stage, batch, microbatch) -> end time; G: the input gradient is there (after B or I)
    ends: dict[tuple[str, int, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    timelines: list[list[SimSpan]] = [[] for _ in range(p)]
    step_ends: list[list[float]] = [[] for _ in range(p)]
    tied_ready: dict[tuple[int, int], float] = {}  # (stage, step) -> when it reached the tied gradient's sum
    remaining = sum(len(w) for w in work)
    while remaining:
        progressed = False
        for s in range(p):
            items, tl = work[s], timelines[s]
            while pos[s] < len(items):
                k, op, b, j, c = items[pos[s]]
                if op is None:
                    if (s, k) in tied_ready:  # came back to it: the data-parallel part was counted already
                        start = tied_ready[(s, k)]
                    else:
                        start = free[s]
                        if reduce_s[s] > 0:
                            done = _reduction(s, k, reduce_s[s], dp_overlap, dp_buckets, marks, last_b, last_action,
                                              dp_spans[s])
                            exposed[s][k] = max(0.0, done - start)
                            start = max(start, done)
                    if s in tied:  # the tied gradient's sum needs every holder's whole step (the engine's order)
                        tied_ready[(s, k)] = start
                        if any((t, k) not in tied_ready for t in tied):
                            break  # another holder is still in its step: go on with the other stages
                        start = max(tied_ready[(t, k)] for t in tied) + tied_s
                    end = start + opt[s]
                    tl.append(SimSpan(s, OPTIMIZER, b, None, start, end, k))
                    step_ends[s].append(end)
                else:
                    vs = virtual_stage(schedule, s, c, p)
                    ready = 0.0
                    if op == "F":
                        if vs > 0:
                            dep = ends.get(("F", vs - 1, b, j))
                            if dep is None:
                                break
                            ready = dep + transfer(device_of(schedule, vs - 1, p), s)
                        duration, name = fwd[s] / chunks, FORWARD
                    elif op == "W":  # its I ran earlier on this device (validated)
                        duration, name = wf * bwd[s] / chunks, BACKWARD
                    else:
                        if vs < last_vs:
                            dep = ends.get(("G", vs + 1, b, j))
                            if dep is None:
                                break
                            ready = dep + transfer(device_of(schedule, vs + 1, p), s)
                        duration = (bwd[s] if op == "B" else (1 - wf) * bwd[s]) / chunks
                        name = BACKWARD
                    start = max(free[s], ready)
                    end = start + duration
                    ends[("F" if op == "F" else "G" if op in "BI" else "W", vs, b, j)] = end
                    tl.append(SimSpan(s, name, b, j, start, end, k, op, c))
                free[s] = end
                if op is not None:
                    marks[(s, pos[s])] = (start, end)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {s: _describe(work[s][pos[s]]) for s in range(p) if pos[s] < len(work[s])}
            raise RuntimeError(f"the schedule cannot make progress: stages wait on each other at {waiting}")

    # Steady state: the steps between the first (pipeline filling) and the last (no lookahead, drain).
    step_done = [max(step_ends[s][k] for s in range(p)) for k in range(steps)]
    # A deferred update of step k lands in step k+1, and the last step (no lookahead) defers nothing: one step less.
    first, last = 0, steps - 2 - int(deferred)
    step_time = (step_done[last] - step_done[first]) / (last - first)
    stage_bubbles = []
    for s in range(p):
        busy = sum(span.duration for span in timelines[s] if first < span.step <= last) / (last - first)
        stage_bubbles.append(max(0.0, 1.0 - busy / step_time) if step_time > 0 else 0.0)

    peaks = []
    for s in range(p):
        inflight = peak = 0
        for _, op, _, _, _ in work[s]:
            if op == "F":
                inflight += 1
                peak = max(peak, inflight)
            elif op in ("B", "W"):  # a split backward frees the activations with its weight gradient
                inflight -= 1
        peaks.append(peak)

    return SimulationResult(
        schedule=schedule, num_stages=p, num_microbatches=m, steps=steps, step_time_s=step_time,
        bubble_fraction=sum(stage_bubbles) / p, stage_bubble_fractions=stage_bubbles, peak_activations=peaks,
        timelines=timelines, step_ends=step_ends, forward_s=fwd, backward_s=bwd, comm_s=comm, optimizer_s=opt,
        dp_reduce_s=reduce_s, dp_overlap=dp_overlap, dp_spans=dp_spans,
        dp_exposed_s=[sum(e for k, e in exposed[s].items() if first < k <= last) / (last - first) for s in range(p)],
        chunks=chunks, weight_versions=2 if schedule == "2bw" else 1, tied_stages=tied, tied_reduce_s=tied_s,
    )


#: Where the data-parallel reduction runs in :func:`simulate` (see its ``dp_overlap``).
DP_OVERLAPS = ("none", "backward", "deferred")
DP_REDUCE = "dp_reduce"  # the span name of a reduction


def _defer_updates(items: list[tuple[int, Optional[str], int, int, int]]) -> list[tuple[int, Optional[str], int, int, int]]:
    """Move each step's update to just before the first action on batch ``k+2`` (or the next update)."""
    updates = [it for it in items if it[1] is None]
    rest = [it for it in items if it[1] is not None]
    out: list[tuple[int, Optional[str], int, int, int]] = []
    due = 0  # the next update to place
    for it in rest:
        while due < len(updates) and (it[2] >= updates[due][0] + 2 or it[0] > updates[due][0] + 1):
            out.append(updates[due])
            due += 1
        out.append(it)
    return out + updates[due:]


def _reduction(s: int, k: int, seconds: float, overlap: str, buckets: int, marks: dict, last_b: list, last_action: list,
               spans: list[SimSpan]) -> float:
    """When stage ``s``'s reduction of step ``k``'s gradient ends (and its spans, on the stage's own link)."""
    if overlap == "none" or k not in last_b[s]:
        start = marks[(s, last_action[s][k])][1]
        spans.append(SimSpan(s, DP_REDUCE, k, None, start, start + seconds, k))
        return start + seconds
    b_start, b_end = marks[(s, last_b[s][k])]
    t = 0.0
    for i in range(1, buckets + 1):
        ready = b_start + (b_end - b_start) * i / buckets
        t = max(t, ready)
        spans.append(SimSpan(s, DP_REDUCE, k, i - 1, t, t + seconds / buckets, k))
        t += seconds / buckets
    return t


def uses_lookahead(schedule: str, next_batch_exists: bool) -> bool:
    """Whether a step starts the next batch's forwards: what ``PipelineRuntime.uses_lookahead`` decides across
    processes for a delayed batch (2BW with ``sync_steps=0``)."""
    return schedule == "2bw" and next_batch_exists


def _describe(item: tuple[int, Optional[str], int, int, int]) -> str:
    k, op, b, j, c = item
    return f"step {k} optimizer" if op is None else f"step {k} {op}{b - k}.{j}" + (f"@{c}" if c else "")


# ---- inputs ---------------------------------------------------------------------------------------------------


def check_inputs(
    schedule: str, num_stages: int, num_microbatches: int, forward_s: Seconds, backward_s: Seconds,
    comm_s: Seconds, optimizer_s: Seconds, steps: int,
) -> tuple[int, int, list[float], list[float], list[float], list[float]]:
    """Every input of :func:`simulate` checked in one place; costs expanded to per-stage (per-boundary) lists."""
    if not _is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if not _is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if schedule not in PLANNER_SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}; valid schedules are {', '.join(map(repr, PLANNER_SCHEDULES))}")
    check_schedule(schedule, num_stages, num_microbatches, valid=PLANNER_SCHEDULES)
    if not _is_int(steps) or steps < 3:
        raise ValueError(
            f"steps must be an integer >= 3 (a first step filling the pipeline, at least one steady-state step and a "
            f"last one draining it), got {steps!r}"
        )
    p = num_stages
    fwd = _seconds("forward_s", forward_s, p, "stage", positive=True)
    bwd = _seconds("backward_s", backward_s, p, "stage", positive=True)
    comm = _seconds("comm_s", comm_s, p - 1, "boundary between stages", positive=False)
    opt = _seconds("optimizer_s", optimizer_s, p, "stage", positive=False)
    return p, num_microbatches, fwd, bwd, comm, opt


def _check_tied(stages: Sequence[int], seconds: float, p: int) -> tuple[tuple[int, ...], float]:
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not all(_is_int(t) for t in stages):
        raise ValueError(f"tied_stages must be a sequence of stage indices, e.g. (0, {p - 1}), got {stages!r}")
    tied = tuple(sorted(set(stages)))
    if tied and (len(tied) < 2 or tied[0] < 0 or tied[-1] >= p):
        raise ValueError(f"tied_stages must name at least two distinct stages among 0..{p - 1} (or none), got {stages!r}")
    if not (isinstance(seconds, Real) and not isinstance(seconds, bool) and math.isfinite(float(seconds))
            and float(seconds) >= 0):
        raise ValueError(f"tied_reduce_s must be a finite number of seconds >= 0, got {seconds!r}")
    return tied, float(seconds)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(name: str, value: Seconds, n: int, per: str, *, positive: bool) -> list[float]:
    bound = "> 0" if positive else ">= 0"
    what = (f"{name} must be a finite number of seconds {bound}, or a sequence of {n} of them (one per {per})")

    def ok(v: object) -> bool:
        return (isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v))
                and (float(v) > 0 if positive else float(v) >= 0))

    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what}, got {value!r}")
    if isinstance(value, Sequence):
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{what}, got a sequence of {len(values)}: {values!r}")
        bad = [(i, v) for i, v in enumerate(values) if not ok(v)]
        if bad:
            i, v = bad[0]
            raise ValueError(f"{what}, got {v!r} for {per} {i} in {values!r}")
        return [float(v) for v in values]
    if not ok(value):
        raise ValueError(f"{what}, got {value!r}")
    return [float(value)] * n  # type: ignore[arg-type]
