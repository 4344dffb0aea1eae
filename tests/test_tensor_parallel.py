"""Tensor parallelism inside each stage (``tensor_parallel_size``): 2 stages x 2 tensor-parallel ranks of
``models.Llama`` train the one-device run's weights; what is not supported yet is refused before training; the
engine keeps a DTensor parameter's local shard in its weight versions.

The tolerance (docs/design/tensor-parallel-shards.md, "Matching one device"): tensor parallelism changes only the order
of sums (a row-parallel product adds two partial products, the norm of the clipped gradient adds shards), a few
ulps per operation; AdamW's normalization ``m / (sqrt(v) + eps)`` turns them into up to about ``1e-3`` of one
step (lr ``3e-3``) for an element whose gradient is near zero. After 3 steps the largest difference measured is
about ``1e-5``; the bound is ``TOL = 5e-5``, while a wrong shard (the control) moves weights by more than ``1e-2``.
Muon's runs have their own bound (``MUON_TOL``, below) and a bitwise check of its step on a sharded matrix.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import llama_fit  # noqa: E402
from pipeline_runs import (  # noqa: E402
    FLOAT32_EPS, max_difference, run_here_on_one_device, script_ranks, whole_tensor_parallel_model)

from lightning_async_pp import AsyncPipelineStrategy, consolidate  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402
from lightning_async_pp.checkpoint import ShardedSource, read_checksums, read_meta  # noqa: E402
from lightning_async_pp.pipeline.config import PipelineConfig  # noqa: E402
from lightning_async_pp.parallel.topology import PipelineTopology  # noqa: E402
from lightning_async_pp.pipeline.versions import WeightVersions  # noqa: E402
from lightning_async_pp.strategy import options  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "llama_fit.py"
TOL = 5e-5
#: Muon's bound: its Newton-Schulz runs in bfloat16 (torch.optim.Muon's math), which turns the ulps by which the
#: sums' order moves a gradient into bfloat16 roundings of the update. The one-device run itself moves as far when
#: only the microbatch split (so the order of the gradient's sum) changes: 2.6e-4 (2bw) and 6.4e-4 (ErrorFeedback
#: around it), measured; tensor parallelism's differences are of that size.
MUON_TOL = 2e-3
BASE = {"tie": True, "steps": 3, "microbatches": 4, "partition": [3, 3]}  # embed + 2 blocks | 2 blocks + head
# StalenessMonitor and PipelineMonitor log every step of these (test_the_monitors_...): a delayed and a synchronous
# schedule, ErrorFeedback's buffers and DelayCompensation's norms, which are DTensors on the shards
MONITORED = {"monitors": True}
CASES = {
    "2bw": {**BASE, "schedule": "2bw", **MONITORED},
    "1f1b_clipped": {**BASE, "schedule": "1f1b", "clip": 0.5, **MONITORED},
    "2bw_muon": {**BASE, "schedule": "2bw", "optimizer": "muon"},
    "1f1b_error_feedback_muon": {**BASE, "schedule": "1f1b", "optimizer": "error_feedback_muon", **MONITORED},
    "gpipe": {**BASE, "schedule": "gpipe"},
    "1f1b_checkpointed": {**BASE, "schedule": "1f1b", "activation_checkpointing": True},
    "zb_h1": {**BASE, "schedule": "zb_h1"},
    "2bw_delay_compensation": {**BASE, "schedule": "2bw", "optimizer": "delay_compensation", **MONITORED},
    "2bw_weight_prediction": {**BASE, "schedule": "2bw", "optimizer": "weight_prediction"},
    "2bw_async_nesterov": {**BASE, "schedule": "2bw", "optimizer": "async_nesterov"},
    # across processes a delay can only be the schedule's own (PipelineConfig.check): given, it changes nothing
    "2bw_delay_given": {**BASE, "schedule": "2bw", "strategy_kwargs": {"delay": 1}},
    "wrong_shard": {**BASE, "schedule": "1f1b", "steps": 1, "swap_shards": True},
    # compiled layers over DTensor shards (a backend counting its graphs); the first forward compiles on 4
    # processes sharing the CPU, past the default pipeline_timeout on a loaded machine
    "2bw_compiled": {**BASE, "schedule": "2bw", "compile_counted": True, "timeout": 600.0},
    # layer_cost="measured": stage 0's two ranks time the layers together; rank 1 sees the head 1000 times slower,
    # rank 0 does not: the split must be the slowest rank's, the head alone on stage 1, on all four ranks
    "2bw_measured": {**BASE, "schedule": "2bw", "partition": "balanced", "strategy_kwargs": {"layer_cost": "measured"},
                     "skew_times": {"tp_rank": 1, "layer": -1, "factor": 1000.0}},
}
#: What the 2 x 2 runs of a case train on one device, where it differs from the case: the split they agreed on;
#: compiled layers against eager ones.
ONE_DEVICE = {"2bw_measured": {**BASE, "schedule": "2bw", "partition": [5, 1]}, "2bw_compiled": CASES["2bw"]}


def _whole_model(ranks: list[dict], case: str) -> dict[str, torch.Tensor]:
    return whole_tensor_parallel_model(ranks, case, tie=("head.proj.weight", "embed.weight"))


_ONE_DEVICE: dict[str, dict] = {}


def _one_device(name: str) -> dict:
    """The one-device run of ``CASES[name]`` (made once per session)."""
    if name not in _ONE_DEVICE:
        _ONE_DEVICE[name] = run_here_on_one_device(llama_fit.run, ONE_DEVICE.get(name, CASES[name]))
    return _ONE_DEVICE[name]


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> list[dict]:
    """Every case of ``CASES`` on 2 stages x 2 tensor-parallel ranks, in one launch: what each rank returned."""
    return script_ranks(SCRIPT, {"devices": 4, "cases": {n: {**c, "tensor_parallel": 2} for n, c in CASES.items()}},
                        tmp_path_factory.mktemp("two_by_two"), ranks=4, timeout=600)


def _check_against_one_device(ranks: list[dict], name: str, case: dict) -> dict[str, torch.Tensor]:
    """The case's weights (gathered per stage) are the one-device run's within the tolerance; the steps moved them;
    the two tensor-parallel ranks of each stage hold halves of each sharded matrix and equal replicated ones.
    Returns the one-device run's weights."""
    reference = _one_device(name)["state_dict"]
    weights = _whole_model(ranks, name)
    tolerance = MUON_TOL if "muon" in case.get("optimizer", "") else TOL
    assert max_difference(weights, reference) < tolerance, (name, max_difference(weights, reference))
    assert max_difference(weights, run_here_on_one_device(llama_fit.run, {**ONE_DEVICE.get(name, case), "steps": 0})
                          ["state_dict"]) > 1e-3, name  # the steps did move the weights
    for r in (0, 2):
        mine, other = ranks[r]["cases"][name]["local_weights"], ranks[r + 1]["cases"][name]["local_weights"]
        sharded = "blocks.1.attn.q_proj.weight" if r == 0 else "blocks.3.mlp.down_proj.weight"
        if sharded in mine:  # (the measured split's second stage holds the head alone)
            assert mine[sharded].shape in ((32, 64), (64, 86)), (name, sharded)
        for n, value in mine.items():
            if value.shape == ranks[r]["cases"][name]["stage_weights"][n].shape:
                assert torch.equal(value, other[n]), (name, n)
    return reference


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_train_llama_as_one_device(two_by_two):
    ranks = two_by_two
    references = {name: _check_against_one_device(ranks, name, case)
                  for name, case in CASES.items() if name != "wrong_shard"}
    # The delay corrections did act: each moves the one-device run far from plain AdamW's (so a correction that
    # did nothing on shards would miss its own reference).
    for name in ("2bw_delay_compensation", "2bw_weight_prediction"):
        assert max_difference(references[name], references["2bw"]) > 20 * TOL, name
    for name in ("2bw", "1f1b_clipped"):
        for r in (0, 2):
            # the embedding and the tied head (listed under the embedding's name) split over the vocabulary: rank i
            # of both stages holds the same rows
            assert ranks[r]["cases"][name]["local_weights"]["embed.weight"].shape == (128, 64)
            # sequence parallelism: each rank sends its peer only its half of the sequence [batch 2, seq 16 / 2, 64]
            assert ranks[r]["cases"][name]["crossed"] == [[2, 8, 64]]
    # Muon's tensor-parallel step on a sharded matrix is bitwise the one-device step of the whole matrix.
    for r in range(4):
        for name in ("2bw_muon", "1f1b_error_feedback_muon"):
            assert ranks[r]["cases"][name]["muon_step_difference"] == 0.0, (r, name)
    # layer_cost="measured": stage 0's ranks timed every layer, their times differ (rank 1's head 1000 times
    # slower), and all four ranks split by the slowest rank's: the head alone on stage 1, a split rank 0's own
    # times do not give; the weights are one device's on that split (checked above).
    timed = [ranks[r]["cases"]["2bw_measured"]["own_times"] for r in range(4)]
    assert [len(t) for t in timed] == [1, 1, 0, 0], timed  # stage 0's ranks time, once; stage 1's wait
    assert timed[1][0][-1] > 100 * timed[0][0][-1] and len(timed[0][0]) == 6
    for r in range(4):
        assert ranks[r]["cases"]["2bw_measured"]["split"] == ("balanced", [5, 1]), r
        assert ranks[r]["cases"]["2bw_measured"]["split_cost"] == "measured", r
    from lightning_async_pp.plan.balanced import balanced_split

    assert balanced_split(timed[0][0], 2) != [5, 1]  # rank 0's own times split otherwise
    # Compiled layers: each rank compiled its layers' graphs in the first batch and nothing after (2bw reads the
    # stashed version from the second batch on, each batch through 4 microbatches); the weights are eager one
    # device's (checked above).
    for r in range(4):
        counts = ranks[r]["cases"]["2bw_compiled"]["graphs_per_batch"]
        assert len(counts) == 3 and counts[0] > 0 and counts == [counts[0]] * 3, (r, counts)
    # The control: a rank that starts from its neighbour's shard is far outside the tolerance.
    wrong = _whole_model(ranks, "wrong_shard")
    assert max_difference(wrong, run_here_on_one_device(llama_fit.run, CASES["wrong_shard"])["state_dict"]) > 1e-2


def _weights_per_step(ranks: list[dict], name: str) -> tuple[list[dict[str, torch.Tensor]], list[set[str]]]:
    """``W_0, W_1, ...`` of a 2 x 2 run, whole, by name (the tied head counted once, under the embedding's name), and
    the names each stage counts (stage 1 not the tied head: stage 0 owns it, as on one device)."""
    stages = [ranks[r]["cases"][name]["weights_per_step"] for r in (0, 2)]
    history = [{**stage0, **{n: t for n, t in stage1.items() if n != "head.proj.weight"}}
               for stage0, stage1 in zip(*stages)]
    return history, [set(stages[0][0]), set(stages[1][0]) - {"head.proj.weight"}]


def _norm(weights: dict[str, torch.Tensor], names) -> float:
    return math.sqrt(sum(float(weights[n].double().square().sum()) for n in names))


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return math.sqrt(sum(float((a[n].double() - b[n].double()).square().sum()) for n in a))


def _staleness_bounds(name: str, ranks: list[dict], tag: str, k: int) -> float:
    """How far the 2 x 2 run's ``tag`` at step ``k`` may lie from one device's, from how far the two runs' weights
    lie apart (tensor parallelism reorders sums; ``E_j = ||W_j(2 x 2) - W_j(one device)||`` over the whole model).
    A norm moves by at most the norm of what its argument moves (triangle inequality), over any part of the model:

    - ``update_norm``, ``||W_k - W_{k+1}||``: ``E_k + E_{k+1}``;
    - ``drift``, ``D / N`` with ``D = ||W_k - W_{k-1}||`` and ``N = ||W_k||``:
      ``(E_k + E_{k-1} + drift E_k) / N`` (``D`` moves by ``E_k + E_{k-1}``, ``N`` by ``E_k``);
    - under ``ErrorFeedback`` (coefficient ``c = 1``), ``u_0 = W_0 - W_1`` and
      ``(1 + c) u_k = W_k - W_{k+1} + c u_{k-1}``: ``update_norm`` ``||u_k||`` moves by
      ``d_k = (E_k + E_{k+1} + c d_{k-1}) / (1 + c)`` (``d_0 = E_0 + E_1``), plus the float32 rounding of the
      identity's terms (``2 eps ||W_{k+1}||``), and ``correction_norm`` ``||W_k - W_{k+1} - u_k||`` by
      ``E_k + E_{k+1} + d_k``.

    ``compensation_ratio`` is a ratio of gradients' norms, which are not the weights': tensor parallelism moves
    them by the order of their sums too (measured: 1e-7 of the ratio); the bound is ``1e-4`` of it, a margin for
    any CPU."""
    history, stage_names = _weights_per_step(ranks, name)
    one = _one_device(name)["weights_per_step"]
    E = [_distance(mine, theirs) for mine, theirs in zip(history, one)]
    stage = tag.split("/")[1] if tag.split("/")[1].startswith("stage") else None
    names = stage_names[int(stage[len("stage"):])] if stage else set(history[k])
    figure = tag.rsplit("/", 1)[1]
    expected = dict(_one_device(name)["logged"][tag])[k]
    if figure == "drift":
        return (E[k] + E[max(k - 1, 0)] + expected * E[k]) / _norm(history[k], names)
    if figure == "compensation_ratio":
        return 1e-4 * expected
    if "error_feedback" not in CASES[name].get("optimizer", ""):
        assert figure == "update_norm", tag
        return E[k] + E[k + 1]
    d = E[0] + E[1]
    for j in range(1, k + 1):
        d = (E[j] + E[j + 1] + d) / 2 + 2 * FLOAT32_EPS * _norm(history[j + 1], history[j + 1])
    assert figure in ("update_norm", "correction_norm"), tag
    return d if figure == "update_norm" else E[k] + E[k + 1] + d


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_monitors_on_two_stages_of_two_tensor_parallel_ranks_log_the_one_device_runs_figures(two_by_two):
    """StalenessMonitor's figures are of whole tensors, each element counted once (a shard on every rank of its
    stage, a replicated parameter and the tied head once), within what the runs' weights differ by; PipelineMonitor
    counts the rows a stage's tensor-parallel ranks share once."""
    for name in (n for n, case in CASES.items() if case.get("monitors")):
        logged, one = two_by_two[0]["cases"][name]["logged"], _one_device(name)["logged"]
        staleness = sorted(tag for tag in one if tag.startswith("staleness/"))
        assert staleness == sorted(tag for tag in logged if tag.startswith("staleness/")), name
        for tag in staleness:
            steps = dict(one[tag])
            assert sorted(dict(logged[tag])) == sorted(steps) == [0, 1, 2], (name, tag)
            for k, value in logged[tag]:
                if tag.endswith("/delay"):
                    assert value == steps[k] == (1 if name.startswith("2bw") and k > 0 else 0), (name, tag, k)
                    continue
                bound = _staleness_bounds(name, two_by_two, tag, k) + 1e-12 * abs(steps[k])  # float64 sums
                assert abs(value - steps[k]) <= bound, (name, tag, k, value, steps[k], bound)
        assert dict(logged["staleness/update_norm"])[1] > 0.1 and (  # the figures are not trivially zero
            dict(logged["staleness/drift"])[1] > 1e-2 or not name.startswith("2bw")), name
        # Throughput: each process divides the window's tokens by its wall time and by its pipeline's processes
        # (2 stages x 2 ranks, which see the same rows), and the figures are summed over processes; the logged step
        # time is the mean of those wall times over the steps. So tokens/s x step time is a batch's tokens
        # (8 rows of 16) times the processes' mean wall time over their harmonic mean: at least 1, and near it as
        # the windows start together (after the previous logging step's reduction, or the collectives that start
        # training) and end within a step; rows counted once per tensor-parallel rank would make it at least 2.
        tokens, seconds = dict(logged["pipeline/tokens_per_sec"]), dict(logged["pipeline/step_time_s"])
        samples = dict(logged["pipeline/samples_per_sec"])
        for k in tokens:
            assert 1 - 1e-9 <= tokens[k] * seconds[k] / (8 * 16) < 1.5, (name, k, tokens[k], seconds[k])
            assert 1 - 1e-9 <= samples[k] * seconds[k] / 8 < 1.5, (name, k, samples[k], seconds[k])


#: 2 data-parallel replicas of 2 stages x 2 ranks (8 processes); ``batch`` and ``microbatches`` are a replica's, and
#: the one-device reference trains both replicas' batches as one batch of twice the microbatches (llama_fit's
#: ``data_parallel``): the replicas' mean gradient is that batch's.
DP_BASE = {**BASE, "data_parallel": 2, "batch": 4, "microbatches": 2}
DP_CASES = {
    "2bw": {**DP_BASE, "schedule": "2bw"},
    "1f1b_clipped": {**DP_BASE, "schedule": "1f1b", "clip": 0.5},
    "2bw_zero": {**DP_BASE, "schedule": "2bw"},  # launched with shard_optimizer=True (ZeRO-1 over the replicas)
    # packed rows with tensor and data parallelism and ZeRO-1 at once (the loss over every target: a replica's mean
    # over its kept targets is not the whole batch's where the replicas keep different counts)
    "2bw_zero_packed": {**DP_BASE, "schedule": "2bw", "packed": True, "skip_ends": False},
}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_replicas_of_two_stages_of_two_tensor_parallel_ranks_train_llama_as_one_device_on_both_batches(tmp_path):
    launch = {n: {**c, "tensor_parallel": 2} for n, c in DP_CASES.items()}
    for name in ("2bw_zero", "2bw_zero_packed"):
        launch[name]["strategy_kwargs"] = {"shard_optimizer": True}
    ranks = script_ranks(SCRIPT, {"devices": 8, "cases": launch}, tmp_path, ranks=8, timeout=600)
    for name, case in DP_CASES.items():
        replicas = [_whole_model(ranks[4 * d : 4 * d + 4], name) for d in range(2)]  # replica d: ranks 4d..4d+3
        reference = run_here_on_one_device(llama_fit.run, case)["state_dict"]
        assert max_difference(replicas[0], reference) < TOL, (name, max_difference(replicas[0], reference))
        # one averaged gradient: the replicas' shards stay equal, bitwise
        assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in reference), name
    # ZeRO-1 steps each parameter on its owner as the unsharded run does: the same weights, bitwise.
    sharded, unsharded = _whole_model(ranks, "2bw_zero"), _whole_model(ranks, "2bw")
    assert all(torch.equal(sharded[k], unsharded[k]) for k in unsharded)
    # The control: what replica 0 trains on its own batches alone (no reduction) is far outside the tolerance.
    alone = run_here_on_one_device(llama_fit.run, {**DP_CASES["2bw"], "only_replica": 0})["state_dict"]
    assert max_difference(_whole_model(ranks, "2bw"), alone) > 1e-2
    # Packed rows' documents were kept apart: one device on the same tokens, documents not separated, is far off.
    unseparated = run_here_on_one_device(llama_fit.run, {**DP_CASES["2bw_zero_packed"], "packed": False})
    assert max_difference(_whole_model(ranks, "2bw_zero_packed"), unseparated["state_dict"]) > 20 * TOL


# ---- the engine's local shards ---------------------------------------------------------------------------------
@pytest.fixture
def two_rank_mesh():
    """Rank 0 of a fake 2-process group in this process (torch's test backend: collectives do nothing) and its
    one-dimensional tensor-parallel mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    dist.destroy_process_group()


def test_weight_versions_keep_a_dtensor_parameters_local_shard_and_updates_write_the_newest_slot(two_rank_mesh):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    layer = parallelize_module(torch.nn.Linear(4, 6, bias=False), two_rank_mesh, ColwiseParallel())
    p = layer.weight
    assert isinstance(p, DTensor) and p.to_local().shape == (3, 4)
    versions = WeightVersions([p], delay=1)
    assert [s[0].shape for s in versions.slots] == [(3, 4), (3, 4)]  # each slot one local shard
    before = versions.slots[0][0].clone()
    versions.prepare_update()
    with torch.no_grad():
        p.add_(1.0)  # the optimizer's in-place update of W_1
    # it wrote the newest slot (p points there, through torch's private _local_tensor), the stash W_0 is intact
    assert torch.equal(versions.slots[1][0], before + 1.0)
    assert torch.equal(versions.slots[0][0], before)
    assert torch.equal(p.to_local(), versions.version(1)[0])


def test_the_data_parallel_buckets_hold_each_dtensor_parameters_local_shard_gradient(two_rank_mesh):
    """A DTensor parameter's local tensor never requires grad: the reducer asks the parameter, so its shard's
    gradient is bucketed (taken from the local tensor, the buckets were empty and no replica reduced)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_async_pp.parallel.data_parallel import GradientReducer
    from lightning_async_pp.parallel.tensor_parallel import local_tensor

    layer = parallelize_module(torch.nn.Linear(4, 6), two_rank_mesh, ColwiseParallel())
    assert layer.weight.requires_grad and not local_tensor(layer.weight).requires_grad
    reducer = GradientReducer(list(layer.parameters()), group=None, size=2)
    assert [b.buffer.numel() for b in reducer.buckets] == [3 * 4 + 3]  # the local shards of weight and bias
    leaves = [p.to_local().detach().requires_grad_() for p in layer.parameters()]
    reducer.attach(leaves)
    assert [tuple(leaf.grad.shape) for leaf in leaves] == [(3, 4), (3,)]  # views into the bucket


def test_undoing_tensor_parallelism_leaves_a_plain_module_that_runs_without_the_group(two_rank_mesh):
    """What rank 0's module becomes after the gather: whole plain parameters (one object where one was shared),
    none of parallelize_module's hooks, so it computes as the module never parallelized (a hook left behind would
    turn the input into a DTensor, which a plain weight refuses)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_async_pp.parallel.tensor_parallel import undo_tensor_parallelism

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
    whole_state = {k: v.clone() for k, v in plain.state_dict().items()}
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
    model = parallelize_module(model, two_rank_mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    other = torch.nn.Module()
    other.shared = model[0]  # the same layer reached from another root (a stage's layer list)
    user_hook = model[1].register_forward_hook(lambda m, i, o: o * 2)  # not torch's: stays
    assert undo_tensor_parallelism([model, other], torch.device("cpu"))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert [tuple(p.shape) for p in model.parameters()] == [(6, 4), (4, 6)] and other.shared.weight is model[0].weight
    assert len(model[0]._forward_pre_hooks) == len(model[0]._forward_hooks) == len(model[1]._forward_pre_hooks) == 0
    assert len(model[1]._forward_hooks) == 1
    user_hook.remove()
    model.load_state_dict(whole_state)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), plain(x))
    assert not undo_tensor_parallelism([plain], torch.device("cpu"))  # nothing to undo


def test_undoing_tensor_parallelism_on_a_stage_without_the_tied_head_gives_the_restored_head_the_plain_matrix(
        two_rank_mesh):
    """Rank 0 of 2 stages with Llama's full plan: the tied head is another stage's, so its matrix (a vocabulary-
    sharded DTensor) is held aside while the head is remote. After the undo and the restore of the gathered state,
    the head's matrix is the embedding's plain one again, and the whole model loads the gathered state."""
    from lightning_async_pp.parallel.placement import layer_paths, remove_other_stages, restore_layers
    from lightning_async_pp.parallel.tensor_parallel import undo_tensor_parallelism

    model = Llama("tiny", init_seed=0, max_seq_len=64)
    model.configure_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.parallelize(two_rank_mesh)
    layers = model.pipeline_layers()
    paths = layer_paths(model, layers)
    remove_other_stages(model, layers, paths, [0] * 3 + [1] * (len(layers) - 3), 0)
    assert undo_tensor_parallelism([model, *layers], torch.device("cpu"))
    restore_layers(model, layers, paths, state, torch.device("cpu"))
    assert model.head.proj.weight is model.embed.weight and not isinstance(model.embed.weight, DTensor)
    model.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


# ---- what is refused -------------------------------------------------------------------------------------------
def test_the_layout_puts_a_stages_tensor_parallel_ranks_side_by_side_and_pipelines_per_tensor_parallel_rank():
    topology = PipelineTopology(world_size=4, data_parallel_size=1, rank=3, tensor_parallel_size=2)
    assert (topology.num_stages, topology.stage, topology.tp_rank, topology.dp_rank) == (2, 1, 1, 0)
    assert topology.pipeline_ranks == [1, 3]  # the peer of rank 3 is tensor-parallel rank 1 of stage 0
    assert topology.rank_to_stage == {0: 0, 1: 0, 2: 1, 3: 1}
    assert PipelineConfig(tensor_parallel_size=2).stages_for(4) == 2
    with pytest.raises(ValueError, match=r"6 process\(es\) cannot be split .* tensor_parallel_size=4"):
        PipelineConfig(tensor_parallel_size=4).stages_for(6)


@pytest.mark.parametrize("option, match", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer, got 0"),
])
def test_options_not_supported_with_tensor_parallelism_are_refused_naming_them(option, match):
    with pytest.raises(ValueError, match=match):
        AsyncPipelineStrategy(**{"tensor_parallel_size": 2, **option})


def test_a_delay_other_than_the_schedules_is_refused_across_tensor_parallel_processes():
    PipelineConfig(tensor_parallel_size=2, delay=1).check(4)
    with pytest.raises(ValueError, match=r"delay=2 is a one-device research variant"):
        PipelineConfig(tensor_parallel_size=2, delay=2).check(4)


def test_tensor_parallelism_on_one_process_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs at least that many processes"):
        PipelineConfig(tensor_parallel_size=2).check(1)


def _trainer(fn=TrainerFn.FITTING, checkpointing=False):
    return SimpleNamespace(state=SimpleNamespace(fn=fn), checkpoint_callbacks=[object()] if checkpointing else [],
                           ckpt_path=None)


@pytest.mark.parametrize("trainer, module, gather, match", [
    (_trainer(), "other", False, "the model TinyLM is not supported with tensor_parallel_size > 1 yet"),
    (_trainer(TrainerFn.VALIDATING), "gathered", True, r"a trainer call on a model gathered by an earlier one "
     r"\(gather_final_weights=True\) is not supported"),
])
def test_setups_not_supported_with_tensor_parallelism_are_refused_naming_them(trainer, module, gather, match):
    from helpers import TinyLM

    model = Llama("tiny") if module != "other" else TinyLM()
    if module == "gathered":  # what the gather after a tensor-parallel call marks on every rank
        object.__setattr__(model, "_pipeline_tensor_parallel_gathered", True)
    with pytest.raises(ValueError, match=match):
        options.refuse_with_tensor_parallelism(trainer, model, PipelineConfig(tensor_parallel_size=2), gather,
                                               previous_call=False)


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING])
def test_checkpoints_evaluation_and_the_gather_are_not_refused_with_tensor_parallelism(fn):
    options.refuse_with_tensor_parallelism(_trainer(fn, checkpointing=True), Llama("tiny"),
                                           PipelineConfig(tensor_parallel_size=2), True, previous_call=False)


def test_optimizers_not_tested_on_shards_are_refused_with_tensor_parallelism_and_the_tested_ones_pass():
    from functools import partial

    from lightning_async_pp.optim import AsyncNesterov, DelayCompensation, ErrorFeedback, Muon, WeightPrediction

    config = PipelineConfig(tensor_parallel_size=2)
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    sgd = partial(torch.optim.SGD, lr=0.1)
    for refused, match in ((torch.optim.SGD(params, lr=0.1), "the optimizer SGD is not supported"),
                           (DelayCompensation(params, optimizer=sgd),
                            r"the optimizer DelayCompensation\(SGD\) is not supported with tensor_parallel_size > 1 yet"),
                           (ErrorFeedback(params, optimizer=partial(WeightPrediction, optimizer=sgd)),
                            r"ErrorFeedback\(WeightPrediction\(SGD\)\) is not supported")):
        with pytest.raises(ValueError, match=match):
            options.refuse_optimizers_with_tensor_parallelism([refused], config)
    options.refuse_optimizers_with_tensor_parallelism(
        [torch.optim.AdamW(params), Muon(params), ErrorFeedback(params, optimizer=partial(Muon)), AsyncNesterov(params),
         DelayCompensation(params, optimizer=torch.optim.AdamW), WeightPrediction(params, optimizer=partial(Muon)),
         ErrorFeedback(params, optimizer=partial(DelayCompensation, optimizer=torch.optim.AdamW))], config)


def test_muons_step_on_gathered_matrices_is_torch_muons_step_on_whole_ones():
    """On plain (whole) matrices the tensor-parallel step is exactly ``torch.optim.Muon``'s: the gather is its only
    change (the DTensor case runs in the 4-process test above). Fails if torch changes Muon's math."""
    from lightning_async_pp.optim import Muon
    from lightning_async_pp.optim.muon import _step_whole_matrices

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4, 6))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    before = [p.detach().clone() for p in ours]
    mine, reference = Muon(ours, lr=0.02), Muon(theirs, lr=0.02)
    for step in range(3):
        grads = [torch.randn(p.shape) for p in ours]
        for params, g in ((ours, grads), (theirs, grads)):
            for p, gi in zip(params, g):
                p.grad = gi.clone()
        _step_whole_matrices(mine.muon)
        reference.step()
    for a, b, start in zip(ours, theirs, before):
        assert torch.equal(a, b)
        assert (a - start).abs().max() > 1e-2  # the steps moved it


# ---- checkpoints, evaluation and the final gather -----------------------------------------------------------------
RESUME = {**BASE, "schedule": "2bw", "resumable": True, "val_batches": 1}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_two_by_two_checkpoint_resumes_exactly_on_two_by_two_on_two_stages_and_on_one_device(tmp_path):
    """One launch of 2 stages x 2 tensor-parallel ranks: 3 steps uninterrupted (gathered into rank 0), 2 steps
    saved (sharded, with validation inside fit; and one file), the sharded save resumed to 3 steps on the same
    layout, then validated, tested and predicted on, and the one file and a one-device checkpoint resumed too; a
    save after fit (``trainer.save_checkpoint``, the weights gathered into rank 0 meanwhile) is the save at the
    last step inside it and resumes too. The checkpoints then resume on 2 stages x 1 rank (one launch of 2
    processes) and on one device here, each to the uninterrupted weights. First in the launch, a setup refused
    there (packed rows from a data module, of a length the sequence split cannot take) surfaces as itself, the model
    left on the meta device."""
    sharded, single, one_device = tmp_path / "sharded", tmp_path / "single", tmp_path / "one_device"
    after = tmp_path / "after"
    (tmp_path / "tp").mkdir(), (tmp_path / "two").mkdir()
    # Saved on one device first, for the 2 x 2 run to resume from (DCP reads its whole tensors into shards).
    saved_on_one_device = run_here_on_one_device(
        llama_fit.run, {**RESUME, "steps": 2, "val_every": 1, "save_at": 2, "checkpoint_dir": str(one_device)})
    cases = {
        # refused at setup (packed rows of 15 tokens, which 2 ranks cannot split, from a data module declaring
        # them), first
        "refused_at_setup": {**BASE, "packed": True, "seq": 15, "refused": True},
        "full": {**RESUME, "gather": True},
        "saved": {**RESUME, "steps": 2, "save_at": 2, "checkpoint_dir": str(sharded), "val_every": 1},
        "single": {**RESUME, "steps": 2, "save_at": 2, "checkpoint_dir": str(single),
                   "strategy_kwargs": {"save_distributed_checkpoint": False}},
        "resumed": {**RESUME, "resume_from": str(sharded / "saved.ckpt"),
                    "eval_calls": ["validate", "test", "predict"]},
        "resumed_from_one_file": {**RESUME, "resume_from": str(single / "saved.ckpt")},  # whole tensors sliced
        "resumed_from_one_device": {**RESUME, "resume_from": str(one_device / "saved.ckpt")},
        # gathered into rank 0 after fit (the default), then saved: as the save inside fit at its last step
        "saved_after_fit": {**RESUME, "steps": 2, "save_at": 2, "checkpoint_dir": str(after), "gather": True,
                            "save_after": str(after / "after_fit.ckpt")},
        "resumed_after_fit": {**RESUME, "resume_from": str(after / "after_fit.ckpt")},
        # DelayCompensation's weight history: the parameter's shards stacked along a new first dimension
        "dc_full": {**RESUME, "optimizer": "delay_compensation"},
        "dc_saved": {**RESUME, "optimizer": "delay_compensation", "steps": 2, "save_at": 2,
                     "checkpoint_dir": str(tmp_path / "dc")},
        "dc_resumed": {**RESUME, "optimizer": "delay_compensation", "resume_from": str(tmp_path / "dc" / "saved.ckpt")},
    }
    ranks = script_ranks(SCRIPT, {"devices": 4, "cases": {n: {**c, "tensor_parallel": 2} for n, c in cases.items()}},
                         tmp_path / "tp", ranks=4, timeout=420)
    reference = run_here_on_one_device(llama_fit.run, {**RESUME, "eval_calls": ["validate", "test", "predict"]})
    # The refusal is the error fit raised on every rank, before any batch: not the teardown's ("different
    # slots", swapping a meta DTensor parameter for a plain placeholder) raised over it; the parameters are on the
    # meta device again, as setup found them.
    for r in range(4):
        refused = ranks[r]["cases"]["refused_at_setup"]
        assert refused["refused"].startswith("ValueError: Llama refuses the rows of RowsDataModule (block_size=15, "
                                             "document_mask=True)"), refused["refused"]
        assert "Change data.block_size (now 15) in the config" in refused["refused"]
        assert refused["batches_started"] == 0 and refused["meta"]
    # The gather: rank 0's module holds the whole model, plain tensors, the one-device run's weights.
    full = ranks[0]["cases"]["full"]["state_dict"]
    assert not any(isinstance(v, DTensor) for v in full.values())
    assert max_difference(full, reference["state_dict"]) < TOL
    # Evaluation through the tensor-parallel pipeline: validate/test losses and predicted logits as on one device.
    evaluated, expected = ranks[0]["cases"]["resumed"]["eval"], reference["eval"]
    for call in ("validate", "test"):
        assert evaluated[call].keys() == expected[call].keys() and evaluated[call]
        for k in expected[call]:
            assert evaluated[call][k] == pytest.approx(expected[call][k], rel=1e-5), (call, k)
    assert evaluated["predict"].shape == expected["predict"].shape
    assert (evaluated["predict"] - expected["predict"]).abs().max() < 1e-4
    assert ranks[0]["cases"]["saved"]["val_loss"] == pytest.approx(saved_on_one_device["val_loss"], rel=1e-5)

    # The sharded checkpoint: each of the 4 processes wrote and hashed its shard; read whole, it holds exactly the
    # stages' weights (each DTensor's shards at their offsets).
    path = str(sharded / "saved.ckpt")
    assert sorted(read_checksums(path)) == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"]
    saved = _whole_model(ranks, "saved")
    consolidated = consolidate.consolidate_checkpoint(path, tmp_path / "consolidated.ckpt")["state_dict"]
    in_one_file = torch.load(single / "saved.ckpt", weights_only=True)["state_dict"]
    for state in (consolidated, in_one_file):
        assert all(torch.equal(state[k], saved[k]) for k in saved)
        assert not any(isinstance(v, DTensor) for v in state.values())
    assert ranks[0]["cases"]["saved"]["global_step"] == 2

    # Saved after fit, from the gathered model's processes: tensor by tensor the save at the last step inside fit
    # (weights, the stash, the optimizer's moments), the steps as the same run's; it consolidates and resumes.
    inside, outside = (ShardedSource(str(after / name)) for name in ("saved.ckpt", "after_fit.ckpt"))
    assert inside.shapes == outside.shapes and any(k.startswith("stash.") for k in inside.shapes)
    tensors = [k for k, shape in inside.shapes.items() if shape is not None]
    read_inside, read_outside = inside.read(tensors), outside.read(tensors)
    assert all(torch.equal(read_inside[k], read_outside[k]) for k in tensors)
    assert read_meta(str(after / "after_fit.ckpt"))["async_pipeline"]["num_updates"] == 2
    consolidated_after = consolidate.consolidate_checkpoint(str(after / "after_fit.ckpt"), tmp_path / "after.ckpt")
    gathered = ranks[0]["cases"]["saved_after_fit"]["state_dict"]  # rank 0's module after fit
    assert all(torch.equal(consolidated_after["state_dict"][k], v) for k, v in gathered.items())
    assert max_difference(_whole_model(ranks, "resumed_after_fit"), full) < 1e-6

    # Resumed on the same layout: the uninterrupted run's weights (same shards, same order of sums).
    assert max_difference(_whole_model(ranks, "resumed"), full) < 1e-6
    assert max_difference(_whole_model(ranks, "resumed_from_one_file"), full) < 1e-6
    assert max_difference(_whole_model(ranks, "dc_resumed"), _whole_model(ranks, "dc_full")) < 1e-6
    # From t = 1 to t = 2: the one-device checkpoint resumed on 2 x 2 (other orders of sums: the tolerance).
    assert max_difference(_whole_model(ranks, "resumed_from_one_device"), reference["state_dict"]) < TOL
    assert max_difference(saved, full) > 1e-3  # the resumed step moved the weights
    # On 2 stages x 1 rank and on one device (other orders of sums: the tolerance).
    two = script_ranks(SCRIPT, {"devices": 2, "cases": {
        n: {**RESUME, "resume_from": str(p / "saved.ckpt")} for n, p in (("sharded", sharded), ("single", single))}},
        tmp_path / "two", ranks=2, timeout=300)
    for name in ("sharded", "single"):
        assert max_difference(two[0]["cases"][name]["state_dict"], full) < TOL, name
    one = run_here_on_one_device(llama_fit.run, {**RESUME, "resume_from": path})
    assert max_difference(one["state_dict"], full) < TOL
    assert max_difference(one["state_dict"], reference["state_dict"]) < TOL


# ---- the memory account ----------------------------------------------------------------------------------------
def test_the_split_accounts_one_tensor_parallel_ranks_shards_and_leaves_the_layouts_hooks_in_place(two_rank_mesh):
    from lightning_async_pp.plan.balanced import MemoryModel, layer_costs, stage_peak
    from lightning_async_pp.strategy.optimizer_state import optimizer_state_per_layer

    import lightning as L

    def built(t: int) -> Llama:
        model = Llama("tiny", init_seed=0, max_seq_len=64)
        model.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
        model.configure_model()
        if t > 1:
            model.parallelize(two_rank_mesh)
        return model

    one, two = built(1), built(2)
    sample = torch.zeros(2, 17, dtype=torch.long)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in two.modules()]
    costs = {t: layer_costs(m.pipeline_layers(), sample, m.pipeline_input, m.pipeline_loss)
             for t, m in ((1, one), (2, two))}
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in two.modules()] == hooks
    assert sum(hooks, ()) != (0,) * 2 * len(hooks)  # the plan's hooks exist, and stayed
    norms = 2 * 64 * 4  # a block's two norm weights stay whole on every rank
    for c1, c2 in zip(costs[1][1:-1], costs[2][1:-1]):  # the blocks
        assert c2.param_bytes == (c1.param_bytes - norms) // 2 + norms
        assert 0.45 < c2.forward_flops / c1.forward_flops < 0.55  # the matrices' products, halved
        assert c2.activation_bytes < c1.activation_bytes
    assert costs[2][0].param_bytes == costs[1][0].param_bytes // 2  # the embedding, split over the vocabulary
    # AdamW's moments of a rank's shards; the peak of a stage under 2bw: 2 weight versions, gradients, moments
    state = {t: optimizer_state_per_layer(m, m.pipeline_layers()) for t, m in ((1, one), (2, two))}
    for t in (1, 2):  # two moments per parameter (and a step count each)
        assert 0 <= state[t].per_layer[1] - 2 * costs[t][1].param_bytes <= 64
    model = MemoryModel("2bw", 2, 4)
    peaks = {t: stage_peak(costs[t], 0, 3, 0, replace(model, state_bytes=state[t].per_layer,
                                                      state_shared=state[t].shared)).total for t in (1, 2)}
    assert 0.45 < peaks[2] / peaks[1] < 0.7, peaks


def test_the_split_report_names_the_layout():
    from lightning_async_pp.plan.balanced import SplitReport
    from lightning_async_pp.parallel.mesh import describe_layout

    layout = describe_layout(2, 2)
    assert layout == "2 stages x 2 tensor-parallel ranks"
    assert describe_layout(4, 1, 2) == "4 stages x 2 data-parallel replicas"
    assert SplitReport("explicit", (3, 3), (), (), layout=layout).describe().startswith(f"{layout}, partition=")


def check_rows_split_packed_or_not(model) -> None:
    """On 2 tensor-parallel ranks, a model's rows of 16 input tokens (17 with the shifted target) split alike, token
    rows and packed ones (whose positions stay whole beside them); rows of 15 are refused naming the count."""
    assert model.pipeline_input(torch.zeros(2, 17, dtype=torch.long)).shape == (2, 16)
    with pytest.raises(ValueError, match=r"splits each row's 15 input tokens .* divisible by 2"):
        model.pipeline_input(torch.zeros(2, 16, dtype=torch.long))
    packed = model.pipeline_input({"input_ids": torch.zeros(2, 17, dtype=torch.long),
                                   "position_ids": torch.zeros(2, 17, dtype=torch.long)})
    assert packed["input_ids"].shape == packed["position_ids"].shape == (2, 16)
    with pytest.raises(ValueError, match=r"splits each row's 15 input tokens .* divisible by 2"):
        model.pipeline_input({"input_ids": torch.zeros(2, 16, dtype=torch.long),
                              "position_ids": torch.zeros(2, 16, dtype=torch.long)})


def test_llama_under_sequence_parallelism_refuses_rows_it_cannot_split_packed_or_not(two_rank_mesh):
    model = Llama("tiny", init_seed=0, max_seq_len=64)
    model.configure_model()
    model.parallelize(two_rank_mesh)
    check_rows_split_packed_or_not(model)


def test_only_sharded_parameters_count_on_every_tensor_parallel_rank_in_the_clipping_norm(two_rank_mesh):
    """A sequence-parallel norm's weight is a replicated DTensor: its gradient is whole on every rank, so the global
    norm counts it on tensor-parallel rank 0 only, as a plain parameter (AdamW hides a double count: the
    4-process test's clipped run stays within its tolerance without this rule)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_async_pp.parallel.tensor_parallel import is_whole

    assert is_whole(torch.zeros(3))
    assert is_whole(distribute_tensor(torch.zeros(4), two_rank_mesh, [Replicate()]))
    assert not is_whole(distribute_tensor(torch.zeros(4, 2), two_rank_mesh, [Shard(0)]))
