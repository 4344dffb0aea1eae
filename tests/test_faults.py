"""Runs that are killed or requeued resume to the uninterrupted result (docs/design/checkpoints.md, "Faults").

- A save interrupted at any point leaves the newest complete checkpoint where ``ckpt_path="last"`` finds it, and
  nothing partial is ever loaded (the crash states are made on disk, then resumed).
- A stage killed with SIGKILL under ``torchrun --max-restarts 1`` takes the job down and the restarted job resumes
  from ``ckpt_path="last"`` to the uninterrupted weights.

Every resumed run is compared with the uninterrupted one-device run (which 2 processes equal, tests/test_scale.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from faults_fit import run  # noqa: E402

from lightning_async_pp import checkpoint as ckpt  # noqa: E402
from lightning_async_pp.checkpoint import writing  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "faults_fit.py"
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One device, 4 steps, a sharded checkpoint every 2 steps: last.ckpt and epoch=0-step={2,4}.ckpt."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    run(dict(steps=4, checkpoint_dir=str(folder), save_top_k=-1))
    return folder


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    return run(dict(steps=5))[0]["state_dict"]


def resume_last(folder: Path, steps: int = 5) -> dict:
    return run(dict(steps=steps, checkpoint_dir=str(folder), save_top_k=-1, resume="last"))[0]


# ---- a kill at each point of a save ----------------------------------------------------------------------------
def test_a_partial_write_is_never_where_a_resume_looks_and_last_resumes_the_previous_checkpoint(saved, uninterrupted, tmp_path):
    # Killed mid-write of the next last.ckpt: shards in the partial folder, no DCP metadata, no meta.pt.
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    partial = Path(ckpt.partial_path(str(folder / "last.ckpt")))
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    result = resume_last(folder)
    assert result["ckpt_path"] == str(folder / "last.ckpt")
    assert max_difference(result["state_dict"], uninterrupted) <= 1e-6
    # The partial folder is out of Lightning's listings: not a last*.ckpt, and no hpc_ckpt_ in its name.
    assert not any(p.name.startswith("last") for p in folder.iterdir() if p.suffix != ".ckpt")
    assert ckpt.PARTIAL_DIR in os.listdir(folder) and "hpc_ckpt_" not in ckpt.PARTIAL_DIR


def test_replacing_a_sharded_checkpoint_swaps_atomically_so_the_target_always_holds_a_complete_one(
        saved, tmp_path, monkeypatch):
    target, newer = tmp_path / "last.ckpt", tmp_path / "newer"
    shutil.copytree(saved / "epoch=0-step=2.ckpt", target)
    shutil.copytree(saved / "epoch=0-step=4.ckpt", newer)

    def killed(*args):  # a kill at the first rename would leave the target missing: there must be none
        raise SystemExit("killed between the renames")

    monkeypatch.setattr(os, "rename", killed)
    ckpt.put_in_place(str(newer), str(target))
    monkeypatch.undo()
    assert ckpt.read_meta(str(target))["async_pipeline"]["num_updates"] == 4
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # the previous one and the temporary are gone


def test_where_the_filesystem_cannot_swap_a_kill_between_the_renames_loads_the_previous_checkpoint(
        saved, uninterrupted, tmp_path, monkeypatch):
    # Between the two renames: the previous checkpoint at last.ckpt.old, the target missing.
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    (folder / "last.ckpt").rename(folder / "last.ckpt.old")
    assert ckpt.resolve(str(folder / "last.ckpt")) == str(folder / "last.ckpt.old")
    result = run(dict(steps=5, checkpoint_dir=str(folder), save_top_k=-1, resume=str(folder / "last.ckpt")))[0]
    assert max_difference(result["state_dict"], uninterrupted) <= 1e-6
    # That save put the new last.ckpt in place (two renames here) and removed the .old.
    monkeypatch.setattr(writing, "_exchange", lambda a, b: False)  # where put_in_place looks it up
    newer = tmp_path / "newer"
    shutil.copytree(folder / "last.ckpt", newer)
    ckpt.put_in_place(str(newer), str(folder / "last.ckpt"))
    assert not (folder / "last.ckpt.old").exists() and (folder / "last.ckpt").is_dir()


def test_after_the_swap_a_leftover_previous_checkpoint_is_not_what_last_resumes(saved, uninterrupted, tmp_path):
    # Killed after the new checkpoint went in place, before the previous one was removed (either way of swapping).
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    (folder / "last.ckpt.old").mkdir()
    (folder / "last.ckpt.old" / "__0_0.distcp").write_bytes(b"stale")
    partial = Path(ckpt.partial_path(str(folder / "last.ckpt")))
    shutil.copytree(saved / "epoch=0-step=2.ckpt", partial)  # the previous one, swapped out
    result = resume_last(folder)
    assert result["ckpt_path"] == str(folder / "last.ckpt")
    assert max_difference(result["state_dict"], uninterrupted) <= 1e-6


def test_last_as_a_link_to_a_sharded_checkpoint_directory_resumes_to_the_uninterrupted_weights(uninterrupted, tmp_path):
    folder = tmp_path / "ckpt"
    run(dict(steps=4, checkpoint_dir=str(folder), save_last="link"))
    assert os.path.islink(folder / "last.ckpt") and (folder / "last.ckpt").resolve() == folder / "epoch=0-step=4.ckpt"
    result = run(dict(steps=5, checkpoint_dir=str(folder), save_last="link", resume="last"))[0]
    assert result["ckpt_path"] == str(folder / "last.ckpt")
    assert max_difference(result["state_dict"], uninterrupted) <= 1e-6


# ---- a damaged checkpoint is refused, naming the file, what is wrong and the way out ----------------------------------
class NotAWeight:
    """An object torch.load(weights_only=True) does not build."""


def test_the_reason_a_checkpoint_is_unreadable_arrives_whole_however_long():
    # A pickle naming a class of a long module path: the reason (and its way out) used to be cut at 200 characters
    module, name = "a" * 150, "B" * 150
    with pytest.raises(ValueError) as caught:
        ckpt.read_settings(f"c{module}\n{name}\n.".encode(), "optimizer")
    assert str(caught.value).endswith(f"name {module}.{name}, which is not loaded from a checkpoint")


def damaged_copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the sharded ``last.ckpt`` with its first shard cut in half; returns the copy and that shard."""
    copy = tmp_path / "cut.ckpt"
    shutil.copytree(saved / "last.ckpt", copy)
    shard = sorted(copy.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return copy, shard


def refusal(call, *args) -> str:
    """The message of the error that ``call(*args)`` raises (consolidate's command line: argparse's exit)."""
    with pytest.raises((Exception, SystemExit)) as caught:
        call(*args)
    return str(caught.value)


def test_a_shard_cut_short_is_refused_naming_the_shard_by_resume_consolidation_and_export(saved, tmp_path, capsys):
    from lightning_async_pp import export
    from lightning_async_pp.consolidate import main as consolidate

    copy, shard = damaged_copy(saved, tmp_path)
    resume = lambda: run(dict(steps=5, resume=str(copy)))  # noqa: E731
    for message in (refusal(resume), refusal(export.read_checkpoint, copy)):
        assert str(shard) in message and "cut short" in message and "another checkpoint" in message, message
    refusal(consolidate, [str(copy), str(tmp_path / "one.ckpt")])  # argparse's error: exit code 2, message on stderr
    assert str(shard) in capsys.readouterr().err and not (tmp_path / "one.ckpt").exists()
    shard.unlink()
    assert "the shard is missing" in refusal(export.read_checkpoint, copy)
    (copy / ".metadata").unlink()
    assert f"{str(copy)!r}: the directory has no .metadata" in refusal(export.read_checkpoint, copy)


def test_a_file_cut_short_or_not_a_checkpoint_is_refused_naming_it_and_never_advising_weights_only_false(
        saved, tmp_path):
    from lightning_async_pp import export

    whole = tmp_path / "one.ckpt"
    ckpt.consolidate(str(saved / "last.ckpt"), str(whole))
    cut, garbage, odd = tmp_path / "cut.ckpt", tmp_path / "notes.ckpt", tmp_path / "odd.ckpt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    garbage.write_text("not a checkpoint\n" * 20)
    torch.save({**torch.load(whole, weights_only=True), "extra": NotAWeight()}, odd)
    for path in (cut, garbage):
        for message in (refusal(lambda: run(dict(steps=5, resume=str(path)))), refusal(export.read_checkpoint, path)):
            assert f"{str(path)!r}: it is not a torch.save archive" in message and "cut short" in message, message
            assert "weights_only=False" not in message
    message = refusal(lambda: run(dict(steps=5, resume=str(odd))))
    assert str(odd) in message and "NotAWeight" in message and "add_safe_globals" in message, message
    assert "weights_only=False" not in message


def flip_a_bit(file: Path, inside: torch.Tensor | None = None) -> None:
    """One bit flipped in ``file`` (its size and structure unchanged, as disk or copy damage leaves it): in the middle
    of the bytes of the tensor ``inside``, where nothing else notices it, else in the middle of the file."""
    data = bytearray(file.read_bytes())
    at = len(data) // 2
    if inside is not None:
        raw = inside.contiguous().numpy().tobytes()
        at = data.find(raw) + len(raw) // 2
        assert at >= len(raw) // 2, f"the tensor's bytes are not in {file}"
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


def largest_weight(saved: Path) -> torch.Tensor:
    source = ckpt.ShardedSource(str(saved / "last.ckpt"))
    state = source.read([k for k in source.shapes if k.startswith(ckpt.MODEL)])
    return max(state.values(), key=torch.Tensor.numel)


def test_a_flipped_bit_in_any_file_of_a_sharded_checkpoint_is_refused_naming_it_by_resume_consolidation_and_export(
        saved, tmp_path, capsys):
    from lightning_async_pp import export
    from lightning_async_pp.consolidate import main as consolidate

    listed = ckpt.read_checksums(str(saved / "last.ckpt"))
    assert listed is not None and sorted(listed) == sorted(p.name for p in (saved / "last.ckpt").iterdir()
                                                          if p.name != ckpt.CHECKSUMS_FILE)
    for name in sorted(listed):
        copy = tmp_path / name.strip("._") / "last.ckpt"
        shutil.copytree(saved / "last.ckpt", copy)
        flip_a_bit(copy / name, largest_weight(saved) if name.endswith(".distcp") else None)
        calls = [lambda: export.read_checkpoint(copy)]
        if name.endswith(".distcp"):  # a training run once: the tensors, which loaded silently before
            calls.append(lambda: run(dict(steps=5, resume=str(copy))))
        for call in calls:
            message = refusal(call)
            assert f"{str(copy / name)!r}: its CRC-32 is" in message and "damaged" in message, (name, message)
            assert "another checkpoint" in message
        refusal(consolidate, [str(copy), str(tmp_path / "one.ckpt")])
        assert str(copy / name) in capsys.readouterr().err and not (tmp_path / "one.ckpt").exists()
    # The list itself damaged: named as such, not blamed on a file it lists.
    copy = tmp_path / "list" / "last.ckpt"
    shutil.copytree(saved / "last.ckpt", copy)
    text = (copy / ckpt.CHECKSUMS_FILE).read_text()
    (copy / ckpt.CHECKSUMS_FILE).write_text(text.replace(listed[ckpt.META_FILE], f"{int(listed[ckpt.META_FILE], 16) ^ 1:08x}"))
    message = refusal(export.read_checkpoint, copy)
    assert f"{str(copy / ckpt.CHECKSUMS_FILE)!r}: its list of the files' checksums fails its own checksum" in message


def one_file_per_tensor(saved: Path, copy: Path) -> dict[str, str]:
    """``saved`` written again at ``copy`` with each value in its own shard file (DCP's ``single_file_per_rank=False``),
    checksums recorded, as a save across processes leaves files that only one stage reads; returns key -> file."""
    source = ckpt.ShardedSource(str(saved))
    flat = source.read(source.shapes)
    copy.mkdir(parents=True)
    shutil.copy(saved / ckpt.META_FILE, copy / ckpt.META_FILE)
    dcp.save(flat, storage_writer=ckpt.ChecksummedWriter(str(copy), single_file_per_rank=False), no_dist=True)
    return {index.fqn: info.relative_path
            for index, info in dcp.FileSystemReader(str(copy)).read_metadata().storage_data.items()}


@pytest.mark.multiprocess
@pytest.mark.traffic_unchecked("the resume is refused on purpose: no run ends cleanly")
def test_a_flipped_bit_in_a_file_only_the_last_stage_reads_is_refused_on_every_process_naming_it(saved, tmp_path):
    from pipeline_runs import run_script

    copy = tmp_path / "last.ckpt"
    files = one_file_per_tensor(saved / "last.ckpt", copy)
    head = files[ckpt.MODEL + "layers.3.1.weight"]  # the last layer: stage 1's of 2, read by rank 1 alone
    flip_a_bit(copy / head)
    # A refusal on rank 1 alone, before the collective load, left rank 0 waiting in it (30 min under NCCL); the
    # process group's timeout is made longer than the run's bound so that it cannot be what ends rank 0 either.
    proc = run_script(SCRIPT, dict(steps=5, devices=2, resume=str(copy), pipeline_timeout=300.0), tmp_path, timeout=180)
    ranks = proc.stderr.split("---- rank ")[1:]
    assert proc.returncode != 0 and len(ranks) == 2, proc.stderr[-5000:]
    for text in ranks:
        assert f"{str(copy / head)!r}: its CRC-32 is" in text and "another checkpoint" in text, text[-3000:]


def test_a_flipped_bit_in_a_single_file_checkpoint_is_refused_naming_it_by_resume_and_export(saved, tmp_path):
    from lightning_async_pp import export

    whole = tmp_path / "one.ckpt"
    ckpt.consolidate(str(saved / "last.ckpt"), str(whole))
    flip_a_bit(whole, largest_weight(saved))
    for message in (refusal(lambda: run(dict(steps=5, resume=str(whole)))), refusal(export.read_checkpoint, whole)):
        assert f"{str(whole)!r}: it fails the checks of its zip records" in message and "CRC" in message, message
        assert "damaged" in message and "another checkpoint" in message


def test_a_checkpoint_saved_before_checksums_still_resumes_to_the_uninterrupted_weights_with_a_warning(
        saved, uninterrupted, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    for listing in folder.glob(f"*/{ckpt.CHECKSUMS_FILE}"):
        listing.unlink()
    with pytest.warns(UserWarning, match=f"has no {ckpt.CHECKSUMS_FILE} .*read without checking"):
        result = resume_last(folder)
    assert max_difference(result["state_dict"], uninterrupted) <= 1e-6


class RunsCode:
    """Unpickling it runs code: it appends to the file ``path`` (what a checkpoint crafted by someone else could do)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'a').write('ran')",))


def test_no_part_of_a_checkpoint_runs_code_it_names_on_resume_consolidation_or_export(saved, tmp_path):
    """A sharded checkpoint whose meta.pt, a pickled optimizer setting, or a non-tensor value in its shards names a
    function to call is refused, naming the checkpoint and the function, and nothing runs (torch.distributed.checkpoint
    reads non-tensor values with weights_only=False by default; the settings were a plain pickle)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from lightning_async_pp import export

    ran = tmp_path / "ran"
    source = ckpt.ShardedSource(str(saved / "last.ckpt"))
    flat = source.read(source.shapes)
    group = next(k for k in flat if k.endswith("/" + ckpt.GROUP))
    crafted = {}
    for name, change in [("group", {group: pickle.dumps(RunsCode(ran))}), ("value", {group: RunsCode(ran)})]:
        crafted[name] = tmp_path / f"{name}.ckpt"
        dcp.save({**flat, **change}, storage_writer=dcp.FileSystemWriter(str(crafted[name])), no_dist=True)
        shutil.copy(saved / "last.ckpt" / ckpt.META_FILE, crafted[name] / ckpt.META_FILE)
    crafted["meta"] = tmp_path / "meta.ckpt"
    shutil.copytree(saved / "last.ckpt", crafted["meta"])
    # A crafted checkpoint carries no checksums, or ones that match it: the refusal must not rely on them.
    (crafted["meta"] / ckpt.CHECKSUMS_FILE).unlink()
    meta = torch.load(crafted["meta"] / ckpt.META_FILE, weights_only=True)
    torch.save({**meta, "extra": RunsCode(ran)}, crafted["meta"] / ckpt.META_FILE)
    for name, path in crafted.items():
        calls = [lambda: run(dict(steps=5, resume=str(path)))]
        if name != "group":  # consolidation copies the settings' bytes without reading them
            calls.append(lambda: ckpt.consolidate(str(path), str(tmp_path / "one.ckpt")))
        if name == "meta":  # export reads the weights and meta.pt only
            calls.append(lambda: export.read_checkpoint(path))
        for call in calls:
            message = refusal(call)
            assert "exec" in message and (str(path) in message or group in message), (name, message)
            assert "weights_only=False" not in message
            assert not ran.exists(), name
    # Written now: the settings as torch.save's format, which weights_only loading reads back.
    settings = {"lr": torch.tensor(0.01), "betas": (0.9, 0.999), "param_names": ["a.weight"], "foreach": None}
    assert ckpt.read_settings(ckpt.settings_bytes(settings), group) == settings


# ---- a stage killed under torchrun ---------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stage_killed_mid_training_under_torchrun_restarts_from_last_to_the_uninterrupted_weights(tmp_path):
    # torchrun tears the surviving stage down as soon as it sees its peer die; pipeline_timeout (also the process
    # group's connect timeout) is only the bound if it did not, and must let a late restarted process connect.
    steps = 8
    cfg = dict(steps=steps, devices=2, checkpoint_dir=str(tmp_path / "ckpt"), save_every=2, resume="last",
               kill={"rank": 1, "step": 5}, pipeline_timeout=60.0,
               strategy_kwargs={"async_checkpoint": True})  # the saves across processes go through async_save
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.5", str(SCRIPT), "--config", json.dumps(cfg), "--out", str(out)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = torch.load(out / "rank0.pt", weights_only=False)
    assert result["restart_count"] == 1  # a worker failed (only the kill does), and the weights are the restart's
    assert result["ckpt_path"] == str(tmp_path / "ckpt" / "last.ckpt") and result["global_step"] == steps
    expected = run(dict(steps=steps))[0]["state_dict"]
    assert max_difference(result["state_dict"], expected) <= 1e-5


def test_under_torchrun_each_restart_attempt_has_its_own_store_keys(monkeypatch):
    """torchrun's agent keeps its store (and its keys) across restarts; a restarted rank reading the killed rank's
    gloo address from the previous attempt failed to connect. Each attempt's process group gets its own keys."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_async_pp.pipeline.comm import elastic_attempt_store

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))  # the agent's store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert elastic_attempt_store(timedelta(seconds=10)) is None  # not under torchrun: Lightning's own rendezvous
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic_attempt_store(timedelta(seconds=10)).set("rank_1_address", "the killed process")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = elastic_attempt_store(timedelta(seconds=10))
    assert not restarted.check(["rank_1_address"])  # the stale address is not read by the restarted attempt
    restarted.set("rank_1_address", "the restarted process")
    assert restarted.get("rank_1_address") == b"the restarted process"


# ---- SLURM requeue ------------------------------------------------------------------------------------------------
def slurm_tasks(cfg: dict, tmp_path: Path, restart: int, tasks: int = 2) -> list[subprocess.CompletedProcess]:
    """The job's tasks as srun starts them (SLURM's variables), with a fake ``scontrol`` on PATH that records its
    arguments in ``tmp_path/scontrol.log``."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
        (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / f"out{restart}"
    procs = []
    for rank in range(tasks):
        env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NAME="fit",
                        SLURM_NTASKS=str(tasks), SLURM_NTASKS_PER_NODE=str(tasks), SLURM_NNODES="1",
                        SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                        SLURM_NODELIST="127.0.0.1", SLURM_RESTART_COUNT=str(restart), MASTER_PORT=str(29600 + restart))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--config", json.dumps(cfg), "--out", str(out)],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    for p in done:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-5000:]
    return [torch.load(out / "rank0.pt", weights_only=False)]


def test_stages_asked_at_different_steps_agree_on_one_step_through_the_store_without_a_collective():
    from torch.distributed import HashStore

    from lightning_async_pp.pipeline.comm import StepAgreement

    store = HashStore()
    first, second = StepAgreement(store, margin=3), StepAgreement(store, margin=3)
    first.request()  # the signal reached the first stage during step 2
    assert [first.due(3), second.due(3)] == [False, False]  # the first stage writes step 3 + 3
    second.request()  # ... and the second one a step later: the step is already set
    assert [second.due(4), first.due(4), second.due(5), first.due(5)] == [False] * 4
    assert [first.due(6), second.due(6)] == [True, True]
    first.clear(coordinator=True)
    second.clear(coordinator=False)
    assert not StepAgreement(store, margin=3).due(7)  # the next request starts afresh
    late = StepAgreement(store, margin=3)
    late.request()
    late.due(8)
    with pytest.raises(RuntimeError, match="agreed step 11 was passed"):
        StepAgreement(store, margin=3).due(12)
    alone = StepAgreement(None, margin=3)  # one process: due at the next boundary
    alone.request()
    assert alone.due(5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_slurm_requeue_signal_saves_at_one_step_on_every_stage_requeues_and_resumes_to_the_uninterrupted_weights(tmp_path):
    steps, root = 10, tmp_path / "root"
    # The signal reaches the two stages at different steps (2 and 3); they agree on one step to save at.
    first = slurm_tasks(dict(steps=steps, devices=2, slurm=True, root_dir=str(root), usr1={0: 2, 1: 3}), tmp_path, 0)[0]
    hpc = root / "hpc_ckpt_1.ckpt"
    saved_at = ckpt.read_meta(str(hpc))["async_pipeline"]["num_updates"]
    assert saved_at == 2 + 1 + 3  # requested at the boundary after the signal, 3 steps ahead (StepAgreement)
    assert first["global_step"] == saved_at + 1  # the step started at the save runs, then training stops
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    # The requeued job: Lightning finds the hpc checkpoint and resumes from it.
    second = slurm_tasks(dict(steps=steps, devices=2, slurm=True, root_dir=str(root)), tmp_path, 1)[0]
    assert second["ckpt_path"] == str(hpc) and second["global_step"] == steps
    expected = run(dict(steps=steps))[0]["state_dict"]
    assert max_difference(second["state_dict"], expected) <= 1e-5
