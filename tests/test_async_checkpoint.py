"""``AsyncPipelineStrategy(async_checkpoint=True)``: sharded saves through ``torch.distributed.checkpoint.async_save``
write the synchronous save's files, resume exactly, and a save in flight is finished (put in place) before the next
save, at teardown and when training fails; a write that fails is never put in place (docs/design/checkpoints.md, "Checkpoints").
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from faults_fit import run  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp import checkpoint as ckpt  # noqa: E402

ASYNC = {"async_checkpoint": True}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def slow_writes(monkeypatch, seconds: float) -> None:
    """Every shard write takes ``seconds`` longer (in DCP's background thread), so a save is still in flight."""
    import time

    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return real(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)


def test_async_checkpoint_needs_sharded_checkpoints_and_says_so():
    with pytest.raises(ValueError, match="async_checkpoint=True.*save_distributed_checkpoint=False.*use "
                                         "save_distributed_checkpoint=True"):
        AsyncPipelineStrategy(async_checkpoint=True, save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="async_checkpoint must be True or False, got 'yes'"):
        AsyncPipelineStrategy(async_checkpoint="yes")


def test_a_last_link_to_a_checkpoint_still_being_written_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"async_checkpoint=True cannot be combined with ModelCheckpoint\(save_last='link'\)"):
        run(dict(steps=2, checkpoint_dir=str(tmp_path), save_last="link", strategy_kwargs=ASYNC))
    assert not any(tmp_path.rglob("*.distcp"))  # nothing was trained or saved


def test_async_saves_write_the_synchronous_files_and_resume_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    run(dict(steps=4, checkpoint_dir=str(sync_dir)))
    slow_writes(monkeypatch, 0.5)  # each save is still being written when training goes on (and changes the weights)
    _, _, trainer = run(dict(steps=4, checkpoint_dir=str(async_dir), strategy_kwargs=ASYNC))
    monkeypatch.undo()
    assert trainer.strategy._pending_save is None  # finished at teardown
    assert sorted(os.listdir(async_dir)) == sorted(os.listdir(sync_dir)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        a, b = sync_dir / name, async_dir / name
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        assert (a / "__0_0.distcp").read_bytes() == (b / "__0_0.distcp").read_bytes()
        assert dcp.FileSystemReader(str(a)).read_metadata().state_dict_metadata == \
            dcp.FileSystemReader(str(b)).read_metadata().state_dict_metadata
        # The background write lists every file's checksum too (meta.pt's, written before it, included).
        sums_a, sums_b = ckpt.read_checksums(str(a)), ckpt.read_checksums(str(b))
        assert sorted(sums_b) == sorted(f for f in os.listdir(b) if f != ckpt.CHECKSUMS_FILE)
        assert sums_a["__0_0.distcp"] == sums_b["__0_0.distcp"] == ckpt.file_crc32(b / "__0_0.distcp")
        for name in sums_b:
            ckpt.verify_file(str(b), name, sums_b)
        meta_a, meta_b = ckpt.read_meta(str(a)), ckpt.read_meta(str(b))
        assert meta_a["async_pipeline"] == meta_b["async_pipeline"] and meta_a["loops"] == meta_b["loops"]
    resumed = run(dict(steps=6, checkpoint_dir=str(async_dir), resume="last", strategy_kwargs=ASYNC))[0]
    assert max_difference(resumed["state_dict"], run(dict(steps=6))[0]["state_dict"]) <= 1e-6


def test_a_save_in_flight_when_training_fails_is_finished_and_put_in_place(tmp_path, monkeypatch):
    from faults_fit import ConfiguredMLP

    def fail_at_step_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("injected failure at step 3")
        return super(ConfiguredMLP, self).training_step(batch, batch_idx)

    monkeypatch.setattr(ConfiguredMLP, "training_step", fail_at_step_3)
    slow_writes(monkeypatch, 1.0)
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        run(dict(steps=6, checkpoint_dir=str(tmp_path), strategy_kwargs=ASYNC))
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # in place, nothing partial left
    assert ckpt.read_meta(str(tmp_path / "last.ckpt"))["async_pipeline"]["num_updates"] == 2


def test_a_background_write_that_fails_is_never_put_in_place_and_its_error_surfaces(tmp_path, monkeypatch):
    target = tmp_path / "a.ckpt"

    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
    pending = ckpt.PendingSave(str(target), {"model.w": torch.ones(3)}, {"meta": 1}, is_coordinator=True,
                               barrier=lambda: None)
    with pytest.raises(dcp.api.CheckpointException) as raised:
        pending.finish()
    assert "disk full" in "".join(map(str, raised.value.failures.values()))
    assert not target.exists()


def test_a_save_after_fit_is_in_place_when_the_call_returns_and_holds_the_final_weights(tmp_path):
    # After fit the strategy's teardown has run: nothing would finish a background write before the process exits.
    result, model, trainer = run(dict(steps=3, strategy_kwargs=ASYNC))
    target = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(target)
    assert trainer.strategy._pending_save is None
    assert sorted(os.listdir(tmp_path)) == ["after_fit.ckpt"]  # in place, nothing left under .partial/
    meta, state = ckpt.read_model_state(str(target))
    assert meta["async_pipeline"]["num_updates"] == 3
    assert max_difference(state, result["state_dict"]) == 0.0
