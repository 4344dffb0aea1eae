"""Data parallelism at scale: the optimizer state sharded across replicas (ZeRO-1) and the bucketed, overlapped
gradient reduction. Replicas are compared with one device trained on the replicas' batches concatenated."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import TinyLM, delayed_loop, make_dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from pipeline_runs import max_difference, run_here_on_one_device, run_multiprocess, script_ranks
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim import ErrorFeedback, Muon
from lightning_async_pp.checkpoint import consolidate
from lightning_async_pp.parallel.data_parallel import GradientReducer
from lightning_async_pp.parallel.zero import rebuild

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from branch_fit import BranchMLP, run as branch_run  # noqa: E402


def concatenated_run(cfg: dict, steps: int, ckpt_path=None, checkpoint_dir=None) -> dict[str, torch.Tensor]:
    """One device; batch k is replica 0's batch k followed by replica 1's (the replicas' shards are rows r::dp)."""
    dp, batch, samples = cfg["dp"], cfg["batch"], cfg["samples"]
    shards = [list(range(r, samples, dp)) for r in range(dp)]
    order = [i for k in range(len(shards[0]) // batch) for shard in shards for i in shard[batch * k : batch * (k + 1)]]
    torch.manual_seed(0)
    model = TinyLM(**cfg.get("model", {}), optimizer=cfg["optimizer"])
    callbacks = [ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=2, save_top_k=-1)] if checkpoint_dir else []
    L.Trainer(
        strategy=AsyncPipelineStrategy(cfg["schedule"], num_microbatches=cfg["microbatches"] * dp), accelerator="cpu",
        devices=1, max_steps=steps, logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=cfg.get("clip"),
    ).fit(model, DataLoader(Subset(make_dataset(samples), order), batch_size=batch * dp, shuffle=False, drop_last=True),
          ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_ok(cfg: dict, tmp_path) -> dict[str, torch.Tensor]:
    proc = run_multiprocess(cfg, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(tmp_path / "final.pt")


def state_bytes(tmp_path, ranks: int) -> list[int]:
    return [int((tmp_path / f"optimizer_state_{r}.txt").read_text()) for r in range(ranks)]


# ---- the sharded optimizer: exact, about half the state per process -------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw_ef", "muon_ef"])
def test_sharded_optimizer_equals_the_unsharded_run_with_half_the_state_per_replica(tmp_path, optimizer):
    """Two replicas of one stage, global-norm clipping and a per-step LR schedule: the same weights to 1e-6."""
    cfg = dict(schedule="2bw", stages=1, dp=2, microbatches=2, steps=5, batch=4, samples=64, optimizer=optimizer,
               clip=0.05, model={"lr_schedule": True}, report_optimizer_state=True)
    (tmp_path / "plain").mkdir()
    (tmp_path / "sharded").mkdir()
    plain = run_ok(cfg, tmp_path / "plain")
    monitored = dict(cfg, shard_optimizer=True, monitors={"pipeline": {}}, log_every_n_steps=2)
    proc = run_multiprocess(monitored, tmp_path / "sharded")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    sharded = torch.load(tmp_path / "sharded" / "final.pt")
    # PipelineMonitor: the reduction's exposed time beside its whole time, per logging step
    log_dir = next(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("LOG_DIR "))
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for k in (1, 3):
        total, exposed = logged["pipeline/dp_comm_s"][k], logged["pipeline/dp_comm_exposed_s"][k]
        assert 0 < total and 0 <= exposed <= total, (k, total, exposed)
    assert max_difference(sharded, plain) < 1e-6
    if optimizer == "adamw_ef":  # Muon's Newton-Schulz (bf16 in torch) magnifies the order of the replicas' sum
        assert max_difference(sharded, concatenated_run(cfg, steps=5)) < 1e-5
    full, shards = state_bytes(tmp_path / "plain", 2), state_bytes(tmp_path / "sharded", 2)
    assert full[0] == full[1] > 0
    assert sum(shards) == full[0]  # every parameter's state is somewhere, once
    assert max(shards) <= 0.55 * full[0], (shards, full)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_parameter_group_added_mid_run_to_the_sharded_optimizer_trains_as_on_one_device(tmp_path):
    """The second half of the layers joins AdamW at update 2 (optimizer.add_param_group, as a finetuning schedule
    does): ZeroRedundancyOptimizer re-partitions, and two sharded replicas end at the one-device weights."""
    cfg = dict(schedule="2bw", stages=1, dp=2, microbatches=2, steps=5, batch=4, samples=64, optimizer="adamw",
               model={"later_group_at": 2}, shard_optimizer=True)
    multi = run_ok(cfg, tmp_path)
    assert max_difference(multi, concatenated_run(cfg, steps=5)) < 1e-5
    # the group added matters: without it those layers stay where they started
    assert max_difference(multi, concatenated_run(dict(cfg, model={"later_group_at": 99}), steps=5)) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_across_layouts_and_consolidate(tmp_path):
    """2 stages x 2 replicas with sharded AdamW + ErrorFeedback: equal to one device; its step-2 checkpoint resumes
    on one device (sharding off) and one device's resumes on 2 sharded replicas, both ending at the one-device
    weights; consolidation gives one file holding every parameter's optimizer state."""
    cfg = dict(schedule="2bw", stages=2, dp=2, microbatches=2, batch=4, samples=16, optimizer="adamw_ef")
    reference = concatenated_run(cfg, steps=4, checkpoint_dir=str(tmp_path / "one"))
    one_ckpt = tmp_path / "one" / "epoch=0-step=2.ckpt"
    assert one_ckpt.is_dir()  # sharded format (the default), written by one process

    run = tmp_path / "run"
    run.mkdir()
    multi = run_ok(dict(cfg, steps=4, shard_optimizer=True, save_every=2, checkpoint_dir=str(run / "ckpt"), keep_checkpoints=True,
                        report_optimizer_state=True), run)
    assert max_difference(multi, reference) < 1e-5
    # and the update rule written out (2bw: every batch's gradient at the previous version) on those batches
    batches = list(DataLoader(Subset(make_dataset(16), [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]),
                              batch_size=8)) * 2
    assert max_difference(multi, delayed_loop(TinyLM(optimizer="adamw_ef"), batches, delay=1)) < 1e-5
    per_stage = state_bytes(run, 4)  # ranks 0, 1: stage 0, 1 of replica 0; ranks 2, 3: of replica 1
    for stage in range(2):  # whole parameters (a few small ones here): both replicas hold part of the state
        assert 0 < per_stage[stage] and 0 < per_stage[stage + 2]

    four_ckpt = run / "ckpt" / "epoch=0-step=2.ckpt"
    resumed_here = concatenated_run(cfg, steps=4, ckpt_path=str(four_ckpt))
    assert max_difference(resumed_here, reference) < 1e-5

    back = tmp_path / "back"
    back.mkdir()
    resumed_there = run_ok(dict(cfg, stages=1, steps=4, shard_optimizer=True, resume_from=str(one_ckpt)), back)
    assert max_difference(resumed_there, reference) < 1e-5

    single = consolidate(str(four_ckpt), str(tmp_path / "one-file.ckpt"))
    tensors = single["async_pipeline"]["tensors"]
    for name, p in reference.items():
        for key in ("exp_avg", "exp_avg_sq", "prev_update"):
            assert tensors[f"optim.0/{name}/{key}"].shape == p.shape, (name, key)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_weight_prediction_on_two_stages_by_two_sharded_replicas_equals_one_device_and_resumes_there(tmp_path):
    """WeightPrediction(AdamW): 2 stages x 2 replicas with ZeRO-1 (2BW's lookahead runs batch k+1's forwards on
    its prediction before update k) equal one device and the rule written out; the step-2 checkpoint (the predicted
    versions, the newest one's included) resumes on one device to the same weights."""
    from test_optim_weight_prediction import SCALE, written_out

    cfg = dict(schedule="2bw", stages=2, dp=2, microbatches=2, batch=4, samples=16, optimizer="adamw_wp")
    reference = concatenated_run(cfg, steps=4)
    run = tmp_path / "run"
    run.mkdir()
    multi = run_ok(dict(cfg, steps=4, shard_optimizer=True, save_every=2, checkpoint_dir=str(run / "ckpt"),
                        keep_checkpoints=True), run)
    assert max_difference(multi, reference) < 1e-5
    batches = list(DataLoader(Subset(make_dataset(16), [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]),
                              batch_size=8)) * 2
    model = TinyLM(optimizer="adamw_wp")
    scales = [SCALE] * len(list(model.parameters()))
    by_hand = written_out(model, batches, 4, 1, scales)
    assert max((multi[n] - p).abs().max().item() for n, p in zip(dict(model.named_parameters()), by_hand)) < 1e-5
    assert max_difference(multi, delayed_loop(TinyLM(optimizer="adamw"), batches[:4], delay=1)) > 1e-5  # stashing
    resumed_here = concatenated_run(cfg, steps=4, ckpt_path=str(run / "ckpt" / "epoch=0-step=2.ckpt"))
    assert max_difference(resumed_here, reference) < 1e-5


# ---- parameters that some replica did not use (MoE experts, data-dependent branches) ---------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_parameter_one_replica_did_not_use_takes_the_mean_gradient_on_every_replica(tmp_path):
    """An expert that only one replica's rows use: 2 replicas (sharded and not, either replica the user, one bucket
    and one bucket per parameter) train it as one device on both replicas' rows, replicas equal; an expert that no
    row uses gets no gradient anywhere, so AdamW's weight decay leaves it as initialized (as on one device)."""
    cases = [dict(user=0), dict(user=1, bucket_bytes=64), dict(user=0, shard_optimizer=True, bucket_bytes=64),
             dict(user=1, shard_optimizer=True)]
    cfg = dict(devices=2, dp=2, steps=4, batch=4, microbatches=2, cases=cases)
    ranks = script_ranks(Path(__file__).parent / "scripts" / "branch_fit.py", cfg, tmp_path)
    one_device = {user: run_here_on_one_device(branch_run, dict(cfg, cases=[dict(user=user)]))["cases"][0]
                  for user in (0, 1)}
    L.seed_everything(0, verbose=False)
    initial = {k: v.detach().clone() for k, v in BranchMLP().state_dict().items()}
    for i, case in enumerate(cases):
        replicas = [r["cases"][i] for r in ranks]
        reference = one_device[case["user"]]
        assert max_difference(replicas[0], replicas[1]) == 0.0, case
        assert max_difference(replicas[0], reference) < 1e-6, case
        expert = "layers.0.expert.weight"
        assert (reference[expert] - initial[expert]).abs().max() > 1e-3, case  # the expert did train
        for name in ("layers.0.idle.weight", "layers.0.idle.bias"):
            assert torch.equal(replicas[0][name], initial[name]) and torch.equal(reference[name], initial[name]), case


# ---- rebuilding an optimizer over one replica's share --------------------------------------------------------------
def test_rebuilt_optimizers_step_like_the_originals_on_their_share_including_empty_groups():
    torch.manual_seed(0)
    w, v, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    for p in (w, v, b):
        p.grad = torch.randn_like(p)
    templates = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.2, betas=(0.8, 0.9)),
        "muon_ef": lambda ps: ErrorFeedback(ps, optimizer=lambda q: Muon(q, lr=0.05), coefficient=0.5),
    }
    for name, make in templates.items():
        originals = [nn.Parameter(p.detach().clone()) for p in (w, v, b)]
        copies = [nn.Parameter(p.detach().clone()) for p in (w, v, b)]
        for o, c, p in zip(originals, copies, (w, v, b)):
            o.grad, c.grad = p.grad.clone(), p.grad.clone()
        template = make([{"params": originals[:2]}, {"params": originals[2:], "weight_decay": 0.0}])
        groups = [{**g, "params": []} for g in template.param_groups]  # this share: v, and b's group left empty
        index = {id(p): i for i, p in enumerate(originals)}
        for g, share in zip(groups, template.param_groups):
            g["params"] = [copies[index[id(p)]] for p in share["params"] if p is originals[1]]
        local = rebuild(template, groups)
        assert len(local.param_groups) == len(template.param_groups), name
        for _ in range(2):
            template.step()
            local.step()
        assert torch.equal(copies[1], originals[1]), name  # the owned parameter moves exactly as in the original
        assert torch.equal(copies[0], w.detach()) and torch.equal(copies[2], b.detach()), name  # others untouched


# ---- the bucketed reduction in one process (a one-rank group: the mechanics, not the arithmetic) ----------------------
@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gradients_accumulate_in_the_buckets_and_reduce_in_order_from_the_last_backward(one_rank_group, monkeypatch):
    monkeypatch.setattr(GradientReducer, "BUCKET_BYTES", 3 * 3 * 4)  # one 3x3 weight per bucket
    layers = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    unused = nn.Parameter(torch.ones(2))
    params = [unused, *layers.parameters()]
    reducer = GradientReducer(params, one_rank_group, size=2)
    assert [b.indices for b in reducer.buckets] == [[3], [2], [1], [0]]  # reverse order: last layers first
    leaves = [p.detach().clone().requires_grad_() for p in params]
    reducer.attach(leaves)
    launched_during_backward = []
    x = torch.randn(5, 3)

    def loss(xs, watch=False):
        h = xs @ leaves[1].T
        if watch:  # runs once layer 0's output gradient exists: after the later layers' weight gradients
            h.register_hook(lambda g: launched_during_backward.append([b.work is not None for b in reducer.buckets]))
        for weight in leaves[2:]:
            h = h @ weight.T
        return h.square().sum()

    loss(x[:2]).backward()  # microbatch 0 of 2: nothing is final yet
    assert not reducer.pending
    reducer.arm()
    loss(x[2:], watch=True).backward()
    # layers 2 and 1 were reduced while layer 0's backward had still to run; the unused parameter waits for the end
    assert launched_during_backward == [[True, True, False, False]]
    assert reducer.buckets[2].work is not None and reducer.buckets[3].work is None
    reducer.launch_rest()
    reference = [p.detach().clone().requires_grad_() for p in params[1:]]
    h = x
    for weight in reference:
        h = h @ weight.T
    expected = torch.autograd.grad(h.square().sum(), reference)
    gradients = reducer.finish([leaf.grad for leaf in leaves])
    for g, e in zip(gradients[1:], expected):
        torch.testing.assert_close(g, e / 2, rtol=1e-6, atol=1e-6)  # the mean over "2 replicas" of one
    assert gradients[0] is None  # no replica used it in the whole step: no gradient, as without data parallelism
    for leaf, bucket in zip(leaves[1:], reversed(reducer.buckets[:3])):
        assert leaf.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()  # in place


def test_a_bucket_ready_before_the_ones_ahead_of_it_waits_for_them(one_rank_group, monkeypatch):
    """Collectives pair up by their order on each rank, and a leaf that one replica's data did not use makes its
    bucket ready later there: buckets are launched in their fixed order only, on every replica."""
    monkeypatch.setattr(GradientReducer, "BUCKET_BYTES", 3 * 4)
    skipped, used = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    reducer = GradientReducer([used, skipped], one_rank_group, size=2)
    assert [b.indices for b in reducer.buckets] == [[1], [0]]
    leaves = [p.detach().clone().requires_grad_() for p in (used, skipped)]
    reducer.attach(leaves)
    reducer.arm()
    (leaves[0] * 2).sum().backward()  # the second bucket is ready, the first (the skipped leaf) is not
    assert [b.work is not None for b in reducer.buckets] == [False, False]
    reducer.launch_rest()
    assert [b.work is not None for b in reducer.buckets] == [True, True]
    gradients = reducer.finish([leaf.grad for leaf in leaves])
    torch.testing.assert_close(gradients[0], torch.ones(3))  # 2 / "2 replicas"
    assert gradients[1] is None


def test_a_parameter_unfrozen_after_the_buckets_were_made_is_reduced_from_its_next_step_on(one_rank_group):
    """Lightning's BaseFinetuning freezes a layer in setup and unfreezes it at an epoch start: the buckets follow
    requires_grad at the next step (the frozen layer had none, and with it no gradient at all), and freezing again
    drops it."""
    frozen, trained = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    frozen.requires_grad_(False)
    reducer = GradientReducer([frozen, trained], one_rank_group, size=2)
    assert [b.indices for b in reducer.buckets] == [[1]]

    def step(requires_grad: list[bool]) -> list:
        leaves = [p.detach().clone().requires_grad_(r) for p, r in zip((frozen, trained), requires_grad)]
        reducer.attach(leaves)
        reducer.arm()
        sum((leaf * (i + 2)).sum() for i, leaf in enumerate(leaves)).backward()
        reducer.launch_rest()
        return reducer.finish([leaf.grad for leaf in leaves])

    assert step([False, True])[0] is None
    unfrozen = step([True, True])  # the epoch start unfroze it
    torch.testing.assert_close(unfrozen[0], torch.full((3,), 1.0))  # 2 / "2 replicas"
    torch.testing.assert_close(unfrozen[1], torch.full((3,), 1.5))
    assert step([False, True])[0] is None  # frozen again: out of the buckets, no gradient


# ---- the planner's model of the reduction ---------------------------------------------------------------------------
def test_planner_reduction_after_the_step_overlapped_from_the_last_backward_and_deferred_worked_by_hand():
    """p=2, m=4, forward 1, backward 2, the stage's reduction 3 s in 4 buckets. After the step: all 3 s exposed.
    Overlapped: buckets are ready 0.5, 1, 1.5, 2 s into the last backward and take 0.75 s each, one after another,
    so the last ends 3.5 s after that backward starts: 1.5 s after it ends. Deferred (2bw): batch k+1's first
    actions hide it all, and the step is the one without data parallelism."""
    from lightning_async_pp.pipeline.simulate import simulate

    plain = {s: simulate(s, 2, 4, 1.0, 2.0).step_time_s for s in ("2bw", "1f1b", "gpipe")}
    for schedule in ("2bw", "1f1b", "gpipe"):
        after = simulate(schedule, 2, 4, 1.0, 2.0, dp_reduce_s=3.0, dp_overlap="none", dp_buckets=4)
        overlapped = simulate(schedule, 2, 4, 1.0, 2.0, dp_reduce_s=3.0, dp_overlap="backward", dp_buckets=4)
        assert after.dp_exposed_s == pytest.approx([3.0, 3.0])
        assert overlapped.dp_exposed_s == pytest.approx([1.5, 1.5])
        assert after.step_time_s == pytest.approx(plain[schedule] + 3.0)
        assert overlapped.step_time_s == pytest.approx(plain[schedule] + 1.5)
        for stage in range(2):  # every bucket starts within or after the step's last backward of its own batch
            for span in overlapped.dp_spans[stage]:
                last_backward = max(x.start for x in overlapped.step_spans(stage, span.step)
                                    if x.op == "backward" and x.batch == span.step)
                assert span.start >= last_backward + 0.5 - 1e-9
    deferred = simulate("2bw", 2, 4, 1.0, 2.0, dp_reduce_s=3.0, dp_overlap="deferred", dp_buckets=4)
    assert deferred.dp_exposed_s == pytest.approx([0.0, 0.0])
    assert deferred.step_time_s == pytest.approx(plain["2bw"])
    # a synchronous schedule has no slack to defer into: the next batch reads the update
    sync = simulate("1f1b", 2, 4, 1.0, 2.0, dp_reduce_s=3.0, dp_overlap="deferred", dp_buckets=4)
    assert sync.step_time_s == pytest.approx(plain["1f1b"] + 1.5)
    with pytest.raises(ValueError, match="dp_overlap must be one of 'none', 'backward', 'deferred', got 'later'"):
        simulate("2bw", 2, 4, 1.0, 2.0, dp_reduce_s=3.0, dp_overlap="later")


def test_plan_prints_the_reduction_table_with_each_stage_s_gradient_bytes(capsys):
    from lightning_async_pp.plan import main

    # A small vocabulary keeps the head's FLOPs small, so the 32 blocks split 8 per stage.
    main(["--model", "smollm-360m", "--vocab", "960", "--stages", "4", "--microbatches", "8", "--data-parallel", "8",
          "--dp-gbps", "25"])
    out = capsys.readouterr().out
    assert "## Data parallel: 8 replicas per stage" in out
    row = next(line for line in out.splitlines() if line.startswith("| 4 | 8 |") and "GiB" in line)
    h, kv, inter = 960, 960 * 5 // 15, 2560
    block = (2 * h * h + 2 * h * kv + h) + (3 * h * inter + h)  # attention + norm, MLP + norm
    last = 8 * block + 960 * h + h  # the last stage also holds the tied embedding/head and the final norm
    assert f"| {last * 4 / 2**30:.2f} GiB |" in row
    expected_ms = (2 * 7 / 8 * last * 4 / 25e9 + 14 * 5e-6) * 1e3  # ring all-reduce over 8, fp32 gradients
    assert f"| {expected_ms:.3g} ms |" in row


def test_bad_shard_optimizer_values_and_unrebuildable_optimizers_are_clear_errors():
    with pytest.raises(ValueError, match=r"shard_optimizer must be True .* or False, got 'yes'"):
        AsyncPipelineStrategy("2bw", num_microbatches=4, shard_optimizer="yes")

    class Needs(torch.optim.SGD):
        def __init__(self, params, secret):  # a required argument that defaults do not name
            super().__init__(params, lr=0.1)

    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match=r"shard_optimizer=True builds each replica's optimizer again .* Needs"):
        rebuild(Needs([p], secret=1), [{"params": [p], "lr": 0.1}])
