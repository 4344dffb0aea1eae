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
from typing import Optional

from lightning_async_pp.pipeline.simulate import OPTIMIZER, SimulationResult


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


def stage_memory(result: SimulationResult, device: int, *, weight_bytes: int, saved_bytes: int, working_bytes: int,
                 first_working_bytes: Optional[int] = None, optimizer_state_bytes: int = 0, correction_bytes: int = 0,
                 update_bytes: int = 0, run_ahead: bool = True) -> StageMemory:
    """The model's peak for ``device``: the largest of what it holds at each point of its simulated timeline.

    Walking the device's actions in order: a forward adds ``saved_bytes``; a backward (a split one's weight pass)
    runs at its working set (``working_bytes`` when its batch's gradients exist, ``first_working_bytes``, which
    includes allocating them, when it is the batch's first) beside the others in flight, then frees what it kept;
    a batch's gradients live from its first backward to its update, which adds ``update_bytes`` (the optimizer's
    transient copies: ErrorFeedback's one per parameter) and then releases them. So a schedule that runs the next
    batch's backward before this batch's update (2bw's last stage) holds two gradients there, unless ``run_ahead``
    is False (the engine under data parallelism updates before the next batch's backward: one gradient). A chunked schedule's
    chunk holds ``1 / chunks`` of the per-microbatch bytes, which are for all of the device's layers.
    """
    if not 0 <= device < len(result.timelines):
        raise ValueError(f"device {device} is not one of the {len(result.timelines)} simulated")
    if first_working_bytes is None:
        first_working_bytes = working_bytes + weight_bytes
    for name, value in (("weight_bytes", weight_bytes), ("saved_bytes", saved_bytes), ("working_bytes", working_bytes),
                        ("first_working_bytes", first_working_bytes), ("optimizer_state_bytes", optimizer_state_bytes),
                        ("correction_bytes", correction_bytes), ("update_bytes", update_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    saved, chunks = saved_bytes / result.chunks, result.chunks
    in_flight, graded = 0, set()  # microbatches whose backward has not run; batches whose gradients exist
    peak = (0.0, 0.0)  # (gradients, activations) at the largest total
    for span in result.timelines[device]:
        if span.op == OPTIMIZER:
            peak = max(peak, (len(graded) * weight_bytes, in_flight * saved + update_bytes), key=sum)
            graded.discard(span.batch)
        elif span.action == "F":
            in_flight += 1
            peak = max(peak, (len(graded) * weight_bytes, in_flight * saved), key=sum)
        elif span.action in ("B", "W"):  # a split backward's input pass (I) frees nothing and makes no gradient
            if span.batch in graded:
                peak = max(peak, (len(graded) * weight_bytes, (in_flight - 1) * saved + working_bytes / chunks), key=sum)
            else:  # the working set of the batch's first backward includes allocating its gradients
                if not run_ahead:
                    graded.clear()  # the earlier batch's update ran before this backward
                first = (first_working_bytes - weight_bytes) / chunks
                peak = max(peak, ((len(graded) + 1) * weight_bytes, (in_flight - 1) * saved + first), key=sum)
                graded.add(span.batch)
            in_flight -= 1
    return StageMemory(weights=weight_bytes, versions=(result.weight_versions - 1) * weight_bytes,
                       gradients=round(peak[0]), optimizer_state=optimizer_state_bytes, correction=correction_bytes,
                       activations=round(peak[1]))
