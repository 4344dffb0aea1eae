"""Activation checkpointing: layers that recompute their forward in backward give the results of layers that keep
their activations, because the recomputation reads the weight version the batch is due (docs/design/stages.md,
"Activation checkpointing")."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from helpers import TinyLM, make_dataset, one_device_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import seam_fit  # noqa: E402
from test_lightning_seam import OWN_SAMPLER, max_difference, seam_results  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.pipeline.config import PipelineConfig  # noqa: E402
from lightning_async_pp.pipeline.stage import Stage  # noqa: E402

# Checkpointing replays the same operations on the same tensors: the results agree to rounding at most.
TOL = 1e-6
BASE = dict(model={"optimizer": "adamw"}, schedule="2bw", steps=6, data={"samples": 64, "batch": 8}, microbatches=4)


def one_device(cfg: dict, **strategy_kwargs) -> dict:
    return seam_fit.run(dict(cfg, strategy_kwargs=dict(cfg.get("strategy_kwargs", {}), **strategy_kwargs)), devices=1)[0]


def assert_same_run(on: dict, off: dict) -> None:
    assert len(on["losses"]) == len(off["losses"]) == BASE["steps"]
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=0, atol=TOL)
    assert max_difference(on["state_dict"], off["state_dict"]) <= TOL


# ---- the whole run ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chosen", [True, [1, 3]])
def test_checkpointed_2bw_run_on_two_stages_equals_the_run_that_keeps_activations(chosen):
    # Under 2BW every batch after the first runs on the stash W_{k-1} while the parameters hold W_k: a
    # recomputation on the parameters would give other gradients from the second step on.
    off = one_device(BASE, num_stages=2)
    on = one_device(BASE, num_stages=2, activation_checkpointing=chosen)
    assert_same_run(on, off)


@pytest.mark.parametrize("stages", [1, 2])
def test_checkpointed_tied_embedding_and_head_equal_the_run_that_keeps_activations(stages):
    # One stage: the tie is within the stage; two stages on one device: the head's stage borrows the embedding.
    cfg = dict(BASE, model={"name": "tied"}, partition=[2, 2] if stages == 2 else [4])
    off = one_device(cfg, num_stages=stages)
    on = one_device(cfg, num_stages=stages, activation_checkpointing=True)
    assert_same_run(on, off)


def test_dropout_in_a_checkpointed_layer_draws_the_same_mask_in_the_recomputation():
    cfg = dict(BASE, model={"optimizer": "adamw", "dropout": 0.5})
    off = one_device(cfg, num_stages=2)
    on = one_device(cfg, num_stages=2, activation_checkpointing=True)
    assert_same_run(on, off)
    # dropout is live: the same weights without it give another loss
    assert abs(one_device(BASE, num_stages=2)["losses"][0] - off["losses"][0]) > 1e-4


# ---- the stage: which weights the recomputation reads ----------------------------------------------------------
def tied_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    first, middle, last = nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4)
    last.weight = first.weight  # one parameter used by two layers of the stage
    return [first, middle, last]


@pytest.mark.parametrize("checkpointed", [[True, True, True], [False, True, False], [True, False, True]])
def test_recomputation_reads_the_version_of_the_first_forward_not_the_newest_weights(checkpointed):
    layers = tied_layers()
    at_w0 = copy.deepcopy(layers)  # the reference: plain modules holding W_0 (the tie survives deepcopy)
    stage = Stage(layers, 0, 1, delay=1, checkpointed=checkpointed)
    x = torch.randn(5, 4)
    out = stage.forward(1, x)  # batch 1 is due W_0 and runs while W_0 is the newest (the 2BW lookahead)
    stage.versions.prepare_update()
    with torch.no_grad():  # the optimizer writes W_1 before batch 1's backward
        for p in stage.params:
            p.add_(1.0)
    out.pow(2).sum().backward()
    grads = stage.take_gradients(1)

    y = x
    for layer in at_w0:
        y = layer(y)
    y.pow(2).sum().backward()
    expected = [p.grad for p in nn.ModuleList(at_w0).parameters()]  # the tied weight once, its uses summed
    assert len(grads) == len(expected) == 5
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=TOL)


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    ("all", "must be True, False or a list of layer indices"),
    ([1.5], "must be True, False or a list of layer indices"),
    ([0, 0], "distinct layer indices >= 0"),
    ([-1], "distinct layer indices >= 0"),
])
def test_bad_activation_checkpointing_values_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(activation_checkpointing=bad)
    with pytest.raises(ValueError, match=match):
        AsyncPipelineStrategy(activation_checkpointing=bad)


def test_a_layer_index_past_the_last_layer_names_the_valid_range():
    loader = DataLoader(make_dataset(16), batch_size=8)
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, activation_checkpointing=[1, 7])
    with pytest.raises(ValueError, match=r"lists layer\(s\) \[7\], but the model has 4 pipeline layers \(valid indices 0\.\.3\)"):
        one_device_trainer(strategy, steps=1).fit(TinyLM(), loader)


# ---- across processes --------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_checkpointed_2bw_on_two_processes_equals_the_one_device_run_that_keeps_activations(tmp_path):
    cfg = dict(BASE, **OWN_SAMPLER)
    multi = seam_results(dict(cfg, strategy_kwargs={"activation_checkpointing": True}), tmp_path)[0]
    off = one_device(cfg, num_stages=2)
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(off["losses"]), rtol=0, atol=1e-5)
    assert max_difference(multi["state_dict"], off["state_dict"]) < 1e-5  # as the other multi-process tests
