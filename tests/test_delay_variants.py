"""Delay variants on one device: general delay d, per-stage delays (original PipeDream), sync start, sync tail."""
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


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_from_step_makes_every_update_from_k_on_synchronous(optimizer):
    k_sync = 4
    model = TinyLM(optimizer=optimizer)
    reference = copy.deepcopy(model)
    trainer(AsyncPipelineStrategy("2bw", 4, sync_from_step=k_sync), steps=STEPS).fit(model, loader())

    # Reference (docs/design/update-rule.md): the delay is 1 for 0 < k < K and 0 for k >= K.
    params = delayed_reference(reference, list(loader()), STEPS,
                               version_for=lambda k: k if k == 0 or k >= k_sync else k - 1)
    assert max_param_difference(model, params) < 1e-6
    # one update more of the delayed rule ends elsewhere
    assert max_param_difference(model, fit(AsyncPipelineStrategy("2bw", 4, sync_from_step=k_sync + 1), optimizer)) > 1e-5


def test_sync_from_step_with_a_research_delay_and_a_sync_start():
    """delay=d with sync_steps=S and sync_from_step=K: delay 0 for k < S, d (at most k) for S <= k < K, 0 after."""
    d, s, k_sync = 2, 1, 5
    model = TinyLM(optimizer="adamw")
    reference = copy.deepcopy(model)
    strategy = AsyncPipelineStrategy("2bw", 4, delay=d, sync_steps=s, sync_from_step=k_sync)
    trainer(strategy, steps=STEPS + 1).fit(model, loader())

    params = delayed_reference(reference, list(loader()), STEPS + 1,
                               version_for=lambda k: k if k < s or k >= k_sync else max(k - d, 0))
    assert max_param_difference(model, params) < 1e-6
    assert strategy.engine.stages[0].versions.delay_for_batch(k_sync) == 0


def test_sync_from_step_zero_is_the_synchronous_schedule():
    assert max_param_difference(fit(AsyncPipelineStrategy("2bw", 4, sync_from_step=0)), fit(AsyncPipelineStrategy("1f1b", 4))) == 0


@pytest.mark.parametrize("bad", [-1, 2.5, "3"])
def test_bad_sync_from_step_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"sync_from_step must be None \(never\) or an integer >= 0.*{bad!r}"):
        AsyncPipelineStrategy("2bw", 4, sync_from_step=bad)


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


def test_a_second_fit_of_the_same_trainer_continues_the_update_count_and_the_stash():
    """fit(3 steps) then fit(up to 6) on one Trainer: updates 3..5 are updates 3..5 of the rule (sync_from_step counts
    them, batch 3 takes W_2), not a restart at 0. SGD is stateless, so the second fit's new optimizer (plain
    Lightning builds one per fit too) changes nothing; the data starts again, as under plain Lightning."""
    k_sync = 4
    model = TinyLM(optimizer="sgd")
    reference = copy.deepcopy(model)
    strategy = AsyncPipelineStrategy("2bw", 4, sync_from_step=k_sync)
    t = trainer(strategy, steps=3)
    t.fit(model, loader(samples=24))  # 3 batches
    t.fit_loop.epoch_loop.max_steps = 6
    t.fit(model, loader(samples=24))
    assert t.global_step == 6 and strategy.engine.stats.batch_index == 6
    params = delayed_reference(reference, list(loader(samples=24)), 6,
                               version_for=lambda k: k if k == 0 or k >= k_sync else k - 1)
    assert max_param_difference(model, params) < 1e-6
    # what a restart of the count gave: no stash for batch 3, and 2BW to the end (the switch at 4 never reached)
    restarted = delayed_reference(copy.deepcopy(reference), list(loader(samples=24)), 6,
                                  version_for=lambda k: k if k in (0, 3) else k - 1)
    assert max_param_difference(model, restarted) > 1e-5
