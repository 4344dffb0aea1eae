"""Schedules as data: the list of actions one stage runs for one training step.

An action is a forward or backward of microbatch ``j`` of either this step's batch (``batch=0``) or, under
2BW, the next step's batch (``batch=1``): 2BW keeps the 1F1B steady state running across batch boundaries by
starting the next batch's forwards before this batch's last backwards, so there is no flush between steps.
One runtime (:mod:`lightning_async_pp.pipeline.runtime`) executes these lists; a new schedule is a new list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("2bw", "1f1b", "gpipe")
Op = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    op: Op
    batch: int  # 0: this step's batch; 1: the next step's batch (2BW lookahead)
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.op}{self.batch}.{self.microbatch}"


def check_schedule(schedule: str, num_stages: int, num_microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}; valid schedules are {', '.join(map(repr, SCHEDULES))}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if schedule == "2bw" and num_microbatches < num_stages:
        raise ValueError(
            f"schedule='2bw' needs num_microbatches >= the number of pipeline stages to run without flushes; "
            f"got num_microbatches={num_microbatches} for {num_stages} stages"
        )


def forwards_ahead(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Warm-up forwards of a 1F1B/2BW stage: it runs this many, then alternates a forward and a backward, so at
    most ``ahead + 1`` of its microbatches are in flight.

    The textbook ``num_stages - 1 - stage`` leaves a stage no slack: the gradient it needs next is the one its
    successor is computing right now, so every transfer round trip and every jitter of the successor stalls it.
    Stages before the last run one forward more, which lets the next forward fill that wait (docs/design.md,
    "Schedules as data"). The update semantics do not change: a batch's microbatches all read the version the
    batch is due, and backwards run in the same order.
    """
    extra = 1 if stage < num_stages - 1 else 0
    return min(num_stages - 1 - stage + extra, num_microbatches)


def lookahead_forwards(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """How many of the next batch's forwards ``stage`` runs during a step under the 2BW lookahead."""
    return sum(a.batch == 1 for a in step_actions(schedule, stage, num_stages, num_microbatches,
                                                   carried_in=True, lookahead=True))


def step_actions(
    schedule: str, stage: int, num_stages: int, num_microbatches: int, *, carried_in: bool = False, lookahead: bool = False
) -> list[Action]:
    """Actions of ``stage`` for one training step.

    ``carried_in``: this step's first forwards already ran as the previous step's lookahead (2BW steady state).
    ``lookahead``: start the next batch's forwards in this step (2BW, when a next batch exists).
    ``1f1b`` is the 2BW step with neither, so it warms up and drains (flushes) every batch.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [Action("F", 0, j) for j in range(m)] + [Action("B", 0, j) for j in range(m)]
    if schedule == "1f1b":
        carried_in = lookahead = False
    elif schedule != "2bw":
        raise ValueError(f"Unknown schedule {schedule!r}; valid schedules are {', '.join(map(repr, SCHEDULES))}")
    ahead = forwards_ahead(stage, num_stages, m)
    actions = [] if carried_in else [Action("F", 0, j) for j in range(ahead)]
    for j in range(m):
        t = j + ahead
        if t < m:
            actions.append(Action("F", 0, t))
        elif lookahead:
            actions.append(Action("F", 1, t - m))
        actions.append(Action("B", 0, j))
    return actions

