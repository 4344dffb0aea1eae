"""Delay variants on one device: general delay d, per-stage delays (original PipeDream), sync start."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import TinyLM
from test_one_device import delayed_reference, loader, max_param_difference, trainer

from lightning_async_pp import AsyncPipelineStrategy

STEPS = 7


def fit(strategy: AsyncPipelineStrategy, optimizer="adamw", steps=STEPS) -> TinyLM:
    model = TinyLM(optimizer=optimizer)
    trainer(strategy, steps=steps).fit(model, loader())
    return model


def test_delay_zero_equals_1f1b_and_delay_one_equals_2bw():
    assert max_param_difference(fit(AsyncPipelineStrategy("2bw", 4, delay=0)), fit(AsyncPipelineStrategy("1f1b", 4))) == 0
    assert max_param_difference(fit(AsyncPipelineStrategy("1f1b", 4, delay=1)), fit(AsyncPipelineStrategy("2bw", 4))) == 0


@pytest.mark.parametrize("delay", [2, 3])
def test_delay_d_follows_the_d_step_delayed_recurrence(delay):
    model = TinyLM(optimizer="adamw")
    reference = delayed_reference(copy.deepcopy(model), list(loader()), STEPS, delay=delay)
    strategy = AsyncPipelineStrategy("2bw", 4, delay=delay)
    trainer(strategy, steps=STEPS).fit(model, loader())
    assert max_param_difference(model, reference) < 1e-6
    # at most d+1 versions: the stash is d parameter copies
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert strategy.engine.stats.stash_nbytes == delay * param_bytes


def test_sync_steps_switch_to_the_delayed_rule_at_the_right_update():
    sync = 3
    model = TinyLM(optimizer="adamw")
    reference = copy.deepcopy(model)
    trainer(AsyncPipelineStrategy("2bw", 4, sync_steps=sync), steps=STEPS).fit(model, loader())

    # Reference: update k uses W_k for k < sync_steps, W_{k-1} afterwards.
    params = delayed_reference(reference, list(loader()), STEPS, version_for=lambda k: k if k < sync else k - 1)
    assert max_param_difference(model, params) < 1e-6
    # switching one update later gives other weights
    later = fit(AsyncPipelineStrategy("2bw", 4, sync_steps=sync + 1))
    assert max_param_difference(model, later) > 1e-5


def test_per_stage_delays_model_original_pipedream():
    """Stage s of p uses delay p-1-s: each stage's gradient is taken with its own stale version."""
    model = TinyLM(optimizer="sgd", depth=4)
    reference = copy.deepcopy(model)
    strategy = AsyncPipelineStrategy("2bw", 4, delay=[1, 0], num_stages=2, partition=[2, 2])
    trainer(strategy, steps=STEPS).fit(model, loader())

    # Reference: layers 0-1 (stage 0) run on W_{k-1}, layers 2-3 (stage 1) on W_k.
    stage0 = [p for layer in reference.pipeline_layers()[:2] for p in layer.parameters()]
    delayed_reference(reference, list(loader()), STEPS, delay=1, stale_params=stage0)
    assert max_param_difference(model, reference) < 1e-6


def test_negative_delay_is_a_clear_error():
    with pytest.raises(ValueError, match=r"delay must be >= 0.*-1"):
        AsyncPipelineStrategy("2bw", 4, delay=-1)


def test_per_stage_delay_list_must_match_the_number_of_stages():
    with pytest.raises(ValueError, match=r"delay=\[2, 1, 0\] gives 3 per-stage delays but the pipeline has 2 stage"):
        trainer(AsyncPipelineStrategy("2bw", 4, delay=[2, 1, 0], num_stages=2)).fit(TinyLM(), loader())
