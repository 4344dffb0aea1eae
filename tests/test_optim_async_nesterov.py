"""``lightning_async_pp.optim.AsyncNesterov`` (Ajanthan et al. 2025, AsyncPP's ``nadamw``): exactly torch's NAdam with
decoupled weight decay and beta1 = the (adaptive) momentum; inside ``ErrorFeedback`` against that recurrence written
out; under 2BW on one device against the delayed loop written out with torch's NAdam."""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers import TinyLM
from test_one_device import delayed_reference, loader, max_param_difference, trainer
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim import AsyncNesterov, ErrorFeedback

W0 = torch.tensor([0.5, -0.4, 1.1, -0.9], dtype=torch.float64)
A = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=torch.float64)
SETTINGS = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.1, "momentum_decay": 0.004}


def grad_at(w: torch.Tensor) -> torch.Tensor:
    return w**3 + A


def run(opt_factory, steps: int = 6) -> torch.Tensor:
    """The optimizer on gradients taken one step late (2BW's W_{k-1})."""
    w = nn.Parameter(W0.clone())
    opt = opt_factory([w])
    previous = W0.clone()
    for _ in range(steps):
        current = w.detach().clone()
        w.grad = grad_at(previous)
        opt.step()
        previous = current
    return w.detach()


def torch_nadam(params, momentum: float):
    return torch.optim.NAdam(params, betas=(momentum, 0.999), decoupled_weight_decay=True, **SETTINGS)


@pytest.mark.parametrize("adaptive, momentum", [(None, 0.99), ((1, 4), 0.9 + 1 * (0.99 - 0.9) / 4),
                                                ((3, 4), 0.9 + 3 * (0.99 - 0.9) / 4)])
def test_it_is_torch_nadam_with_decoupled_weight_decay_and_the_computed_momentum(adaptive, momentum):
    base = 0.99 if adaptive is None else 0.9
    ours = partial(AsyncNesterov, momentum=base, beta2=0.999, adaptive_momentum=adaptive, **SETTINGS)
    opt = ours([nn.Parameter(W0.clone())])
    assert opt.momentum == pytest.approx(momentum, rel=1e-15) and opt.param_groups[0]["decoupled_weight_decay"]
    assert torch.equal(run(ours), run(partial(torch_nadam, momentum=opt.momentum)))
    # and not torch's default NAdam (coupled L2 weight decay, beta1 0.9)
    default = partial(torch.optim.NAdam, **SETTINGS)
    assert (run(ours) - run(default)).abs().max() > 1e-6


def test_inside_error_feedback_it_follows_the_written_out_recurrence():
    """W_{k+1} = W_k - u_k - c (u_k - u_{k-1}), u_k the NAdam step from W_k (a separate torch NAdam on a copy)."""
    c = 0.7
    both = partial(ErrorFeedback, optimizer=partial(AsyncNesterov, momentum=0.99, **SETTINGS), coefficient=c)
    shadow = nn.Parameter(W0.clone())
    nadam = torch_nadam([shadow], momentum=0.99)
    weights, prev_u = [W0.clone()], None
    for k in range(6):
        with torch.no_grad():
            shadow.copy_(weights[k])
        shadow.grad = grad_at(weights[max(k - 1, 0)])
        nadam.step()
        u = weights[k] - shadow.detach()
        weights.append(weights[k] - u - (c * (u - prev_u) if prev_u is not None else 0))
        prev_u = u
    assert torch.allclose(run(both), weights[-1], rtol=0, atol=1e-12)
    assert (run(both) - run(partial(AsyncNesterov, momentum=0.99, **SETTINGS))).abs().max() > 1e-6


class NesterovTinyLM(TinyLM):
    def configure_optimizers(self):
        return AsyncNesterov(self.parameters(), lr=0.01, momentum=0.9, adaptive_momentum=(1, 3), weight_decay=0.1)


class TorchNAdamTinyLM(TinyLM):
    """The reference: torch's NAdam with the momentum computed by hand, 0.9 + 1 * (0.99 - 0.9) / 3 = 0.93."""

    def configure_optimizers(self):
        return torch.optim.NAdam(self.parameters(), lr=0.01, betas=(0.93, 0.999), weight_decay=0.1,
                                 decoupled_weight_decay=True)


@pytest.mark.parametrize("delay", [1, 2])
def test_under_the_pipeline_on_one_device_with_three_stages_it_follows_the_delayed_loop(delay):
    steps = 6
    model = NesterovTinyLM()
    reference = TorchNAdamTinyLM()
    reference.load_state_dict(model.state_dict())
    params = delayed_reference(reference, list(loader()), steps, delay=delay)
    trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=3, delay=delay), steps=steps).fit(model, loader())
    assert max_param_difference(model, params) < 1e-6
    synchronous = delayed_reference(copy.deepcopy(reference), list(loader()), steps, delay=0)
    assert max_param_difference(model, synchronous) > 1e-5


@pytest.mark.parametrize("kwargs, message", [
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\) .* got 1\.0"),
    ({"beta2": -0.1}, r"beta2 must be in \[0, 1\) .* got -0\.1"),
    ({"lr": -1e-3}, r"lr must be a number >= 0, got -0\.001"),
    ({"adaptive_momentum": (1,)}, r"adaptive_momentum must be None or \(delay, num_stages\).* got \(1,\)"),
    ({"adaptive_momentum": (1, 0)}, r"adaptive_momentum must be None or \(delay, num_stages\).* got \(1, 0\)"),
    ({"momentum": 0.5, "adaptive_momentum": (8, 4)}, r"adaptive momentum must be in \[0, 1\) .* got 1\.48"),
])
def test_bad_settings_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncNesterov([nn.Parameter(W0.clone())], **kwargs)
