"""The planner: ``pipeline.simulate`` runs the engine's action lists as a discrete-event simulation, and the
``lightning-async-pp-plan`` command prints its tables and Chrome traces."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_async_pp import plan
from lightning_async_pp.trace import CATEGORIES
from lightning_async_pp.pipeline import simulate as simulate_module
from lightning_async_pp.pipeline.schedule import Action, step_actions
from lightning_async_pp.pipeline.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
GRID = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (2, 8), (3, 3), (3, 7), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]


# ---- the bubble with unit costs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushing_schedules_waste_p_minus_1_slots_of_m_plus_p_minus_1(schedule, p, m):
    r = simulate(schedule, p, m, 1.0, 2.0)
    assert r.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.stage_bubble_fractions == pytest.approx([(p - 1) / (m + p - 1)] * p)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= p])
def test_2bw_steady_state_wastes_nothing(p, m):
    r = simulate("2bw", p, m, 1.0, 2.0)
    assert r.step_time_s == pytest.approx(m * 3.0)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert r.stage_bubble_fractions == pytest.approx([0.0] * p, abs=1e-12)
    # Every steady-state step of every stage is back to back: no gap between its spans.
    for s in range(p):
        spans = [x for k in range(1, r.steps - 1) for x in r.step_spans(s, k)]
        assert all(a.end == pytest.approx(b.start) for a, b in zip(spans, spans[1:]))


# ---- a weight tied across stages (an embedding tied to the head) -------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (3, 7), (4, 8)])
@pytest.mark.parametrize("f,b,t", [(1.0, 2.0, 0.0), (1.0, 3.0, 0.5)])
def test_a_tied_weight_costs_2bw_p_minus_1_backwards_less_the_last_stages_run_ahead_and_a_synchronous_schedule_only_its_sum(
        p, m, f, b, t):
    """The first and last stage sum the tied gradient before each update, so every update waits for the first
    stage's last backward, which comes p - 1 backwards after the last stage's. Without ``last_ahead`` 2BW's step
    grows from m (f + b) to m (f + b) + (p - 1) b + t; with it the last stage fills f + b of that wait with the next
    batch's first microbatch: m (f + b) + max(0, (p - 1) b - (f + b)) + t. A flushing schedule already waits for
    it and pays only the sum's t."""
    tied = dict(tied_stages=(0, p - 1), tied_reduce_s=t)
    assert simulate("2bw", p, m, f, b, **tied, last_ahead=False).step_time_s == pytest.approx(
        m * (f + b) + (p - 1) * b + t)
    assert simulate("2bw", p, m, f, b, **tied).step_time_s == pytest.approx(
        m * (f + b) + max(0.0, (p - 1) * b - (f + b)) + t)
    assert simulate("2bw", p, m, f, b).step_time_s == simulate("2bw", p, m, f, b, last_ahead=False).step_time_s
    for schedule in ("1f1b", "gpipe", "zb_h1"):
        assert simulate(schedule, p, m, f, b, **tied).step_time_s == pytest.approx(
            simulate(schedule, p, m, f, b).step_time_s + t)


def test_each_tied_stage_updates_only_after_every_tied_stage_finished_its_step():
    r = simulate("2bw", 3, 4, [1.0, 1.5, 2.0], [2.0, 2.5, 3.0], comm_s=0.25, optimizer_s=[0.1, 0.2, 0.3], steps=5,
                 tied_stages=[2, 0], tied_reduce_s=0.75)
    assert r.tied_stages == (0, 2)
    for k in range(r.steps):
        done = {s: max(x.end for x in r.step_spans(s, k) if x.op != "optimizer") for s in range(3)}
        update = {s: next(x for x in r.step_spans(s, k) if x.op == "optimizer") for s in range(3)}
        assert update[0].start == pytest.approx(max(done[0], done[2]) + 0.75)
        assert update[2].start == pytest.approx(max(done[0], done[2]) + 0.75)
        assert update[1].start == pytest.approx(done[1])  # not tied: right after its own step


@pytest.mark.parametrize("kwargs,match", [
    (dict(tied_stages=(0,)), r"tied_stages must name at least two distinct stages among 0..2 \(or none\), got \(0,\)"),
    (dict(tied_stages=(0, 0)), r"at least two distinct stages.*got \(0, 0\)"),
    (dict(tied_stages=(0, 3)), r"among 0..2.*got \(0, 3\)"),
    (dict(tied_stages="02"), r"tied_stages must be a sequence of stage indices, e.g. \(0, 2\), got '02'"),
    (dict(tied_stages=(0, 2.0)), r"tied_stages must be a sequence of stage indices.*got \(0, 2.0\)"),
    (dict(tied_stages=(0, 2), tied_reduce_s=-1.0), r"tied_reduce_s must be a finite number of seconds >= 0, got -1.0"),
])
def test_bad_tied_stages_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate("1f1b", 3, 4, 1.0, 2.0, **kwargs)


def test_plan_tied_reduce_s_ties_the_first_and_last_stage(capsys):
    argv = ["--layers", "8", "--forward-s", "1", "--stages", "2", "--microbatches", "4", "--schedules", "2bw", "1f1b"]
    plan.main(argv + ["--tied-reduce-s", "0.5"])
    out = capsys.readouterr().out
    assert "A tied weight on the devices of the first and the last layer: its gradient is summed in 500 ms" in out
    rows = {c[3]: c[4] for c in ([x.strip() for x in line.strip("|").split("|")] for line in out.splitlines()
                                 if line.startswith("| 2 "))}
    # p=2, m=4, 4 layers per stage: f = 4 s, b = 8 s; 2bw: 4 x 12 + max(0, 8 - 12) + 0.5 (the last stage runs the
    # next batch's first microbatch while the first stage runs its last backward); 1f1b: (4 + 1) x 12 + 0.5.
    assert rows == {"2bw": "48.5 s", "1f1b": "60.5 s"}


def test_plan_ties_the_devices_that_hold_the_ends_of_the_model():
    """Interleaved: the last layer is on device p - 1, so the tie waits; ZBV's V puts both ends on device 0."""
    args = plan.parser().parse_args(["--layers", "8", "--forward-s", "1", "--tied-reduce-s", "0"])
    assert plan.tied_kwargs(args, "interleaved_1f1b", 4) == {"tied_stages": (0, 3), "tied_reduce_s": 0.0}
    assert plan.tied_kwargs(args, "2bw", 4) == {"tied_stages": (0, 3), "tied_reduce_s": 0.0}
    assert plan.tied_kwargs(args, "zbv", 4) == {}
    assert plan.tied_kwargs(args, "1f1b", 1) == {}
    assert plan.tied_kwargs(plan.parser().parse_args(["--layers", "8", "--forward-s", "1"]), "2bw", 4) == {}


# ---- it runs exactly the engine's lists ----------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,p,m", [("2bw", 3, 5), ("1f1b", 3, 5), ("gpipe", 2, 3), ("2bw", 4, 4)])
def test_each_stage_runs_exactly_the_step_actions_the_runtime_runs(schedule, p, m, monkeypatch):
    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return step_actions(*args, **kwargs)

    monkeypatch.setattr(simulate_module, "step_actions", recording)
    steps = 5
    r = simulate(schedule, p, m, 1.0, 2.0, steps=steps)
    # As PipelineRuntime.train_batch across processes: 2BW starts the next batch's forwards in every step that
    # has a next batch, and the next step is carried in; the synchronous schedules never are. Without data
    # parallelism the last stage runs ahead.
    for s in range(p):
        flags = [kw for args, kw in calls if args[1] == s]
        assert all(args == (schedule, s, p, m) for args, _ in calls if args[1] == s)
        lookahead = [schedule == "2bw" and k + 1 < steps for k in range(steps)]
        assert flags == [{"carried_in": k > 0 and lookahead[k - 1], "lookahead": lookahead[k], "last_ahead": True}
                         for k in range(steps)]
        for k, kw in enumerate(flags):
            actions = step_actions(schedule, s, p, m, **kw)
            spans = r.step_spans(s, k)
            assert len(spans) == len(actions) + 1  # the list, then the optimizer update
            assert [(x.op, x.batch, x.microbatch) for x in spans[:-1]] == [
                ("forward" if a.op == "F" else "backward", k + a.batch, a.microbatch) for a in actions]
            assert spans[-1].op == "optimizer" and spans[-1].start == pytest.approx(spans[-2].end)


def test_a_changed_schedule_is_simulated_as_listed_not_by_formula(monkeypatch):
    """Give '1f1b' GPipe's list: the simulation follows the list (all forwards in flight at once)."""
    def gpipe_lists(schedule, stage, num_stages, m, *, carried_in=False, lookahead=False, last_ahead=False):
        return [Action("F", 0, j) for j in range(m)] + [Action("B", 0, j) for j in range(m)]

    monkeypatch.setattr(simulate_module, "step_actions", gpipe_lists)
    assert simulate("1f1b", 4, 6, 1.0, 2.0).peak_activations == [6, 6, 6, 6]


def test_a_list_that_cannot_progress_is_reported(monkeypatch):
    """Stage 0 waits for microbatch 0's gradient, stage 1 for microbatch 1's activation: a deadlock."""
    def crossed(schedule, stage, num_stages, m, *, carried_in=False, lookahead=False, last_ahead=False):
        if stage == 0:
            return [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
        return [Action("F", 0, 1), Action("B", 0, 1), Action("F", 0, 0), Action("B", 0, 0)]

    monkeypatch.setattr(simulate_module, "step_actions", crossed)
    with pytest.raises(RuntimeError, match=r"cannot make progress.*0: 'step 0 B0.0'.*1: 'step 0 F0.1'"):
        simulate("1f1b", 2, 2, 1.0, 2.0)


# ---- costs per stage, transfers, the optimizer ---------------------------------------------------------------------
def test_the_slowest_stage_bounds_the_step():
    fwd, bwd, m = [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0], 8
    r = simulate("2bw", 4, m, fwd, bwd)
    assert r.step_time_s == pytest.approx(m * 6.0)  # stage 2's m x (2 + 4)
    assert r.stage_bubble_fractions == pytest.approx([0.5, 0.5, 0.0, 0.5])
    for schedule in ("1f1b", "gpipe"):
        flushed = simulate(schedule, 4, m, fwd, bwd)
        assert flushed.step_time_s > r.step_time_s
        assert max(flushed.stage_bubble_fractions) > 0.5
    # The same total work spread evenly is faster.
    assert simulate("2bw", 4, m, 1.25, 2.5).step_time_s == pytest.approx(m * 3.75)


def test_transfer_time_adds_as_computed_by_hand():
    c = 0.5  # forward 1, backward 2
    # GPipe, p=2, m=2: stage 0 forwards 0-1 and 1-2; stage 1 forwards 1.5-2.5 and 2.5-3.5, backwards 3.5-5.5 and
    # 5.5-7.5; stage 0's backwards start once the gradients arrive: 6-8 and 8-10. The next step starts at 10.
    r = simulate("gpipe", 2, 2, 1.0, 2.0, comm_s=c)
    assert r.step_time_s == pytest.approx(9 + 2 * c)
    first = [(x.op, x.microbatch, x.start, x.end) for s in range(2) for x in r.step_spans(s, 0)[:-1]]
    assert first == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 6, 8), ("backward", 1, 8, 10),
                     ("forward", 0, 1.5, 2.5), ("forward", 1, 2.5, 3.5), ("backward", 0, 3.5, 5.5),
                     ("backward", 1, 5.5, 7.5)]
    # 1F1B, one microbatch: forward, transfer, forward, backward, transfer, backward.
    assert simulate("1f1b", 2, 1, 1.0, 2.0, comm_s=c).step_time_s == pytest.approx(6 + 2 * c)
    # 2BW, p=2: stage 0 runs two forwards ahead of stage 1 (F0 F1 F2 B0 F3 B1 ...), so between the end of its F(j)
    # and the start of its B(j) it has 6 units of its own work (B(j-2), F(j+1), B(j-1), F(j+2)). The round trip of
    # microbatch j (transfer, stage 1's forward and backward, transfer: 2c + 3) hides behind them while c <= 1.5,
    # and the step is stage 1's m x 3; a slower link shows.
    for m in (2, 4, 8):
        for hidden in (0.5, 1.5):
            assert simulate("2bw", 2, m, 1.0, 2.0, comm_s=hidden).step_time_s == pytest.approx(m * 3.0)
        assert simulate("2bw", 2, m, 1.0, 2.0, comm_s=2.0).step_time_s > m * 3.0 + 0.5
    # Per boundary: only the slow link costs (one transfer each way per microbatch on p=3 gpipe, m=1).
    assert simulate("gpipe", 3, 1, 1.0, 2.0, comm_s=[0.0, 1.0]).step_time_s == pytest.approx(9 + 2)


def test_the_optimizer_runs_after_each_stages_last_backward():
    r = simulate("1f1b", 2, 2, 1.0, 2.0, optimizer_s=0.5)
    assert r.step_time_s == pytest.approx(9 + 0.5)  # stage 0 finishes last; its next forward waits for the update
    for s in range(2):
        for k in range(r.steps):
            spans = r.step_spans(s, k)
            assert spans[-1].op == "optimizer" and spans[-1].duration == pytest.approx(0.5)
            assert spans[-1].start == pytest.approx(max(x.end for x in spans if x.op == "backward"))
            assert r.step_ends[s][k] == spans[-1].end
    # Counted as work, not bubble: 2BW with an update per step is still busy all the time on a balanced pipe.
    two = simulate("2bw", 2, 4, 1.0, 2.0, optimizer_s=0.5)
    assert two.step_time_s == pytest.approx(4 * 3 + 0.5) and two.bubble_fraction == pytest.approx(0.0, abs=1e-12)


# ---- activations in flight ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 2)])
def test_peak_activations(p, m):
    assert simulate("gpipe", p, m, 1.0, 2.0).peak_activations == [m] * p
    # Stages before the last hold one forward more than the textbook p - s (the slack for their round trip).
    in_flight = [p - s + (1 if s < p - 1 else 0) for s in range(p)]
    assert simulate("1f1b", p, m, 1.0, 2.0).peak_activations == [min(n, m) for n in in_flight]
    if m >= p:  # the lookahead's forwards of the next batch count too, so 2BW may exceed m
        assert simulate("2bw", p, m, 1.0, 2.0).peak_activations == in_flight


# ---- bad inputs ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="zb"), r"Unknown schedule 'zb'; valid schedules are '2bw', '1f1b', 'gpipe', 'zb_h1', "
                          r"'interleaved_1f1b', 'zbv'"),
    (dict(schedule="interleaved_1f1b", num_microbatches=4), r"num_microbatches must be a multiple of the 3 stages, got 4"),
    (dict(schedule="interleaved_1f1b", num_microbatches=6, virtual_stages=0), r"virtual_stages must be a positive"),
    (dict(schedule="zb_h1", weight_grad_fraction=1.0), r"weight_grad_fraction must be .* between 0 and 1.*got 1.0"),
    (dict(num_stages=0), r"num_stages must be a positive integer, got 0"),
    (dict(num_stages=True), r"num_stages must be a positive integer, got True"),
    (dict(num_microbatches=2.0), r"num_microbatches must be a positive integer, got 2.0"),
    (dict(schedule="2bw", num_microbatches=2), r"needs num_microbatches >= the number of pipeline stages.*=2 for 3"),
    (dict(forward_s=-1.0), r"forward_s must be a finite number of seconds > 0.*one per stage\), got -1.0"),
    (dict(forward_s=math.nan), r"forward_s must be .* got nan"),
    (dict(forward_s="1"), r"forward_s must be .* got '1'"),
    (dict(forward_s=[1.0, 2.0]), r"sequence of 3 of them \(one per stage\), got a sequence of 2: \[1.0, 2.0\]"),
    (dict(backward_s=[1.0, 0.0, 1.0]), r"backward_s must be .*> 0.*got 0.0 for stage 1 in \[1.0, 0.0, 1.0\]"),
    (dict(comm_s=-0.1), r"comm_s must be a finite number of seconds >= 0.*one per boundary between stages\), got -0.1"),
    (dict(comm_s=[0.1, 0.1, 0.1]), r"comm_s must be .*a sequence of 2 of them.*got a sequence of 3"),
    (dict(optimizer_s=[0.1]), r"optimizer_s must be .*a sequence of 3 of them.*got a sequence of 1"),
    (dict(steps=2), r"steps must be an integer >= 3.*got 2"),
])
def test_bad_inputs_are_clear_errors(kwargs, match):
    args = dict(schedule="1f1b", num_stages=3, num_microbatches=4, forward_s=1.0, backward_s=2.0)
    args.update(kwargs)
    schedule, p, m, f, b = (args.pop(k) for k in ("schedule", "num_stages", "num_microbatches", "forward_s", "backward_s"))
    with pytest.raises(ValueError, match=match):
        simulate(schedule, p, m, f, b, **args)


def test_per_stage_costs_may_be_any_sequence_and_zero_transfer_or_update_is_fine():
    r = simulate("1f1b", 3, 4, (1, 1, 1), [2, 2, 2], comm_s=(0, 0), optimizer_s=[0, 0, 0])
    assert r.forward_s == [1.0, 1.0, 1.0] and r.comm_s == [0.0, 0.0] and r.step_time_s == pytest.approx(18.0)


# ---- the console command -----------------------------------------------------------------------------------------------
def test_console_command_is_installed_as_lightning_async_pp_plan():
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject[pyproject.index("[project.scripts]"):].split("\n\n")[0]
    assert 'lightning-async-pp-plan = "lightning_async_pp.plan:main"' in scripts


def test_plan_prints_a_table_over_p_and_m(capsys):
    plan.main(["--layers", "8", "--forward-s", "1", "--stages", "2", "4", "16", "--microbatches", "2", "4"])
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:4]): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| p ")}
    schedules = ["2bw", "1f1b", "gpipe", "zb_h1", "interleaved_1f1b (v=2)", "zbv"]
    assert set(rows) == ({(p, m, "4" if p == "2" else "2", s) for p in ("2", "4") for m in ("2", "4") for s in schedules}
                         | {("16", m, "-", "-") for m in ("2", "4")})
    # p=2, m=4: 4 layers per stage, forward 4 s, backward 8 s: 2bw 4 x 12 = 48 s, 1f1b (4 + 1) x 12 = 60 s; ZB-H1
    # 3m + p - 1 = 13 units of 4 s; ZBV wastes nothing at m = 2p with F = I = W; interleaved 3m + 3(p-1)/2 units.
    by = {s: rows[("2", "4", "4", s)][4:] for s in schedules}
    # Columns: step, bubble, optimizer (no update time given: 0), x 1f1b, x best sync, peak act., weights.
    assert by["2bw"] == ["48 s", "0.0%", "0.0%", "1.25", "1.00 (zbv)", "3", "2 versions"]
    assert by["1f1b"] == ["60 s", "20.0%", "0.0%", "1.00", "-", "3", "1"]  # p - s + 1 forwards in flight on stage 0
    assert by["gpipe"] == ["60 s", "20.0%", "0.0%", "1.00", "-", "4", "1"]  # m
    assert by["zb_h1"][:4] == ["52 s", "7.7%", "0.0%", "1.15"] and by["zb_h1"][5:] == ["3", "1"]
    assert by["interleaved_1f1b (v=2)"][:4] == ["54 s", "11.1%", "0.0%", "1.11"]
    assert by["interleaved_1f1b (v=2)"][5:] == ["2.5", "1 in 2 chunks"]
    assert by["zbv"][:4] == ["48 s", "0.0%", "0.0%", "1.25"] and by["zbv"][5:] == ["2", "1 in 2 chunks"]
    assert rows[("4", "2", "2", "2bw")][4] == "needs m >= p"
    assert rows[("4", "2", "2", "interleaved_1f1b (v=2)")][4] == "needs m a multiple of p"
    assert "more stages than the 8 pipeline layers" in rows[("16", "2", "-", "-")][4]


def test_plan_from_a_model_shape_balances_flops_and_derives_the_transfer():
    shape = plan.MODELS["smollm-360m"]
    assert shape.parameters() == 361_821_120  # models.Llama("smollm-360m", vocab_size=49152), tied head
    args = plan.parser().parse_args(["--model", "smollm-360m", "--stages", "2", "64", "--microbatches", "64",
                                     "--split-blocks"])
    lines, records = plan.plan(args)
    rate = 400e12 * 0.4
    by_p = {r["p"]: r for r in records}
    assert sum(by_p[2]["layers_per_stage"]) == 64 and by_p[64]["layers_per_stage"] == [1] * 64
    two = by_p[2]["results"]["2bw"]
    assert two.comm_s == pytest.approx([2048 * 960 * 2 / 25e9])  # one sequence of bf16 activations at 25 GB/s
    total = (32 * (shape.attention_flops() + shape.mlp_flops()) + shape.head_flops()) * 2048 / rate
    assert sum(two.forward_s) == pytest.approx(total)
    assert two.backward_s == pytest.approx([2 * f for f in two.forward_s])
    # At p=64 the last stage holds an MLP and the 49152-word head: it bounds the step.
    last = by_p[64]["results"]["2bw"]
    assert last.stage_bubble_fractions[-1] == pytest.approx(0.0, abs=1e-9) and last.bubble_fraction > 0.5


def test_plan_from_a_model_shape_prints_each_devices_peak_memory_by_what_holds_it(capsys):
    # The memory model (tests/test_memory_model.py) fed what device 0 holds, worked out here from the shape's
    # per-layer numbers (tests/test_adapters.py counts those against the layers), under Muon and with
    # ErrorFeedback's buffer (and its update's transient copy) per parameter.
    from lightning_async_pp.plan.memory import stage_memory

    argv = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
            "--vocab", "256", "--seq-len", "32", "--microbatch-size", "3", "--stages", "2", "--microbatches", "2",
            "--schedules", "2bw", "1f1b", "--bytes-per-value", "4", "--optimizer", "muon",
            "--correction-buffers", "1"]
    args = plan.parser().parse_args(argv)
    _, records = plan.plan(args)
    shape, counts = plan.CostModel(args).shape, records[0]["layers_per_stage"]
    first = counts[0]
    tokens = 3 * 32
    weights = sum(shape.layer_parameters(False)[:first]) * 4
    # Muon's momentum for the blocks' projections, AdamW's two moments for the embedding and the norms:
    matrices = first * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) * 4
    state = matrices + 2 * (weights - matrices)
    kept = sum(shape.layer_saved_bytes(False, tokens, 4)[:first]) + tokens * 64 * 4  # and its output
    working = kept + max(shape.layer_transient_bytes(False, tokens, 4)[:first])
    one, two = records[0]["memory"]["1f1b"][0], records[0]["memory"]["2bw"][0]
    assert one == stage_memory(records[0]["results"]["1f1b"], 0, weight_bytes=weights, saved_bytes=kept,
                               working_bytes=working, first_working_bytes=max(working, weights),
                               optimizer_state_bytes=state, correction_bytes=weights, update_bytes=weights)
    assert (one.weights, one.versions, one.optimizer_state, one.correction) == (weights, 0, state, weights)
    assert two.versions == weights and two.total > one.total  # 2bw stashes one more version
    plan.main(argv)
    out = capsys.readouterr().out
    table = out[out.index("## Memory per device"):]
    row = next(line for line in table.splitlines() if line.startswith("| 2 | 2 | 1f1b |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    device = max(range(2), key=lambda d: records[0]["memory"]["1f1b"][d].total)
    assert cells[3] == str(device)
    assert float(cells[-1]) == pytest.approx(records[0]["memory"]["1f1b"][device].total / 2**30, abs=0.006)


def test_plan_writes_the_timelines_as_the_monitors_chrome_trace(tmp_path):
    path = tmp_path / "plan.json"
    plan.main(["--stage-forward-s", "1", "1.5", "--stage-backward-s", "2", "3", "--microbatches", "4",
               "--schedules", "2bw", "--steps", "4", "--trace", str(path)])
    trace = json.loads(path.read_text())
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["otherData"]["simulated"]["schedule"] == "2bw" and trace["otherData"]["steps"] == [0, 3]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} <= set(CATEGORIES)
    for e in spans:
        assert set(e) == {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"} and e["cat"] == CATEGORIES[e["name"]]
    for stage in (0, 1):
        track = sorted((e for e in spans if e["tid"] == stage), key=lambda e: e["ts"])
        names = [e["name"] for e in track]
        assert names.count("forward") == names.count("backward") == 4 * 4 and names.count("optimizer") == 4
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(track, track[1:]))
        assert {e["args"]["microbatch"] for e in track if e["name"] == "forward"} == {0, 1, 2, 3}
    # Microseconds: stage 1's steady 2bw step is m x (1.5 + 3) s.
    assert trace["otherData"]["simulated"]["step_time_s"] == pytest.approx(4 * 4.5)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "stage 0 (rank 0)", 1: "stage 1 (rank 1)"}


def test_several_traces_get_one_file_each(tmp_path):
    plan.main(["--layers", "4", "--forward-s", "0.01", "--stages", "2", "--microbatches", "2", "4",
               "--schedules", "2bw", "gpipe", "--trace", str(tmp_path / "t.json")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t-2bw-p2-m2.json", "t-2bw-p2-m4.json", "t-gpipe-p2-m2.json", "t-gpipe-p2-m4.json"]


def test_the_console_command_runs(tmp_path):
    # What the `lightning-async-pp-plan` entry point does: sys.exit(main()) with the command line's arguments.
    out = subprocess.run([sys.executable, "-c", "import sys; from lightning_async_pp.plan import main; sys.exit(main())",
                          "--model", "llama-10b", "--stages", "4", "--microbatches", "8", "--trace",
                          str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert "| 4 | 8 | 8 | 2bw |" in out.stdout and "10.31 B parameters" in out.stdout
    assert len(list(tmp_path.glob("t-*.json"))) == 6  # one per schedule


@pytest.mark.parametrize("argv,match", [
    (["--model", "smollm-360m", "--forward-s", "1", "--layers", "2"], "one source of costs"),
    (["--forward-s", "1"], r"give the number of layers \(--layers\)"),
    (["--stage-forward-s", "1", "0"], r"forward_s must be a finite number of seconds > 0.*got 0.0 for stage 1"),
    (["--stage-forward-s", "1", "1", "--stage-backward-s", "2"], r"--stage-backward-s needs 2 values"),
    (["--hidden", "64"], r"missing --layers, --heads"),
    (["--model", "smollm-360m", "--mfu", "2"], r"expected a fraction in \(0, 1\]"),
    (["--layers", "2", "--forward-s", "1", "--steps", "2"], r"--steps must be >= 3"),
    (["--stage-forward-s", "1", "1", "--stages", "4"], r"costs of 2 stages; --stages \[4\] disagrees"),
])
def test_plan_rejects_bad_arguments_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)



# ---- the synchronous competitors: zero-bubble and interleaved ------------------------------------------------------
SYNC_GRID = [(1, 4), (2, 2), (2, 4), (2, 8), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]


@pytest.mark.parametrize("p,m", SYNC_GRID)
@pytest.mark.parametrize("f", [0.5, 0.25])
def test_zb_h1_step_is_the_published_3m_plus_p_minus_1(p, m, f):
    # Qi et al. 2024: ZB-H1's bubble is (p - 1)(F + I - W) where 1F1B's is (p - 1)(F + I + W); F = 1, I + W = 2.
    i, w = 2 * (1 - f), 2 * f
    r = simulate("zb_h1", p, m, 1.0, 2.0, weight_grad_fraction=f)
    assert r.step_time_s == pytest.approx(3 * m + (p - 1) * (1 + i - w))
    # Memory: no device holds more microbatches than under 1F1B.
    assert max(r.peak_activations) == max(simulate("1f1b", p, m, 1.0, 2.0).peak_activations)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SYNC_GRID if m % p == 0])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaved_step_is_the_published_3m_plus_3_p_minus_1_over_v(p, m, v):
    r = simulate("interleaved_1f1b", p, m, 1.0, 2.0, virtual_stages=v)  # each chunk: forward 1/v, backward 2/v
    assert r.step_time_s == pytest.approx(3 * m + 3 * (p - 1) / v)
    assert r.chunks == v and r.weight_versions == 1


@pytest.mark.parametrize("p,m", SYNC_GRID)
def test_zbv_is_no_worse_than_zb_h1_and_2bw_wastes_nothing(p, m):
    zbv, zb = simulate("zbv", p, m, 1.0, 2.0), simulate("zb_h1", p, m, 1.0, 2.0)
    assert zbv.step_time_s <= zb.step_time_s + 1e-9
    assert zbv.chunks == 2 and zbv.peak_activation_memory <= max(zb.peak_activations)
    if m >= p:
        two = simulate("2bw", p, m, 1.0, 2.0)
        assert two.step_time_s == pytest.approx(3 * m) and two.weight_versions == 2


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 2), (4, 9)])
def test_zbv_lists_are_torchs_schedule_zbv_zero_bubble(p, m):
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType as T

    from lightning_async_pp.pipeline.schedule import zbv_actions

    ops = {T.FORWARD: "F", T.BACKWARD_INPUT: "I", T.BACKWARD_WEIGHT: "W", T.FULL_BACKWARD: "B"}
    for rank in range(p):
        theirs = ScheduleZBVZeroBubble._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m), rank)
        # torch names the stage (rank, or 2p-1-rank for the V's second leg) and pads with None for its timing.
        expected = [(ops[a.computation_type], 0 if a.stage_index == rank else 1, a.microbatch_index)
                    for a in theirs if a is not None]
        assert [(a.op, a.chunk, a.microbatch) for a in zbv_actions(rank, p, m)] == expected


def test_a_split_backward_prices_input_and_weight_gradients_apart():
    r = simulate("zb_h1", 2, 2, 1.0, 2.0, weight_grad_fraction=0.25, steps=3)
    durations = {(s.stage, s.action): s.duration for tl in r.timelines for s in tl if s.action}
    assert durations[(0, "I")] == pytest.approx(1.5) and durations[(0, "W")] == pytest.approx(0.5)
    z = simulate("zbv", 2, 4, 1.0, 2.0, steps=3)  # two chunks per device: each half the device's costs
    assert {round(s.duration, 9) for tl in z.timelines for s in tl if s.action == "F"} == {0.5}
    assert {round(s.duration, 9) for tl in z.timelines for s in tl if s.action in "IW" and s.action} == {0.5}


def test_the_v_turn_costs_no_transfer_and_a_boundary_does():
    # ZBV on p=1: both chunks on one device, so a transfer time never shows; on p=2 it does.
    assert simulate("zbv", 1, 4, 1.0, 2.0, comm_s=[]).step_time_s == pytest.approx(12.0)
    assert simulate("zbv", 2, 4, 1.0, 2.0, comm_s=0.5).step_time_s > simulate("zbv", 2, 4, 1.0, 2.0).step_time_s


@pytest.mark.parametrize("actions,match", [
    ([Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)], r"F0.0\) runs twice"),
    ([Action("B", 0, 0), Action("F", 0, 0)], r"a backward before its forward"),
    ([Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)], r"a weight gradient before its input gradient"),
    ([Action("F", 0, 0), Action("I", 0, 0), Action("B", 0, 0)], r"both a whole backward and a split one"),
    ([Action("F", 0, 0), Action("I", 0, 0)], r"microbatch 0 lacks its forward or its backward"),
    ([Action("F", 0, 0), Action("B", 0, 0, 1)], r"chunk in 0..0"),
])
def test_validation_names_the_first_bad_action(actions, match):
    from lightning_async_pp.pipeline.schedule import validate_actions

    with pytest.raises(ValueError, match=match):
        validate_actions("zb_h1", [actions], 1)


@pytest.mark.parametrize("schedule", ["zb_h1", "interleaved_1f1b", "zbv"])
def test_a_broken_competitor_list_is_refused_before_simulating(schedule, monkeypatch):
    name = {"zb_h1": "step_actions", "interleaved_1f1b": "interleaved_actions", "zbv": "zbv_actions"}[schedule]
    real = getattr(simulate_module, name)
    monkeypatch.setattr(simulate_module, name, lambda *a, **k: real(*a, **k)[:-1])  # the last backward goes missing
    with pytest.raises(ValueError, match=rf"schedule '{schedule}', device 0: .* lacks its forward or its backward"):
        simulate(schedule, 2, 4, 1.0, 2.0)
