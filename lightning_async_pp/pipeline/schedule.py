"""Schedules as data: the list of actions one stage runs for one training step.

An action is a forward or backward of microbatch ``j`` of either this step's batch (``batch=0``) or, under
2BW, the next step's batch (``batch=1``): 2BW keeps the 1F1B steady state running across batch boundaries by
starting the next batch's forwards before this batch's last backwards, so there is no flush between steps.
A backward is either whole (``B``) or split, as the zero-bubble schedules split it, into the input gradient
(``I``, what the previous stage waits for) and the weight gradient (``W``, which nobody waits for and so can
fill a bubble). One runtime (:mod:`lightning_async_pp.pipeline.runtime`) executes these lists; a new schedule
is a new list.

``interleaved_1f1b`` and ``zbv`` give each device several model chunks (``Action.chunk``); the planner
simulates them as the synchronous competitors torch ships, the runtime does not run them (``SCHEDULES`` are
the ones it runs, ``PLANNER_SCHEDULES`` the ones the planner prices).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Literal

SCHEDULES = ("2bw", "1f1b", "gpipe", "zb_h1")
#: Several model chunks per device: priced by the planner against 2bw, not run by the engine.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zbv")
PLANNER_SCHEDULES = SCHEDULES + MULTI_CHUNK_SCHEDULES
Op = Literal["F", "B", "I", "W"]
OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    op: Op  # F forward, B whole backward, I input gradient only, W weight gradient only (after its I)
    batch: int  # 0: this step's batch; 1: the next step's batch (2BW lookahead)
    microbatch: int
    chunk: int = 0  # which of the device's model chunks (interleaved_1f1b, zbv); 0 for one stage per device

    def __repr__(self) -> str:
        return f"{self.op}{self.batch}.{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def check_schedule(schedule: str, num_stages: int, num_microbatches: int, *, valid: Sequence[str] = SCHEDULES,
                   virtual_stages: int = 2) -> None:
    """The arguments of a schedule, checked before any list is built. ``valid``: the schedules the caller runs
    (the engine: ``SCHEDULES``; the planner: ``PLANNER_SCHEDULES``)."""
    if schedule not in valid:
        raise ValueError(f"Unknown schedule {schedule!r}; valid schedules are {', '.join(map(repr, valid))}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if schedule == "interleaved_1f1b":
        if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
            raise ValueError(f"virtual_stages must be a positive integer (model chunks per device), got {virtual_stages!r}")
        if num_microbatches % num_stages:
            raise ValueError(
                f"schedule='interleaved_1f1b' runs microbatches in rounds of one per device: num_microbatches must be "
                f"a multiple of the {num_stages} stages, got {num_microbatches}"
            )
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
    Stages before the last run one forward more, which lets the next forward fill that wait (docs/design/schedules.md,
    "Schedules as data"). The update semantics do not change: a batch's microbatches all read the version the
    batch is due, and backwards run in the same order.
    """
    extra = 1 if stage < num_stages - 1 else 0
    return min(num_stages - 1 - stage + extra, num_microbatches)


def lookahead_forwards(schedule: str, stage: int, num_stages: int, num_microbatches: int,
                       last_ahead: bool = False) -> int:
    """How many of the next batch's forwards ``stage`` runs during a step under the 2BW lookahead."""
    return sum(a.op == "F" and a.batch == 1 for a in step_actions(
        schedule, stage, num_stages, num_microbatches, carried_in=True, lookahead=True, last_ahead=last_ahead))


def step_actions(
    schedule: str, stage: int, num_stages: int, num_microbatches: int, *, carried_in: bool = False,
    lookahead: bool = False, last_ahead: bool = False,
) -> list[Action]:
    """Actions of ``stage`` for one training step.

    ``carried_in``: this step's first forwards already ran as the previous step's lookahead (2BW steady state).
    ``lookahead``: start the next batch's forwards in this step (2BW, when a next batch exists).
    ``last_ahead``: under the lookahead the last stage also runs the next batch's first microbatch, forward and
    backward, at the end of the step (before its update), and so skips it in the next step. That batch reads
    ``W_k``, the version held before the update, so the numbers do not change; what changes is that the last
    stage has work while the first stage runs the step's last backwards, which is when a weight tied across
    them (an embedding tied to the head) keeps the last stage waiting for the sum of its gradient
    (docs/design/schedules.md, "Schedules as data").
    ``1f1b`` is the 2BW step with neither, so it warms up and drains (flushes) every batch.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [Action("F", 0, j) for j in range(m)] + [Action("B", 0, j) for j in range(m)]
    if schedule == "zb_h1":
        return zb_h1_actions(stage, num_stages, m)
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
    if last_ahead and stage == num_stages - 1:  # its ahead is 0: the list alternates F0.j B0.j
        if carried_in:
            actions = actions[2:]
        if lookahead:
            actions += [Action("F", 1, 0), Action("B", 1, 0)]
    return actions



def zb_h1_actions(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward split into
    its input gradient ``I`` and weight gradient ``W``. The ``I`` is what the previous stage waits for, so it runs
    where 1F1B runs the whole backward; stage ``s`` defers its first ``p-1-s`` ``W`` and runs them in the drain,
    where 1F1B leaves the stage idle. Warm-up and in-flight activations are 1F1B's (``forwards_ahead``), so
    memory is 1F1B's. Synchronous, one flush per batch, same numbers as 1f1b (docs/design/schedules.md, "Schedules as
    data"). With unit costs (F = I = W = 1) a step takes ``3m + p - 1`` instead of 1F1B's ``3m + 3(p - 1)``."""
    m = num_microbatches
    ahead = forwards_ahead(stage, num_stages, m)
    deferred = min(stage, m)
    actions = [Action("F", 0, j) for j in range(ahead)]
    weights = 0
    for j in range(m):
        if j + ahead < m:
            actions.append(Action("F", 0, j + ahead))
        actions.append(Action("I", 0, j))
        if j >= deferred:
            actions.append(Action("W", 0, weights))
            weights += 1
    actions += [Action("W", 0, j) for j in range(weights, m)]
    return actions


# ---- several chunks per device (planner only) ------------------------------------------------------------------


def chunks_per_device(schedule: str, virtual_stages: int = 2) -> int:
    return virtual_stages if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1


def virtual_stage(schedule: str, device: int, chunk: int, num_stages: int) -> int:
    """The position in the model of ``device``'s ``chunk``: interleaved deals chunks round-robin (chunk ``c`` of
    device ``d`` is stage ``c p + d``); ZBV folds the model into a V (device ``d`` holds ``d`` and ``2p-1-d``)."""
    if schedule == "zbv" and chunk == 1:
        return 2 * num_stages - 1 - device
    return chunk * num_stages + device


def device_of(schedule: str, vstage: int, num_stages: int) -> int:
    if schedule == "zbv" and vstage >= num_stages:
        return 2 * num_stages - 1 - vstage
    return vstage % num_stages


def interleaved_actions(device: int, num_stages: int, num_microbatches: int, virtual_stages: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., SC 2021, Megatron-LM's order): microbatches go through a device's
    chunks in rounds of ``p``; ``2(p-1-d) + (v-1)p`` warm-up forwards, then one forward and one backward
    alternate, backwards visiting the chunks in reverse. Needs ``m`` a multiple of ``p``. With unit costs a
    step takes ``3m + 3(p - 1)/v``."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    total = m * v

    def order(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warmup = min(2 * (p - 1 - device) + (v - 1) * p, total)
    actions: list[Action] = []
    for k in range(warmup):
        c, j = order(k, False)
        actions.append(Action("F", 0, j, c))
    for k in range(total):
        if warmup + k < total:
            c, j = order(warmup + k, False)
            actions.append(Action("F", 0, j, c))
        c, j = order(k, True)
        actions.append(Action("B", 0, j, c))
    return actions


def zbv_actions(device: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """ZBV (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024), in the order
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble`` gives rank ``d`` (its ``_calculate_single_rank_
    operations``, torch 2.14): chunk 0 is stage ``d``, chunk 1 stage ``2p-1-d``; built for
    ``max(m, 2p-1)`` microbatches and cut to ``m`` as torch does."""
    p, m = num_stages, num_microbatches
    n = max(2 * p - 1, m)
    out: list[Action] = []
    f = [0, 0]
    b = [0, 0]

    def fwd(c: int) -> None:
        out.append(Action("F", 0, f[c], c))
        f[c] += 1

    def inp(c: int) -> None:
        out.append(Action("I", 0, b[c], c))
        b[c] += 1

    def wgt(c: int, j: int) -> None:
        out.append(Action("W", 0, j, c))

    for _ in range(2 * (p - device) - 1):
        fwd(0)
    for _ in range(device):
        fwd(1)
        fwd(0)
    for _ in range(p - device):
        fwd(1)
        inp(1)
        wgt(1, b[1] - 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            fwd(0)
        inp(0)
        wgt(0, b[0] - 1)
        fwd(1)
        inp(1)
        wgt(1, b[1] - 1)
    w = list(b)
    for _ in range(device):
        inp(0)
        inp(1)
    for _ in range(p - device):
        inp(0)
        wgt(0, w[0])
        w[0] += 1
    while w[1] < b[1]:
        wgt(1, w[1])
        w[1] += 1
    while w[0] < b[0]:
        wgt(0, w[0])
        w[0] += 1
    return [a for a in out if a.microbatch < m]


def validate_actions(schedule: str, lists: Sequence[Sequence[Action]], num_microbatches: int, *,
                     virtual_stages: int = 2, batches: Sequence[int] = (0,)) -> None:
    """Check the lists of one step, one per device, as torch's ``_validate_schedule`` checks its own: every
    (chunk, batch, microbatch) runs one forward and either one ``B`` or one ``I`` followed by one ``W``, each after
    what it needs on the same device (a backward after its forward, ``W`` after its ``I``). ``batches``: the
    batches whose forwards (and backwards) these lists must hold in full. Raises ``ValueError`` naming the first
    bad action. Cross-device order (deadlock freedom) is what the planner's simulation finds. The planner
    validates each device's whole run (every step, batches numbered absolutely), so 2BW's lookahead forwards
    are checked with the backwards of the next step."""
    chunks = chunks_per_device(schedule, virtual_stages)
    for d, actions in enumerate(lists):
        done: dict[tuple[str, int, int, int], int] = {}
        for n, a in enumerate(actions):
            where = f"schedule {schedule!r}, device {d}, action {n} ({a!r})"
            if a.op not in OPS or not 0 <= a.chunk < chunks or not 0 <= a.microbatch < num_microbatches:
                raise ValueError(f"{where}: op must be one of {OPS}, chunk in 0..{chunks - 1} and microbatch in "
                                 f"0..{num_microbatches - 1}")
            key = (a.op, a.chunk, a.batch, a.microbatch)
            if key in done:
                raise ValueError(f"{where} runs twice (first at action {done[key]})")
            own = lambda op: (op, a.chunk, a.batch, a.microbatch) in done  # noqa: E731
            if a.op in "BI" and not own("F"):
                raise ValueError(f"{where}: a backward before its forward")
            if a.op == "W" and not own("I"):
                raise ValueError(f"{where}: a weight gradient before its input gradient")
            if a.op == "I" and own("B") or a.op == "B" and own("I"):
                raise ValueError(f"{where}: both a whole backward and a split one")
            done[key] = n
        for c in range(chunks):
            for b in batches:
                for j in range(num_microbatches):
                    has = lambda op: (op, c, b, j) in done  # noqa: E731
                    if not has("F") or not (has("B") or has("I") and has("W")):
                        raise ValueError(f"schedule {schedule!r}, device {d}: chunk {c} of batch {b}, microbatch {j} "
                                         f"lacks its forward or its backward")
