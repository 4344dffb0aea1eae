"""Optimizers and schedulers from the CLI's YAML: built per stage at setup, by name, stepped every update."""
from __future__ import annotations

import sys

import pytest
import torch
import yaml
from test_cli import demo_config

from lightning_async_pp.cli import AsyncPipelineCLI
from lightning_async_pp.optim import ErrorFeedback, Muon, WarmupCosine


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])


def with_optimizer(tmp_path, optimizer: dict, lr_scheduler: dict | None = None):
    path = demo_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["optimizer"] = optimizer
    if lr_scheduler:
        config["lr_scheduler"] = lr_scheduler
    path.write_text(yaml.safe_dump(config))
    return path


def test_error_feedback_wrapping_muon_from_yaml_trains_two_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    optimizer = {
        "class_path": "lightning_async_pp.optim.ErrorFeedback",
        "init_args": {"coefficient": 1.0, "optimizer": {"class_path": "lightning_async_pp.optim.Muon", "init_args": {"lr": 0.02}}},
    }
    cli = AsyncPipelineCLI(args=["fit", "--config", str(with_optimizer(tmp_path, optimizer))])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, ErrorFeedback) and isinstance(opt.wrapped, Muon) and opt.coefficient == 1.0
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    # Built from named parameters: the GPT's embeddings and head went to AdamW, block matrices to Muon.
    muon_params = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    model = cli.model
    assert id(model.embedding.token.weight) not in muon_params and id(model.head.proj.weight) not in muon_params
    assert id(model.blocks[0].attn.qkv.weight) in muon_params
    # the correction buffer exists after two steps
    assert any("prev_update" in opt.state[p] for p in model.parameters())


def test_error_feedback_per_part_coefficients_from_yaml(tmp_path, monkeypatch):
    """coefficient 1 for the AdamW part, muon_coefficient 0 for the Muon part: only AdamW's parameters keep a
    correction buffer, and each group reports its own coefficient."""
    monkeypatch.chdir(tmp_path)
    optimizer = {
        "class_path": "lightning_async_pp.optim.ErrorFeedback",
        "init_args": {"coefficient": 1.0, "muon_coefficient": 0.0,
                      "optimizer": {"class_path": "lightning_async_pp.optim.Muon", "init_args": {"lr": 0.02}}},
    }
    cli = AsyncPipelineCLI(args=["fit", "--config", str(with_optimizer(tmp_path, optimizer))])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, ErrorFeedback) and opt.muon_coefficient == 0.0 and cli.trainer.global_step == 2
    assert {(g["use_muon"], opt.group_coefficient(g)) for g in opt.param_groups} == {(True, 0.0), (False, 1.0)}
    for group in opt.param_groups:
        for p in group["params"]:
            assert ("prev_update" in opt.state[p]) == (not group["use_muon"])


def test_warmup_cosine_from_yaml_steps_every_update(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}
    scheduler = {"class_path": "lightning_async_pp.optim.WarmupCosine", "init_args": {"warmup_steps": 4, "total_steps": 10}}
    cli = AsyncPipelineCLI(args=["fit", "--config", str(with_optimizer(tmp_path, optimizer, scheduler))])
    # two updates taken: the scheduler was stepped twice, so the next update uses warmup factor 3/4
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 3 / 4)


def test_warmup_cosine_schedule_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lrs[6:] == pytest.approx([0.1, 0.1])


def test_warmup_cosine_rejects_a_warmup_as_long_as_the_run():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"warmup_steps=10, total_steps=10"):
        WarmupCosine(opt, warmup_steps=10, total_steps=10)


def test_async_nesterov_with_pipemare_around_exponential_lr_from_yaml(tmp_path, monkeypatch):
    """AsyncNesterov's adaptive momentum (a YAML list for the tuple) and PipeMareLR's nested inner schedule build
    from the config; after two updates the rate is 0.01 * 0.5^2 / 2^(1 - 3/4)."""
    from torch.optim.lr_scheduler import ExponentialLR

    from lightning_async_pp.optim import AsyncNesterov, PipeMareLR

    monkeypatch.chdir(tmp_path)
    optimizer = {"class_path": "lightning_async_pp.optim.AsyncNesterov",
                 "init_args": {"lr": 0.01, "momentum": 0.9, "adaptive_momentum": [1, 2]}}
    scheduler = {"class_path": "lightning_async_pp.optim.PipeMareLR",
                 "init_args": {"delay": 2, "warmup_steps": 4, "scheduler": {
                     "class_path": "torch.optim.lr_scheduler.ExponentialLR", "init_args": {"gamma": 0.5}}}}
    # PipeMareLR's tau is the pipeline's delay (optim/checks.py): a one-device delay-2 study
    cli = AsyncPipelineCLI(args=["fit", "--config", str(with_optimizer(tmp_path, optimizer, scheduler)),
                                 "--trainer.strategy.init_args.delay", "2"])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, AsyncNesterov) and opt.momentum == pytest.approx(0.945)
    sched = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, PipeMareLR) and isinstance(sched.inner, ExponentialLR) and cli.trainer.global_step == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2 / 2 ** (1 - 3 / 4))


def test_weight_prediction_inside_error_feedback_around_muon_from_yaml_turns_the_engine_prediction_on(tmp_path,
                                                                                                    monkeypatch):
    """ErrorFeedback(WeightPrediction(Muon)) with a scale from YAML: every stage predicts with that scale, and holds
    the predictions besides the parameters (2BW: two slots beyond them)."""
    from lightning_async_pp.optim import WeightPrediction

    monkeypatch.chdir(tmp_path)
    optimizer = {"class_path": "lightning_async_pp.optim.ErrorFeedback", "init_args": {"coefficient": 0.5, "optimizer": {
        "class_path": "lightning_async_pp.optim.WeightPrediction", "init_args": {"scale": 0.8, "optimizer": {
            "class_path": "lightning_async_pp.optim.Muon", "init_args": {"lr": 0.02}}}}}}
    cli = AsyncPipelineCLI(args=["fit", "--config", str(with_optimizer(tmp_path, optimizer))])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt.wrapped, WeightPrediction) and opt.wrapped.scale == 0.8 and isinstance(opt.wrapped.wrapped, Muon)
    stats = cli.trainer.strategy.engine.stats
    assert stats.stages and all(view.predicts for view in stats.stages) and cli.trainer.global_step == 2
    param_bytes = sum(p.numel() * p.element_size() for p in cli.model.parameters())
    assert stats.stash_nbytes == 2 * param_bytes
