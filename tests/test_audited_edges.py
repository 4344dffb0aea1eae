"""Edges that once gave silent wrong results, each against plain Lightning or a written-out loop (one device).

Multi-process counterparts live beside the runs they extend (test_multiprocess.py, test_llama_pipeline.py).
"""
from __future__ import annotations

import copy

import lightning as L
import torch
from torch.utils.data import DataLoader

from helpers import TinyLM, make_dataset, one_device_trainer
from lightning_async_pp import AsyncPipelineStrategy


class TwoOptimizers(TinyLM):
    """Manual optimization with SGD on the first two layers and Adam on the others, both stepped every batch."""

    def __init__(self) -> None:
        super().__init__(width=8, depth=4, seed=3)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        loss = self._loss(batch, batch_idx)
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self):
        return (torch.optim.SGD(self.layers[:2].parameters(), lr=0.1),
                torch.optim.Adam(self.layers[2:].parameters(), lr=0.01))


def test_two_optimizers_under_manual_optimization_both_update_as_in_plain_lightning():
    loader = DataLoader(make_dataset(32), batch_size=8)
    plain, piped = TwoOptimizers(), TwoOptimizers()
    piped.load_state_dict(plain.state_dict())
    start = copy.deepcopy(plain.state_dict())
    one_device_trainer(steps=4).fit(plain, loader)
    one_device_trainer(AsyncPipelineStrategy(schedule="1f1b", num_stages=2, num_microbatches=2), steps=4).fit(piped, loader)
    for name, value in plain.state_dict().items():
        assert not torch.equal(value, start[name]), f"{name} never moved in plain Lightning"
        assert torch.allclose(piped.state_dict()[name], value, atol=1e-6, rtol=0), name


def test_a_group_loaded_in_another_layout_keeps_its_own_param_names():
    from lightning_async_pp import checkpoint as ckpt
    from lightning_async_pp.checkpoint.layouts import _optimizer_by_name

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([("a", a), ("b", b)], lr=0.5)  # named parameters: the groups carry param_names
    (a.sum() + b.sum()).backward()
    saved.step()
    flat = _optimizer_by_name(saved, {id(a): "a", id(b): "b"}, f"{ckpt.OPTIM}0/")
    # Another layout: this process holds b alone.
    b2 = torch.nn.Parameter(torch.ones(3))
    loaded = torch.optim.AdamW([("b", b2)], lr=0.1)
    ckpt.load_optimizers([loaded], {id(b2): "b"}, copy.deepcopy(flat))
    group = loaded.param_groups[0]
    assert group["param_names"] == ["b"] and group["lr"] == 0.5
    assert torch.equal(loaded.state[b2]["exp_avg"], saved.state[b]["exp_avg"])
