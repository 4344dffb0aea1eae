"""The planner's memory model: what one device holds at its peak, by what holds it.

A device holds its parameters, the older weight versions its schedule stashes (2bw: one), the optimizer's state
and a correction's buffers throughout; on top, at each point of its simulated timeline, the gradients of the batches
whose backward has begun and whose update has not run, and the activations of the microbatches in flight. The
model takes the largest total. Per microbatch it needs what a forward keeps for its backward and the peak of a
forward and backward, both measured once on one microbatch through the device's layers in a plain loop, as the
planner takes per-layer times; ``benchmarks/realistic_llama.py --memory`` compares it with the allocator's
measured peak (BENCHMARKS.md). See docs/design/planner.md, "Memory".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Optional

from lightning_async_pp.pipeline.simulate import OPTIMIZER, SimulationResult, simulate


@dataclass(frozen=True)
class StageMemory:
    """Bytes one device holds at its peak, by what holds them."""

    weights: int  # the parameters (the newest version)
    versions: int  # older versions the schedule stashes (2bw: one more copy of ``weights``)
    gradients: int  # one per parameter and batch whose gradients exist at the peak
    optimizer_state: int  # e.g. AdamW's two moments, Muon's momentum
    correction: int  # a delay correction's buffers (ErrorFeedback: one per parameter)
    activations: int  # the microbatches in flight at the peak (and the optimizer's transient copies, if there)

    @property
    def total(self) -> int:
        return (self.weights + self.versions + self.gradients + self.optimizer_state + self.correction
                + self.activations)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class PeakPoint:
    """One point of a device's walk at which its total may peak: what it holds there, in counts, not bytes."""

    gradients: int  # batches whose gradients exist
    saved: int  # (chunk) forwards whose kept bytes are held beside it
    extra: str = ""  # "update" (the optimizer's transient copies), "working" or "first" (a backward's working set)
    # sets of autocast's cached weight casts alive (a cache-enabled autocast): one per (step, batch, chunk) whose
    # forwards are cached in this step's region or held by a microbatch in flight
    casts: int = 0


def peak_points(result: SimulationResult, device: int, run_ahead: bool = True) -> tuple[PeakPoint, ...]:
    """The points of ``device``'s simulated timeline at which :func:`stage_memory` weighs what it holds, in the
    order first met, each once. They depend on the order of its actions only, not on their times, so a simulation
    with any costs gives them (the balanced split takes them from unit costs before the split's costs exist)."""
    if not 0 <= device < len(result.timelines):
        raise ValueError(f"device {device} is not one of the {len(result.timelines)} simulated")
    in_flight, graded = 0, set()  # microbatches whose backward has not run; batches whose gradients exist
    # Autocast's cache lives for one step's autocast region (the training step; the update runs outside it) and is
    # keyed by weight leaf, and each batch has its own (WeightVersions.leaves_for_batch): the sets of casts alive are
    # those this region made (one per batch and chunk it forwarded) and those older regions made that a microbatch
    # in flight still keeps for its backward (2bw's lookahead forwards of the next batch).
    made: dict[tuple, tuple] = {}  # microbatch in flight -> the cast set it keeps: (step, batch, chunk)
    region: set[tuple] = set()  # the cast sets this step's region has cached
    step = None

    def casts() -> int:
        return len(region | set(made.values()))

    points: dict[PeakPoint, None] = {}
    for span in result.timelines[device]:
        if span.op == OPTIMIZER:
            region.clear()
            points.setdefault(PeakPoint(len(graded), in_flight, "update", casts()))
            graded.discard(span.batch)
            continue
        if span.step != step:
            step = span.step
            region.clear()
        key = (span.batch, span.microbatch, span.chunk)
        if span.action == "F":
            in_flight += 1
            made[key] = (span.step, span.batch, span.chunk)
            region.add(made[key])
            points.setdefault(PeakPoint(len(graded), in_flight, casts=casts()))
        elif span.action in ("B", "W"):  # a split backward's input pass (I) frees nothing and makes no gradient
            if span.batch in graded:
                points.setdefault(PeakPoint(len(graded), in_flight - 1, "working", casts()))
            else:  # the working set of the batch's first backward includes allocating its gradients
                if not run_ahead:
                    graded.clear()  # the earlier batch's update ran before this backward
                points.setdefault(PeakPoint(len(graded) + 1, in_flight - 1, "first", casts()))
                graded.add(span.batch)
            in_flight -= 1
            made.pop(key, None)
    return tuple(points)


@lru_cache(maxsize=64)
def action_order(schedule: str, num_stages: int, num_microbatches: int, last_ahead: Optional[bool] = None,
                 virtual_stages: int = 2) -> SimulationResult:
    """``schedule`` simulated with unit costs over 4 steps (filling, two steady, draining): the order of each
    device's actions, all :func:`peak_points` needs, for a split whose costs are not known yet."""
    return simulate(schedule, num_stages, num_microbatches, 1.0, 2.0, steps=4, last_ahead=last_ahead,
                    virtual_stages=virtual_stages)


@lru_cache(maxsize=1024)
def order_peak_points(schedule: str, num_stages: int, num_microbatches: int, last_ahead: Optional[bool],
                      virtual_stages: int, device: int, run_ahead: bool) -> tuple[PeakPoint, ...]:
    """:func:`peak_points` of :func:`action_order`'s simulation, walked once: the balanced split prices every
    candidate stage at the same points."""
    order = action_order(schedule, num_stages, num_microbatches, last_ahead, virtual_stages)
    return peak_points(order, device, run_ahead)


def stage_memory(result: SimulationResult, device: int, *, weight_bytes: int, saved_bytes: int, working_bytes: int,
                 first_working_bytes: Optional[int] = None, optimizer_state_bytes: int = 0, correction_bytes: int = 0,
                 update_bytes: int = 0, cast_bytes: int = 0, run_ahead: bool = True,
                 points: Optional[tuple[PeakPoint, ...]] = None) -> StageMemory:
    """The model's peak for ``device``: the largest of what it holds at each point of its simulated timeline.

    Walking the device's actions in order: a forward adds ``saved_bytes``; a backward (a split one's weight pass)
    runs at its working set (``working_bytes`` when its batch's gradients exist, ``first_working_bytes``, which
    includes allocating them, when it is the batch's first) beside the others in flight, then frees what it kept;
    a batch's gradients live from its first backward to its update, which adds ``update_bytes`` (the optimizer's
    transient copies: ErrorFeedback's one per parameter) and then releases them. So a schedule that runs the next
    batch's backward before this batch's update (2bw's last stage) holds two gradients there, unless ``run_ahead``
    is False (the engine under data parallelism updates before the next batch's backward: one gradient). A chunked schedule's
    chunk holds ``1 / chunks`` of the per-microbatch bytes, which are for all of the device's layers. ``cast_bytes``:
    one set of a cache-enabled autocast's weight casts, held as many times as :attr:`PeakPoint.casts` says.
    """
    if first_working_bytes is None:
        first_working_bytes = working_bytes + weight_bytes
    for name, value in (("weight_bytes", weight_bytes), ("saved_bytes", saved_bytes), ("working_bytes", working_bytes),
                        ("first_working_bytes", first_working_bytes), ("optimizer_state_bytes", optimizer_state_bytes),
                        ("correction_bytes", correction_bytes), ("update_bytes", update_bytes), ("cast_bytes", cast_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    saved, chunks = saved_bytes / result.chunks, result.chunks
    extra = {"": 0.0, "update": update_bytes, "working": working_bytes / chunks,
             "first": (first_working_bytes - weight_bytes) / chunks}
    peak = (0.0, 0.0)  # (gradients, activations) at the largest total, the first met where several tie
    if points is None:
        points = peak_points(result, device, run_ahead)
    for point in points:
        peak = max(peak, (point.gradients * weight_bytes,
                          point.saved * saved + extra[point.extra] + point.casts * cast_bytes / chunks), key=sum)
    return StageMemory(weights=weight_bytes, versions=(result.weight_versions - 1) * weight_bytes,
                       gradients=round(peak[0]), optimizer_state=optimizer_state_bytes, correction=correction_bytes,
                       activations=round(peak[1]))
