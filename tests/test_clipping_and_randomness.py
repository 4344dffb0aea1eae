"""One clipping path and one random stream per stage: every way Lightning offers to clip, and dropout, give the
same weights on one device, on 2 processes and (clipping) in plain Lightning (docs/design/lightning.md, "The Lightning
seam" and "Randomness").

References: plain Lightning (no strategy) for clipping; for dropout, the update rule written out as a loop in which
each stage's forward of microbatch j of batch k draws from ``forward_seed(seed, stage, k, j)`` (plain Lightning
draws one stream in layer order, so its masks differ: equal in distribution, not bit for bit).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import seam_fit  # noqa: E402
from test_lightning_seam import OWN_SAMPLER, batches_of, max_difference, seam_results  # noqa: E402

from lightning_async_pp.pipeline.microbatch import split_microbatches  # noqa: E402
from lightning_async_pp.pipeline.randomness import forward_seed  # noqa: E402

TOL = 1e-6
BASE = dict(model={"optimizer": "sgd"}, schedule="1f1b", steps=6, data={"samples": 64, "batch": 8}, microbatches=4,
            partition=[2, 2])
# Each way to clip by norm (0.05 clips every step here), by value, and an override that skips the Trainer's value.
CLIPPING = {
    "trainer_norm": dict(clip=0.05),
    "trainer_value": dict(clip=0.01, clip_algorithm="value"),
    "override_norm": dict(model={"optimizer": "sgd", "clipping": {"how": "override", "val": 0.05}}),
    "override_skips": dict(clip=0.05, model={"optimizer": "sgd", "clipping": {"how": "skip"}}),
    "manual_norm": dict(model={"optimizer": "sgd", "clipping": {"how": "manual", "val": 0.05}}),
    "tied_across_stages": dict(clip=0.05, model={"name": "tied"}),
}
DROPOUT = dict(BASE, model={"optimizer": "adamw", "dropout": 0.5, "seed": 5})
RANDOM = {
    "dropout_1f1b": dict(DROPOUT),
    "dropout_2bw": dict(DROPOUT, schedule="2bw"),
    "dropout_2bw_checkpointed": dict(DROPOUT, schedule="2bw", strategy_kwargs={"activation_checkpointing": True}),
    "dropout_zb_h1": dict(DROPOUT, schedule="zb_h1"),
}


def case(overrides: dict) -> dict:
    return dict(BASE, **overrides)


def one_device(cfg: dict, strategy: bool = True) -> dict:
    if strategy:
        cfg = dict(cfg, strategy_kwargs=dict(cfg.get("strategy_kwargs", {}), num_stages=2))
    return seam_fit.run(cfg, devices=1, strategy=strategy)[0]


def seeded_loop(model, batches: list, partition: list[int], microbatches: int, delay: int, seed: int) -> dict:
    """docs/design/update-rule.md's update rule with the random streams of docs/design/stages.md, "Randomness": stage s's forward of
    microbatch j of batch k (the layers of s, and the loss on the last stage) runs with the global RNG seeded by
    forward_seed(seed, s, k, j). Gradients are the mean over microbatches; the optimizer state is never rewound."""
    layers = list(model.pipeline_layers())
    stages = [layers[sum(partition[:s]):sum(partition[:s + 1])] for s in range(len(partition))]
    opt = model.configure_optimizers()
    params = list(model.parameters())
    history = [[p.detach().clone() for p in params]]
    for k, batch in enumerate(batches):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, history[max(k - delay, 0)]):
                p.copy_(w)
        opt.zero_grad()
        for j, mb in enumerate(split_microbatches(batch, microbatches)):
            x = model.pipeline_input(mb)
            for s, stage in enumerate(stages):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(forward_seed(seed, s, k, j))
                    for layer in stage:
                        x = layer(x)
                    if s == len(stages) - 1:
                        x = model.pipeline_loss(x, mb) / microbatches
            x.backward()
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- one device --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CLIPPING))
def test_every_clipping_kind_on_one_device_equals_plain_lightning(name):
    cfg = case(CLIPPING[name])
    ours, plain = one_device(cfg), one_device(cfg, strategy=False)
    assert max_difference(ours["state_dict"], plain["state_dict"]) < TOL
    plain_model = {k: v for k, v in cfg.get("model", {}).items() if k != "clipping"}
    unclipped = one_device(case({"model": plain_model}))["state_dict"]
    clipped = name != "override_skips"
    assert (max_difference(ours["state_dict"], unclipped) > 1e-3) == clipped  # it clipped, or skipped as asked


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_dropout_on_one_device_draws_each_stage_forward_from_its_own_seeded_stream(name):
    cfg = RANDOM[name]
    ours = one_device(cfg)["state_dict"]
    delay = 1 if cfg["schedule"] == "2bw" else 0

    def reference(seed: int) -> dict:
        return seeded_loop(seam_fit.build_model(cfg), batches_of(cfg)[:cfg["steps"]], cfg["partition"],
                           cfg["microbatches"], delay, seed=seed)

    assert max_difference(ours, reference(cfg["model"]["seed"])) < TOL  # the model's seed is the run's
    assert max_difference(ours, reference(cfg["model"]["seed"] + 1)) > 1e-3  # the masks matter


def test_drawing_random_numbers_outside_the_pipeline_leaves_training_unchanged():
    from lightning.pytorch.callbacks import Callback

    class DrawsRandomNumbers(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            torch.rand(3)

    cfg = RANDOM["dropout_2bw"]
    model = seam_fit.build_model(cfg)
    disturbed = copy.deepcopy(model)
    for m, callbacks in ((model, []), (disturbed, [DrawsRandomNumbers()])):
        trainer = seam_fit.build_trainer(dict(cfg, strategy_kwargs={"num_stages": 2}), devices=1)
        trainer.callbacks.extend(callbacks)
        trainer.fit(m, seam_fit.build_loader(cfg))
    assert max_difference(model.state_dict(), disturbed.state_dict()) == 0


# ---- two processes -----------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_clipping_kind_and_dropout_on_two_processes_equal_one_device(tmp_path):
    # One launch runs every case in turn (scripts/seam_fit.py, "cases"); 2 stages of 2 layers each.
    cases = {name: dict(case(c), **OWN_SAMPLER) for name, c in CLIPPING.items()}
    cases.update({name: dict(c, **OWN_SAMPLER) for name, c in RANDOM.items()})
    cases["trainer_norm_2bw"] = dict(case(CLIPPING["trainer_norm"]), schedule="2bw", **OWN_SAMPLER)
    multi = seam_results({"cases": cases}, tmp_path)[0]["cases"]
    failures = []
    for name, cfg in cases.items():
        difference = max_difference(multi[name]["state_dict"], one_device(cfg)["state_dict"])
        if not difference < 1e-5:
            failures.append(f"{name}: {difference:.3g}")
    assert not failures, failures
