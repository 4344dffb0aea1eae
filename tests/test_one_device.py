"""AsyncPipelineStrategy on one device: the update rules of docs/design/update-rule.md, checked against plain loops."""
from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers import ResumableLoader, TinyLM, make_dataset, one_device_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule
from lightning_async_pp.pipeline.runtime import PipelineRuntime
from lightning_async_pp.pipeline.stage import Stage

STEPS = 6


def trainer(strategy=None, steps=STEPS, **kwargs) -> L.Trainer:
    return one_device_trainer(strategy, steps, **kwargs)


def loader(batch_size=8, samples=64) -> DataLoader:
    return DataLoader(make_dataset(samples), batch_size=batch_size, shuffle=False, drop_last=True)


class ScheduledTinyLM(TinyLM):
    """AdamW with a warmup scheduler stepped every update, to check schedulers act on the stale gradient."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def delayed_reference(model: TinyLM, batches, steps: int, delay: int = 1, clip: float | None = None,
                      version_for=None, stale_params=None):
    """docs/design/update-rule.md's update rule written out: W_{k+1} = W_k - U(grad f(W_{version_for(k)}; B_k)), optimizer state never rewound.

    ``version_for(k)`` defaults to ``max(k - delay, 0)``; ``stale_params`` (default: all) are the parameters that
    take their gradient at that older version, the others at ``W_k`` (per-stage delays).
    """
    config = model.configure_optimizers()
    opt = config["optimizer"] if isinstance(config, dict) else config
    sched = config["lr_scheduler"]["scheduler"] if isinstance(config, dict) else None
    params = list(model.parameters())
    stale = params if stale_params is None else list(stale_params)
    version_for = version_for or (lambda k: max(k - delay, 0))
    history = [[p.detach().clone() for p in stale]]  # history[j] = W_j of the stale parameters
    for k in range(steps):
        current = [p.detach().clone() for p in stale]
        for p, w in zip(stale, history[version_for(k)]):
            p.data.copy_(w)
        opt.zero_grad()
        batch = batches[k % len(batches)]
        model.pipeline_loss(model.pipeline_forward(batch), batch).backward()
        for p, w in zip(stale, current):
            p.data.copy_(w)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched is not None:
            sched.step()
        history.append([p.detach().clone() for p in stale])
    return params


def max_param_difference(a: nn.Module, b) -> float:
    b_params = list(b.parameters()) if isinstance(b, nn.Module) else list(b)
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b_params))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_2bw_final_weights_follow_the_one_step_delayed_recurrence(optimizer):
    model = TinyLM(optimizer=optimizer)
    reference = delayed_reference(copy.deepcopy(model), list(loader()), STEPS, delay=1)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4)).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6
    # The delay matters: the synchronous recurrence ends elsewhere.
    synchronous = delayed_reference(TinyLM(optimizer=optimizer), list(loader()), STEPS, delay=0)
    assert max_param_difference(model, synchronous) > 1e-4


def test_2bw_scheduler_and_clipping_act_on_the_stale_gradient():
    model = ScheduledTinyLM()
    reference = delayed_reference(copy.deepcopy(model), list(loader()), STEPS, delay=1, clip=0.05)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=2), gradient_clip_val=0.05).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1"])
def test_synchronous_schedules_equal_ordinary_lightning_training(schedule):
    model = TinyLM(optimizer="adamw")
    plain = copy.deepcopy(model)
    trainer(AsyncPipelineStrategy(schedule, num_microbatches=4)).fit(model, loader())
    trainer().fit(plain, loader())
    assert max_param_difference(model, plain) < 1e-6


def test_registered_strategy_name_trains_with_2bw_semantics():
    model = TinyLM()
    reference = delayed_reference(copy.deepcopy(model), list(loader()), STEPS, delay=1)
    t = trainer("async_pipeline")
    t.fit(model, loader())
    assert isinstance(t.strategy, AsyncPipelineStrategy) and t.strategy.schedule == "2bw"
    assert max_param_difference(model, reference) < 1e-6


def test_microbatched_gradient_equals_whole_batch_gradient():
    model = TinyLM()
    whole = copy.deepcopy(model)
    batch = next(iter(loader(batch_size=16)))
    whole.pipeline_loss(whole.pipeline_forward(batch), batch).backward()
    stages = [Stage(model.pipeline_layers()[:2], 0, 2, delay=0), Stage(model.pipeline_layers()[2:], 1, 2, delay=0)]
    pipeline = PipelineRuntime(stages, schedule="1f1b", num_microbatches=4, input_fn=model.pipeline_input,
                               loss_fn=model.pipeline_loss)
    loss = pipeline.train_batch(batch)
    expected_loss = whole.pipeline_loss(whole.pipeline_forward(batch), batch)
    assert torch.allclose(loss, expected_loss, atol=1e-6)
    for g, p in zip(pipeline.gradients, whole.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_2bw_stash_holds_exactly_the_parameter_bytes():
    model = TinyLM()
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4)
    trainer(strategy, steps=2).fit(model, loader())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert strategy.engine.stats.stash_nbytes == param_bytes
    synchronous = AsyncPipelineStrategy("1f1b", num_microbatches=4)
    trainer(synchronous, steps=2).fit(TinyLM(), loader())
    assert synchronous.engine.stats.stash_nbytes == 0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resume_from_checkpoint_continues_exactly(tmp_path, optimizer):
    # Stop after k=3 updates, mid-epoch (4 batches per epoch), and continue to N=7 from the saved file.
    def data():
        return ResumableLoader(make_dataset(32), batch_size=8)

    uninterrupted = TinyLM(optimizer=optimizer)
    first_part = copy.deepcopy(uninterrupted)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4), steps=7).fit(uninterrupted, data())

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, save_distributed_checkpoint=False)  # one file
    t = trainer(strategy, steps=3, enable_checkpointing=True, callbacks=[checkpoint])
    t.fit(first_part, data())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["async_pipeline"]["num_updates"] == 3
    # W_k is the state_dict, W_{k-1} the stash: both for every parameter.
    names = [n for n, _ in first_part.named_parameters()]
    assert sorted(saved["state_dict"]) == sorted(first_part.state_dict())
    assert sorted(k for k in saved["async_pipeline"]["tensors"] if k.startswith("stash.")) == sorted(f"stash.1.{n}" for n in names)
    assert not list(tmp_path.glob("*.tmp-*"))  # written beside the target, then renamed

    resumed = TinyLM(optimizer=optimizer, seed=123)  # other initial weights: everything must come from the file
    t = trainer(AsyncPipelineStrategy("2bw", num_microbatches=4), steps=7)
    t.fit(resumed, data(), ckpt_path=tmp_path / "last.ckpt")
    assert max_param_difference(resumed, uninterrupted) < 1e-6


def test_a_batch_size_the_microbatches_do_not_divide_is_refused_before_the_first_step():
    class CountBatches(L.Callback):
        started = 0

        def on_train_batch_start(self, *args) -> None:
            CountBatches.started += 1

    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"The training dataloader's batch_size=6 cannot be split into "
                                         r"num_microbatches=4 equal microbatches; use a batch size that is a multiple "
                                         r"of 4, or a num_microbatches that divides 6"):
        trainer(AsyncPipelineStrategy("2bw", num_microbatches=4), callbacks=[CountBatches()]).fit(model, loader(batch_size=6))
    assert CountBatches.started == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # a loader whose batch sampler has no batch_size is still checked at each batch, by the engine
    with pytest.raises(ValueError, match=r"A batch of size 6 cannot be split into num_microbatches=4"):
        batches = DataLoader(make_dataset(12), batch_sampler=[list(range(6)), list(range(6, 12))])
        trainer(AsyncPipelineStrategy("2bw", num_microbatches=4)).fit(TinyLM(), batches)


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Unknown schedule 'pipedream'.*'2bw', '1f1b', 'gpipe'"):
        AsyncPipelineStrategy("pipedream")


def test_module_that_is_not_a_pipeline_module_is_a_clear_error():
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match=r"PipelineModule; got Plain"):
        trainer(AsyncPipelineStrategy()).fit(Plain(), loader())


def test_pipeline_layers_returning_nothing_is_a_clear_error():
    class Empty(TinyLM):
        def pipeline_layers(self):
            return []

    with pytest.raises(ValueError, match=r"pipeline_layers\(\) returned no layers"):
        trainer(AsyncPipelineStrategy()).fit(Empty(), loader())


def test_parameters_outside_every_layer_are_a_clear_error():
    class Orphan(TinyLM):
        def __init__(self):
            super().__init__()
            self.stray = nn.Parameter(torch.zeros(3))

    with pytest.raises(ValueError, match=r"outside every pipeline layer.*stray"):
        trainer(AsyncPipelineStrategy()).fit(Orphan(), loader())


def test_validation_uses_the_newest_weights():
    model = TinyLM()
    t = trainer(AsyncPipelineStrategy("2bw", num_microbatches=4), steps=3, limit_val_batches=2, val_check_interval=3)
    t.fit(model, loader(), loader())
    val = next(iter(loader()))
    expected = model.pipeline_loss(model.pipeline_forward(val), val)
    second = next(x for i, x in enumerate(loader()) if i == 1)
    expected = (expected + model.pipeline_loss(model.pipeline_forward(second), second)) / 2
    assert torch.allclose(t.callback_metrics["val_loss"], expected, atol=1e-6)


def test_pipeline_module_trains_without_the_strategy():
    model = TinyLM()
    before = copy.deepcopy(model)
    trainer(steps=2).fit(model, loader())
    assert max_param_difference(model, before) > 0
    assert isinstance(model, PipelineModule)
