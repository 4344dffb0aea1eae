"""The messages of a step between stages, as data: each stage's program of computations, sends and receives, in
one global order that every process derives alike.

NCCL ignores tags: for each ordered pair of ranks the k-th send meets the k-th receive, and each process runs its
point-to-point operations in issue order on one CUDA stream, a send completing only together with its receive
(docs/design/runtime.md, "Communication under NCCL's rules"). A protocol is right under those rules when

- both sides of every ordered pair issue the same messages in the same order, and
- no rank waits for a message that can only come after something it has not issued yet.

Both follow from one construction. :func:`plan_programs` simulates every stage's action list (the schedule, data
from :mod:`.schedule`) with unit costs and numbers each message in the order the simulation creates it; the
receiver's receive is placed in its program at the moment the message is created, the sender's send right after
the computation that produced it. Every program therefore issues its messages in increasing global order, and a
computation only waits for messages numbered below everything its program issues afterwards. Then the message
with the lowest number not yet delivered always has both of its operations at the head of their streams with
nothing they wait on outstanding, however streams are shared (one per pair of ranks or one per process group):
it is delivered, and by induction every message is. :func:`check_programs` verifies these properties of a plan.

Every message sent in a step is received in the same step, the 2BW lookahead's included (its receives are posted
now, consumed by the next step's forwards and, with ``last_ahead``, by the first backward of the stage before the
last), so an evaluation between two steps, or the end of training, finds no
message in flight.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Optional

from lightning_async_pp.pipeline.schedule import Action, lookahead_forwards, step_actions

Kind = Literal["act", "check", "grad", "loss", "value", "result"]
#: Unit costs of the simulation that orders the messages (a whole backward costs a forward and a weight pass).
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Message:
    """One transfer between two stages: an activation (``act``), the batch fingerprint that goes along with a
    batch's first activation (``check``), an input gradient (``grad``), the batch loss (``loss``), an evaluation
    activation (``value``) or the evaluation's outcome (``result``: the loss or the prediction)."""

    kind: Kind
    src: int  # stage
    dst: int  # stage
    batch: int  # 0: this step's batch; 1: the next one (2BW lookahead)
    microbatch: int
    index: int  # the global order

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.batch, self.microbatch


@dataclass(frozen=True)
class Entry:
    """One item of a stage's program: run ``action``, or send or receive ``message``."""

    op: Literal["compute", "send", "recv"]
    action: Optional[Action] = None
    message: Optional[Message] = None

    def __repr__(self) -> str:
        if self.op == "compute":
            return repr(self.action)
        m = self.message
        assert m is not None
        arrow = f"->{m.dst}" if self.op == "send" else f"<-{m.src}"
        return f"{self.op}:{m.kind}{m.batch}.{m.microbatch}{arrow}#{m.index}"


def _needs(stage: int, num_stages: int, action: Action) -> Optional[tuple[str, int, int, int]]:
    """The message ``action`` waits for on ``stage``, as (kind, stage, batch, microbatch), if any."""
    if action.op == "F" and stage > 0:
        return "act", stage, action.batch, action.microbatch
    if action.op in ("B", "I") and stage < num_stages - 1:
        return "grad", stage, action.batch, action.microbatch
    return None


def plan_programs(
    lists: Sequence[Sequence[Action]],
    *,
    carried: Sequence[tuple[int, int, int]] = (),
    carried_grads: Sequence[tuple[int, int, int]] = (),
    checks: bool = False,
    outcome: Optional[Literal["loss", "result_to_all", "result_to_first"]] = None,
    forward_kind: Kind = "act",
) -> list[list[Entry]]:
    """Each stage's program for one step (or evaluation) whose actions per stage are ``lists``.

    ``carried``: (stage, batch, microbatch) of activations received in an earlier step (the 2BW lookahead's);
    ``carried_grads``: of gradients received in an earlier step (the last stage's ``last_ahead`` backward).
    ``checks``: a batch's first activation is preceded by its fingerprint. ``outcome``: after the last stage's
    last forward of batch 0 it sends the batch loss to every other stage (``loss``, ``result_to_all``) or the
    result to the first stage (``result_to_first``). ``forward_kind``: what forwards send (``value`` in
    evaluation). Raises ``ValueError`` when the lists wait on each other (no stage can go on)."""
    p = len(lists)
    programs: list[list[Entry]] = [[] for _ in range(p)]
    arrived: dict[tuple[str, int, int, int], float] = {("act", s, b, j): 0.0 for s, b, j in carried}
    arrived.update({("grad", s, b, j): 0.0 for s, b, j in carried_grads})
    clock = [0.0] * p
    head = [0] * p
    count = 0
    last_forward = max((n for n, a in enumerate(lists[-1]) if a.op == "F" and a.batch == 0), default=-1)

    def emit(kind: Kind, src: int, dst: int, batch: int, microbatch: int, at: float) -> None:
        nonlocal count
        message = Message(kind, src, dst, batch, microbatch, count)
        count += 1
        programs[src].append(Entry("send", message=message))
        programs[dst].append(Entry("recv", message=message))
        arrived[("act" if kind == "value" else kind, dst, batch, microbatch)] = at  # what a forward waits for

    while True:
        best: Optional[tuple[float, int]] = None
        for s in range(p):
            if head[s] == len(lists[s]):
                continue
            need = _needs(s, p, lists[s][head[s]])
            if need is not None and need not in arrived:
                continue
            start = max(clock[s], arrived[need] if need is not None else 0.0)
            if best is None or start < best[0]:
                best = (start, s)
        if best is None:
            if any(head[s] < len(lists[s]) for s in range(p)):
                waiting = {s: repr(lists[s][head[s]]) for s in range(p) if head[s] < len(lists[s])}
                raise ValueError(f"the schedule cannot make progress: stages wait on each other at {waiting}")
            return programs
        start, s = best
        n, action = head[s], lists[s][head[s]]
        head[s] += 1
        end = clock[s] = start + COSTS[action.op]
        programs[s].append(Entry("compute", action=action))
        if action.op == "F" and s < p - 1:
            if checks and action.microbatch == 0:
                emit("check", s, s + 1, action.batch, 0, end)
            emit(forward_kind, s, s + 1, action.batch, action.microbatch, end)
        elif action.op in ("B", "I") and s > 0:
            emit("grad", s, s - 1, action.batch, action.microbatch, end)
        if s == p - 1 and n == last_forward and outcome is not None:
            kind: Kind = "loss" if outcome == "loss" else "result"
            for dst in ([0] if outcome == "result_to_first" else range(p - 1)):
                if dst != s:
                    emit(kind, s, dst, 0, 0, end)


@lru_cache(maxsize=64)
def evaluation_programs(num_stages: int, num_microbatches: int,
                        outcome: Literal["result_to_all", "result_to_first"]) -> tuple[tuple[Entry, ...], ...]:
    """Each stage's program for an evaluation or prediction: microbatch by microbatch, each stage receives it,
    runs its forward and sends it on, so ``value(j, s -> s+1)`` is message ``j (p-1) + s``; then the last
    stage sends the result (the loss to every stage, or the prediction to the first)."""
    p = num_stages
    programs: list[list[Entry]] = [[] for _ in range(p)]
    count = 0

    def emit(kind: Kind, src: int, dst: int, microbatch: int) -> None:
        nonlocal count
        message = Message(kind, src, dst, 0, microbatch, count)
        count += 1
        programs[src].append(Entry("send", message=message))
        programs[dst].append(Entry("recv", message=message))

    for j in range(num_microbatches):
        for s in range(p):
            programs[s].append(Entry("compute", action=Action("F", 0, j)))
            if s < p - 1:
                emit("value", s, s + 1, j)
    for dst in ([0] if outcome == "result_to_first" else range(p - 1)):
        if dst != p - 1:
            emit("result", p - 1, dst, 0)
    return tuple(tuple(program) for program in programs)


def check_programs(programs: Sequence[Sequence[Entry]], carried: Sequence[tuple[int, int, int]] = (),
                   carried_grads: Sequence[tuple[int, int, int]] = ()) -> None:
    """What makes a plan right under NCCL's rules, checked: for every ordered pair of stages the sender's sends
    and the receiver's receives are the same messages in the same order; every program issues its messages in
    increasing global order; a computation comes after the receive of the message it consumes and before the
    sends of the messages it produces. Raises ``ValueError`` naming the first violation."""
    p = len(programs)
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for s, program in enumerate(programs):
        last = -1
        received = {(b, j) for c, b, j in carried if c == s}
        computed: set[tuple[str, int, int]] = {("grad", b, j) for c, b, j in carried_grads if c == s}
        for n, entry in enumerate(program):
            where = f"stage {s}, entry {n} ({entry!r})"
            if entry.op == "compute":
                a = entry.action
                assert a is not None
                need = _needs(s, p, a)
                if need is not None and need[0] == "act" and (a.batch, a.microbatch) not in received:
                    raise ValueError(f"{where}: runs before the receive of its input")
                if need is not None and need[0] == "grad" and ("grad", a.batch, a.microbatch) not in computed:
                    raise ValueError(f"{where}: runs before the receive of its gradient")
                computed.add((a.op, a.batch, a.microbatch))
                continue
            m = entry.message
            assert m is not None
            if m.index <= last:
                raise ValueError(f"{where}: issued after message #{last}, out of the global order")
            last = m.index
            if entry.op == "send":
                if m.src != s:
                    raise ValueError(f"{where}: sends a message of stage {m.src}")
                producer = "F" if m.kind in ("act", "check", "value") else ("B", "I") if m.kind == "grad" else None
                if producer is not None and not any((op, m.batch, m.microbatch) in computed for op in producer):
                    raise ValueError(f"{where}: sent before the computation that produces it")
                sends.setdefault((m.src, m.dst), []).append(m)
            else:
                if m.dst != s:
                    raise ValueError(f"{where}: receives a message for stage {m.dst}")
                recvs.setdefault((m.src, m.dst), []).append(m)
                if m.kind in ("act", "value"):
                    received.add((m.batch, m.microbatch))
                elif m.kind == "grad":
                    computed.add(("grad", m.batch, m.microbatch))
    for pair in sorted(set(sends) | set(recvs)):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise ValueError(f"stages {pair[0]} -> {pair[1]}: the sends {sends.get(pair, [])} and the receives "
                             f"{recvs.get(pair, [])} differ")


def carried_activations(schedule: str, num_stages: int, num_microbatches: int) -> list[tuple[int, int, int]]:
    """(stage, batch 0, microbatch) of the activations a 2BW step finds received: the previous step's lookahead
    forwards of each stage's predecessor."""
    return [(s, 0, j) for s in range(1, num_stages)
            for j in range(lookahead_forwards(schedule, s - 1, num_stages, num_microbatches))]


def carried_gradients(schedule: str, num_stages: int, last_ahead: bool) -> list[tuple[int, int, int]]:
    """(stage, batch 0, microbatch) of the gradients a 2BW step finds received: with ``last_ahead``, that of the
    last stage's backward of the batch's first microbatch, run at the end of the previous step."""
    return [(num_stages - 2, 0, 0)] if schedule == "2bw" and last_ahead and num_stages > 1 else []


@lru_cache(maxsize=64)
def step_programs(schedule: str, num_stages: int, num_microbatches: int, *, carried_in: bool, lookahead: bool,
                  checks: bool, loss: bool = True, last_ahead: bool = False) -> tuple[tuple[Entry, ...], ...]:
    """Every stage's program for one training step (:func:`plan_programs` over the schedule's action lists);
    ``loss``: the last stage sends the batch loss to the others; ``last_ahead``: see ``step_actions``."""
    lists = [step_actions(schedule, s, num_stages, num_microbatches, carried_in=carried_in, lookahead=lookahead,
                          last_ahead=last_ahead) for s in range(num_stages)]
    carried = carried_activations(schedule, num_stages, num_microbatches) if carried_in else []
    grads = carried_gradients(schedule, num_stages, last_ahead) if carried_in else []
    programs = plan_programs(lists, carried=carried, carried_grads=grads, checks=checks,
                             outcome="loss" if loss else None)
    check_programs(programs, carried, grads)
    return tuple(tuple(program) for program in programs)
