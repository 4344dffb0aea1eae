"""The engine's pieces on their own: schedules, partitioning, weight versions, transfer headers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_async_pp.pipeline.structure import Layout, flatten, normalize, unflatten
from lightning_async_pp.plan.partition import partition_layers
from lightning_async_pp.pipeline.schedule import check_schedule, step_actions
from lightning_async_pp.pipeline.versions import WeightVersions


def stream_of_actions(schedule: str, stage: int, p: int, m: int, steps: int) -> list[list[tuple[str, int, int]]]:
    """Each step's actions with absolute batch indices, carrying 2BW's lookahead as the runtime does."""
    out, carried = [], False
    for k in range(steps):
        lookahead = schedule == "2bw" and k + 1 < steps
        actions = step_actions(schedule, stage, p, m, carried_in=carried, lookahead=lookahead)
        out.append([(a.op, k + a.batch, a.microbatch) for a in actions])
        carried = lookahead
    return out


def simulate(schedule: str, p: int, m: int, steps: int, forward: float = 1.0, backward: float = 2.0):
    """Discrete-event run of every stage's action list with real dependencies (activation from the previous
    stage, gradient from the next, and a stage's update before it starts a batch that needs it). Returns each
    stage's per-step finish times; raises if the lists deadlock."""
    lists = [[a for step in stream_of_actions(schedule, s, p, m, steps) for a in step] for s in range(p)]
    step_ends = [[None] * steps for _ in range(p)]
    position, clock = [0] * p, [0.0] * p
    done: dict[tuple[str, int, int, int], float] = {}
    while any(position[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] >= len(lists[s]):
                continue
            op, b, j = lists[s][position[s]]
            deps = []
            if op == "F" and s > 0:
                deps.append(("F", b, j, s - 1))
            if op == "B" and s < p - 1:
                deps.append(("B", b, j, s + 1))
            if op == "B":
                deps.append(("F", b, j, s))
            if any(d not in done for d in deps):
                continue
            start = max([clock[s]] + [done[d] for d in deps])
            clock[s] = start + (forward if op == "F" else backward)
            done[(op, b, j, s)] = clock[s]
            position[s] += 1
            progressed = True
            if op == "B" and j == m - 1:
                step_ends[s][b] = clock[s]
        if not progressed:
            raise AssertionError(f"{schedule} deadlocks at positions {position}")
    return step_ends


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_every_microbatch_runs_forward_then_backward_exactly_once(schedule, p, m):
    steps = 3
    for s in range(p):
        flat = [a for step in stream_of_actions(schedule, s, p, m, steps) for a in step]
        assert sorted(flat) == sorted((op, b, j) for op in "FB" for b in range(steps) for j in range(m))
        for b in range(steps):
            for j in range(m):
                assert flat.index(("F", b, j)) < flat.index(("B", b, j))
        # 2BW weight versions: every batch's forwards start only after the update two batches back.
        if schedule == "2bw":
            for b in range(2, steps):
                assert flat.index(("F", b, 0)) > flat.index(("B", b - 2, m - 1))
    simulate(schedule, p, m, steps)  # no deadlock


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_2bw_steady_state_has_no_bubble_while_synchronous_schedules_flush(p, m):
    forward, backward, steps = 1.0, 2.0, 8
    ideal = m * (forward + backward)
    for schedule, expected in [("2bw", ideal), ("1f1b", ideal + (p - 1) * (forward + backward)),
                               ("gpipe", ideal + (p - 1) * (forward + backward))]:
        ends = simulate(schedule, p, m, steps, forward, backward)
        per_step = [ends[0][k + 1] - ends[0][k] for k in range(2, steps - 2)]
        assert all(abs(t - expected) < 1e-9 for t in per_step), (schedule, per_step, expected)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_1f1b"])
def test_planner_only_schedules_are_refused_by_the_engine_with_a_pointer_to_the_planner(schedule):
    from lightning_async_pp.pipeline.config import PipelineConfig

    with pytest.raises(ValueError, match=rf"schedule='{schedule}' is priced by the planner .* valid schedules are "
                                         r"'2bw', '1f1b', 'gpipe', 'zb_h1'"):
        PipelineConfig(schedule=schedule)
    assert PipelineConfig(schedule="zb_h1").stage_delays(2) == [0, 0]  # synchronous


def test_2bw_needs_at_least_one_microbatch_per_stage():
    with pytest.raises(ValueError, match=r"num_microbatches=3 for 4 stages"):
        check_schedule("2bw", 4, 3)
    check_schedule("1f1b", 4, 3)  # synchronous schedules flush, any count works


def test_partition_by_parameters_balances_the_heaviest_stage():
    layers = [nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 4)]
    ranges = partition_layers(layers, 2, "parameters")
    assert [list(r) for r in ranges] == [[0, 1], [2, 3, 4]]
    assert [list(r) for r in partition_layers(layers, 2, "uniform")] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in partition_layers(layers, 3, [1, 1, 3])] == [[0], [1], [2, 3, 4]]
    assert all(len(r) >= 1 for r in partition_layers(layers, 5, "parameters"))


@pytest.mark.parametrize("bad,match", [
    ([2, 2], r"Explicit partition \[2, 2\] is invalid.*sum to the 5 layers"),
    ([5, 0], r"Explicit partition \[5, 0\] is invalid"),
    ("by-flops", r"Unknown partition method 'by-flops'"),
])
def test_bad_partitions_are_clear_errors(bad, match):
    layers = [nn.Linear(2, 2) for _ in range(5)]
    with pytest.raises(ValueError, match=match):
        partition_layers(layers, 2, bad)


def test_fewer_layers_than_stages_is_a_clear_error():
    with pytest.raises(ValueError, match=r"returned 2 layer\(s\), fewer than the 3 pipeline stages"):
        partition_layers([nn.Linear(2, 2), nn.Linear(2, 2)], 3)


def test_weight_versions_keep_the_stashed_version_intact_through_an_in_place_update():
    p = nn.Parameter(torch.zeros(3))
    versions = WeightVersions([p], delay=1)
    leaf0 = versions.leaves_for_batch(0)[0]
    loss = (leaf0 * torch.arange(3.0)).sum()  # batch 0 in flight on W_0
    versions.prepare_update()
    with torch.no_grad():
        p.add_(1.0)  # the optimizer writes W_1 in place
    loss.backward()  # still fine: W_0 was not touched
    assert torch.equal(leaf0, torch.zeros(3)) and torch.equal(p.detach(), torch.ones(3))
    assert torch.equal(versions.leaves_for_batch(1)[0], torch.zeros(3))  # batch 1 uses W_0
    versions.take_gradients(1)
    versions.prepare_update()
    with torch.no_grad():
        p.add_(1.0)
    assert torch.equal(versions.leaves_for_batch(2)[0], torch.ones(3))  # batch 2 uses W_1
    assert versions.stash_nbytes() == 3 * 4


def test_weight_versions_refuse_a_version_no_longer_held():
    p = nn.Parameter(torch.zeros(2))
    versions = WeightVersions([p], delay=1)
    for _ in range(3):
        versions.prepare_update()
    with pytest.raises(IndexError, match=r"version 0 is not held \(held: 2..3\)"):
        versions.version(0)


def test_layout_round_trips_nesting_shapes_dtypes_and_grad_flags():
    value = {"h": torch.zeros(2, 3, 4, dtype=torch.bfloat16, requires_grad=True),
             "aux": [torch.arange(5), None, (torch.ones(1),)], 7: torch.zeros(())}
    leaves, spec = flatten(value)
    layout = Layout.of(leaves, spec)
    decoded = Layout.decode(layout.encode())
    assert decoded == Layout(normalize(spec), layout.metas)
    assert [m.needs_grad for m in decoded.metas] == [True, False, False, False]
    rebuilt = unflatten(leaves, decoded.spec)
    assert rebuilt["aux"][1] is None and rebuilt["aux"][2][0] is leaves[2] and rebuilt[7] is leaves[3]
    assert isinstance(rebuilt["aux"][2], tuple) and rebuilt["h"] is leaves[0]


@pytest.mark.parametrize("bad", [{"a": 1.5}, [torch.zeros(1), "text"], {(1, 2): torch.zeros(1)}])
def test_values_that_cannot_cross_a_stage_boundary_are_named(bad):
    with pytest.raises(TypeError, match="stage boundary"):
        flatten(bad)


def test_flatten_and_unflatten_leave_no_reference_cycle_that_keeps_the_tensors_alive():
    # A cycle would keep every stage output (and through its graph the batch's gradients) until the garbage
    # collector ran: a stage's memory grew by a gradient per step between collections.
    import gc
    import weakref

    gc.disable()
    try:
        t = torch.ones(3)
        alive = weakref.ref(t)
        leaves, spec = flatten({"a": [t, None], "b": (t,)})
        rebuilt = unflatten(leaves, spec)
        assert rebuilt["b"][0] is t
        del t, leaves, rebuilt
        assert alive() is None
    finally:
        gc.enable()


def test_batch_fingerprint_changes_with_any_element_with_row_order_and_with_tensor_order():
    from lightning_async_pp.pipeline.microbatch import fingerprint

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 64, generator=g), torch.randint(0, 50, (512, 8), generator=g)
    base = fingerprint((x, y))
    assert fingerprint((x.clone(), y.clone())) == base  # equal data, equal fingerprint
    changed = x.clone()
    changed[301, 17] += 0.5  # one element, most likely not among the sampled positions
    assert fingerprint((changed, y)) != base
    assert fingerprint((x[torch.randperm(512, generator=g)], y)) != base  # the same rows in another order
    assert fingerprint((x, y.flip(0))) != base
    assert fingerprint({"a": x, "b": x * 2}) != fingerprint({"a": x * 2, "b": x})  # which tensor holds what
    assert fingerprint((torch.ones(3, dtype=torch.bool),)).dtype == torch.float64


@pytest.mark.parametrize("build", ["sgd", "adamw", "error_feedback", "muon"])
def test_an_optimizer_over_a_wholly_frozen_stage_is_one_empty_group_that_trains_what_is_added_to_it(build):
    """A stage whose parameters are all frozen at setup gets an optimizer over no parameters (the fine-tuning
    one over the ``requires_grad`` ones); it must step over nothing, then train a group added later exactly as
    the same optimizer built with that group does."""
    from lightning_async_pp.optim import ErrorFeedback, Muon
    from lightning_async_pp.optim.empty import allowing_empty_parameter_lists

    factories = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
                 "error_feedback": lambda ps: ErrorFeedback(ps, optimizer=lambda q: torch.optim.AdamW(q, lr=0.01)),
                 "muon": lambda ps: Muon(ps, lr=0.02)}
    make = factories[build]
    with pytest.raises(ValueError, match="empty parameter list"):
        make([])  # outside the strategy's setup torch's own refusal stands
    with allowing_empty_parameter_lists():
        empty = make([])
    assert [g["params"] for g in empty.param_groups] == [[]] and not dict(empty.state)
    empty.step()  # nothing to do
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 2))
    initial = w.detach().clone()
    empty.add_param_group({"params": [w], "lr": 0.05})
    # The reference: the first group holds a parameter that never has a gradient (a frozen one), so steps skip it.
    reference_w = nn.Parameter(initial.clone())
    reference = make([nn.Parameter(torch.zeros(2), requires_grad=False)])
    reference.add_param_group({"params": [reference_w], "lr": 0.05})
    for step in range(3):
        for p, opt in ((w, empty), (reference_w, reference)):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            opt.step()
    assert torch.equal(w, reference_w) and not torch.equal(w, initial)


def test_a_loss_weight_that_is_not_a_count_is_refused_naming_the_hook():
    from lightning_async_pp.pipeline.microbatch import loss_shares

    assert loss_shares([2, 2, 2]) is None  # equal microbatches: each loss divided by m, as before the hook
    torch.testing.assert_close(loss_shares([torch.tensor(3), 1, 0]), torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))
    assert loss_shares([torch.tensor(0), torch.tensor(0)]).tolist() == [0.0, 0.0]  # every target skipped: no NaN
    # Weights of any scale: the shares add up to 1 (fractions summing below 1 were left unnormalised).
    torch.testing.assert_close(loss_shares([0.5, 0.25]), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(loss_shares([torch.tensor(0.3), torch.tensor(0.1)]),
                               torch.tensor([0.75, 0.25], dtype=torch.float64))
    for bad in (None, -1, True, torch.ones(2)):
        with pytest.raises(TypeError, match="pipeline_loss_weight must return a number >= 0 or a one-element tensor"):
            loss_shares([1, bad])
