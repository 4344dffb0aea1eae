"""``lightning_async_pp.optim.DelayCompensation`` (DC-ASGD): the wrapped optimizer steps on
``g + c g g (W_k - W_b)``, ``W_b`` the version ``g`` was taken on, checked against the rule written out by hand:
alone, under 2BW on one device with 3 stages and with delay 2, combined with ``ErrorFeedback``, with the moving
average of ``g g``, and through a checkpoint."""
from __future__ import annotations

import copy
import io
from functools import partial

import pytest
import torch
from helpers import TinyLM
from test_one_device import loader, max_param_difference, trainer
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim import DelayCompensation, ErrorFeedback
from lightning_async_pp.optim.delay_compensation import SQUARE_AVERAGE, WEIGHT_HISTORY

A = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=torch.float64)
W0 = torch.tensor([0.5, -0.4, 1.1, -0.9], dtype=torch.float64)
LR, C = 0.1, 0.5


def grad_at(w: torch.Tensor) -> torch.Tensor:
    """Gradient of f(w) = sum(w^4)/4 + sum(A w): depends on w, so a wrong weight gives a wrong update."""
    return w**3 + A


def delayed_run(opt_factory, steps: int, delay: int = 1) -> torch.Tensor:
    """The optimizer stepped on gradients taken ``delay`` steps late, W_{max(k-delay,0)}, as 2BW gives them."""
    w = nn.Parameter(W0.clone())
    opt = opt_factory([w])
    history = [W0.clone()]
    for k in range(steps):
        w.grad = grad_at(history[max(k - delay, 0)])
        opt.step()
        history.append(w.detach().clone())
    return w.detach()


def written_out(steps: int, delay: int = 1, c: float = C, ema: float | None = None) -> torch.Tensor:
    """SGD on g~ = g + c s (W_k - W_b), s = g g or its moving average, g taken at W_b = W_{max(k-delay,0)}."""
    weights, s = [W0.clone()], torch.zeros(4, dtype=torch.float64)
    for k in range(steps):
        stale = weights[max(k - delay, 0)]
        g = grad_at(stale)
        s = g * g if ema is None else ema * s + (1 - ema) * g * g
        weights.append(weights[k] - LR * (g + c * s * (weights[k] - stale)))
    return weights[-1]


def test_sgd_steps_on_the_compensated_gradient_written_out():
    dc = partial(DelayCompensation, optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C)
    assert torch.allclose(delayed_run(dc, 6), written_out(6), rtol=0, atol=1e-12)
    # the compensation matters: plain SGD on the stale gradients ends elsewhere
    assert (delayed_run(partial(torch.optim.SGD, lr=LR), 6) - written_out(6)).abs().max() > 1e-3


def test_delay_two_takes_the_weights_two_steps_back():
    dc = partial(DelayCompensation, optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C, delay=2)
    assert torch.allclose(delayed_run(dc, 6, delay=2), written_out(6, delay=2), rtol=0, atol=1e-12)
    w = nn.Parameter(W0.clone())
    opt = dc([w])
    w.grad = grad_at(W0)
    opt.step()
    assert opt.state[w][WEIGHT_HISTORY].shape == (2, 4)  # W_{k-2}, W_{k-1}: two buffers for delay 2


@pytest.mark.parametrize("delay", [1, 2])
def test_a_parameter_that_missed_a_step_is_compensated_against_the_weights_delay_steps_back(delay):
    """An MoE expert no token chose, a frozen branch: no gradient at some steps (the optimizer leaves it there), yet
    ``W_b`` stays ``W_{k-delay}`` of every step, not of the steps that had a gradient."""
    missed = {2, 5}
    w = nn.Parameter(W0.clone())
    opt = DelayCompensation([w], optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C, delay=delay)
    history = [W0.clone()]
    for k in range(8):
        w.grad = None if k in missed else grad_at(history[max(k - delay, 0)])
        opt.step()
        history.append(w.detach().clone())
    weights = [W0.clone()]  # written out: no gradient, no update
    for k in range(8):
        stale = weights[max(k - delay, 0)]
        if k in missed:
            weights.append(weights[k].clone())
            continue
        g = grad_at(stale)
        weights.append(weights[k] - LR * (g + C * g * g * (weights[k] - stale)))
    assert torch.allclose(w.detach(), weights[-1], rtol=0, atol=1e-12)


def test_moving_average_of_the_squared_gradient_written_out():
    dc = partial(DelayCompensation, optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C, ema=0.9)
    assert torch.allclose(delayed_run(dc, 6), written_out(6, ema=0.9), rtol=0, atol=1e-12)
    assert (written_out(6, ema=0.9) - written_out(6)).abs().max() > 1e-4


def test_coefficient_zero_is_the_wrapped_optimizer_and_keeps_no_buffer():
    factory = partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    dc = partial(DelayCompensation, optimizer=factory, coefficient=0.0)
    assert torch.equal(delayed_run(dc, 5), delayed_run(factory, 5))
    w = nn.Parameter(W0.clone())
    opt = dc([w])
    w.grad = grad_at(W0)
    opt.step()
    assert WEIGHT_HISTORY not in opt.state[w]


def test_the_gradient_is_put_back_after_the_step():
    w = nn.Parameter(W0.clone())
    opt = DelayCompensation([w], optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C)
    for k in range(3):
        g = grad_at(W0 * (k + 1))
        w.grad = g
        opt.step()
        assert w.grad is g and torch.equal(g, grad_at(W0 * (k + 1)))


def test_inside_error_feedback_both_corrections_follow_their_rules():
    """ErrorFeedback(DelayCompensation(SGD)): u_k = lr (g + c1 g g (W_k - W_{k-1})), then
    W_{k+1} = W_k - u_k - c2 (u_k - u_{k-1}); W_{k-1} is the weight really applied, error feedback included."""
    c1, c2 = 0.5, 0.7

    def both(params):
        return ErrorFeedback(params, optimizer=partial(DelayCompensation, optimizer=partial(torch.optim.SGD, lr=LR),
                                                       coefficient=c1), coefficient=c2)

    weights, prev_u = [W0.clone()], None
    for k in range(6):
        stale = weights[max(k - 1, 0)]
        g = grad_at(stale)
        u = LR * (g + c1 * g * g * (weights[k] - stale))
        weights.append(weights[k] - u - (c2 * (u - prev_u) if prev_u is not None else 0))
        prev_u = u
    assert torch.allclose(delayed_run(both, 6), weights[-1], rtol=0, atol=1e-12)


class CompensatedTinyLM(TinyLM):
    def __init__(self, coefficient: float, delay: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.coefficient, self.dc_delay = coefficient, delay

    def configure_optimizers(self):
        return DelayCompensation(self.parameters(), optimizer=partial(torch.optim.SGD, lr=LR),
                                 coefficient=self.coefficient, delay=self.dc_delay)


def pipeline_written_out(model: TinyLM, batches, steps: int, delay: int, c: float,
                         synchronous=lambda k: False) -> list[torch.Tensor]:
    """docs/design/update-rule.md's version rule with DC-ASGD's SGD step written out: g = grad f(W_b; B_k),
    W_b = W_{max(k-d,0)} (W_k for a synchronous batch), W_{k+1} = W_k - lr (g + c g g (W_k - W_b))."""
    params = list(model.parameters())
    history = [[p.detach().clone() for p in params]]
    for k in range(steps):
        stale = history[k if synchronous(k) else max(k - delay, 0)]
        with torch.no_grad():
            for p, w in zip(params, stale):
                p.copy_(w)
        for p in params:
            p.grad = None
        batch = batches[k]
        model.pipeline_loss(model.pipeline_forward(batch), batch).backward()
        history.append([w - LR * (p.grad + c * p.grad * p.grad * (w - s))
                        for p, w, s in zip(params, history[k], stale)])
    return history[-1]


@pytest.mark.parametrize("delay", [1, 2])
def test_under_the_pipeline_on_one_device_with_three_stages_it_follows_the_written_out_rule(delay):
    steps = 6
    model = CompensatedTinyLM(coefficient=2.0, delay=delay)
    reference = pipeline_written_out(copy.deepcopy(model), list(loader()), steps, delay, c=2.0)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=3, delay=delay)
    trainer(strategy, steps=steps).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6
    uncorrected = pipeline_written_out(CompensatedTinyLM(coefficient=0.0), list(loader()), steps, delay, c=0.0)
    assert max_param_difference(model, uncorrected) > 1e-5


@pytest.mark.parametrize("delay", [1, 2])
def test_synchronous_updates_of_sync_steps_and_sync_from_step_are_not_compensated(delay):
    """sync_steps=2, sync_from_step=5: batches 0, 1, 5, 6 take their gradient on W_k, and W_b = W_k leaves no
    term; the strategy tells the wrapper each update's realized delay (step_delay)."""
    steps = 7
    model = CompensatedTinyLM(coefficient=2.0, delay=delay)
    synchronous = lambda k: k < 2 or k >= 5  # noqa: E731
    reference = pipeline_written_out(copy.deepcopy(model), list(loader()), steps, delay, c=2.0, synchronous=synchronous)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2, delay=delay, sync_steps=2, sync_from_step=5)
    trainer(strategy, steps=steps).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6


def test_step_delay_picks_the_version_of_this_step_and_zero_is_no_term():
    w = nn.Parameter(W0.clone())
    opt = DelayCompensation([w], optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C, delay=2)
    weights = [W0.clone()]
    for k, r in enumerate([0, 1, 2, 0, 1]):  # the realized delay of each step
        opt.step_delay = r
        stale = weights[k - r]
        g = grad_at(stale)
        w.grad = g
        opt.step()
        weights.append(weights[k] - LR * (g + C * g * g * (weights[k] - stale)))
        assert torch.allclose(w.detach(), weights[-1], rtol=0, atol=1e-12), k


def test_checkpoint_round_trip_through_torch_save_continues_exactly_and_the_history_matters():
    factory = partial(DelayCompensation, optimizer=partial(torch.optim.AdamW, lr=0.05), coefficient=3.0, ema=0.5)

    def train(w, opt, ks):
        for k in ks:
            w.grad = grad_at(w.detach() * (1 + 0.1 * k))  # differs per step and depends on w
            opt.step()

    w = nn.Parameter(W0.clone())
    opt = factory([w])
    train(w, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"w": w.detach().clone(), "opt": opt.state_dict()}, buffer)
    train(w, opt, range(3, 6))

    def resumed(keep_state: bool) -> torch.Tensor:
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        w2 = nn.Parameter(saved["w"].clone())
        opt2 = factory([w2])
        if keep_state:
            opt2.load_state_dict(saved["opt"])
            assert {WEIGHT_HISTORY, SQUARE_AVERAGE} <= set(opt2.state[w2])
        else:
            inner = saved["opt"]
            for state in inner["state"].values():
                state.pop(WEIGHT_HISTORY), state.pop(SQUARE_AVERAGE)
            opt2.load_state_dict(inner)
        train(w2, opt2, range(3, 6))
        return w2.detach()

    assert torch.equal(resumed(keep_state=True), w.detach())
    assert (resumed(keep_state=False) - w.detach()).abs().max() > 1e-6


@pytest.mark.parametrize("kwargs, message", [
    ({"coefficient": -1.0}, r"coefficient must be >= 0, got -1\.0"),
    ({"delay": -1}, r"delay must be an integer >= 0 .* got -1"),
    ({"delay": 1.5}, r"delay must be an integer >= 0 .* got 1\.5"),
    ({"ema": 1.0}, r"ema must be None .* in \[0, 1\), got 1\.0"),
])
def test_bad_settings_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayCompensation([nn.Parameter(W0.clone())], optimizer=partial(torch.optim.SGD, lr=LR), **kwargs)


def test_a_bad_group_coefficient_is_refused_naming_the_group():
    a, b = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    with pytest.raises(ValueError, match=r"coefficient of parameter group 1 must be >= 0, got -2"):
        DelayCompensation([{"params": [a]}, {"params": [b], "coefficient": -2}],
                          optimizer=partial(torch.optim.SGD, lr=LR))


def test_staleness_monitor_logs_the_compensation_term_relative_to_the_stale_gradient(tmp_path):
    """compensation_ratio at update k = ||c g g (W_k - W_{k-1})|| / ||g||, g the gradient of batch k at W_{k-1},
    recomputed here from the weights saved at every step (whole model and per stage)."""
    from test_callbacks import WeightRecorder, close, fit, scalars

    from lightning_async_pp.callbacks import StalenessMonitor

    c, steps = 2.0, 4
    model = CompensatedTinyLM(coefficient=c)
    initial = copy.deepcopy(model)
    recorder = WeightRecorder()
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", 4, num_stages=2), [recorder, StalenessMonitor()],
                     model=model, steps=steps)
    logged = scalars(trainer)
    batches = list(loader())
    stage_sizes = [len(w) for w in recorder.weights[0]]
    for k in range(steps):
        current = [t.double() for w in recorder.weights[k] for t in w]
        stale = [t.double() for w in recorder.weights[max(k - 1, 0)] for t in w]
        reference = copy.deepcopy(initial).double()
        with torch.no_grad():
            for p, w in zip(reference.parameters(), stale):
                p.copy_(w)
        batch = [t.double() for t in batches[k]]
        grads = torch.autograd.grad(reference.pipeline_loss(reference.pipeline_forward(batch), batch),
                                    list(reference.parameters()))
        terms = [c * g * g * (w - s) for g, w, s in zip(grads, current, stale)]
        sq = lambda ts: sum(float((t**2).sum()) for t in ts)  # noqa: E731
        assert close(logged["staleness/compensation_ratio"][k], (sq(terms) / sq(grads)) ** 0.5, rel=1e-4, abs_=1e-9)
        n0 = stage_sizes[0]
        assert close(logged["staleness/stage0/compensation_ratio"][k],
                     (sq(terms[:n0]) / sq(grads[:n0])) ** 0.5, rel=1e-4, abs_=1e-9)
    assert logged["staleness/compensation_ratio"][0] == 0.0  # W_b = W_k at the first update
    assert min(logged["staleness/compensation_ratio"][k] for k in range(1, steps)) > 1e-6
    assert "staleness/correction_norm" not in logged and "staleness/lr_factor" not in logged


def test_step_records_the_squared_norms_of_the_term_and_the_gradient():
    w = nn.Parameter(W0.clone())
    opt = DelayCompensation([w], optimizer=partial(torch.optim.SGD, lr=LR), coefficient=C)
    w.grad = grad_at(W0)
    opt.step()
    before = w.detach().clone()
    g = grad_at(W0)
    w.grad = g
    opt.step()
    term_sq, grad_sq = opt.last_square_norms[w]
    assert torch.allclose(term_sq, ((C * g * g * (before - W0)) ** 2).sum(), rtol=1e-12)
    assert torch.allclose(grad_sq, (g**2).sum(), rtol=1e-12)


def test_the_monitor_finds_the_compensation_inside_error_feedback_and_lightnings_wrapper():
    from types import SimpleNamespace

    from lightning_async_pp.callbacks.staleness import _compensation_norms

    w = nn.Parameter(W0.clone())
    opt = ErrorFeedback([w], optimizer=partial(DelayCompensation, optimizer=partial(torch.optim.SGD, lr=LR),
                                               coefficient=C), coefficient=0.5)
    for k in range(2):
        w.grad = grad_at(W0 * (k + 1))
        opt.step()
    norms = _compensation_norms([SimpleNamespace(optimizer=opt)])  # as a LightningOptimizer holds it
    assert set(norms) == {w} and norms[w] is opt.wrapped.last_square_norms[w]
    assert float(norms[w][0]) > 0


class ScheduledCompensatedTinyLM(CompensatedTinyLM):
    """DelayCompensation with a PipeMareLR at the given interval."""

    def __init__(self, interval: str, pipemare_delay: int, frequency: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.interval, self.pipemare_delay, self.frequency = interval, pipemare_delay, frequency

    def configure_optimizers(self):
        from lightning_async_pp.optim import PipeMareLR

        opt = super().configure_optimizers()
        sched = PipeMareLR(opt, delay=self.pipemare_delay, warmup_steps=4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval,
                                                   "frequency": self.frequency}}


@pytest.mark.parametrize("schedule, strategy_delay, model, message", [
    ("1f1b", None, CompensatedTinyLM(coefficient=1.0, delay=1), r"DelayCompensation\(delay=1\) .* 0 update\(s\) stale"),
    ("2bw", 2, CompensatedTinyLM(coefficient=1.0, delay=1), r"DelayCompensation\(delay=1\) .* 2 update\(s\) stale"),
    ("2bw", 2, ScheduledCompensatedTinyLM("epoch", 2, coefficient=1.0, delay=2), r"interval 'step' \(got 'epoch'\)"),
    ("2bw", 2, ScheduledCompensatedTinyLM("step", 3, coefficient=1.0, delay=2), r"PipeMareLR\(delay=3\) .* 2 update"),
    # stepped every second update it would count half the updates (6 updates gave 3 steps)
    ("2bw", 2, ScheduledCompensatedTinyLM("step", 2, frequency=2, coefficient=1.0, delay=2),
     r"PipeMareLR counts updates: give it with frequency 1 \(got 2"),
])
def test_a_correction_told_another_delay_than_the_pipelines_is_refused_before_training(schedule, strategy_delay, model,
                                                                                       message):
    before = [p.detach().clone() for p in model.parameters()]
    strategy = AsyncPipelineStrategy(schedule, num_microbatches=4, num_stages=2, delay=strategy_delay)
    t = trainer(strategy, steps=2)
    with pytest.raises(ValueError, match=message):
        t.fit(model, loader())
    assert t.global_step == 0 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
