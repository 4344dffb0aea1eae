"""Expert parallelism (``expert_parallel_size``): 2 stages x 2 data-parallel replicas of a ``models.Llama`` with
routed experts, each replica holding half of every stage's experts, train the one-device run's weights on both
replicas' batches; the layout, the dispatch, the refusals and the host reads in one process.

The tolerances (docs/design/expert-parallel.md, "Matching one device"): expert parallelism changes only the order
of sums (an expert's rows from both replicas in one product, its gradient summed over them before the division by
the replicas), as another microbatch count does on one device. That noise reference, measured on the one-device run
without the router loss (with it, each microbatch's balancing term is another objective): 3.2e-5 (2bw, 1f1b,
gpipe) and 2.5e-5 (1f1b clipped) under AdamW (1.3e-6 on one stage of 4 replicas), 6.8e-4 and 1.1e-3 under Muon (bf16 Newton-Schulz),
1.1e-8 under SGD. The bounds are a
little above them; a misrouted expert (the control) lands 1e-1 away, expert gradients left undivided 2e-3 away under
SGD (AdamW's normalization hides a gradient's scale: SGD is the case that sees it).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import llama_fit  # noqa: E402
from pipeline_runs import max_difference, run_here_on_one_device, script_ranks  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402
from lightning_async_pp.pipeline.config import PipelineConfig  # noqa: E402
from lightning_async_pp.parallel.expert import LocalExperts, route, run_experts  # noqa: E402
from lightning_async_pp.parallel.mesh import EXPERT_MESH_DIMS, MeshLayout  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "llama_fit.py"
TOL = 5e-5
MUON_TOL = 2e-3
SGD_TOL = 1e-6
EXPERTS = {"num_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 32}
#: a replica's batch and microbatches; the one-device reference trains both replicas' batches as one batch of twice
#: the microbatches (llama_fit's ``data_parallel``), so each of its microbatches is one replica's, router loss included
BASE = {"tie": True, "steps": 3, "microbatches": 2, "partition": [3, 3], "data_parallel": 2, "batch": 4,
        "experts": EXPERTS, "expert_parallel": 2}
CASES = {
    "2bw": {**BASE, "schedule": "2bw", "count_expert_reads": True},
    "1f1b_clipped": {**BASE, "schedule": "1f1b", "clip": 0.5},
    "1f1b_checkpointed": {**BASE, "schedule": "1f1b", "activation_checkpointing": True},
    "2bw_muon": {**BASE, "schedule": "2bw", "optimizer": "muon"},
    "1f1b_muon": {**BASE, "schedule": "1f1b", "optimizer": "muon"},
    # gather_final_weights=True: rank 0 holds all; validation inside fit runs through the all-to-alls too
    "1f1b_gathered": {**BASE, "schedule": "1f1b", "gather": True, "val_every": 2, "val_batches": 1},
    "gpipe": {**BASE, "schedule": "gpipe"},
    "2bw_sgd": {**BASE, "schedule": "2bw", "optimizer": "sgd", "lr": 0.5},
    # clipped far below the gradient's norm: SGD's step is then the clipping coefficient itself, so the norm must count
    # every expert once
    "1f1b_sgd_clipped": {**BASE, "schedule": "1f1b", "optimizer": "sgd", "lr": 0.5, "clip": 0.01},
    # 1 stage x 4 replicas, 2 expert groups: experts 0, 1 on replicas 0 and 2 (copies, their gradients summed)
    "copies_2bw": {**BASE, "schedule": "2bw", "data_parallel": 4, "stages": 1, "partition": [6], "samples": 64},
    "copies_1f1b_sgd_clipped": {**BASE, "schedule": "1f1b", "data_parallel": 4, "stages": 1, "partition": [6],
                                "samples": 64, "optimizer": "sgd", "lr": 0.5, "clip": 0.01},
    # the controls
    "unaveraged_sgd": {**BASE, "schedule": "2bw", "optimizer": "sgd", "lr": 0.5, "unaveraged_experts": True},
    "misrouted": {**BASE, "schedule": "1f1b", "steps": 1, "misroute_experts": True},
}
CONTROLS = ("unaveraged_sgd", "misrouted")


def _whole_model(ranks: list[dict], case: str) -> dict[str, torch.Tensor]:
    """The 4 ranks' parameters by name (ranks 0, 1: stages 0, 1 of replica 0; ranks 2, 3: of replica 1); a name
    two ranks hold (everything but the experts) must be bitwise equal on both replicas."""
    merged: dict[str, torch.Tensor] = {}
    for r, rank in enumerate(ranks):
        for name, value in rank["cases"][case]["stage_weights"].items():
            if name in merged:
                assert torch.equal(merged[name], value), (case, name, r)
            merged[name] = value
    merged.setdefault("head.proj.weight", merged["embed.weight"])
    return merged


def _experts_of(rank: dict, case: str) -> set[str]:
    return {n for n in rank["cases"][case]["stage_weights"] if ".experts." in n}


def _reference(case: dict) -> dict[str, torch.Tensor]:
    return run_here_on_one_device(llama_fit.run, {k: v for k, v in case.items()
                                                  if k not in ("misroute_experts", "unaveraged_experts")})["state_dict"]


#: The checkpoint cases: 16 rows, so a replica's epoch is 2 steps and the step-2 checkpoint is at an epoch's end
#: (a plain DataLoader restarts its epoch on resume); the third step is the second epoch, shuffled by each replica's
#: sampler, which the one-device run reads as ``replica_epoch=1``.
CKPT = {**BASE, "schedule": "2bw", "samples": 16}
UNSPLIT = {k: v for k, v in CKPT.items() if k != "expert_parallel"}  # 2 stages x 2 replicas, every expert on each


def _checkpoint_cases(tmp_path: Path) -> dict[str, dict]:
    sharded, single, one = (str(tmp_path / d / "saved.ckpt") for d in ("sharded", "single", "one"))
    return {
        "ckpt_full": CKPT,
        "ckpt_saved": {**CKPT, "steps": 2, "save_at": 2, "checkpoint_dir": str(tmp_path / "sharded")},
        "ckpt_saved_single": {**CKPT, "steps": 2, "save_at": 2, "checkpoint_dir": str(tmp_path / "single"),
                              "strategy_kwargs": {"save_distributed_checkpoint": False}},
        "ckpt_resumed": {**CKPT, "resume_from": sharded},
        "ckpt_resumed_unsplit": {**UNSPLIT, "resume_from": sharded},  # expert_parallel_size=1 (gathered to rank 0)
        "ckpt_resumed_from_one_file": {**CKPT, "resume_from": single},
        "ckpt_resumed_from_one_device": {**CKPT, "resume_from": one},
    }


def _check_checkpoints(ranks: list[dict], tmp_path: Path) -> dict[str, float]:
    """A checkpoint of 2 x 2 with expert_parallel_size=2 (each replica writing its own experts under their global
    names) resumes on the same layout to the uninterrupted run's weights, and within the tolerance with
    expert_parallel_size=1 and on one device; a one-device checkpoint resumes into expert parallelism; the one-file
    checkpoint and the consolidated sharded one hold every expert."""
    from lightning_async_pp import consolidate

    full = _whole_model(ranks, "ckpt_full")
    saved = _whole_model(ranks, "ckpt_saved")
    assert max_difference(saved, full) > 1e-3  # the resumed step moved the weights
    assert max_difference(_whole_model(ranks, "ckpt_resumed"), full) < 1e-6
    assert max_difference(_whole_model(ranks, "ckpt_resumed_from_one_file"), full) < 1e-6
    one_device = run_here_on_one_device(llama_fit.run, {**UNSPLIT, "resume_from": str(tmp_path / "sharded" / "saved.ckpt"),
                                                        "replica_epoch": 1})["state_dict"]
    measured = {"unsplit": max_difference(ranks[0]["cases"]["ckpt_resumed_unsplit"]["state_dict"], full),
                "one_device": max_difference(one_device, full),
                "from_one_device": max_difference(_whole_model(ranks, "ckpt_resumed_from_one_device"), full)}
    assert all(value < TOL for value in measured.values()), measured
    single = torch.load(tmp_path / "single" / "saved.ckpt", weights_only=True)["state_dict"]
    whole = consolidate.consolidate_checkpoint(str(tmp_path / "sharded" / "saved.ckpt"),
                                               tmp_path / "consolidated.ckpt")["state_dict"]
    for state in (single, whole):
        assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    return measured


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_stages_of_two_replicas_splitting_the_experts_train_the_moe_llama_as_one_device(tmp_path):
    # the one-device checkpoint that a case resumes into expert parallelism
    run_here_on_one_device(llama_fit.run, {**UNSPLIT, "steps": 2, "save_at": 2, "checkpoint_dir": str(tmp_path / "one")})
    cases = {**CASES, **_checkpoint_cases(tmp_path)}
    ranks = script_ranks(SCRIPT, {"devices": 4, "cases": cases}, tmp_path, ranks=4, timeout=600)
    measured = {}
    for name, case in CASES.items():
        if name in CONTROLS:
            continue
        reference = _reference(case)
        tolerance = MUON_TOL if "muon" in name else SGD_TOL if "sgd" in name else TOL
        weights = ranks[0]["cases"][name]["state_dict"] if case.get("gather") else _whole_model(ranks, name)
        measured[name] = max_difference(weights, reference)
        assert measured[name] < tolerance, (name, measured[name])
    print("expert parallelism against one device:", measured)
    initial = run_here_on_one_device(llama_fit.run, {**CASES["2bw"], "steps": 0})["state_dict"]
    assert max_difference(_whole_model(ranks, "2bw"), initial) > 1e-3  # the steps did move the weights
    # The 4 ranks hold every expert once: each stage's two replicas hold disjoint halves of its blocks' experts,
    # replica 0 the first half (experts 0, 1), replica 1 the second.
    blocks = {0: (0, 1), 1: (2, 3)}  # partition [3, 3]: embed + blocks 0, 1 | blocks 2, 3 + head
    for stage, (a, b) in blocks.items():
        mine, theirs = _experts_of(ranks[stage], "2bw"), _experts_of(ranks[stage + 2], "2bw")
        every = {f"blocks.{k}.mlp.experts.{j}.{m}.weight" for k in (a, b) for j in range(4)
                 for m in ("gate_proj", "up_proj", "down_proj")}
        assert not mine & theirs and mine | theirs == every, stage
        assert all(n.split(".")[4] in ("0", "1") for n in mine), mine
    # One host read per MoE layer call (the split sizes), none in the all-to-alls' backward.
    for r in range(4):
        reads = ranks[r]["cases"]["2bw"]["expert_reads"]
        assert reads["calls"] > 0 and reads["reads"] == reads["calls"], (r, reads)
    # The gather: rank 0's module holds every stage and every expert, one device's state dict (compared above).
    assert "blocks.3.mlp.experts.3.down_proj.weight" in ranks[0]["cases"]["1f1b_gathered"]["state_dict"]
    assert ranks[0]["cases"]["1f1b_gathered"]["runs_alone"]
    assert 0 < ranks[0]["cases"]["1f1b_gathered"]["val_loss"] < 10  # validation inside fit ran
    # The controls, far outside the tolerances.
    assert max_difference(_whole_model(ranks, "misrouted"), _reference(CASES["misrouted"])) > 1e-2
    assert max_difference(_whole_model(ranks, "unaveraged_sgd"), _reference(CASES["unaveraged_sgd"])) > 100 * SGD_TOL
    print("checkpoints resumed, against the uninterrupted run:", _check_checkpoints(ranks, tmp_path))


# ---- the layout --------------------------------------------------------------------------------------------------
def test_an_expert_group_is_consecutive_replicas_of_a_stage_and_its_copies_hold_the_same_experts():
    layout = MeshLayout(world_size=8, data_parallel_size=4, expert_parallel_size=2)  # 2 stages; rank = replica * 2 + stage
    assert layout.expert_parallel_ranks(0) == [0, 2] and layout.expert_parallel_ranks(6) == [4, 6]
    assert layout.expert_parallel_ranks(3) == [1, 3]  # stage 1, replicas 0 and 1
    assert layout.expert_data_parallel_ranks(0) == [0, 4] and layout.expert_data_parallel_ranks(6) == [2, 6]
    assert layout.shape == (2, 2, 2, 1)  # (expert_data_parallel, expert_parallel, pipeline, tensor_parallel)
    whole = MeshLayout(world_size=4, data_parallel_size=2, expert_parallel_size=2)
    assert whole.expert_parallel_ranks(1) == [1, 3] and whole.expert_data_parallel_ranks(1) == [1]
    assert MeshLayout(4, 2).shape == (2, 2, 1)  # expert_parallel_size=1: the mesh as before
    assert PipelineConfig(data_parallel_size=2, expert_parallel_size=2).stages_for(4) == 2  # no extra processes


@pytest.fixture
def fake_world(request):
    """Rank ``request.param[0]`` of a fake ``request.param[1]``-process group (torch's test backend: collectives do
    nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield rank
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_world", [(2, 4)], indirect=True)
def test_the_device_mesh_has_the_expert_view_a_model_shards_its_experts_over(fake_world):
    from lightning_async_pp.parallel.expert import expert_parallel_mesh
    from lightning_async_pp.parallel.mesh import build_device_mesh, tensor_parallel_mesh

    mesh = build_device_mesh(MeshLayout(4, data_parallel_size=2, expert_parallel_size=2), "cpu")
    assert mesh.mesh_dim_names == EXPERT_MESH_DIMS
    ep = expert_parallel_mesh(mesh)
    assert ep.mesh.tolist() == [0, 2] and ep.get_local_rank() == 1  # rank 2: replica 1 of stage 0
    assert mesh["pipeline"].mesh.tolist() == [2, 3] and tensor_parallel_mesh(mesh) is None
    assert expert_parallel_mesh(build_device_mesh(MeshLayout(4, data_parallel_size=2), "cpu")) is None


@pytest.mark.parametrize("options, match", [
    ({"data_parallel_size": 2, "expert_parallel_size": 3}, r"expert_parallel_size=3 does not divide the 2 ranks of a "
     r"stage \(data_parallel_size=2 x tensor_parallel_size=1\).* among \[1, 2\]"),
    ({"expert_parallel_size": 0}, "expert_parallel_size must be a positive integer, got 0"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 2},
     "tensor_parallel_size=2 is not supported with expert_parallel_size > 1 yet"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "schedule": "zb_h1"},
     "schedule='zb_h1' is not supported with expert_parallel_size > 1 yet .* use schedule='1f1b'"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "shard_optimizer": True},
     "shard_optimizer=True is not supported with expert_parallel_size > 1 yet"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "compile": True}, "compile=True is not supported"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "layer_cost": "measured"},
     "layer_cost='measured' is not supported"),
])
def test_bad_expert_parallel_sizes_and_unsupported_options_are_refused_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        AsyncPipelineStrategy(**options)


def _trainer(fn=TrainerFn.FITTING, checkpointing=False):
    return SimpleNamespace(state=SimpleNamespace(fn=fn), checkpoint_callbacks=[object()] if checkpointing else [],
                           ckpt_path=None)


def _gathered(model: Llama) -> Llama:
    object.__setattr__(model, "_pipeline_tensor_parallel_gathered", True)  # what the gather after a call marks
    return model


@pytest.mark.parametrize("trainer, model, match", [
    (_trainer(), lambda: Llama("tiny"), "the model Llama is not supported with expert_parallel_size > 1 yet .* "
     "holds no experts"),
    (_trainer(TrainerFn.PREDICTING), lambda: Llama("tiny", num_experts=4), "trainer.predict is not supported"),
    (_trainer(TrainerFn.VALIDATING), lambda: _gathered(Llama("tiny", num_experts=4)), r"a trainer call on a model "
     r"gathered by an earlier one \(gather_final_weights=True\) is not supported"),
])
def test_setups_not_supported_with_expert_parallelism_are_refused_naming_them(trainer, model, match):
    from lightning_async_pp.strategy.experts import refuse_with_expert_parallelism_at_setup

    config = PipelineConfig(data_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match=match):
        refuse_with_expert_parallelism_at_setup(trainer, model(), config)
    refuse_with_expert_parallelism_at_setup(_trainer(checkpointing=True), Llama("tiny", num_experts=4), config)


@pytest.mark.parametrize("fake_world", [(0, 2), (1, 2)], indirect=True)
def test_each_rank_keeps_its_half_of_the_experts_initialized_as_on_one_device(fake_world):
    """Rank r of a 2-rank expert group keeps experts 2r, 2r + 1 of every block under their global names, and each
    expert's weights are the one-device model's (drawn from the expert's own seed, whatever the others)."""
    from torch.distributed.device_mesh import init_device_mesh

    one = Llama("tiny", num_experts=4, init_seed=0)
    one.configure_model()
    model = Llama("tiny", num_experts=4, init_seed=0)
    model._device_mesh = init_device_mesh("cpu", (1, 2, 1, 1), mesh_dim_names=EXPERT_MESH_DIMS)  # as the strategy sets it
    model.configure_model()
    held = {n.split(".")[4] for n, _ in model.named_parameters() if ".experts." in n}
    assert held == {str(2 * fake_world), str(2 * fake_world + 1)}
    whole = dict(one.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, whole[name]), name
    assert len(whole) - len(dict(model.named_parameters())) == 4 * 2 * 3  # 4 blocks x 2 experts x 3 matrices gone
    # what the gather into rank 0 makes of it: every expert again, in one device's order, computed without the group
    from lightning_async_pp.parallel.expert import unshard_experts

    unshard_experts([model])
    assert list(model.state_dict()) == list(one.state_dict())
    assert all(block.mlp.experts.mesh is None and block.mlp.experts.first == 0 for block in model.blocks)
    uneven = Llama("tiny", num_experts=3)
    uneven._device_mesh = model._device_mesh
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 does not divide Llama's num_experts=3: .* among "
                                         r"\[1, 3\]"):
        uneven.configure_model()


# ---- the dispatch on one device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_routed_experts_compute_upstreams_loop_over_experts_bitwise(k):
    """Mixtral's and Qwen3-MoE's block: softmax, top k renormalized, then for each expert in turn its rows' products
    index-added into the output: the same bits (each token's products added in ascending expert order)."""
    from lightning_async_pp.models.routed_experts import RoutedExperts

    torch.manual_seed(0)
    block = RoutedExperts(16, 8, num_experts=5, top_k=k)
    x = torch.randn(3, 7, 16)
    out, statistics = block(x)
    tokens = x.reshape(-1, 16)
    probs = torch.softmax(block.gate(tokens), dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    expected = torch.zeros_like(tokens)
    for e in range(5):
        rows, slot = torch.where(chosen == e)
        expected.index_add_(0, rows, block.experts[str(e)](tokens[rows]) * weights[rows, slot, None])
    assert torch.equal(out.reshape(-1, 16), expected)
    assert statistics["expert_counts"].sum() == 21 * k


def test_an_expert_no_token_chose_gets_a_zero_gradient_as_on_one_device():
    torch.manual_seed(0)
    experts = LocalExperts([torch.nn.Linear(4, 4) for _ in range(3)])
    x = torch.randn(5, 4, requires_grad=True)
    logits = torch.tensor([[5.0, 1.0, -9.0]]).repeat(5, 1)  # expert 2 is never chosen
    weights, chosen = route(logits, 2, True, x.dtype)
    run_experts(x, weights, chosen, experts).sum().backward()
    assert torch.equal(experts["2"].weight.grad, torch.zeros(4, 4))
    assert experts["0"].weight.grad.abs().sum() > 0


def test_one_host_read_per_moe_layer_and_microbatch_none_in_backward(monkeypatch):
    from lightning_async_pp.parallel import expert as expert_parallel

    model = Llama("tiny", num_experts=4, init_seed=0)
    model.configure_model()
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename == expert_parallel.__file__:
                reads.append(sys._getframe(1).f_code.co_name)
            return _original(tensor, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    batch = torch.randint(0, 256, (2, 17))
    loss = model.pipeline_loss(model.pipeline_forward(batch), batch)
    assert reads == ["run_experts"] * 4  # one per block
    loss.backward()
    assert len(reads) == 4


def test_the_split_costs_routed_experts_on_fake_tensors():
    """The balanced split runs each layer on fake tensors: the routed experts take an equal share of the rows each
    (no data-dependent sizes, no communication), so a MoE Llama is split by FLOPs, not by parameter counts."""
    from lightning_async_pp.plan.balanced import layer_costs

    def block_flops(**kwargs) -> int:
        model = Llama("tiny", init_seed=0, **kwargs)
        model.configure_model()
        return layer_costs(model.pipeline_layers(), torch.zeros(2, 33, dtype=torch.long), model.pipeline_input,
                           model.pipeline_loss)[1].forward_flops

    dense, routed = block_flops(), block_flops(num_experts=4, experts_per_token=2)
    # two experts of the dense MLP's width per token, plus the router: more than one dense MLP, less than three
    assert 1.2 * dense < routed < 2.2 * dense, (dense, routed)


def test_router_statistics_count_each_rank_of_choice_per_expert():
    from lightning_async_pp.models.moe import router_statistics

    torch.manual_seed(0)
    logits = torch.randn(11, 6)
    stats = router_statistics(logits, 3, 6)
    chosen = torch.topk(torch.softmax(logits, -1), 3, dim=-1).indices
    assert torch.equal(stats["expert_counts"], torch.nn.functional.one_hot(chosen, 6).sum(0).float())


def test_the_option_and_the_routed_experts_come_from_a_yaml_config(tmp_path, monkeypatch):
    """LightningCLI builds both from their signatures: ``expert_parallel_size`` beside the strategy's other options,
    ``num_experts`` and ``experts_per_token`` beside Llama's."""
    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    config = tmp_path / "moe.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 4\n  logger: false\n"
        "  strategy:\n    class_path: lightning_async_pp.AsyncPipelineStrategy\n"
        "    init_args: {data_parallel_size: 2, expert_parallel_size: 2}\n"
        "model:\n  class_path: lightning_async_pp.models.Llama\n  init_args: {num_experts: 4, experts_per_token: 2}\n")
    cli = AsyncPipelineCLI(args=["--config", str(config)], run=False)
    assert cli.trainer.strategy.config.expert_parallel_size == 2
    assert cli.model.config.num_experts == 4 and cli.model.config.experts_per_token == 2
