"""``lightning_async_pp.optim.WeightPrediction``: a delayed batch runs on ``W_v + s d (W_v - W_{v-1})``, checked
against that rule written out in a plain loop: on one device with 3 stages at delays 1 and 2, per-group scales,
with ``ErrorFeedback`` in either order, with ``optim.Muon``, with a synchronous tail, through a checkpoint, and the
memory it holds."""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers import ResumableLoader, TinyLM, make_dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from test_one_device import loader, max_param_difference, trainer
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim import DelayCompensation, ErrorFeedback, Muon, WeightPrediction
from lightning_async_pp.optim.weight_prediction import GROUP_SCALE, prediction_scales

SCALE = 0.7


def adamw(params):
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


class PredictedTinyLM(TinyLM):
    """``build(parameter groups)`` is the optimizer; the groups split the layers in two, the second half with its
    own ``prediction_scale`` when ``second_scale`` is given."""

    def __init__(self, build, second_scale: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.build, self.second_scale = build, second_scale

    def groups(self) -> list[dict]:
        params = list(self.parameters())
        second = {"params": params[len(params) // 2:]}
        if self.second_scale is not None:
            second[GROUP_SCALE] = self.second_scale
        return [{"params": params[:len(params) // 2]}, second]

    def configure_optimizers(self):
        return self.build(self.groups())


def written_out(model: PredictedTinyLM, batches, steps: int, delay: int, scales: list[float],
                sync_from: int | None = None, sync_head: int = 0) -> list[torch.Tensor]:
    """The rule by hand: batch k's gradient is taken on W_k if it is synchronous (k < sync_head or
    k >= sync_from), else on
    W_v + s d (W_v - W_{v-1}), v = k - min(d, k), W_{-1} = W_0; the optimizer then steps W_k (state never
    rewound). ``scales``: s per parameter."""
    opt = model.configure_optimizers()
    params = list(model.parameters())
    history = [[p.detach().clone() for p in params]]
    for k in range(steps):
        if k < sync_head or sync_from is not None and k >= sync_from:
            weights = history[k]
        else:
            v = k - min(delay, k)
            before = history[max(v - 1, 0)]
            weights = [w + s * delay * (w - b) for w, b, s in zip(history[v], before, scales)]
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
        opt.zero_grad()
        batch = batches[k]
        model.pipeline_loss(model.pipeline_forward(batch), batch).backward()
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history[-1]


def scales_of(model: PredictedTinyLM, first: float, second: float) -> list[float]:
    n = len(list(model.parameters()))
    return [first] * (n // 2) + [second] * (n - n // 2)


@pytest.mark.parametrize("delay", [1, 2])
def test_on_one_device_with_three_stages_delayed_batches_run_on_the_written_out_prediction(delay):
    steps = 6
    build = partial(WeightPrediction, optimizer=adamw, scale=SCALE)
    model = PredictedTinyLM(build, second_scale=1.5)
    reference = written_out(copy.deepcopy(model), list(loader()), steps, delay, scales_of(model, SCALE, 1.5))
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=3, delay=delay)
    trainer(strategy, steps=steps).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6
    # the prediction matters: weight stashing alone (s = 0) ends elsewhere, and so does one scale for both groups
    stashing = written_out(PredictedTinyLM(build), list(loader()), steps, delay, scales_of(model, 0.0, 0.0))
    assert max_param_difference(model, stashing) > 1e-4
    one_scale = written_out(PredictedTinyLM(build), list(loader()), steps, delay, scales_of(model, SCALE, SCALE))
    assert max_param_difference(model, one_scale) > 1e-5
    # memory: the true newest weights plus d + 1 slots of predictions (2BW: one more than weight stashing)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert strategy.engine.stats.stash_nbytes == (delay + 1) * param_bytes


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_with_error_feedback_in_either_order_both_rules_hold(order):
    """ErrorFeedback(WeightPrediction(AdamW)) and WeightPrediction(ErrorFeedback(AdamW)): the gradient at the
    prediction, W_{k+1} = W_k - u_k - c (u_k - u_{k-1}); the prediction extrapolates the whole last update."""
    c = 0.8
    if order == "outside":
        build = partial(ErrorFeedback, optimizer=partial(WeightPrediction, optimizer=adamw, scale=SCALE), coefficient=c)
    else:
        build = partial(WeightPrediction, optimizer=partial(ErrorFeedback, optimizer=adamw, coefficient=c), scale=SCALE)
    model = PredictedTinyLM(build)
    reference = written_out(PredictedTinyLM(partial(ErrorFeedback, optimizer=adamw, coefficient=c)),
                            list(loader()), 6, 1, scales_of(model, SCALE, SCALE))
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2)).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6


def test_with_muon_and_synchronous_head_and_tail_those_batches_run_on_the_true_weights():
    """sync_steps=2, sync_from_step=6: batches 0, 1 and 6, 7 synchronous; batch 2 is the first on a prediction
    (of W_1, from W_1 and W_0, which no synchronous batch needed)."""
    steps, scales = 8, [SCALE] * len(list(TinyLM().parameters()))
    build = partial(WeightPrediction, optimizer=partial(Muon, lr=0.05), scale=SCALE)
    model = PredictedTinyLM(build)
    reference = written_out(copy.deepcopy(model), list(loader()), steps, 1, scales, sync_from=6, sync_head=2)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2, sync_steps=2, sync_from_step=6),
            steps=steps).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-5
    predicted_tail = written_out(PredictedTinyLM(build), list(loader()), steps, 1, scales, sync_head=2)
    assert max_param_difference(model, predicted_tail) > 1e-5


def test_resume_from_a_checkpoint_continues_exactly_and_saves_the_newest_prediction(tmp_path):
    def data():
        return ResumableLoader(make_dataset(32), batch_size=8)

    build = partial(WeightPrediction, optimizer=adamw, scale=SCALE)
    uninterrupted = PredictedTinyLM(build)
    first_part = copy.deepcopy(uninterrupted)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2), steps=7).fit(uninterrupted, data())

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2, save_distributed_checkpoint=False)
    trainer(strategy, steps=3, enable_checkpointing=True, callbacks=[checkpoint]).fit(first_part, data())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["async_pipeline"]["tensors"]
    names = [n for n, _ in first_part.named_parameters()]
    assert sorted(k for k in saved if k.startswith("stash.")) == sorted(f"stash.{o}.{n}" for o in (0, 1) for n in names)

    resumed = PredictedTinyLM(build, seed=123)  # other initial weights: everything must come from the file
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2), steps=7).fit(
        resumed, data(), ckpt_path=tmp_path / "last.ckpt")
    assert max_param_difference(resumed, uninterrupted) < 1e-6
    # the newest prediction is needed: without "stash.0" the resumed run predicts from the saved prediction
    # W_hat_{k-1} instead of W_{k-1}, and ends elsewhere
    torch.save(dict(torch.load(tmp_path / "last.ckpt", weights_only=False)), tmp_path / "copy.ckpt")
    bare = torch.load(tmp_path / "copy.ckpt", weights_only=False)
    bare["async_pipeline"]["tensors"] = {k: v for k, v in saved.items() if not k.startswith("stash.0.")}
    torch.save(bare, tmp_path / "bare.ckpt")
    other = PredictedTinyLM(build, seed=123)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2), steps=7).fit(
        other, data(), ckpt_path=tmp_path / "bare.ckpt")
    assert max_param_difference(other, uninterrupted) > 1e-6


def test_prediction_scales_reads_every_wrapper_of_the_chain_and_group_scales():
    a, b, c = (nn.Parameter(torch.ones(2)) for _ in range(3))
    opt = ErrorFeedback([{"params": [a]}, {"params": [b], GROUP_SCALE: 0.0}, {"params": [c], GROUP_SCALE: 2.0}],
                        optimizer=partial(WeightPrediction, optimizer=adamw, scale=0.5))
    assert prediction_scales([opt]) == {id(a): 0.5, id(c): 2.0}
    assert prediction_scales([ErrorFeedback([a], optimizer=adamw)]) == {}


@pytest.mark.parametrize("build, strategy, message", [
    (partial(WeightPrediction, optimizer=partial(DelayCompensation, optimizer=adamw)), AsyncPipelineStrategy("2bw", 4),
     r"combines WeightPrediction with DelayCompensation, which is not defined"),
    (partial(DelayCompensation, optimizer=partial(WeightPrediction, optimizer=adamw)), AsyncPipelineStrategy("2bw", 4),
     r"combines WeightPrediction with DelayCompensation"),
    (partial(WeightPrediction, optimizer=adamw), AsyncPipelineStrategy("1f1b", 4),
     r"WeightPrediction under a synchronous pipeline \(delay \[0\]\): .* Use schedule='2bw'"),
])
def test_combinations_without_a_defined_rule_are_refused_before_training(build, strategy, message):
    model = PredictedTinyLM(build)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        trainer(strategy).fit(model, loader())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_scale_zero_is_allowed_anywhere_and_a_negative_scale_is_refused_naming_it():
    trainer(AsyncPipelineStrategy("1f1b", 4), steps=2).fit(
        PredictedTinyLM(partial(WeightPrediction, optimizer=adamw, scale=0.0)), loader())
    with pytest.raises(ValueError, match=r"WeightPrediction scale must be >= 0, got -1\.0"):
        WeightPrediction([nn.Parameter(torch.ones(2))], optimizer=adamw, scale=-1.0)
    with pytest.raises(ValueError, match=r"prediction_scale of parameter group 1 must be >= 0, got -2"):
        WeightPrediction([{"params": [nn.Parameter(torch.ones(2))]},
                          {"params": [nn.Parameter(torch.ones(2))], GROUP_SCALE: -2}], optimizer=adamw)


def test_staleness_monitor_measures_drift_to_the_prediction_and_the_true_update(tmp_path):
    """Under prediction the drift is ||W_k - W_hat|| / ||W_k||, W_hat = W_{k-1} + s (W_{k-1} - W_{k-2}) the
    weights batch k ran on, and update_norm is ||W_{k+1} - W_k||, both recomputed from the weights at every step
    (the older slots hold predictions, so the monitor keeps its own copy of W_k for the update)."""
    from test_callbacks import WeightRecorder, close, fit, scalars

    from lightning_async_pp.callbacks import StalenessMonitor

    steps = 5
    recorder = WeightRecorder()
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", 4, num_stages=2), [recorder, StalenessMonitor()],
                     model=PredictedTinyLM(partial(WeightPrediction, optimizer=adamw, scale=SCALE)), steps=steps)
    logged = scalars(trainer)
    w = {k: torch.cat([t.flatten().double() for stage in recorder.weights[k] for t in stage]) for k in recorder.weights}
    for k in range(steps):
        v = k - min(1, k)
        predicted = w[v] + SCALE * (w[v] - w[max(v - 1, 0)])
        assert close(logged["staleness/drift"][k], float((w[k] - predicted).norm() / w[k].norm()), rel=1e-4, abs_=1e-9)
        assert close(logged["staleness/update_norm"][k], float((w[k + 1] - w[k]).norm()), rel=1e-4, abs_=1e-9)
    assert logged["staleness/drift"][3] > 0
