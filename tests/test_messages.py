"""The step's messages as data (pipeline/messages.py): every plan the runtime can be given is right under NCCL's
rules by construction, checked as a property over every schedule, stage count, microbatch count and lookahead
state, and the checker of those rules fails the plans that break them."""
from __future__ import annotations

import itertools

import pytest

from lightning_async_pp.pipeline.comm import FailureBoard, PipelineFailure, StageLink, is_lost_connection
from lightning_async_pp.pipeline.messages import (
    carried_activations, check_programs, evaluation_programs, plan_programs, step_programs,
)
from lightning_async_pp.pipeline.schedule import SCHEDULES, Action, step_actions


def _step_states(schedule: str):
    """(carried_in, lookahead) of the steps of a run: 2BW's first, middle and last steps, else one kind."""
    return [(False, True), (True, True), (True, False), (False, False)] if schedule == "2bw" else [(False, False)]


def _replay(programs) -> None:
    """An independent replay of the programs under NCCL's rules, one stream per process (the strictest sharing):
    each process runs its operations in program order; a send and its receive complete together, only when both
    are at the head of their process's stream; a computation runs once the receive it consumes completed."""
    heads = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for s, program in enumerate(programs):
            while heads[s] < len(program):
                e = program[heads[s]]
                if e.op == "compute":
                    heads[s] += 1
                    progress = True
                    continue
                m = e.message
                partner = m.dst if e.op == "send" else m.src
                other = programs[partner]
                h = heads[partner]
                if h < len(other) and other[h].op != "compute" and other[h].message == m and other[h].op != e.op:
                    heads[s] += 1
                    heads[partner] += 1
                    progress = True
                    continue
                break
    stuck = {s: program[heads[s]] for s, program in enumerate(programs) if heads[s] < len(program)}
    assert not stuck, f"deadlock under one stream per process: {stuck}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_step_plan_pairs_each_send_with_its_receive_in_order_and_cannot_deadlock(schedule):
    cases = 0
    for p, m in itertools.product(range(2, 5), (1, 2, 3, 4, 6, 8)):
        if schedule == "2bw" and m < p:
            continue
        for (carried_in, lookahead), checks, ahead in itertools.product(_step_states(schedule), (False, True),
                                                                         (False, True)):
            programs = step_programs(schedule, p, m, carried_in=carried_in, lookahead=lookahead, checks=checks,
                                     last_ahead=ahead)
            where = f"{schedule} p={p} m={m} carried_in={carried_in} lookahead={lookahead} checks={checks} " \
                    f"last_ahead={ahead}"
            for s, program in enumerate(programs):
                computed = [e.action for e in program if e.op == "compute"]
                assert computed == step_actions(schedule, s, p, m, carried_in=carried_in, lookahead=lookahead,
                                                last_ahead=ahead), where
                losses = [e for e in program if e.message is not None and e.message.kind == "loss"]
                assert len(losses) == (p - 1 if s == p - 1 else 1), where  # the loss reaches every stage once
            _replay(programs)
            cases += 1
    assert cases > 20


def test_2bw_lookahead_activations_are_received_in_the_step_that_sends_them():
    p, m = 4, 6
    sent = step_programs("2bw", p, m, carried_in=False, lookahead=True, checks=True)
    for s in range(1, p):
        received = {(e.message.batch, e.message.microbatch) for e in sent[s] if e.op == "recv" and e.message.kind == "act"}
        assert received == {(0, j) for j in range(m)} | {(1, j) for j in range(len(
            [a for a in step_actions("2bw", s - 1, p, m, lookahead=True) if a.batch == 1]))}
    # The next step consumes exactly those (carried) before any new receive of batch 0.
    carried = carried_activations("2bw", p, m)
    nxt = step_programs("2bw", p, m, carried_in=True, lookahead=True, checks=True)
    for s in range(1, p):
        again = [e for e in nxt[s] if e.op == "recv" and e.message.kind == "act" and e.message.batch == 0]
        assert {(0, e.message.microbatch) for e in again}.isdisjoint({(b, j) for c, b, j in carried if c == s})


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (4, 6)])
def test_2bw_last_stage_run_ahead_sends_its_gradient_in_the_step_and_the_next_step_consumes_it_first(p, m):
    """With ``last_ahead`` the last stage runs the next batch's first forward and backward at the end of a step: the
    gradient it sends is received by stage p - 2 in that step, and the next step's first backward there takes it
    without a new receive, while the last stage skips that microbatch."""
    sent = step_programs("2bw", p, m, carried_in=True, lookahead=True, checks=True, last_ahead=True)
    last = [e.action for e in sent[p - 1] if e.op == "compute"]
    assert last[-2:] == [Action("F", 1, 0), Action("B", 1, 0)] and Action("F", 0, 0) not in last
    ahead_grads = [e for e in sent[p - 2] if e.op == "recv" and e.message.kind == "grad" and e.message.batch == 1]
    assert [e.message.microbatch for e in ahead_grads] == [0]
    nxt = step_programs("2bw", p, m, carried_in=True, lookahead=False, checks=True, last_ahead=True)
    assert not any(e.op == "recv" and e.message.kind == "grad" and (e.message.batch, e.message.microbatch) == (0, 0)
                   for e in nxt[p - 2])
    assert Action("B", 0, 0) in [e.action for e in nxt[p - 2] if e.op == "compute"]
    with pytest.raises(ValueError, match="before the receive of its gradient"):
        check_programs(nxt, carried_activations("2bw", p, m))  # without the carried gradient the plan is wrong


def test_the_plan_checker_refuses_swapped_sends_a_late_receive_and_a_send_before_its_computation():
    lists = [step_actions("1f1b", s, 2, 2) for s in range(2)]
    good = plan_programs(lists, outcome="loss")
    check_programs(good)
    sends = [n for n, e in enumerate(good[0]) if e.op == "send"]
    swapped = [list(good[0]), list(good[1])]
    a, b = sends[0], sends[1]
    swapped[0][a], swapped[0][b] = swapped[0][b], swapped[0][a]
    with pytest.raises(ValueError, match="out of the global order|before the computation"):
        check_programs(swapped)
    late = [list(good[0]), list(good[1])]
    n = next(i for i, e in enumerate(late[1]) if e.op == "recv")
    entry = late[1].pop(n)
    late[1].append(entry)
    with pytest.raises(ValueError, match="before the receive"):
        check_programs(late)
    early = [list(good[0]), list(good[1])]
    first_send = next(i for i, e in enumerate(early[0]) if e.op == "send")
    early[0].insert(0, early[0].pop(first_send))
    with pytest.raises(ValueError, match="before the computation"):
        check_programs(early)


def test_a_schedule_whose_stages_wait_on_each_other_is_refused_when_planned():
    lists = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]]
    with pytest.raises(ValueError, match="cannot make progress"):
        plan_programs(lists)


@pytest.mark.parametrize("outcome", ["result_to_all", "result_to_first"])
def test_evaluation_plan_orders_value_j_of_stage_s_at_j_p_plus_s(outcome):
    """What the runtime's evaluation and prediction execute (pipeline/runtime.py, ``_forward_microbatches``)."""
    for p, n in itertools.product(range(2, 5), range(1, 5)):
        programs = evaluation_programs(p, n, outcome)
        check_programs(programs)
        _replay(programs)
        values = [e.message for e in programs[-1] if e.message is not None and e.message.kind == "value"]
        assert [(x.microbatch, x.index) for x in values] == [(j, j * (p - 1) + p - 2) for j in range(n)]
        results = [e for e in programs[0] if e.message is not None and e.message.kind == "result"]
        assert len(results) == 1


class _Broken:
    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:1234")


def test_a_lost_neighbour_is_named_as_the_failed_stage_not_the_survivor():
    import torch

    link = StageLink(stage=1, rank=1, prev_rank=0, next_rank=None, device=torch.device("cpu"), timeout=60.0,
                     board=FailureBoard(None), rank_to_stage={0: 0, 1: 1})
    with pytest.raises(PipelineFailure) as caught:
        link.wait(_Broken(), 0, "an activation")
    message = str(caught.value)
    assert message.startswith("stage 0 (rank 0) failed or died"), message
    assert "stage 1 (rank 1) failed" not in message
    assert is_lost_connection(RuntimeError("Connection closed by peer")) and not is_lost_connection(ValueError("x"))
