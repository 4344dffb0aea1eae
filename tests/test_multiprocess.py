"""The real pipeline: one process per stage (gloo on CPU), compared with the one-device semantics."""
from __future__ import annotations

import json
import re
import time

import lightning as L
import pytest
import torch
from helpers import TinyLM, make_dataset
from pipeline_runs import max_difference, multiprocess_weights, one_device_weights, run_multiprocess
from torch.utils.data import DataLoader, Subset

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint import read_checksums, read_meta

pytestmark = pytest.mark.multiprocess
BASE = dict(microbatches=4, steps=6, batch=8)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "muon_ef"])
def test_2bw_two_stages_equal_the_one_device_2bw_run(tmp_path, optimizer):
    cfg = dict(BASE, schedule="2bw", stages=2, optimizer=optimizer)
    # Other runs start every rank at once (as torchrun does, forked from tests/launcher.py's server); here, once,
    # Lightning's own launcher starts rank 1 (``python train.py``).
    multi = multiprocess_weights(cfg, tmp_path, launch="lightning" if optimizer == "sgd" else "at_once")
    assert max_difference(multi, one_device_weights(cfg)) < 1e-5
    # and it is really asynchronous: the synchronous schedule ends elsewhere
    assert max_difference(multi, one_device_weights(dict(cfg, schedule="1f1b"))) > 1e-4


def test_2bw_four_stages_equal_the_one_device_2bw_run_on_the_split_rank_0_measured(tmp_path):
    """The split is balanced by measured time (layer_cost="measured"), and layer 0 sleeps only in rank 0's
    process: each process timing its own layers would choose another split, and the pipeline would not connect.
    Every process takes rank 0's times, so all put layer 0 alone on stage 0."""
    cfg = dict(BASE, schedule="2bw", stages=4, model={"depth": 5}, partition="balanced", layer_cost="measured",
               example_batch=True, slow_on_rank0=0, report_split=True)
    assert max_difference(multiprocess_weights(cfg, tmp_path), one_device_weights(cfg)) < 1e-5
    splits = [json.loads((tmp_path / f"split_{rank}.json").read_text()) for rank in range(4)]
    assert all(s == splits[0] for s in splits), splits
    assert splits[0]["method"] == "balanced" and splits[0]["cost"] == "measured" and splits[0]["counts"][0] == 1


@pytest.mark.parametrize("stages", [2, 4])
def test_sync_from_step_flushes_from_k_on_and_equals_the_one_device_run(tmp_path, stages):
    """2BW's lookahead stops before batch K (a lookahead forward of batch K would read W_{K-1}, not W_K)."""
    cfg = dict(BASE, schedule="2bw", stages=stages, optimizer="adamw", model={"depth": 5}, sync_from_step=3)
    multi = multiprocess_weights(cfg, tmp_path)
    # The one-device run with sync_from_step follows the written-out recurrence (tests/test_delay_variants.py).
    assert max_difference(multi, one_device_weights(cfg, sync_from_step=3)) < 1e-5
    assert max_difference(multi, one_device_weights(cfg)) > 1e-4  # not plain 2BW
    assert max_difference(multi, one_device_weights(cfg, sync_from_step=4)) > 1e-4  # the switch is at K, not later


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_synchronous_schedules_two_stages_equal_the_one_device_run(tmp_path, schedule):
    cfg = dict(BASE, schedule=schedule, stages=2, optimizer="adamw", check_exit=True)
    assert max_difference(multiprocess_weights(cfg, tmp_path), one_device_weights(cfg)) < 1e-5
    # The process groups are destroyed before the interpreter finalizes (gloo's worker threads aborted it then).
    assert [(tmp_path / f"exit_{r}.txt").read_text() for r in range(2)] == ["destroyed"] * 2


def test_clipping_uses_the_norm_over_all_stages(tmp_path):
    cfg = dict(BASE, schedule="2bw", stages=2, optimizer="adamw", clip=0.05)
    multi = multiprocess_weights(cfg, tmp_path)
    assert max_difference(multi, one_device_weights(cfg)) < 1e-5
    assert max_difference(multi, one_device_weights(dict(cfg, clip=None))) > 1e-4


def test_reused_receive_buffers_keep_2bw_equal_to_the_one_device_run_with_no_host_read_in_the_steady_state(tmp_path):
    """The receive-buffer pools (on by default on CUDA only) run here with gloo. The middle of three stages passes
    its input through as its output, so its activation buffer is still being sent on, and the gradient it
    receives may become its input's gradient: neither may be overwritten by the next receive.

    The same run counts the host reads of tensors inside each training step (on CUDA each waits for the device
    and stalls the host's queueing): the first step reads each layout once; later steps read nothing but the
    deferred fingerprint comparison, every ``CHECK_EVERY_ON_CUDA`` steps (here at none of them)."""
    cfg = dict(BASE, schedule="2bw", stages=3, reuse_buffers=True, model={"depth": 4, "passthrough_at": 2},
               partition=[2, 1, 2], count_host_reads=True)
    proc = run_multiprocess(cfg, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reused = [int((tmp_path / f"buffers_reused_{rank}.txt").read_text()) for rank in range(3)]
    assert reused[0] > 0 and reused[2] > 0, reused  # stage 0 reuses gradient buffers, stage 2 activation buffers
    for rank in range(3):
        steps = json.loads((tmp_path / f"host_reads_{rank}.json").read_text())
        assert [k for k, _, _ in steps] == list(range(cfg["steps"])), steps
        assert all(count == 0 for k, count, _ in steps if k > 0), (rank, steps)
        if rank > 0:  # the activation layout (its length, then its bytes), once; batch 0's fingerprint, compared
            assert 1 <= steps[0][1] <= 4, (rank, steps[0])
    one = one_device_weights(cfg)
    assert max_difference(torch.load(tmp_path / "final.pt"), one) < 1e-5


def test_reused_receive_buffers_wait_for_zb_h1s_deferred_weight_pass(tmp_path):
    """Under zb_h1 the middle stage (two blocks ending in a Linear) defers a weight pass past later receives; that
    pass reads the output gradient it received, so the buffer must not take another transfer before it."""
    cfg = dict(BASE, schedule="zb_h1", stages=3, reuse_buffers=True, model={"depth": 5}, partition=[1, 2, 2])
    proc = run_multiprocess(cfg, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reused = [int((tmp_path / f"buffers_reused_{rank}.txt").read_text()) for rank in range(3)]
    assert reused[1] > 0, reused
    assert max_difference(torch.load(tmp_path / "final.pt"), one_device_weights(cfg)) < 1e-5


def test_tuple_across_a_boundary_and_uneven_partition(tmp_path):
    # 6 layers as [2, 4]: the boundary after layer 2 carries the tuple (tanh(h), sum(h)).
    cfg = dict(BASE, schedule="2bw", stages=2, model={"depth": 5, "tuple_boundary": True}, partition=[2, 4])
    multi = multiprocess_weights(cfg, tmp_path)
    assert max_difference(multi, one_device_weights(cfg)) < 1e-5


@pytest.mark.parametrize("schedule", ["2bw", "zb_h1"])
def test_data_parallel_two_by_two_stages_equals_one_device_on_concatenated_batches(schedule, tmp_path):
    # The second replica's processes perturb their weights before the Trainer: replicas must start from the first's.
    # zb_h1: the gradient becomes final in a stage's last weight pass, where the bucketed reduction must start.
    cfg = dict(schedule=schedule, stages=2, dp=2, microbatches=2, steps=5, batch=4, samples=64, optimizer="adamw",
               perturb_replicas=True)
    proc = run_multiprocess(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert 'SAMPLER_KWARGS {"num_replicas": 2, "rank": 0}' in proc.stdout
    multi = torch.load(tmp_path / "final.pt")

    # Reference: one device, batch k = replica 0's batch k followed by replica 1's (shards are rows r::2).
    dataset = make_dataset(64)
    shards = [list(range(r, 64, 2)) for r in range(2)]
    order = [i for k in range(len(shards[0]) // 4) for shard in shards for i in shard[4 * k : 4 * k + 4]]
    model = TinyLM(optimizer="adamw")
    L.Trainer(
        strategy=AsyncPipelineStrategy(schedule, num_microbatches=4), accelerator="cpu", devices=1, max_steps=5,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(model, DataLoader(Subset(dataset, order), batch_size=8, shuffle=False, drop_last=True))
    assert max_difference(multi, model.state_dict()) < 1e-5


def test_validation_across_stages_reports_the_newest_weights_loss(tmp_path):
    cfg = dict(BASE, schedule="2bw", stages=2, val_batches=2)
    proc = run_multiprocess(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    reported = float(proc.stdout.split("VAL_LOSS")[1].split()[0])
    model = TinyLM()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))
    batches = list(DataLoader(make_dataset(64), batch_size=8))[:2]
    with torch.no_grad():
        expected = sum(model.pipeline_loss(model.pipeline_forward(b), b).item() for b in batches) / 2
    assert abs(reported - expected) < 1e-5


def test_validation_between_2bw_steps_does_not_stall_the_lookahead(tmp_path):
    # Validation runs while the next batch's forwards are in flight between stages; many steps and validations
    # must neither deadlock nor lose the in-flight microbatch (12 validation batches send more than 64 messages).
    cfg = dict(BASE, schedule="2bw", stages=2, steps=12, samples=256, val_batches=12, val_every=3, timeout=30)
    assert max_difference(multiprocess_weights(cfg, tmp_path), one_device_weights(cfg)) < 1e-5


@pytest.mark.traffic_unchecked("a stage fails on purpose: no run ends cleanly")
def test_a_stage_that_raises_stops_every_process_within_the_timeout_and_alone_prints_its_error(tmp_path):
    cfg = dict(BASE, schedule="2bw", stages=3, steps=8, timeout=30, fail_at={"stage": 1, "step": 3})
    start = time.monotonic()
    proc = run_multiprocess(cfg, tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30 + 60  # the timeout plus start-up; in practice a few seconds after the failure
    # The failing stage prints its error and traceback, once, naming itself; the traceback is the only one.
    err = proc.stderr
    assert err.count("injected failure at step 3") == 1 and err.count("Traceback (most recent call last)") == 1
    assert "lightning_async_pp: stage 1 (rank 1) failed:\nTraceback" in err
    # Every other stage says in one line that it stopped because of it, and nothing after that line: no
    # traceback of the connection the failing process closed.
    section = r"---- rank (\d) \(exit code -?\d+\) ----\n(.*?)(?=\n---- rank|\Z)"
    sections = {int(m.group(1)): m.group(2) for m in re.finditer(section, err, re.S)}
    assert sorted(sections) == [0, 1, 2], err
    for rank in (0, 2):
        line = (f"lightning_async_pp: stage {rank} (rank {rank}) stopped because stage 1 (rank 1) failed with "
                f"RuntimeError (its error is printed by that process)")
        assert sections[rank].rstrip().endswith(line) and sections[rank].count("\n[rank") == 0, sections[rank]
    assert "Connection closed by peer" not in err and "PipelineFailure" not in err


@pytest.mark.traffic_unchecked("the run is refused on purpose: no run ends cleanly")
def test_too_few_layers_for_the_stages_is_a_clear_error_before_training(tmp_path):
    cfg = dict(BASE, schedule="2bw", stages=3, model={"depth": 2})  # 2 layers, 3 stages
    proc = run_multiprocess(cfg, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "returned 2 layer(s), fewer than the 3 pipeline stages" in proc.stderr


@pytest.mark.traffic_unchecked("refused before any process starts")
def test_fewer_microbatches_than_stages_under_2bw_is_a_clear_error_before_any_process_starts():
    with pytest.raises(ValueError, match=r"num_microbatches >= the number of pipeline stages.*num_microbatches=2 for 4 stages"):
        L.Trainer(strategy=AsyncPipelineStrategy("2bw", num_microbatches=2), accelerator="cpu", devices=4)


@pytest.mark.traffic_unchecked("refused before any process starts")
def test_devices_not_divisible_by_data_parallel_size_is_a_clear_error_before_any_process_starts():
    with pytest.raises(ValueError, match=r"3 process\(es\) cannot be split into data_parallel_size=2"):
        L.Trainer(strategy=AsyncPipelineStrategy("2bw", num_microbatches=4, data_parallel_size=2), accelerator="cpu", devices=3)


@pytest.mark.traffic_unchecked("refused before any process starts")
def test_delay_variants_are_refused_across_processes():
    with pytest.raises(ValueError, match=r"delay=2 is a one-device research variant"):
        L.Trainer(strategy=AsyncPipelineStrategy("2bw", num_microbatches=4, delay=2), accelerator="cpu", devices=2)


def test_checkpoint_across_stages_resumes_to_the_uninterrupted_weights(tmp_path):
    # Save after 3 updates (mid-epoch, while 2BW has the next batch's forwards in flight), resume to 7.
    cfg = dict(BASE, schedule="2bw", stages=2, steps=7, samples=64, optimizer="adamw", resumable=True)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    uninterrupted = multiprocess_weights(cfg, tmp_path / "a")
    checkpoints = tmp_path / "checkpoints"
    proc = run_multiprocess(dict(cfg, steps=3, save_every=3, checkpoint_dir=str(checkpoints)), tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = read_meta(str(checkpoints / "last.ckpt"))["async_pipeline"]  # a sharded checkpoint (the default)
    assert (saved["num_stages"], saved["num_updates"]) == (2, 3)
    # Each process hashed the shard it wrote; the coordinator listed them with .metadata and meta.pt.
    assert sorted(read_checksums(str(checkpoints / "last.ckpt"))) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    resumed = multiprocess_weights(dict(cfg, resume_from=str(checkpoints / "last.ckpt"), model={"seed": 7}), tmp_path / "c")
    assert max_difference(resumed, uninterrupted) < 1e-6


def test_2bw_across_an_epoch_boundary_trains_every_batch_once(tmp_path):
    # 4 batches per epoch, 7 steps: the lookahead must stop at each epoch's last batch and not skip or repeat one.
    cfg = dict(BASE, schedule="2bw", stages=2, steps=7, samples=32, optimizer="adamw")
    assert max_difference(multiprocess_weights(cfg, tmp_path), one_device_weights(cfg)) < 1e-5
