"""The backward split into an input-gradient pass and a weight-gradient pass (pipeline/backward.py), and the
``zb_h1`` schedule that uses it: the same numbers as the whole backward, bit for bit."""
from __future__ import annotations

import pytest
import torch
from helpers import TinyLM, make_dataset
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_pp.pipeline import runtime as runtime_module
from lightning_async_pp.pipeline.backward import backward_input, backward_weight
from lightning_async_pp.pipeline.runtime import PipelineRuntime
from lightning_async_pp.pipeline.stage import Stage


def batch(n=16):
    return next(iter(DataLoader(make_dataset(64), batch_size=n)))


def one_batch(schedule, model, cuts, *, checkpointed=False, trace=False):
    layers = model.pipeline_layers()
    p = len(cuts) - 1
    stages = [Stage(layers[cuts[i]:cuts[i + 1]], i, p, delay=0, checkpointed=[checkpointed] * (cuts[i + 1] - cuts[i]))
              for i in range(p)]
    rt = PipelineRuntime(stages, schedule=schedule, num_microbatches=4, input_fn=model.pipeline_input,
                         loss_fn=model.pipeline_loss)
    rt.trace = [] if trace else None
    loss = rt.train_batch(batch())
    return loss, [g.clone() for g in rt.gradients], rt.trace


def whole_batch_gradient(model):
    """The plain loop: one forward and backward of the whole batch through the layers in order."""
    b = batch()
    model.zero_grad()
    model.pipeline_loss(model.pipeline_forward(b), b).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def splits(monkeypatch):
    """Per input pass: whether it was split (it left weight gradients for W) rather than run whole."""
    seen = []

    def spy(*args):
        pending = backward_input(*args)
        seen.append(bool(pending.param_groups))
        return pending

    monkeypatch.setattr(runtime_module, "backward_input", spy)
    return seen


@pytest.mark.parametrize("checkpointed", [False, True])
def test_zb_h1_gives_1f1bs_gradient_bit_for_bit(splits, checkpointed):
    model = TinyLM(depth=6, tuple_boundary=True)  # a tuple crosses the first boundary
    loss_1f1b, grads_1f1b, _ = one_batch("1f1b", model, [0, 2, 4, 6])
    splits.clear()
    loss, grads, trace = one_batch("zb_h1", model, [0, 2, 4, 6], checkpointed=checkpointed, trace=True)
    assert loss.item() == loss_1f1b.item()
    assert len(grads) == len(grads_1f1b) and all(torch.equal(a, b) for a, b in zip(grads, grads_1f1b))
    # The split really ran: stages 1 and 2 (inputs that carry a gradient) split every microbatch; stage 0 (token
    # ids in, nothing to send back) runs its backward whole.
    assert splits.count(True) == 8 and splits.count(False) == 4
    # ... and the last stage defers its weight passes: ZB-H1's stage s defers s of them (the stages nearest the
    # loss are the ones the others wait on), so stage 2's first W follows its third I.
    last = [(s.args["part"], s.args["microbatch"]) for s in trace if s.name == "backward" and s.stage == 2]
    assert last[:4] == [("input", 0), ("input", 1), ("input", 2), ("weight", 0)]
    # (1f1b's gradient is the whole batch's: tests/test_one_device.py. TwoOutputs sums over the batch, so here the
    # microbatch mean is not the whole-batch gradient; the side-output test below checks against the plain loop.)


class SideOutput(nn.Module):
    """Passes its input on with a second output that only its own weight feeds: that weight's gradient does not
    cross the stage's input, so torch's parameter groups (which start from the input's path) miss it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.5, -1.5]))

    def forward(self, x):
        return torch.tanh(x), self.scale * 2.0


class Merge(nn.Module):
    def forward(self, pair):
        x, side = pair
        return x + side.sum()


class SideLM(TinyLM):
    def __init__(self):
        super().__init__(depth=3)
        self.layers = nn.ModuleList([nn.Linear(4, 8), SideOutput(), Merge(), nn.Linear(8, 1)])


def test_a_weight_whose_gradient_bypasses_the_input_gets_the_whole_backward(splits):
    model = SideLM()
    _, grads_1f1b, _ = one_batch("1f1b", model, [0, 1, 2, 4])
    splits.clear()
    _, grads, _ = one_batch("zb_h1", model, [0, 1, 2, 4])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_1f1b))
    scale = grads[2]  # Linear(4, 8) weight and bias, then SideOutput.scale
    assert scale.shape == (2,) and torch.allclose(scale, whole_batch_gradient(model)[2], atol=1e-6)
    assert splits.count(False) == 8 and splits.count(True) == 4  # stages 0 and 1 (the side weight) whole, 2 split


def test_the_weight_pass_adds_exactly_what_the_whole_backward_adds():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    seed = torch.randn(4, 3)
    inp = x.clone().requires_grad_(True)
    layer(inp).backward(seed)
    expected = [p.grad.clone() for p in layer.parameters()] + [inp.grad.clone()]
    layer.zero_grad(set_to_none=True)
    inp2 = x.clone().requires_grad_(True)
    out = layer(inp2)
    pending = backward_input([out], [seed], [inp2], list(layer.parameters()))
    assert all(p.grad is None for p in layer.parameters())  # the input pass computes no weight gradient
    assert torch.equal(inp2.grad, expected[-1])
    backward_weight(pending)
    assert all(torch.equal(p.grad, e) for p, e in zip(layer.parameters(), expected))
