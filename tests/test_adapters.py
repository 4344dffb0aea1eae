"""models.HuggingFaceCausalLM and models.LitGPT against the upstream models they adapt.

The references are the upstream classes themselves (``AutoModelForCausalLM.from_config``, ``litgpt.GPT``): the same
weights give the same logits and loss, the state_dict keys are theirs, the initialization follows their rule; the
pipeline runs are checked against the update rule written out (helpers.delayed_loop) and, on 2 processes, against
the one-device run. Configs are built here; nothing is downloaded.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.hf  # make test also runs the HF ones on transformers 5.x (the litgpt ones skip there)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    from litgpt import GPT, Config
except ImportError:  # the transformers 5 environment has no litgpt: the HF tests run there, these are skipped
    GPT = Config = None
needs_litgpt = pytest.mark.skipif(GPT is None, reason="litgpt is not installed")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import adapter_fit  # noqa: E402
from helpers import delayed_loop  # noqa: E402
from pipeline_runs import max_difference, run_here_on_one_device, script_ranks  # noqa: E402

from lightning_async_pp.consolidate import consolidate_checkpoint  # noqa: E402
from lightning_async_pp.models import HuggingFaceCausalLM, LitGPT  # noqa: E402
from lightning_async_pp.parallel.placement import materialize_layers  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "adapter_fit.py"
TOL = 1e-5
VOCAB = 256

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
HF_CASES = {
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama-untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama-eager": dict(model_type="llama", tie_word_embeddings=True, attn_implementation="eager"),  # a real mask
    "mistral-window-4": dict(model_type="mistral", sliding_window=4, tie_word_embeddings=False),
    "mistral-window-32": dict(model_type="mistral", sliding_window=32, tie_word_embeddings=False),  # > T: no mask
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),  # biases on q, k, v
}


def hf_config(case: str, **overrides):
    return AutoConfig.for_model(**{**TINY, **HF_CASES[case], **overrides})


def built(model):
    model.configure_model()
    return model


def tokens(b: int = 3, t: int = 16, seed: int = 1) -> torch.Tensor:
    """A batch as the data module makes it: (B, T + 1) token ids."""
    return torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(seed))


# ---- Hugging Face: the upstream model's forward, loss, keys, init --------------------------------------------------
@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_adapter_gives_the_upstream_logits_and_loss_with_the_upstream_keys(case):
    config = hf_config(case)
    ours = built(HuggingFaceCausalLM(config, init_seed=3)).eval()
    upstream = AutoModelForCausalLM.from_config(config).eval()
    assert list(ours.state_dict()) == list(upstream.state_dict())
    upstream.load_state_dict(ours.state_dict(), strict=True)
    batch = tokens()
    logits = ours(batch)
    torch.testing.assert_close(logits, upstream(batch[:, :-1]).logits, rtol=0, atol=0)
    # The upstream loss shifts its labels itself: the whole row is its input and its labels.
    torch.testing.assert_close(ours.pipeline_loss(logits, batch), upstream(batch, labels=batch).loss)
    tied = config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_decoder_layers_get_the_attention_mask_the_upstream_forward_gives_them(case):
    # Under SDPA upstream passes no mask (causal attention, the flash kernel where there is one); a mask built
    # anyway gives the same logits at this size but attends through it, slower and holding more per layer.
    config = hf_config(case)
    ours = built(HuggingFaceCausalLM(config, init_seed=3)).eval()
    upstream = AutoModelForCausalLM.from_config(config).eval()
    masks: dict[str, list] = {"ours": [], "upstream": []}

    def record(name):
        return lambda module, args, kwargs: masks[name].append(kwargs.get("attention_mask"))

    ours.model.layers[0].register_forward_pre_hook(record("ours"), with_kwargs=True)
    upstream.model.layers[0].register_forward_pre_hook(record("upstream"), with_kwargs=True)
    batch = tokens()
    with torch.no_grad():
        ours(batch)
        upstream(batch[:, :-1])
    (mine,), (theirs,) = masks["ours"], masks["upstream"]
    if theirs is None:
        assert mine is None, f"{case}: the adapter built a {tuple(mine.shape)} mask where upstream passes none"
    else:
        assert mine is not None and torch.equal(mine, theirs), case


def test_hf_sliding_window_of_mistral_is_applied():
    # Guards the test above: with T = 16 a window of 4 changes the logits, so the adapter's mask is checked there.
    windowed = built(HuggingFaceCausalLM(hf_config("mistral-window-4"), init_seed=3)).eval()
    full = built(HuggingFaceCausalLM(hf_config("mistral-window-4", sliding_window=None), init_seed=3)).eval()
    full.load_state_dict(windowed.state_dict())
    batch = tokens()
    assert not torch.allclose(windowed(batch), full(batch))
    torch.testing.assert_close(windowed(batch)[:, :4], full(batch)[:, :4])  # inside the window: the same


def test_hf_layers_are_embedding_decoder_layers_norm_and_head_passing_the_hidden_state():
    model = built(HuggingFaceCausalLM(hf_config("llama-tied")))
    layers = model.pipeline_layers()
    assert layers == [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    x = model.pipeline_input(tokens())
    for layer in layers[:-1]:
        x = layer(x)
        assert isinstance(x, torch.Tensor) and x.shape == (3, 16, 32)  # what crosses a stage boundary


def test_hf_init_follows_the_upstream_rule():
    config = hf_config("llama-untied", hidden_size=128, intermediate_size=256, initializer_range=0.05, pad_token_id=7)
    model = built(HuggingFaceCausalLM(config))
    for name, p in model.named_parameters():
        if p.dim() == 2:
            assert p.std().item() == pytest.approx(0.05, rel=0.05), name
        else:
            assert torch.equal(p, torch.ones_like(p)), name  # RMSNorm gains
    assert torch.equal(model.model.embed_tokens.weight[7], torch.zeros(128))  # the padding row, as _init_weights does


def test_hf_init_is_seeded_per_layer_index():
    two = built(HuggingFaceCausalLM(hf_config("llama-tied"), init_seed=5))
    three = built(HuggingFaceCausalLM(hf_config("llama-tied", num_hidden_layers=3), init_seed=5))
    other = built(HuggingFaceCausalLM(hf_config("llama-tied"), init_seed=6))
    # A layer's weights do not depend on how many layers follow it (a stage builds only its own).
    assert max_difference(two.model.layers[1].state_dict(), three.model.layers[1].state_dict()) == 0.0
    assert torch.equal(two.model.embed_tokens.weight, three.model.embed_tokens.weight)
    assert not torch.equal(two.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(two.model.layers[0].self_attn.q_proj.weight, two.model.layers[1].self_attn.q_proj.weight)


def test_hf_built_on_meta_and_materialized_has_the_upstream_rotary_buffer_and_the_same_weights():
    """What the strategy does: configure_model under the meta device, then per-layer materialization."""
    config = hf_config("llama-tied", rope_theta=500.0)
    with torch.device("meta"):
        lazy = built(HuggingFaceCausalLM(config, init_seed=2))
    assert lazy.model.embed_tokens.weight.is_meta
    layers = lazy.pipeline_layers()
    materialize_layers(layers, list(range(len(layers))), torch.device("cpu"), lazy.init_layer)
    upstream = AutoModelForCausalLM.from_config(config)
    inv_freq = lazy.model.rotary_emb.inv_freq
    assert not inv_freq.is_meta and torch.equal(inv_freq, upstream.model.rotary_emb.inv_freq)
    assert not any(t.is_meta for t in (*lazy.parameters(), *lazy.buffers()))
    eager = built(HuggingFaceCausalLM(config, init_seed=2))
    assert max_difference(lazy.state_dict(), eager.state_dict()) == 0.0
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight


def test_hf_config_may_be_a_mapping_with_model_type_and_rebuilds_from_its_hyperparameters():
    mapping = {**TINY, **HF_CASES["qwen2"]}
    model = built(HuggingFaceCausalLM(mapping, init_seed=1))
    assert type(model.model).__name__ == "Qwen2Model"
    again = built(HuggingFaceCausalLM(**model.hparams))  # what load_from_checkpoint does
    assert again.config.to_dict() == model.config.to_dict()
    assert max_difference(again.state_dict(), model.state_dict()) == 0.0
    with pytest.raises(ValueError, match="model_type"):
        HuggingFaceCausalLM({"hidden_size": 32})


def test_hf_config_mapping_with_a_misspelt_key_is_refused_and_legitimate_extras_are_kept(monkeypatch):
    # The finding: hiden_size: 256 trained the family's default width (4096) without a word.
    with pytest.raises(ValueError, match=r"'llama'.*no key 'hiden_size' \(did you mean 'hidden_size'"):
        HuggingFaceCausalLM({**TINY, "model_type": "llama", "hiden_size": 256})
    with monkeypatch.context() as patched:  # a transformers that refuses an unknown key itself: the key meant too
        real = AutoConfig.for_model

        def strict(model_type, **kwargs):
            if "hiden_size" in kwargs:
                raise TypeError("LlamaConfig.__init__() got an unexpected keyword argument 'hiden_size'")
            return real(model_type, **kwargs)

        patched.setattr(AutoConfig, "for_model", strict)
        with pytest.raises(ValueError, match=r"no key 'hiden_size' \(did you mean 'hidden_size'.*building it fails"):
            HuggingFaceCausalLM({**TINY, "model_type": "llama", "hiden_size": 256})
    # Keys the family's constructor takes without keeping them as given, PretrainedConfig's common ones, rope.
    extras = dict(attn_implementation="eager", torch_dtype="float32", tie_word_embeddings=False, use_cache=False,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500.0, pad_token_id=0)
    model = HuggingFaceCausalLM({**TINY, "model_type": "llama", **extras})
    expected = AutoConfig.for_model("llama", **TINY, **extras)
    assert model.config.to_dict() == expected.to_dict()
    assert model.config._attn_implementation == "eager"
    sizes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sizes == {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(expected).named_parameters()}
    # A key the class does not name but the family's modeling code reads (Qwen3-MoE's head_dim, with a default).
    moe = HuggingFaceCausalLM({**TINY, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 2,
                               "num_experts_per_tok": 1, "moe_intermediate_size": 32})
    assert moe.model.layers[0].self_attn.q_proj.weight.shape == (TINY["num_attention_heads"] * 16, TINY["hidden_size"])
    # A config transformers wrote is taken as it is: a real config.json may hold keys its class does not name
    # (SmolLM's: is_llama_config), and the checkpoint's hyperparameters (to_dict) rebuild it for load_from_checkpoint.
    written = HuggingFaceCausalLM(AutoConfig.for_model("llama", **TINY, is_llama_config=True))
    again = HuggingFaceCausalLM(**written.hparams)
    assert again.config.to_dict() == written.config.to_dict() and again.config.is_llama_config is True


def test_hf_refuses_an_architecture_it_cannot_split_naming_what_is_missing():
    gpt2 = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*no model\.embed_tokens, model\.layers, model\.norm, model\.rotary_emb"):
        HuggingFaceCausalLM(gpt2).configure_model()


# ---- litgpt ---------------------------------------------------------------------------------------------------------
LITGPT_CASES = {
    "pythia": dict(name="pythia-14m", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, block_size=64),
    "llama-style": dict(name="tiny-llama-1.1b", n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
                        intermediate_size=64, vocab_size=VOCAB, block_size=64),
}


@needs_litgpt
@pytest.mark.parametrize("case", list(LITGPT_CASES))
def test_litgpt_adapter_gives_the_upstream_logits_with_the_upstream_keys(case):
    config = Config.from_name(**LITGPT_CASES[case])
    ours = built(LitGPT(config, init_seed=3)).eval()
    upstream = GPT(config).eval()
    assert list(ours.state_dict()) == list(upstream.state_dict())
    upstream.load_state_dict(ours.state_dict(), strict=True)
    batch = tokens()
    torch.testing.assert_close(ours(batch), upstream(batch[:, :-1]), rtol=0, atol=0)
    assert torch.equal(ours.rope.cos, upstream.cos) and torch.equal(ours.rope.sin, upstream.sin)


@needs_litgpt
def test_litgpt_init_follows_the_upstream_rule_and_rope_is_real_after_a_meta_build():
    config = Config.from_name(**{**LITGPT_CASES["pythia"], "n_embd": 128})
    with torch.device("meta"):
        lazy = built(LitGPT(config, init_seed=4))
    layers = lazy.pipeline_layers()
    materialize_layers(layers, list(range(len(layers))), torch.device("cpu"), lazy.init_layer)
    assert not lazy.rope.cos.is_meta and torch.equal(lazy.rope.cos, GPT(config).cos)
    for name, p in lazy.named_parameters():
        if p.dim() == 2:  # GPT._init_weights: normal(0, 0.02) for linear and embedding weights
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
        elif "norm" in name or "ln_f" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        else:
            assert torch.equal(p, torch.zeros_like(p)), name  # linear biases
    assert max_difference(lazy.state_dict(), built(LitGPT(config, init_seed=4)).state_dict()) == 0.0


@needs_litgpt
def test_litgpt_config_by_name_or_mapping_and_unsupported_configs_are_refused():
    assert LitGPT("pythia-14m").config.n_layer == 6
    model = LitGPT({"name": "pythia-14m", "n_layer": 2, "vocab_size": VOCAB})
    assert (model.config.n_layer, model.config.padded_vocab_size) == (2, VOCAB)
    again = LitGPT(**model.hparams)
    assert again.config == model.config
    with pytest.raises(ValueError, match="scale_embeddings"):
        LitGPT({"name": "pythia-14m", "scale_embeddings": True})
    for mapping in ({"name": "pythia-14m", "n_embdd": 64}, {"n_embdd": 64}):  # a misspelt field names the one meant
        with pytest.raises(ValueError, match=r"no field 'n_embdd' \(did you mean 'n_embd'\?\)"):
            LitGPT(mapping)


# ---- under the pipeline: one device against the written-out rule ---------------------------------------------------
def one_device(cfg: dict) -> dict:
    return run_here_on_one_device(adapter_fit.run, cfg)


@pytest.mark.parametrize("adapter", ["hf", pytest.param("litgpt", marks=needs_litgpt)])
def test_two_stage_2bw_on_one_device_follows_the_delayed_recurrence(adapter):
    # embedding + block 0 | block 1 + norm + head: with hf the tied matrix is used on both stages.
    cfg = {"adapter": adapter, "steps": 4, "partition": [2, 3]}
    result = one_device(cfg)
    assert result["global_step"] == 4
    model = built(adapter_fit.build_model(cfg))
    batches = [b for _, b in zip(range(4), adapter_fit.loader(cfg))]
    expected = delayed_loop(model, batches, delay=1)
    assert max_difference(result["state_dict"], expected) < TOL
    initial = built(adapter_fit.build_model(cfg)).state_dict()
    assert max_difference(result["state_dict"], initial) > 1e-3  # the steps did move the weights
    # the delay matters: the synchronous recurrence ends elsewhere
    assert max_difference(result["state_dict"], delayed_loop(built(adapter_fit.build_model(cfg)), batches, delay=0)) > 1e-4


@needs_litgpt
def test_litgpt_consolidated_checkpoint_loads_strictly_into_litgpt_gpt(tmp_path):
    cfg = {"adapter": "litgpt", "steps": 2, "partition": [2, 3], "checkpoint_dir": str(tmp_path / "ckpt")}
    result = one_device(cfg)
    consolidate_checkpoint(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    upstream = GPT(Config.from_name(**adapter_fit.LITGPT_PYTHIA)).eval()
    upstream.load_state_dict(state, strict=True)
    assert max_difference(upstream.state_dict(), result["state_dict"]) == 0.0
    ours = built(adapter_fit.build_model(cfg)).eval()
    ours.load_state_dict(state, strict=True)
    batch = tokens()
    torch.testing.assert_close(upstream(batch[:, :-1]), ours(batch), rtol=0, atol=0)


# ---- Lightning's fine-tuning callbacks: the modules exist (on meta) before configure_model ----------------------
FINETUNE = {"finetune": True, "steps": 8, "samples": 32, "batch": 8}  # 4 batches an epoch
EMBEDDING = {"hf": "model.embed_tokens.weight", "litgpt": "transformer.wte.weight"}


@pytest.mark.parametrize("adapter", ["hf", pytest.param("litgpt", marks=needs_litgpt)])
def test_base_finetuning_freezing_the_embedding_in_setup_equals_plain_lightning(adapter):
    # BaseFinetuning freezes the embedding (model.embed_tokens; transformer.wte) in setup, before configure_model
    # (HF: with it the tied head), and unfreezes it into a new parameter group at epoch 1. 2 stages in one process
    # under gpipe against plain Lightning, both on SGD (AdamW would scale the two runs' rounding in near-zero
    # gradients up to ~1e-5).
    cfg = {**FINETUNE, "adapter": adapter, "sgd": True, "lr": 0.1, "schedule": "gpipe", "partition": [2, 3]}
    plain = one_device({**cfg, "strategy": False})
    piped = one_device(cfg)
    assert piped["global_step"] == plain["global_step"] == 8
    assert max_difference(piped["state_dict"], plain["state_dict"]) < TOL
    # Frozen through epoch 0 (its value at the unfreeze is the initial one), trained in epoch 1.
    initial = built(adapter_fit.build_model(cfg)).state_dict()[EMBEDDING[adapter]]
    for run in (plain, piped):
        assert torch.equal(run["frozen_embedding"], initial)
        assert (run["state_dict"][EMBEDDING[adapter]] - initial).abs().max() > 1e-3


# ---- two processes -----------------------------------------------------------------------------------------------
def run_two_processes(cfg: dict, tmp_path: Path) -> list[dict]:
    return script_ranks(SCRIPT, cfg, tmp_path)


def upstream_document_loss(upstream, batch: dict) -> torch.Tensor:
    """The loss of a packed batch as the pipeline logs it with ``skip_document_ends``, from the upstream model run
    on each document alone: the mean over the batch's kept targets (each document's own), whatever the microbatch
    count (docs/design/update-rule.md)."""
    total, count = torch.zeros(()), 0
    for row, row_pos in zip(batch["input_ids"], batch["position_ids"]):
        starts = [*torch.nonzero(row_pos == 0).flatten().tolist(), len(row)]
        for a, b in zip(starts, starts[1:]):
            if b - a > 1:
                document = row[a:b].unsqueeze(0)
                total = total + upstream(document, labels=document).loss * (b - a - 1)
                count += b - a - 1
    return total / max(count, 1)


@pytest.mark.multiprocess
def test_hf_two_processes_from_pretrained_on_packed_rows_equal_one_device_and_consolidate_hf_loads_in_transformers(tmp_path):
    # Tied embedding and head on different processes (embedding + block 0 | block 1 + norm + head), starting from a
    # sharded save_pretrained folder; the first update has lr 0, the next three train. The rows are packed (issue
    # 43): documents of 1..7 tokens, positions restarting at each and crossing the stage boundary with the hidden
    # state, each document's end skipped in the loss.
    from test_pretrained import HF_TIED, equals_file, hf_file_tensors, hf_folder

    folder = hf_folder(tmp_path / "pretrained")
    cfg = {"adapter": "hf", "steps": 4, "partition": [2, 3], "pretrained": str(folder), "zero_lr_first": True,
           "packed": True}
    ranks = run_two_processes({**cfg, "checkpoint_dir": str(tmp_path / "ckpt")}, tmp_path)
    assert [r["global_step"] for r in ranks] == [4, 4]
    # Each process read only its own stage's tensors (the head's stage, the tied matrix under the file's name) ...
    file = hf_file_tensors(folder)
    layer0 = sorted(k for k in file if k.startswith("model.layers.0."))
    assert ranks[0]["keys_read"] == sorted(["model.embed_tokens.weight", *layer0])
    assert ranks[1]["keys_read"] == sorted(["model.embed_tokens.weight", "model.norm.weight",
                                            *(k for k in file if k.startswith("model.layers.1."))])
    # ... and after the lr-0 update holds exactly the file's values. The first loss is upstream from_pretrained's on
    # each document alone; on the same tokens as one sequence upstream's differs.
    for rank in ranks:
        assert rank["first_step"] and not equals_file(rank["first_step"], file, HF_TIED)
    upstream = AutoModelForCausalLM.from_pretrained(folder).eval()
    first = next(iter(adapter_fit.loader(cfg)))
    with torch.no_grad():
        alone = upstream_document_loss(upstream, first)
        unpacked = upstream(first["input_ids"], labels=first["input_ids"]).loss
    torch.testing.assert_close(ranks[1]["first_loss"], alone, rtol=0, atol=1e-6)
    assert abs(unpacked - alone) > 1e-3
    # The trained weights equal the one-device run's; the tied copies stayed identical.
    weights = ranks[0]["state_dict"]
    reference = one_device(cfg)
    assert max_difference(weights, reference["state_dict"]) < TOL
    losses = [r["metrics"]["train_loss"] for r in ranks if "train_loss" in r["metrics"]]
    assert losses and all(abs(loss - reference["metrics"]["train_loss"]) < TOL for loss in losses)
    assert max_difference(weights, upstream.state_dict()) > 1e-3  # the three updates did move the weights
    # The packed rows changed the training: the same tokens without positions end elsewhere.
    assert max_difference(one_device({**cfg, "packed": False})["state_dict"], weights) > 1e-3
    assert torch.equal(weights["model.embed_tokens.weight"], weights["lm_head.weight"])
    # The sharded checkpoint -> consolidate --hf -> transformers' from_pretrained: the trained weights exactly.
    from lightning_async_pp.consolidate import main as consolidate_main

    assert consolidate_main([str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"), str(tmp_path / "hf"), "--hf"]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert max_difference(reloaded.state_dict(), weights) == 0.0
    ours = built(adapter_fit.build_model({k: v for k, v in cfg.items() if k != "pretrained"})).eval()
    ours.load_state_dict(weights, strict=True)
    batch = tokens()
    torch.testing.assert_close(reloaded(batch[:, :-1]).logits, ours(batch), rtol=0, atol=0)
    # The plain Lightning file of the same checkpoint still loads strictly into the upstream class.
    consolidate_checkpoint(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**adapter_fit.HF_LLAMA))
    plain.load_state_dict(state, strict=True)
    assert max_difference(plain.state_dict(), weights) == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("adapter", ["hf", pytest.param("litgpt", marks=needs_litgpt)])
def test_trainer_calls_after_fit_with_the_tie_across_processes_equal_one_device(adapter, tmp_path):
    # fit, then validate, predict and fit again in the same interpreter, each building a new engine on the model
    # the previous call split across the processes (HF ties its embedding and head; litgpt's config here not).
    cfg = {"adapter": adapter, "steps": 2, "partition": [2, 3], "after": ["validate", "predict", "fit"], "lr": 3e-4}
    if adapter == "litgpt":  # also: litgpt.from_checkpoint on 2 processes, the file's values after an lr-0 update
        from test_pretrained import equals_file, litgpt_folder

        folder = litgpt_folder(tmp_path / "pretrained")
        cfg.update(pretrained=str(folder), zero_lr_first=True)
    ranks = run_two_processes(cfg, tmp_path)
    if adapter == "litgpt":
        file = torch.load(folder / "lit_model.pth")
        assert [r["keys_read"] for r in ranks] == [
            sorted(k for k in file if k.startswith(("transformer.wte.", "transformer.h.0."))),
            sorted(k for k in file if k.startswith(("transformer.h.1.", "transformer.ln_f.", "lm_head.")))]
        for rank in ranks:
            assert rank["first_step"] and not equals_file(rank["first_step"], file, {})
    reference = one_device(cfg)
    got, want = ranks[0]["after"], reference["after"]
    assert abs(got[0]["val_loss"] - want[0]["val_loss"]) < TOL
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=TOL)
    assert max_difference(got[2], want[2]) < TOL


@pytest.mark.multiprocess
def test_hf_base_finetuning_on_two_processes_equals_one_device(tmp_path):
    # The same freeze in setup and unfreeze at epoch 1 under 2bw, with the adapter's own AdamW (the callback adds
    # its group to it), the tied embedding and head on different processes.
    cfg = {**FINETUNE, "adapter": "hf", "partition": [2, 3]}
    ranks = run_two_processes(cfg, tmp_path)
    assert [r["global_step"] for r in ranks] == [8, 8]
    reference = one_device(cfg)
    assert max_difference(ranks[0]["state_dict"], reference["state_dict"]) < TOL
    initial = built(adapter_fit.build_model(cfg)).state_dict()["model.embed_tokens.weight"]
    for rank in ranks:  # both hold a copy of the tied matrix: frozen through epoch 0 on both
        assert torch.equal(rank["frozen_embedding"], initial)
    assert (ranks[0]["state_dict"]["model.embed_tokens.weight"] - initial).abs().max() > 1e-3


# ---- the YAML configs --------------------------------------------------------------------------------------------
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name, cls", [("hf_llama_tiny", HuggingFaceCausalLM),
                                       pytest.param("litgpt_tiny", LitGPT, marks=needs_litgpt)])
def test_adapter_config_trains_two_steps_in_one_process(name, cls, tmp_path, monkeypatch):
    import yaml

    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    # One process (the one-device emulation of the same 2 stages): under pytest, Lightning's launcher would re-run
    # the whole test session for a second rank.
    config["trainer"].update(devices=1, max_steps=2, limit_val_batches=1, val_check_interval=2, log_every_n_steps=1,
                             default_root_dir=str(tmp_path))
    config["trainer"]["strategy"]["init_args"]["num_stages"] = 2
    # and the split by each layer timed (YAML's layer_cost) on the data module's example batch: the adopted models'
    # layers are still on meta when the split is chosen, so they are timed on random stand-ins
    config["trainer"]["strategy"]["init_args"].update(partition="balanced", layer_cost="measured")
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["data"].update(block_size=32, batch_size=4, max_bytes=60_000, cache_dir=str(tmp_path / "cache"))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert isinstance(cli.model, cls) and cli.trainer.global_step == 2
    assert len(cli.model.pipeline_layers()) == 7 and cli.trainer.strategy.num_stages == 2
    split = cli.trainer.strategy.engine.stats.split
    assert (split.method, split.cost, sum(split.counts)) == ("balanced", "measured", 7), split
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])


def tiny_shape(kv_heads: int, seq_len: int):
    """The planner's ``Shape`` of the TINY configs."""
    from lightning_async_pp.plan import Shape

    return Shape(hidden=TINY["hidden_size"], layers=TINY["num_hidden_layers"], heads=TINY["num_attention_heads"],
                 kv_heads=kv_heads, intermediate=TINY["intermediate_size"], vocab=VOCAB, seq_len=seq_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_planners_activation_bytes_are_what_the_hf_llama_layers_keep(dtype, kv_heads):
    # lightning-async-pp-plan's memory table takes each pipeline layer's saved bytes from a model shape
    # (plan.Shape.layer_saved_bytes): here they are counted, storage by storage, as the adapter's layers keep them.
    seq, rows = 32, 3
    config = hf_config("llama-tied", num_key_value_heads=kv_heads, max_position_embeddings=seq)
    model = built(HuggingFaceCausalLM(config, init_seed=3)).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch = tokens(b=rows, t=seq)
    x, counted = model.pipeline_input(batch), []
    for index, layer in enumerate(model.pipeline_layers()):
        kept: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
            if index == len(model.pipeline_layers()) - 1:
                model.pipeline_loss(x, batch)
        counted.append(sum(kept.values()))
    # The shape's layers are the blocks, the embedding with the first and the final norm and head with the last.
    # Beyond the shape's count the ids' storage holds the batch's target column and the loss keeps a scalar.
    counted = [counted[0] + counted[1] - 8 * rows, *counted[2:-3], sum(counted[-3:]) - 4]
    shape = tiny_shape(kv_heads, seq)
    assert shape.layer_saved_bytes(False, rows * seq, dtype.itemsize) == counted
    split = shape.layer_saved_bytes(True, rows * seq, dtype.itemsize)
    assert [split[0] + split[1], *(a + b for a, b in zip(split[2::2], split[3::2]))] == counted


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
def test_the_planners_optimizer_state_is_what_the_optimizer_keeps_for_an_hf_llama(name):
    # lightning-async-pp-plan's memory table counts each optimizer's state from a shape's parameters
    # (plan.optimizer_state_bytes); here it is what the optimizer holds after a step on the adapter's model. The
    # shape's layers hold the tied embedding twice (with the first and with the last stage); the model once.
    from lightning_async_pp.optim import Muon
    from lightning_async_pp.plan import optimizer_state_bytes

    model = built(HuggingFaceCausalLM(hf_config("llama-tied"), init_seed=3))
    optimizer = {"adamw": lambda: torch.optim.AdamW(model.parameters()),
                 "muon": lambda: Muon(model.named_parameters(), lr=0.02),
                 "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}[name]()
    batch = tokens()
    x = model.pipeline_input(batch)
    for layer in model.pipeline_layers():
        x = layer(x)
    model.pipeline_loss(x, batch).backward()
    optimizer.step()
    parts = [optimizer.muon, optimizer.adamw] if isinstance(optimizer, Muon) else [optimizer]
    held = sum(t.nbytes for part in parts for state in part.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    shape = tiny_shape(TINY["num_key_value_heads"], 16)
    counted = optimizer_state_bytes(name, shape.layer_parameters(False), shape.layer_matrix_parameters(False), 4)
    tied_copy = {"adamw": 2, "muon": 2, "sgd": 1}[name] * VOCAB * TINY["hidden_size"] * 4
    assert counted - tied_copy == held


def _held_tables(model):
    """Every tensor the model's layers reach outside their parameters: their buffers and what their forward hooks
    hold (HF's shared rotary module, litgpt's RopeCache), by where it is held."""
    found = {}
    for i, layer in enumerate(model.pipeline_layers()):
        for name, b in layer.named_buffers():
            found[f"{i}.{name}"] = b
        for j, hook in enumerate([*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]):
            for attr, value in vars(hook).items() if hasattr(hook, "__dict__") else ():
                if isinstance(value, torch.nn.Module):
                    found.update({f"{i}.hook{j}.{attr}.{n}": b for n, b in value.named_buffers()})
                elif hasattr(value, "__dict__"):
                    found.update({f"{i}.hook{j}.{attr}.{n}": t for n, t in vars(value).items()
                                  if isinstance(t, torch.Tensor)})
    return found


@pytest.mark.parametrize("adapter", ["hf", pytest.param("litgpt", marks=needs_litgpt)])
def test_costing_on_another_device_leaves_the_shared_rotary_tables_as_they_were(adapter):
    """Issue 54, item 12: costing on fake tensors of another device (CUDA in a run; ``meta`` here) ran the hooks that
    move the shared rotary tables to the input's device, and they kept fake tensors: the next real forward raised."""
    from torch._subclasses.fake_tensor import FakeTensor
    from lightning_async_pp.plan.balanced import layer_costs

    if adapter == "hf":
        model = built(HuggingFaceCausalLM(hf_config("llama-tied"), init_seed=3)).eval()
    else:
        model = built(LitGPT({"name": "pythia-14m", "n_layer": 2, "vocab_size": VOCAB, "padded_vocab_size": VOCAB},
                             init_seed=3)).eval()
    batch = tokens()
    with torch.no_grad():
        before = model.pipeline_loss(model(batch), batch)
    tables = {k: (t, t.clone()) for k, t in _held_tables(model).items()}
    assert any("hook" in k for k in tables), sorted(tables)  # the shared tables are among those checked
    try:
        costs = layer_costs(model.pipeline_layers(), batch, model.pipeline_input, model.pipeline_loss,
                            device=torch.device("meta"))
        assert len(costs) == len(model.pipeline_layers()) and costs[1].forward_flops > 0
    except RuntimeError as err:  # HF's rotary forward enters torch.autocast("meta"), which meta cannot (CUDA can)
        assert adapter == "hf" and "unsupported scalarType" in str(err), err
    after_tables = _held_tables(model)
    assert sorted(after_tables) == sorted(tables)
    for k, t in after_tables.items():
        assert not isinstance(t, FakeTensor) and t.device.type == "cpu", k
        assert t is tables[k][0] and torch.equal(t, tables[k][1]), k
    with torch.no_grad():
        assert torch.equal(model.pipeline_loss(model(batch), batch), before)
