"""``lightning_async_pp.optim.PipeMareLR`` (PipeMare's learning-rate rescheduling): the learning rate of update k is
the inner schedule's times ``tau ** -(1 - min((k + 1) / T, 1))``, checked against the sequence written out by hand
for a recursive (ExponentialLR, CosineAnnealingLR) and a closed-form (LambdaLR) inner schedule, under the pipeline
with delay 2 against a written-out delayed loop, through ``state_dict`` and a Lightning checkpoint, and in the
StalenessMonitor's ``lr_factor``."""
from __future__ import annotations

import copy
import io
import math
from functools import partial

import pytest
import torch
from helpers import ResumableLoader, TinyLM, make_dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from test_one_device import delayed_reference, loader, max_param_difference, trainer
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, LambdaLR, ReduceLROnPlateau

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim import PipeMareLR

LR, TAU, T, STEPS = 0.5, 2, 4, 8


def factor(k: int, tau: int = TAU, warmup: int = T) -> float:
    """PipeMare's division written out: 1 / tau^(1 - min((k + 1) / T, 1))."""
    return 1.0 / tau ** (1 - min((k + 1) / warmup, 1))


INNER = {  # name: (builder, the inner schedule's k-th rate written out)
    "exponential": (lambda opt: ExponentialLR(opt, gamma=0.8), lambda k: LR * 0.8**k),
    "cosine": (lambda opt: CosineAnnealingLR(opt, T_max=6, eta_min=0.05),
               lambda k: 0.05 + (LR - 0.05) * (1 + math.cos(math.pi * k / 6)) / 2 if k <= 6 else None),
    "lambda": (lambda opt: LambdaLR(opt, lambda k: 1.0 / (1.0 + k)), lambda k: LR / (1.0 + k)),
}


def rates(opt, sched, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", sorted(INNER))
def test_the_rate_is_the_inner_schedules_times_the_factor_without_compounding(name):
    build, written = INNER[name]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    sched = PipeMareLR(opt, delay=TAU, warmup_steps=T, scheduler=build(opt))
    steps = 7 if name == "cosine" else STEPS
    for k, lr in enumerate(rates(opt, sched, steps)):
        assert lr == pytest.approx(written(k) * factor(k), rel=1e-12, abs=1e-15), k
    assert factor(0) == pytest.approx(2**-0.75) and factor(T - 1) == 1.0  # divided early, undivided from T - 1
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_delay_one_is_the_identity_and_no_scheduler_means_the_constant_rate():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    inner_only = rates(opt, ExponentialLR(opt, gamma=0.8), STEPS)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    assert rates(opt, PipeMareLR(opt, delay=1, warmup_steps=T, scheduler=ExponentialLR(opt, gamma=0.8)), STEPS) == inner_only
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    assert rates(opt, PipeMareLR(opt, delay=3, warmup_steps=T), STEPS) == pytest.approx(
        [LR * factor(k, tau=3) for k in range(STEPS)], rel=1e-12)


def test_a_callable_builds_the_inner_schedule_as_from_yaml():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    sched = PipeMareLR(opt, delay=TAU, warmup_steps=T, scheduler=partial(ExponentialLR, gamma=0.8))
    assert isinstance(sched.inner, ExponentialLR)
    assert rates(opt, sched, STEPS) == pytest.approx([LR * 0.8**k * factor(k) for k in range(STEPS)], rel=1e-12)


def test_state_dict_round_trip_through_torch_save_continues_the_sequence_and_holds_the_inners_state():
    def build():
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
        return opt, PipeMareLR(opt, delay=TAU, warmup_steps=T, scheduler=ExponentialLR(opt, gamma=0.8))

    opt, sched = build()
    rates(opt, sched, 2)
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    uninterrupted = rates(opt, sched, STEPS - 2)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["sched"]["inner"]["last_epoch"] == 2
    opt2, sched2 = build()
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert rates(opt2, sched2, STEPS - 2) == uninterrupted


class PipeMareTinyLM(TinyLM):
    """SGD with ExponentialLR inside PipeMareLR (delay 2, T = 4), stepped every update."""

    def __init__(self, pipemare: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipemare = pipemare

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        sched = ExponentialLR(opt, gamma=0.8)
        if self.pipemare:
            sched = PipeMareLR(opt, delay=TAU, warmup_steps=T, scheduler=sched)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class WrittenOutRates(TinyLM):
    """Plain SGD whose k-th rate is set to LR 0.8^k / 2^(1 - min((k+1)/4, 1)) by a LambdaLR: the reference."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        sched = LambdaLR(opt, lambda k: 0.8**k * factor(k))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_under_the_pipeline_with_three_stages_and_delay_two_it_follows_the_delayed_loop_with_the_written_out_rates():
    model = PipeMareTinyLM()
    reference = WrittenOutRates()
    reference.load_state_dict(model.state_dict())
    params = delayed_reference(reference, list(loader()), STEPS, delay=TAU)
    t = trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=3, delay=TAU), steps=STEPS)
    t.fit(model, loader())
    assert max_param_difference(model, params) < 1e-6
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.8**STEPS * factor(STEPS))
    without = PipeMareTinyLM(pipemare=False)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, delay=TAU), steps=STEPS).fit(without, loader())
    assert max_param_difference(model, without) > 1e-5  # the rescheduling matters


def test_resume_from_a_lightning_checkpoint_continues_exactly(tmp_path):
    def data():
        return ResumableLoader(make_dataset(32), batch_size=8)

    def strategy(**kwargs):
        return AsyncPipelineStrategy("2bw", num_microbatches=4, delay=TAU, **kwargs)

    uninterrupted = PipeMareTinyLM()
    first_part = copy.deepcopy(uninterrupted)
    trainer(strategy(), steps=6).fit(uninterrupted, data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    trainer(strategy(save_distributed_checkpoint=False), steps=2, enable_checkpointing=True,
            callbacks=[checkpoint]).fit(first_part, data())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["lr_schedulers"][0]["last_epoch"] == 2 and saved["lr_schedulers"][0]["inner"]["last_epoch"] == 2
    resumed = PipeMareTinyLM(seed=123)
    t = trainer(strategy(), steps=6)
    t.fit(resumed, data(), ckpt_path=tmp_path / "last.ckpt")
    assert max_param_difference(resumed, uninterrupted) < 1e-6
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 6


def test_staleness_monitor_logs_the_factor_of_each_update(tmp_path):
    from test_callbacks import fit, scalars

    from lightning_async_pp.callbacks import StalenessMonitor

    _, t = fit(tmp_path, AsyncPipelineStrategy("2bw", 4, delay=TAU), [StalenessMonitor()], model=PipeMareTinyLM())
    logged = scalars(t)["staleness/lr_factor"]
    assert sorted(logged) == list(range(6))
    for k, value in logged.items():
        assert value == pytest.approx(factor(k), rel=1e-6)  # TensorBoard stores float32


@pytest.mark.parametrize("kwargs, message", [
    ({"delay": -1, "warmup_steps": 4}, r"delay must be an integer >= 0 .* got -1"),
    ({"delay": 2.0, "warmup_steps": 4}, r"delay must be an integer >= 0 .* got 2\.0"),
    ({"delay": 2, "warmup_steps": 0}, r"warmup_steps must be an integer >= 1 .* got 0"),
])
def test_bad_settings_are_refused_naming_the_value(kwargs, message):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    with pytest.raises(ValueError, match=message):
        PipeMareLR(opt, **kwargs)


def test_a_plateau_schedule_or_one_on_another_optimizer_is_refused():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    with pytest.raises(ValueError, match="cannot wrap ReduceLROnPlateau"):
        PipeMareLR(opt, delay=2, warmup_steps=4, scheduler=ReduceLROnPlateau(opt))
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    with pytest.raises(ValueError, match="same optimizer"):
        PipeMareLR(opt, delay=2, warmup_steps=4, scheduler=ExponentialLR(other, gamma=0.8))


def test_it_sets_every_group_of_error_feedback_around_muon():
    """Around ErrorFeedback(Muon): the Muon and the AdamW groups (the wrapped optimizer's own dicts) all follow the
    written-out rates while the optimizer steps."""
    from lightning_async_pp.optim import ErrorFeedback, Muon

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.zeros(4))]
    opt = ErrorFeedback(params, optimizer=partial(Muon, lr=0.02), coefficient=1.0)
    sched = PipeMareLR(opt, delay=TAU, warmup_steps=T, scheduler=ExponentialLR(opt, gamma=0.8))
    assert {g["use_muon"] for g in opt.wrapped.param_groups} == {True, False}
    for k in range(6):
        assert [g["lr"] for g in opt.wrapped.param_groups] == pytest.approx([0.02 * 0.8**k * factor(k)] * 2, rel=1e-12)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
