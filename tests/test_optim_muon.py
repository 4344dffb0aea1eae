"""``lightning_async_pp.optim.Muon``: routing, equality with the two torch optimizers it delegates to, schedulers,
checkpoints, and construction from LightningCLI YAML."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_async_pp.optim import Muon

HIDDEN_MATRICES = {"blocks.0.attn.weight", "blocks.0.mlp.weight", "blocks.1.attn.weight", "blocks.1.mlp.weight"}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 2 * dim)
        self.mlp = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(self.norm(x))))


class TinyGPT(nn.Module):
    """Named like the example GPT: ``embedding.token``, ``embedding.position``, ``blocks.N.*``, ``head.norm``, ``head.proj``."""

    def __init__(self, vocab: int = 13, dim: int = 8, context: int = 6) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.token = nn.Embedding(vocab, dim)
        self.embedding.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Module()
        self.head.norm = nn.LayerNorm(dim)
        self.head.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding.token(idx) + self.embedding.position(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head.proj(self.head.norm(x))


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def loss_of(model: TinyGPT, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 13, (3, 6), generator=g)
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 13), idx[:, 1:].reshape(-1))


def routed(opt: Muon, model: nn.Module) -> tuple[set[str], set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    return muon, adamw


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def test_named_parameters_route_embeddings_head_norms_biases_to_adamw_and_block_matrices_to_muon():
    model = make_model()
    opt = Muon(model.named_parameters(), lr=0.02)
    muon, adamw = routed(opt, model)
    assert muon == HIDDEN_MATRICES
    assert adamw == {n for n, _ in model.named_parameters()} - HIDDEN_MATRICES
    assert isinstance(opt.muon, torch.optim.Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    assert opt.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_explicit_use_muon_groups_win_and_keep_their_own_lr_and_weight_decay():
    model = make_model()
    named = dict(model.named_parameters())
    groups = [
        {"params": [named[n] for n in sorted(HIDDEN_MATRICES)], "use_muon": True, "lr": 0.05},
        # a block matrix explicitly sent to AdamW, with its own weight decay
        {"params": [p for n, p in named.items() if n not in HIDDEN_MATRICES], "use_muon": False, "weight_decay": 0.0},
    ]
    opt = Muon(groups, lr=0.01, weight_decay=0.2)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert routed(opt, model)[0] == HIDDEN_MATRICES
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (0.05, 0.2)
    assert (opt.param_groups[1]["lr"], opt.param_groups[1]["weight_decay"]) == (0.01, 0.0)


def test_plain_parameters_route_by_shape_alone_every_2d_tensor_to_muon():
    model = make_model()
    opt = Muon(model.parameters())
    muon, _ = routed(opt, model)
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2}
    assert "embedding.token.weight" in muon and "head.proj.weight" in muon


def test_a_use_muon_attribute_on_a_tensor_routes_it_even_without_names():
    model = make_model()
    for p in (model.embedding.token.weight, model.embedding.position.weight, model.head.proj.weight):
        p.use_muon = False
    opt = Muon(model.parameters())
    assert routed(opt, model)[0] == HIDDEN_MATRICES


def test_adamw_names_is_configurable():
    model = make_model()
    opt = Muon(model.named_parameters(), adamw_names=("mlp",))
    assert routed(opt, model)[0] == {"embedding.token.weight", "embedding.position.weight", "head.proj.weight",
                                     "blocks.0.attn.weight", "blocks.1.attn.weight"}


def test_muon_part_equals_bare_torch_muon_and_adamw_part_equals_bare_adamw():
    hp = dict(lr=0.02, weight_decay=0.1)
    model = make_model()
    reference = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), momentum=0.9, nesterov=True, ns_steps=5, adamw_betas=(0.8, 0.9), adamw_eps=1e-6, **hp)
    ref_named = dict(reference.named_parameters())
    bare_muon = torch.optim.Muon([ref_named[n] for n in sorted(HIDDEN_MATRICES)], momentum=0.9, nesterov=True,
                                 ns_steps=5, adjust_lr_fn="match_rms_adamw", **hp)
    bare_adamw = torch.optim.AdamW([p for n, p in ref_named.items() if n not in HIDDEN_MATRICES],
                                   betas=(0.8, 0.9), eps=1e-6, **hp)
    for step in range(4):
        opt.zero_grad()
        bare_muon.zero_grad()
        bare_adamw.zero_grad()
        loss_of(model, step).backward()
        loss_of(reference, step).backward()
        opt.step()
        bare_muon.step()
        bare_adamw.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.blocks[0].attn.weight, make_model().blocks[0].attn.weight)


def test_step_evaluates_the_closure_once_and_returns_its_loss():
    model = make_model()
    opt = Muon(model.named_parameters())
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    assert opt.step(closure) is not None and len(calls) == 1


def test_a_scheduler_changes_the_learning_rate_of_both_parts():
    model = make_model()
    opt = Muon(model.named_parameters(), lr=0.02, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: [1.0, 0.0][min(step, 1)])
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [0.02, 0.02]
    train(model, opt, range(1))
    scheduler.step()
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [0.0, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, range(1, 2))  # lr 0 (and so lr * weight_decay 0): nothing may move, in either part
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_state_dict_round_trips_through_torch_save_and_continues_exactly():
    model = make_model()
    opt = Muon(model.named_parameters(), lr=0.02)
    train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, range(3, 6))  # uninterrupted

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = make_model(seed=1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = Muon(resumed.named_parameters(), lr=0.02)
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert resumed_opt.param_groups[0] is resumed_opt.muon.param_groups[0]  # still the parts' own groups
    assert len(resumed_opt.state) == len(opt.state) == len(list(model.parameters()))
    train(resumed, resumed_opt, range(3, 6))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_refuses_a_checkpoint_routed_differently():
    model = make_model()
    saved = Muon(model.named_parameters()).state_dict()
    by_shape = Muon(model.parameters())  # also two groups, but embeddings/head on the Muon side
    with pytest.raises(ValueError, match="loaded state dict contains a parameter group"):
        by_shape.load_state_dict(saved)
    swapped = Muon([{"params": [model.head.norm.weight], "use_muon": False},
                    {"params": [model.blocks[0].attn.weight], "use_muon": True}])
    with pytest.raises(ValueError, match="parameter group 0 goes to AdamW here but to Muon"):
        swapped.load_state_dict(Muon([{"params": [model.blocks[0].attn.weight], "use_muon": True},
                                      {"params": [model.head.norm.weight], "use_muon": False}]).state_dict())
    plain = torch.optim.AdamW([model.head.norm.weight]).state_dict()
    with pytest.raises(ValueError, match="no use_muon tag"):
        Muon([{"params": [model.head.norm.weight]}]).load_state_dict(plain)


def test_state_is_a_view_of_both_parts_keyed_by_parameter():
    model = make_model()
    opt = Muon(model.named_parameters())
    train(model, opt, range(1))
    assert set(opt.state[model.blocks[0].attn.weight]) == {"momentum_buffer"}
    assert set(opt.state[model.head.proj.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert model.head.proj.weight in opt.state and torch.zeros(1) not in opt.state
    with pytest.raises(KeyError):
        opt.state[torch.zeros(1)]


def test_no_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match="Muon got an empty parameter list"):
        Muon([])
    with pytest.raises(ValueError, match="without any parameters"):
        Muon([{"params": []}])


def test_explicit_use_muon_on_a_vector_is_refused_by_torch_muon():
    with pytest.raises(ValueError, match="2D"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])


def test_a_parameter_in_two_groups_is_refused():
    p = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        Muon([{"params": [p]}, {"params": [p], "use_muon": False}])


def test_lightning_cli_yaml_builds_muon_from_the_optimizer_key(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.setattr("sys.argv", ["lightning-async-pp"])  # pytest's own arguments are not for the CLI
    config = tmp_path / "optimizer.yaml"
    config.write_text("optimizer:\n  class_path: lightning_async_pp.optim.Muon\n  init_args: {lr: 0.02}\n")
    cli = LightningCLI(
        BoringModel, BoringDataModule, run=False, save_config_callback=None,
        args=["--config", str(config), "--trainer.max_steps=2", "--trainer.logger=false",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_checkpointing=false",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"],
    )
    cli.trainer.fit(cli.model, cli.datamodule)
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, Muon) and [g["lr"] for g in opt.param_groups] == [0.02, 0.02]
    assert set(opt.state[cli.model.layer.weight]) == {"momentum_buffer"}
