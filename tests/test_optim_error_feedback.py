"""``lightning_async_pp.optim.ErrorFeedback``: ``W_{k+1} = W_k - u_k - c (u_k - u_{k-1})`` around any optimizer,
one buffer of state, checkpoints, bad input, and the nested LightningCLI YAML."""
from __future__ import annotations

import copy
import io
import math
from functools import partial

import pytest
import torch
from torch import nn

from lightning_async_pp.optim import PREV_UPDATE, ErrorFeedback, Muon

A = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=torch.float64)
W0 = torch.tensor([0.5, -0.4, 1.1, -0.9], dtype=torch.float64)


def grad_at(w: torch.Tensor) -> torch.Tensor:
    """Gradient of f(w) = sum(w^4)/4 + sum(A w): depends on w, so a wrong weight gives a wrong update."""
    return w**3 + A


def run(opt_factory, steps: int, coefficient: float) -> torch.Tensor:
    w = nn.Parameter(W0.clone())
    opt = ErrorFeedback([w], optimizer=opt_factory, coefficient=coefficient)
    for _ in range(steps):
        opt.zero_grad()
        (w.pow(4).sum() / 4 + (A * w).sum()).backward()
        opt.step()
    return w.detach()


def test_coefficient_zero_is_exactly_the_wrapped_optimizer():
    factory = partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    bare = nn.Parameter(W0.clone())
    bare_opt = factory([bare])
    for _ in range(5):
        bare_opt.zero_grad()
        (bare.pow(4).sum() / 4 + (A * bare).sum()).backward()
        bare_opt.step()
    assert torch.equal(run(factory, 5, coefficient=0.0), bare.detach())


def test_sgd_with_coefficient_one_follows_the_formula_written_out():
    lr = 0.1
    W1 = W0 - lr * grad_at(W0)
    u0 = W0 - W1
    u1 = lr * grad_at(W1)
    W2 = W1 - u1 - (u1 - u0)
    u2 = lr * grad_at(W2)
    W3 = W2 - u2 - (u2 - u1)
    assert torch.allclose(run(partial(torch.optim.SGD, lr=lr), 3, coefficient=1.0), W3, rtol=0, atol=1e-12)


def test_adamw_with_coefficient_half_matches_a_hand_written_adamw_and_correction():
    lr, wd, (b1, b2), eps, c = 0.05, 0.1, (0.9, 0.95), 1e-8, 0.5
    w, m, v, prev = W0.clone(), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), None
    for k in range(1, 6):
        g = grad_at(w)  # the wrapped optimizer sees the corrected weights W_k, weight decay included
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = lr * wd * w + (lr / (1 - b1**k)) * m / (v.sqrt() / math.sqrt(1 - b2**k) + eps)
        w = w - u if prev is None else w - u - c * (u - prev)
        prev = u
    factory = partial(torch.optim.AdamW, lr=lr, weight_decay=wd, betas=(b1, b2), eps=eps)
    assert torch.allclose(run(factory, 5, coefficient=c), w, rtol=0, atol=1e-12)


def test_the_wrapped_optimizer_moments_advance_once_per_step():
    w = nn.Parameter(W0.clone())
    opt = ErrorFeedback([w], optimizer=partial(torch.optim.Adam, lr=0.01), coefficient=1.0)
    for _ in range(3):
        opt.zero_grad()
        w.sum().backward()
        opt.step()
    assert opt.wrapped.state[w]["step"].item() == 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(7, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embedding(idx))))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def train(model: Net, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        idx = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        nn.functional.cross_entropy(model(idx).reshape(-1, 7), idx.roll(1, dims=1).reshape(-1)).backward()
        opt.step()


WRAPPED = {
    "adamw": partial(torch.optim.AdamW, lr=0.01),
    "sgd_momentum": partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "muon": partial(Muon, lr=0.02),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_state_dict_round_trip_through_torch_save_continues_exactly_as_uninterrupted(name):
    model = net()
    opt = ErrorFeedback(model.named_parameters(), optimizer=WRAPPED[name], coefficient=0.7)
    train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, range(3, 6))

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = net(seed=1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = ErrorFeedback(resumed.named_parameters(), optimizer=WRAPPED[name], coefficient=0.7)
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert all(PREV_UPDATE in resumed_opt.state[p] for p in resumed.parameters())
    train(resumed, resumed_opt, range(3, 6))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_losing_the_buffer_changes_the_trajectory():
    """Guards the round-trip test above: the buffer really matters after a restart."""
    model = net()
    opt = ErrorFeedback(model.parameters(), optimizer=WRAPPED["adamw"], coefficient=0.7)
    train(model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        del entry[PREV_UPDATE]
    forked = copy.deepcopy(model)
    forked_opt = ErrorFeedback(forked.parameters(), optimizer=WRAPPED["adamw"], coefficient=0.7)
    forked_opt.load_state_dict(saved)
    train(model, opt, range(3, 4))
    train(forked, forked_opt, range(3, 4))
    assert not torch.equal(model.hidden.weight, forked.hidden.weight)


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_persistent_state_is_one_parameter_sized_buffer_beyond_the_wrapped_optimizers_own(name):
    model, bare_model = net(), net()
    opt = ErrorFeedback(model.named_parameters(), optimizer=WRAPPED[name], coefficient=0.5)
    bare = WRAPPED[name](bare_model.named_parameters())
    train(model, opt, range(3))
    train(bare_model, bare, range(3))
    ours, theirs = opt.state_dict()["state"], bare.state_dict()["state"]
    params = [p for group in opt.param_groups for p in group["params"]]  # state_dict's index order
    assert ours.keys() == theirs.keys() or not theirs  # plain SGD-like optimizers may keep no state at all
    for index, param in enumerate(params):
        assert set(ours[index]) - set(theirs.get(index, {})) == {PREV_UPDATE}
        assert ours[index][PREV_UPDATE].shape == param.shape


def test_buffer_holds_the_last_update_of_the_wrapped_optimizer():
    w = nn.Parameter(W0.clone())
    opt = ErrorFeedback([w], optimizer=partial(torch.optim.SGD, lr=0.1), coefficient=1.0)
    for _ in range(2):
        opt.zero_grad()
        (w.pow(4).sum() / 4 + (A * w).sum()).backward()
        before = w.detach().clone()
        opt.step()
    assert torch.allclose(opt.state[w][PREV_UPDATE], 0.1 * grad_at(before), rtol=0, atol=1e-12)


def test_parameters_without_a_gradient_are_left_alone():
    used, unused = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    opt = ErrorFeedback([used, unused], optimizer=partial(torch.optim.SGD, lr=0.1), coefficient=1.0)
    for _ in range(2):
        opt.zero_grad()
        used.sum().backward()
        opt.step()
    assert torch.equal(unused, W0) and PREV_UPDATE not in opt.state[unused]


def test_a_scheduler_acts_on_the_wrapped_optimizers_learning_rate():
    model = net()
    opt = ErrorFeedback(model.named_parameters(), optimizer=WRAPPED["muon"], coefficient=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, range(1))
    scheduler.step()
    assert [g["lr"] for g in opt.wrapped.muon.param_groups + opt.wrapped.adamw.param_groups] == [0.01, 0.01]
    assert opt.param_groups is opt.wrapped.param_groups


def test_negative_coefficient_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"coefficient must be >= 0, got -0\.25"):
        ErrorFeedback([nn.Parameter(W0.clone())], optimizer=partial(torch.optim.SGD, lr=0.1), coefficient=-0.25)


def test_optimizer_that_builds_no_torch_optimizer_is_refused_naming_what_it_built():
    with pytest.raises(TypeError, match="must build a torch.optim.Optimizer.*returned object"):
        ErrorFeedback([nn.Parameter(W0.clone())], optimizer=lambda params: object())


# ---- LightningCLI ---------------------------------------------------------------------------------------------------

NESTED_YAML = """
optimizer:
  class_path: lightning_async_pp.optim.ErrorFeedback
  init_args:
    coefficient: 1.0
    optimizer:
      class_path: lightning_async_pp.optim.Muon
      init_args: {lr: 0.02}
"""


def build_cli(tmp_path, max_steps: int):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = tmp_path / "optimizer.yaml"
    config.write_text(NESTED_YAML)
    return LightningCLI(
        BoringModel, BoringDataModule, run=False, save_config_callback=None,
        args=["--config", str(config), f"--trainer.max_steps={max_steps}", "--trainer.logger=false",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_checkpointing=false",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"],
    )


def test_nested_yaml_builds_error_feedback_around_muon_that_trains_under_lightning(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-async-pp"])  # pytest's own arguments are not for the CLI
    cli = build_cli(tmp_path, max_steps=3)
    before = cli.model.layer.weight.detach().clone()
    cli.trainer.fit(cli.model, cli.datamodule)
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, ErrorFeedback) and opt.coefficient == 1.0
    assert isinstance(opt.wrapped, Muon) and opt.wrapped.muon.param_groups[0]["lr"] == 0.02
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]  # Linear weight -> Muon, bias -> AdamW
    assert not torch.equal(cli.model.layer.weight, before)
    assert PREV_UPDATE in opt.state[cli.model.layer.weight]


def test_lightning_checkpoint_resume_restores_the_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-async-pp"])
    cli = build_cli(tmp_path, max_steps=2)
    cli.trainer.fit(cli.model, cli.datamodule)
    cli.trainer.save_checkpoint(tmp_path / "two.ckpt")
    saved = cli.trainer.optimizers[0].state[cli.model.layer.weight][PREV_UPDATE].clone()

    resumed = build_cli(tmp_path, max_steps=2)  # nothing left to train: the restored state is what we see
    resumed.trainer.fit(resumed.model, resumed.datamodule, ckpt_path=tmp_path / "two.ckpt")
    opt = resumed.trainer.optimizers[0]
    assert resumed.trainer.global_step == 2
    assert torch.equal(opt.state[resumed.model.layer.weight][PREV_UPDATE], saved)
    assert opt.wrapped.muon.state[resumed.model.layer.weight][PREV_UPDATE] is opt.state[resumed.model.layer.weight][PREV_UPDATE]


# ---- per-group coefficients ------------------------------------------------------------------------------------
def hand_adamw_ef(steps: int, c: float, lr=0.05, wd=0.1, b1=0.9, b2=0.95, eps=1e-8) -> torch.Tensor:
    """AdamW and the correction written out for one tensor (c = 0: plain AdamW)."""
    w, m, v, prev = W0.clone(), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), None
    for k in range(1, steps + 1):
        g = grad_at(w)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = lr * wd * w + (lr / (1 - b1**k)) * m / (v.sqrt() / math.sqrt(1 - b2**k) + eps)
        w = w - u if prev is None or c == 0 else w - u - c * (u - prev)
        prev = u
    return w


def two_groups(first: dict, second: dict, coefficient: float):
    a, b = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    factory = partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt = ErrorFeedback([{"params": [a], **first}, {"params": [b], **second}], optimizer=factory, coefficient=coefficient)
    return a, b, opt


def step_both(a, b, opt, steps: range) -> None:
    for _ in steps:
        opt.zero_grad()
        (a.pow(4).sum() / 4 + (A * a).sum() + b.pow(4).sum() / 4 + (A * b).sum()).backward()
        opt.step()


@pytest.mark.parametrize("first, second, coefficient, expected", [
    ({}, {"coefficient": 0.0}, 1.0, (1.0, 0.0)),  # a group's own 0 beats the constructor's 1
    ({"coefficient": 1.0}, {}, 0.0, (1.0, 0.0)),  # a group's own 1 beats the constructor's 0
    ({"coefficient": 0.5}, {"coefficient": 2.0}, 1.0, (0.5, 2.0)),
], ids=["group0_off", "group1_on", "both_own"])
def test_each_group_follows_the_written_out_recurrence_with_its_own_coefficient(first, second, coefficient, expected):
    a, b, opt = two_groups(first, second, coefficient)
    step_both(a, b, opt, range(5))
    assert torch.allclose(a.detach(), hand_adamw_ef(5, expected[0]), rtol=0, atol=1e-12)
    assert torch.allclose(b.detach(), hand_adamw_ef(5, expected[1]), rtol=0, atol=1e-12)
    # a group with coefficient 0 keeps no buffer
    for p, c in zip((a, b), expected):
        assert (PREV_UPDATE in opt.state[p]) == (c > 0)


def test_group_coefficients_survive_a_checkpoint_round_trip_and_continue_exactly():
    a, b, opt = two_groups({}, {"coefficient": 0.0}, 1.0)
    step_both(a, b, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"a": a.detach().clone(), "b": b.detach().clone(), "opt": opt.state_dict()}, buffer)
    step_both(a, b, opt, range(3, 6))

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    a2, b2, opt2 = two_groups({}, {}, 1.0)  # built without the group key: the checkpoint brings it back
    with torch.no_grad():
        a2.copy_(checkpoint["a"])
        b2.copy_(checkpoint["b"])
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.group_coefficient(opt2.param_groups[1]) == 0.0
    step_both(a2, b2, opt2, range(3, 6))
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert torch.allclose(b2.detach(), hand_adamw_ef(6, 0.0), rtol=0, atol=1e-12)


def test_muon_coefficient_leaves_muons_part_uncorrected_and_corrects_the_adamw_part():
    """coefficient=1, muon_coefficient=0 (RamTorch's default) on a separable loss: the matrix (Muon part) follows
    bare Muon, the vector (AdamW part) follows AdamW with the correction written out."""
    B = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)

    def run(make):
        torch.manual_seed(0)
        matrix, vector = nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), nn.Parameter(W0.clone())
        opt = make([("matrix", matrix), ("vector", vector)])
        for _ in range(5):
            opt.zero_grad()
            (matrix.pow(4).sum() / 4 + (B * matrix).sum() + vector.pow(4).sum() / 4 + (A * vector).sum()).backward()
            opt.step()
        return matrix.detach(), vector.detach(), opt

    muon = partial(Muon, lr=0.05, weight_decay=0.1)
    matrix, vector, opt = run(partial(ErrorFeedback, optimizer=muon, coefficient=1.0, muon_coefficient=0.0))
    bare_matrix, _, _ = run(muon)
    corrected_matrix, _, _ = run(partial(ErrorFeedback, optimizer=muon, coefficient=1.0))
    assert [(g["use_muon"], opt.group_coefficient(g)) for g in opt.param_groups] == [(True, 0.0), (False, 1.0)]
    assert torch.equal(matrix, bare_matrix) and not torch.allclose(matrix, corrected_matrix, rtol=0, atol=1e-6)
    assert torch.allclose(vector, hand_adamw_ef(5, 1.0, lr=0.05, wd=0.1), rtol=0, atol=1e-12)
    # the Muon part keeps no buffer, the AdamW part does
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [PREV_UPDATE in opt.state[p] for p in params] == [False, True]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1"])
def test_bad_group_coefficient_is_refused_naming_the_group_and_value(bad):
    with pytest.raises(ValueError, match=rf"coefficient of parameter group 1 must be >= 0, got {bad!r}"):
        two_groups({}, {"coefficient": bad}, 1.0)
