import copy
import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_pp import PipelineModule
from lightning_async_pp.models import Llama
from lightning_async_pp.models.llama import PRESETS

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama_tiny.yaml"
VOCAB = 256


def built(size: str = "tiny", seed: int = 0, **kwargs) -> Llama:
    torch.manual_seed(seed)
    m = Llama(size, **kwargs)
    m.configure_model()
    return m


def tokens(b: int = 3, t: int = 16, seed: int = 1) -> torch.Tensor:
    """A batch as the data module makes it: (B, T + 1) token ids."""
    return torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(seed))


def trainer(max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )


def loader(batches: torch.Tensor, batch_size: int) -> DataLoader:
    return DataLoader(list(batches), batch_size=batch_size, shuffle=False)


# ---- structure ---------------------------------------------------------------------------------------------------
def test_layers_are_embedding_blocks_and_head_without_biases():
    m = built()
    assert isinstance(m, PipelineModule)
    assert isinstance(m.embed, nn.Embedding) and len(m.blocks) == 4
    assert list(m.pipeline_layers()) == [m.embed, *m.blocks, m.head]
    assert isinstance(m.head.norm, nn.RMSNorm) and isinstance(m.blocks[0].attn_norm, nn.RMSNorm)
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, nn.Linear))
    # Rotary tables are not state: nothing but trained weights is saved.
    assert list(m.buffers()) == []
    assert set(m.state_dict()) == {n for n, _ in m.named_parameters(remove_duplicate=False)}
    assert {"embed.weight", "head.norm.weight", "head.proj.weight", "blocks.3.mlp.down_proj.weight"} <= set(m.state_dict())


def test_layers_exist_on_meta_from_init_and_get_memory_in_configure_model_once():
    # The tree exists from __init__ (callbacks' setup, before configure_model, may freeze a layer), without memory.
    m = Llama("tiny")
    assert list(m.parameters()) and all(p.is_meta for p in m.parameters())
    with pytest.raises(RuntimeError, match="configure_model"):
        m.pipeline_layers()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) before configure_model"):
        m.load_state_dict(built().state_dict())  # it would copy nothing into meta tensors
    m.configure_model()
    assert not any(p.is_meta for p in m.parameters())
    layers = list(m.pipeline_layers())
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.configure_model()  # Lightning calls the hook on every trainer entry point: a second call changes nothing
    assert all(a is b for a, b in zip(m.pipeline_layers(), layers))
    assert all(torch.equal(p, weights[n]) for n, p in m.named_parameters())


def test_pipeline_layers_split_in_two_stages_compose_to_the_forward():
    m = built().eval()
    b = tokens()
    x = m.pipeline_input(b)
    assert torch.equal(x, b[:, :-1])
    layers = m.pipeline_layers()
    for stage in (layers[:3], layers[3:]):
        for layer in stage:
            x = layer(x)
            if layer is not layers[-1]:
                assert x.shape == (3, 16, 64)  # what crosses a stage boundary: the hidden state (B, T, C)
    assert x.shape == (3, 16, VOCAB)
    torch.testing.assert_close(x, m(b), rtol=0, atol=0)


def test_attention_is_causal():
    m = built().eval()
    b = tokens()
    changed = b.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    out, out_changed = m(b), m(changed)
    torch.testing.assert_close(out[:, :10], out_changed[:, :10])
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:])


def test_attention_depends_on_position():
    # Without positions a causal model's output at the last token would not depend on the order of the others.
    m = built().eval()
    b = tokens(b=1)
    swapped = b.clone()
    swapped[:, [3, 7]] = swapped[:, [7, 3]]
    assert not torch.allclose(m(b)[:, -1], m(swapped)[:, -1])


def test_grouped_query_attention_shapes():
    m = built(num_heads=8, num_kv_heads=2, hidden_size=64)
    attn = m.blocks[0].attn
    head_dim = 64 // 8
    assert attn.q_proj.weight.shape == (8 * head_dim, 64)
    assert attn.k_proj.weight.shape == (2 * head_dim, 64) and attn.v_proj.weight.shape == (2 * head_dim, 64)
    assert attn.o_proj.weight.shape == (64, 8 * head_dim)
    assert m(tokens()).shape == (3, 16, VOCAB)


def test_grouped_query_attention_equals_full_attention_with_repeated_kv_heads():
    gqa = built(num_heads=4, num_kv_heads=2).eval()
    mha = built(num_heads=4, num_kv_heads=4).eval()
    state = gqa.state_dict()
    for i in range(len(gqa.blocks)):
        for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j + 1
            w = state[f"blocks.{i}.attn.{name}.weight"].view(2, 16, 64)
            state[f"blocks.{i}.attn.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(64, 64)
    mha.load_state_dict(state)
    b = tokens()
    torch.testing.assert_close(gqa(b), mha(b))


def test_sequences_longer_than_max_seq_len_are_rejected():
    m = built(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(tokens(t=9))


# ---- presets -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, expected", [("smollm-135m", 134_515_008), ("smollm-360m", 361_821_120)])
def test_smollm_presets_have_the_published_parameter_counts(size, expected):
    with torch.device("meta"):  # shapes only, no memory
        m = Llama(size, vocab_size=49152)
        m.configure_model()
    assert m.head.proj.weight is m.embed.weight
    assert sum(p.numel() for p in m.parameters()) == expected  # the tied matrix is counted once


def test_smollm_135m_shapes():
    with torch.device("meta"):
        m = Llama("smollm-135m", vocab_size=49152)
        m.configure_model()
    attn = m.blocks[0].attn
    assert len(m.blocks) == 30 and m.embed.weight.shape == (49152, 576)
    assert attn.q_proj.weight.shape == (576, 576) and attn.k_proj.weight.shape == (3 * 64, 576)
    assert m.blocks[0].mlp.gate_proj.weight.shape == (1536, 576)


def test_keyword_arguments_override_the_preset():
    m = built("tiny", num_layers=2)
    assert len(m.blocks) == 2 and m.config.num_layers == 2
    assert m.config.hidden_size == PRESETS["tiny"]["hidden_size"]
    assert m.hparams.num_layers == 2 and m.hparams.size == "tiny"


def test_unknown_size_names_the_presets():
    with pytest.raises(ValueError, match="tiny.*smollm-135m.*smollm-360m"):
        Llama("smollm-1.7b")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3), "divisible by num_heads"),
    (dict(num_kv_heads=3), "divisible by num_kv_heads"),
    (dict(hidden_size=12, num_heads=4, num_kv_heads=4), "even"),
])
def test_inconsistent_shapes_are_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Llama("tiny", **kwargs)


# ---- tied embeddings ---------------------------------------------------------------------------------------------
def test_tied_head_is_the_embedding_parameter():
    tied, untied = built(), built(tie_embeddings=False)
    assert tied.head.proj.weight is tied.embed.weight
    assert untied.head.proj.weight is not untied.embed.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == VOCAB * 64
    assert [n for n, _ in tied.named_parameters()].count("head.proj.weight") == 0  # listed once, as embed.weight


def test_tied_model_equals_untied_model_with_copied_weights():
    tied, untied = built(), built(tie_embeddings=False, seed=5)
    untied.load_state_dict(tied.state_dict())  # the tied state dict carries the matrix under both names
    b = tokens()
    tied_logits, untied_logits = tied(b), untied(b)
    torch.testing.assert_close(tied_logits, untied_logits, rtol=0, atol=0)
    tied_loss, untied_loss = tied.pipeline_loss(tied_logits, b), untied.pipeline_loss(untied_logits, b)
    assert tied_loss.item() == untied_loss.item()
    # The shared matrix's gradient is the sum of its two uses.
    tied_loss.backward()
    untied_loss.backward()
    torch.testing.assert_close(tied.embed.weight.grad, untied.embed.weight.grad + untied.head.proj.weight.grad)


def test_one_lightning_step_updates_the_tied_weight_once():
    m = built(lr=1e-2)
    reference = copy.deepcopy(m)  # deepcopy keeps the tie
    assert reference.head.proj.weight is reference.embed.weight
    b = tokens(b=4)
    trainer(max_steps=1).fit(m, loader(b, batch_size=4))
    assert m.head.proj.weight is m.embed.weight  # still one Parameter after training
    # The same step by hand: one AdamW update of the shared matrix with the summed gradient.
    opt = reference.configure_optimizers()
    reference.pipeline_loss(reference(b), b).backward()
    opt.step()
    assert not torch.equal(m.embed.weight, built().embed.weight)
    torch.testing.assert_close(m.embed.weight, reference.embed.weight)
    for (name, p), (_, q) in zip(m.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_checkpoint_round_trip_keeps_weights_and_tie(tmp_path):
    m = built(num_layers=2)
    t = trainer(max_steps=1)
    t.fit(m, loader(tokens(b=2), batch_size=2))
    t.save_checkpoint(tmp_path / "llama.ckpt")
    loaded = Llama.load_from_checkpoint(tmp_path / "llama.ckpt")  # calls configure_model, then loads
    assert loaded.head.proj.weight is loaded.embed.weight and len(loaded.blocks) == 2
    for (name, p), (_, q) in zip(m.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name


class FreezeEmbeddingUntilEpoch1(BaseFinetuning):
    """BaseFinetuning as Lightning's docs show it: ``embed`` (and the tied head) frozen in setup, which Lightning runs
    before configure_model; unfrozen into a new parameter group at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.embed)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            pl_module.frozen_embedding = pl_module.embed.weight.detach().clone()
            self.unfreeze_and_add_param_group(pl_module.embed, optimizer, lr=0.05)


def finetuned(strategy: object) -> Llama:
    m = Llama("tiny", num_layers=2, init_seed=0)
    # SGD: plain Lightning's and the pipeline's rounding stay ~1e-7 apart (AdamW scales it up in tiny gradients).
    m.configure_optimizers = lambda: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
              callbacks=[FreezeEmbeddingUntilEpoch1()]).fit(m, loader(tokens(b=8, seed=2), batch_size=4))
    return m


def test_base_finetuning_freezing_the_embedding_in_setup_equals_plain_lightning():
    from lightning_async_pp import AsyncPipelineStrategy

    plain = finetuned("auto")
    piped = finetuned(AsyncPipelineStrategy(num_stages=2, num_microbatches=2, schedule="gpipe"))
    initial = built(num_layers=2, init_seed=0).embed.weight
    for m in (plain, piped):
        assert torch.equal(m.frozen_embedding, initial)  # frozen through epoch 0
        assert (m.embed.weight - initial).abs().max() > 1e-3  # trained in epoch 1
    for (name, p), (_, q) in zip(piped.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)


# ---- initialization, loss, optimizer -----------------------------------------------------------------------------
def test_initialization_is_deterministic_per_layer():
    a, b = built(seed=3), built(seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(built(seed=4).blocks[0].attn.q_proj.weight, a.blocks[0].attn.q_proj.weight)
    # A layer's weights do not depend on how many layers come after it (a pipeline stage builds only its own).
    shallow = built(seed=3, num_layers=2)
    assert torch.equal(shallow.blocks[1].mlp.up_proj.weight, a.blocks[1].mlp.up_proj.weight)
    explicit = Llama("tiny", init_seed=3)
    explicit.configure_model()
    assert all(torch.equal(p, q) for p, q in zip(explicit.parameters(), a.parameters()))


def test_residual_projections_get_the_scaled_init():
    m = built(num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    block = m.blocks[0]
    assert block.attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert block.mlp.down_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert block.mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert m.embed.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(block.attn_norm.weight, torch.ones(256))


def test_loss_at_init_is_close_to_ln_vocab_size():
    m = built()
    b = tokens(b=16)
    assert abs(m.pipeline_loss(m(b), b).item() - math.log(VOCAB)) < 0.1


def test_loss_targets_are_the_inputs_shifted_by_one():
    m = built()
    b = tokens()
    perfect = nn.functional.one_hot(b[:, 1:], VOCAB).float() * 100
    wrong = nn.functional.one_hot(b[:, :-1], VOCAB).float() * 100
    assert m.pipeline_loss(perfect, b).item() < 1e-3
    assert m.pipeline_loss(wrong, b).item() > 10


def test_optimizer_decays_matrices_but_not_norms():
    m = built(lr=1e-3)
    opt = m.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-3
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    name = {id(p): n for n, p in m.named_parameters()}
    decayed_names, plain_names = ({name[id(p)] for p in g["params"]} for g in (decayed, plain))
    assert decayed_names | plain_names == set(name.values())
    assert "head.norm.weight" in plain_names and "embed.weight" in decayed_names
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))  # tied matrix once


def test_lightning_training_lowers_the_loss():
    m = built(lr=3e-3)
    data = tokens(b=8, t=32, seed=7)
    before = m.pipeline_loss(m(data), data).item()
    trainer(max_steps=20).fit(m, loader(data, batch_size=4))
    with torch.no_grad():
        after = m.pipeline_loss(m(data), data).item()
    assert after < before - 1.0, (before, after)


# ---- the example config ------------------------------------------------------------------------------------------
def test_llama_config_describes_a_two_stage_2bw_run():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["model"]["class_path"] == "lightning_async_pp.models.Llama"
    assert config["model"]["init_args"]["size"] == "tiny"
    assert config["model"]["init_args"]["max_seq_len"] >= config["data"]["block_size"]
    assert config["trainer"]["devices"] == 2 and config["trainer"]["accelerator"] == "cpu"
    assert config["trainer"]["strategy"]["init_args"]["schedule"] == "2bw"
    assert config["trainer"]["max_steps"] <= 500
    # Tied as in SmolLM, with the embedding and the head on different stages (partition [3, 3] of 6 layers).
    assert config["model"]["init_args"]["tie_embeddings"] is True
    assert config["trainer"]["strategy"]["init_args"]["partition"] == [3, 3]


def test_llama_config_trains_two_steps_in_one_process(tmp_path, monkeypatch):
    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(CONFIG.read_text())
    # One process: under pytest, Lightning's launcher would re-run the whole test session for a second rank.
    config["trainer"].update(devices=1, max_steps=2, limit_val_batches=2, val_check_interval=2, log_every_n_steps=1,
                             default_root_dir=str(tmp_path))
    config["trainer"]["strategy"]["init_args"].pop("partition", None)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["model"]["init_args"].update(max_seq_len=32)
    config["data"].update(block_size=32, batch_size=4, max_bytes=60_000, cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert isinstance(cli.model, Llama) and cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
