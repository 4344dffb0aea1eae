"""Large-model paths on tiny models: layers built in ``configure_model`` (materialized per stage), sharded and
single-file checkpoints resumed in other layouts, consolidation, crash-safe saving.

Every resumed run is compared with the uninterrupted run on one device (which the multi-process runs equal, see
tests/test_multiprocess.py), or with a delayed loop written out here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from helpers import delayed_loop  # noqa: E402
from pipeline_runs import run_script  # noqa: E402
from scale_fit import ConfiguredMLP, build_loader, run  # noqa: E402

from lightning_async_pp.consolidate import consolidate_checkpoint, main as consolidate_main  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "scale_fit.py"
TOL = 1e-6
STEPS = 8


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def multiprocess(cfg: dict, tmp_path: Path, timeout: float = 240) -> list[dict]:
    """Run scale_fit.py on ``cfg["devices"]`` processes; what each rank saved, rank 0 first."""
    out = tmp_path / "out"
    proc = run_script(SCRIPT, cfg, tmp_path, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(cfg["devices"])]


@pytest.fixture(scope="module")
def reference() -> dict:
    """Uninterrupted one-device 2bw runs (mlp: 8 steps; mlp: 3 steps; dp: batch 16), in this process."""
    full, _, _ = run(dict(steps=STEPS))
    three, _, _ = run(dict(steps=3))
    dp, _, _ = run(dict(steps=STEPS // 2, batch=16, microbatches=8))
    return {"full": full, "three": three, "dp": dp}


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> tuple[list[dict], Path]:
    """2 processes, 8 steps, a sharded checkpoint every 3 steps."""
    tmp = tmp_path_factory.mktemp("two_stages")
    cfg = dict(devices=2, steps=STEPS, checkpoint_dir=str(tmp / "ckpt"))
    return multiprocess(cfg, tmp), tmp / "ckpt" / "epoch=0-step=3.ckpt"


# ---- stage-local construction ---------------------------------------------------------------------------------
def test_layers_built_in_configure_model_exist_only_on_their_stage_with_the_one_device_weights(two_stages):
    ranks, _ = two_stages
    alone, _, _ = run(dict(steps=0))
    one_device = alone["held"]["materialized"]
    assert not alone["held"]["meta"]
    # The partition by parameter count puts layers 0-1 on stage 0 and 2-3 on stage 1 (widths 4->8->8->8->1).
    owned = {0: ("layers.0.", "layers.1."), 1: ("layers.2.", "layers.3.")}
    for r, result in enumerate(ranks):
        held = result["held"]
        # Exactly its own stage's parameters; the other stage's layers hold no tensors at all (not even meta).
        assert set(held["materialized"]) == {n for n in one_device if n.startswith(owned[r])}
        assert held["meta"] == []
        assert max_difference(held["materialized"], {n: one_device[n] for n in held["materialized"]}) == 0.0


def test_llama_with_tied_embeddings_built_per_stage_equals_the_one_device_weights_and_training(tmp_path):
    cfg = dict(model="llama", devices=2, steps=4, strategy_kwargs={"save_distributed_checkpoint": False})
    ranks = multiprocess(cfg, tmp_path)
    alone, model, _ = run(dict(model="llama", steps=4))
    setup, _, _ = run(dict(model="llama", steps=0))
    assert model.head.proj.weight is model.embed.weight
    for result in ranks:
        held = result["held"]["materialized"]
        assert max_difference(held, {n: setup["held"]["materialized"][n] for n in held}) == 0.0
    # The last stage holds the head, whose weight is its copy of the embedding: initialized as the embedding, and
    # listed first under the name it has on one device (embed.weight), so name-keyed code agrees on every stage.
    last = ranks[1]["held"]["materialized"]
    assert list(last)[0] == "embed.weight" and "head.proj.weight" in last
    assert torch.equal(last["embed.weight"], last["head.proj.weight"])
    assert max_difference(ranks[0]["state_dict"], alone["state_dict"]) < 1e-5


def test_a_layer_without_reset_parameters_built_on_meta_is_a_clear_error():
    class NoReset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    class Model(ConfiguredMLP):
        def configure_model(self):
            if self.layers is None:
                self.layers = torch.nn.ModuleList([NoReset(), torch.nn.Linear(4, 1)])

    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2))
    with pytest.raises(TypeError, match=r"NoReset has no reset_parameters\(\).*init_layer"):
        trainer.fit(Model(), build_loader(dict()))


def test_a_buffer_computed_in_init_of_a_layer_built_in_configure_model_keeps_its_values():
    # A table computed in __init__ (rotary frequencies, a scale) is set by no reset_parameters: built on meta it
    # came back as uninitialized memory and training ran on it silently.
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.linspace(1.0, 2.0, 4), persistent=False)

        def forward(self, x):
            return self.lin(x) * self.scale

    class Model(ConfiguredMLP):
        def configure_model(self):
            if self.layers is None:
                self.layers = torch.nn.ModuleList([Scaled(), torch.nn.Linear(4, 1)])

    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2))
    trainer.fit(model, build_loader(dict()))
    assert torch.equal(model.layers[0].scale, torch.linspace(1.0, 2.0, 4))
    assert not model.layers[0].lin.weight.is_meta


# ---- resuming in another layout ---------------------------------------------------------------------------------
def test_two_stage_run_equals_one_device_and_its_sharded_checkpoint_resumes_on_one_device(two_stages, reference):
    ranks, checkpoint = two_stages
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file()
    assert max_difference(ranks[0]["state_dict"], reference["full"]["state_dict"]) < TOL
    resumed, _, _ = run(dict(steps=STEPS, resume_from=str(checkpoint)))
    assert max_difference(resumed["state_dict"], reference["full"]["state_dict"]) < TOL


def test_two_stage_sharded_checkpoint_resumes_on_four_stages_whose_checkpoint_consolidates(two_stages, reference, tmp_path):
    _, checkpoint = two_stages
    ranks = multiprocess(dict(devices=4, steps=STEPS, resume_from=str(checkpoint), checkpoint_dir=str(tmp_path / "ckpt")),
                         tmp_path)
    assert ranks[0]["global_step"] == STEPS
    assert max_difference(ranks[0]["state_dict"], reference["full"]["state_dict"]) < TOL
    # The 4-stage run saved at step 6: its shards, consolidated, hold the one-device W_6.
    six, _, _ = run(dict(steps=6))
    consolidate_checkpoint(tmp_path / "ckpt" / "epoch=0-step=6.ckpt", tmp_path / "one.ckpt")
    loaded = ConfiguredMLP.load_from_checkpoint(tmp_path / "one.ckpt")
    assert max_difference({k: v.detach() for k, v in loaded.state_dict().items()}, six["state_dict"]) < TOL


def test_one_device_sharded_checkpoint_resumes_on_two_stages(reference, tmp_path):
    run(dict(steps=3, checkpoint_dir=str(tmp_path / "ckpt")))
    ranks = multiprocess(dict(devices=2, steps=STEPS, resume_from=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")), tmp_path)
    assert max_difference(ranks[0]["state_dict"], reference["full"]["state_dict"]) < TOL


def test_two_replicas_single_file_checkpoint_resumes_on_one_device(reference, tmp_path):
    cfg = dict(devices=2, dp=2, steps=3, save_every=3, checkpoint_dir=str(tmp_path / "ckpt"),
               strategy_kwargs={"data_parallel_size": 2, "save_distributed_checkpoint": False})
    multiprocess(cfg, tmp_path)
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert checkpoint.is_file()
    resumed, _, _ = run(dict(steps=STEPS // 2, batch=16, microbatches=8, resume_from=str(checkpoint)))
    assert max_difference(resumed["state_dict"], reference["dp"]["state_dict"]) < TOL


def test_a_plain_lightning_checkpoint_resumes_on_one_device_and_two_stages_with_its_optimizer_state_and_update_count(tmp_path):
    # Saved by plain Lightning (no strategy): its AdamW moments are keyed by index in the whole model's optimizer,
    # and its update count is the loop's. Both must survive a resume on any number of processes (two processes
    # used to start fresh moments, and every layout restarted the engine's count at 0).
    run(dict(steps=3, checkpoint_dir=str(tmp_path / "ckpt"), save_every=3), strategy=False)
    plain = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    full, _, _ = run(dict(steps=6), strategy=False)
    alone, _, _ = run(dict(steps=6, schedule="1f1b", resume_from=str(plain)))
    assert alone["batch_index"] == 6
    assert max_difference(alone["state_dict"], full["state_dict"]) < TOL
    ranks = multiprocess(dict(devices=2, steps=6, schedule="1f1b", resume_from=str(plain)), tmp_path)
    assert [r["batch_index"] for r in ranks] == [6, 6]
    assert max_difference(ranks[0]["state_dict"], full["state_dict"]) < TOL


def test_a_plain_lightning_checkpoint_resumes_on_two_replicas_with_a_sharded_optimizer(tmp_path):
    # Each replica owns part of the optimizer state under shard_optimizer: the plain checkpoint's index-keyed
    # moments must reach the replica that owns each parameter, or the run silently restarts some of them at 0.
    run(dict(steps=3, batch=16, checkpoint_dir=str(tmp_path / "ckpt"), save_every=3), strategy=False)
    plain = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    full, _, _ = run(dict(steps=6, batch=16), strategy=False)
    cfg = dict(devices=2, dp=2, steps=6, schedule="1f1b", resume_from=str(plain),
               strategy_kwargs={"data_parallel_size": 2, "shard_optimizer": True})
    ranks = multiprocess(cfg, tmp_path)
    assert [r["batch_index"] for r in ranks] == [6, 6]
    assert max_difference(ranks[0]["state_dict"], full["state_dict"]) < TOL


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sharded_optimizer_checkpoint_resumes_at_the_learning_rate_of_the_next_step_on_any_layout(tmp_path):
    # ExponentialLR derives each learning rate from the group's current one, so a checkpoint must hold the rate
    # the next step uses: with shard_optimizer the local optimizer's groups learn it only inside step(), after
    # the scheduler has moved on. 2 sharded replicas save at step 3 and resume there, and on one device unsharded.
    cfg = dict(steps=6, lr_gamma=0.5)
    full, _, _ = run(dict(cfg, batch=16, microbatches=8))
    sharded = dict(cfg, devices=2, dp=2, strategy_kwargs={"data_parallel_size": 2, "shard_optimizer": True})
    (tmp_path / "first").mkdir()
    uninterrupted = multiprocess(dict(sharded, save_every=3, checkpoint_dir=str(tmp_path / "ckpt")), tmp_path / "first")
    assert max_difference(uninterrupted[0]["state_dict"], full["state_dict"]) < TOL
    checkpoint = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    (tmp_path / "resumed").mkdir()
    resumed = multiprocess(dict(sharded, resume_from=checkpoint), tmp_path / "resumed")
    assert max_difference(resumed[0]["state_dict"], full["state_dict"]) < TOL
    alone, _, trainer = run(dict(cfg, batch=16, microbatches=8, resume_from=checkpoint))
    assert max_difference(alone["state_dict"], full["state_dict"]) < TOL
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**6)


def written_out(steps: int, version_of) -> dict:
    """The one-device model's updates with the gradient of batch k taken at W_{version_of(k)}, written out."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    model = ConfiguredMLP()
    model.configure_model()
    for i, layer in enumerate(model.pipeline_layers()):
        model.init_layer(i, layer)
    batches = [batch for _, batch in zip(range(steps), build_loader({}))]
    return delayed_loop(model, batches, version_of=version_of)


def test_switching_2bw_to_1f1b_continues_synchronously_from_the_newest_weights(tmp_path):
    run(dict(steps=3, checkpoint_dir=str(tmp_path)))
    resumed, _, _ = run(dict(steps=STEPS, schedule="1f1b", resume_from=str(tmp_path / "epoch=0-step=3.ckpt")))
    expected = written_out(STEPS, lambda k: max(k - 1, 0) if k < 3 else k)
    assert max_difference(resumed["state_dict"], expected) < TOL


def test_switching_1f1b_to_2bw_starts_the_delay_from_the_loaded_weights(tmp_path):
    run(dict(steps=3, schedule="1f1b", checkpoint_dir=str(tmp_path)))
    resumed, _, _ = run(dict(steps=STEPS, resume_from=str(tmp_path / "epoch=0-step=3.ckpt")))
    expected = written_out(STEPS, lambda k: k if k <= 3 else k - 1)
    assert max_difference(resumed["state_dict"], expected) < TOL


# ---- consolidation --------------------------------------------------------------------------------------------
def test_consolidated_two_stage_checkpoint_loads_without_the_strategy_holding_the_newest_weights(two_stages, reference, tmp_path):
    _, checkpoint = two_stages
    assert consolidate_main([str(checkpoint), str(tmp_path / "one.ckpt")]) == 0
    model = ConfiguredMLP.load_from_checkpoint(tmp_path / "one.ckpt")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    assert max_difference(weights, reference["three"]["state_dict"]) < TOL
    # The file also resumes a pipeline, like the directory it came from.
    resumed, _, _ = run(dict(steps=STEPS, resume_from=str(tmp_path / "one.ckpt")))
    assert max_difference(resumed["state_dict"], reference["full"]["state_dict"]) < TOL


def test_consolidate_refuses_a_file_naming_it(tmp_path):
    (tmp_path / "x.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match="x.ckpt.*not a sharded checkpoint"):
        consolidate_checkpoint(tmp_path / "x.ckpt", tmp_path / "y.ckpt")


def test_consolidated_tied_llama_keeps_the_tie(tmp_path):
    run(dict(model="llama", steps=3, checkpoint_dir=str(tmp_path / "ckpt")))
    consolidate_checkpoint(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", tmp_path / "one.ckpt")
    model = Llama.load_from_checkpoint(tmp_path / "one.ckpt")
    assert model.head.proj.weight is model.embed.weight


# ---- crash safety ------------------------------------------------------------------------------------------------
CRASH = """
import os, sys, torch
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {tests!r})
import torch.distributed.checkpoint as dcp
from scale_fit import run
_, model, trainer = run(dict(steps=3))
trainer.save_checkpoint({path!r})
real = dcp.save
def save_then_die(*args, **kwargs):
    real(*args, **kwargs)  # every shard written, the checkpoint not yet in place: the process is killed
    os._exit(3)
dcp.save = save_then_die
trainer.fit_loop.epoch_loop._batches_that_stepped += 1
torch.nn.init.zeros_(next(model.parameters()))
trainer.save_checkpoint({path!r})
"""


def test_a_kill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "a.ckpt"
    code = CRASH.format(scripts=str(SCRIPT.parent), tests=str(SCRIPT.parent.parent), path=str(path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    expected, _, _ = run(dict(steps=3))
    consolidate_checkpoint(path, tmp_path / "one.ckpt")
    loaded = ConfiguredMLP.load_from_checkpoint(tmp_path / "one.ckpt")
    assert max_difference({k: v.detach() for k, v in loaded.state_dict().items()}, expected["state_dict"]) == 0.0


def test_a_checkpoint_of_the_earlier_format_is_refused_naming_the_format(tmp_path):
    run(dict(steps=3, checkpoint_dir=str(tmp_path), strategy_kwargs={"save_distributed_checkpoint": False}))
    path = tmp_path / "epoch=0-step=3.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["async_pipeline"] = {"schedule": "2bw", "num_stages": 1, "stages": []}  # the earlier layout
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="earlier version.*format 0, this version reads 1"):
        run(dict(steps=STEPS, resume_from=str(path)))
