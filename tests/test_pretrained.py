"""Pretrained weights in (``HuggingFaceCausalLM.from_pretrained``, ``LitGPT.from_checkpoint``) and the upstream folder
out (``consolidate --hf`` / ``--litgpt``).

The references are the upstream loaders themselves: ``AutoModelForCausalLM.from_pretrained`` and litgpt's
``GPT(Config.from_file(...)).load_state_dict(torch.load(...))`` of the same folder give the same weights, loss and
logits. Folders are written here from tiny configs; nothing is downloaded. The two-process runs are in
tests/test_adapters.py (HF: one run checks what each rank reads, the lr-0 step, training and ``consolidate --hf``
together; litgpt: what each rank reads and the lr-0 step, within the trainer-calls run).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.hf  # make test also runs these on transformers 5.x, where litgpt is not installed
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import adapter_fit  # noqa: E402
from pipeline_runs import run_here_on_one_device  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.consolidate import main as consolidate_main  # noqa: E402
from lightning_async_pp.models import HuggingFaceCausalLM, LitGPT  # noqa: E402


def tokens(b: int = 3, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, t + 1), generator=torch.Generator().manual_seed(seed))


def hf_folder(path: Path, tied: bool = True, shard: bool = True, seed: int = 7, **overrides) -> Path:
    """A tiny upstream Llama with random weights, saved by ``save_pretrained`` (sharded: several safetensors files
    and ``model.safetensors.index.json``)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**adapter_fit.HF_LLAMA, "tie_word_embeddings": tied, **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="20KB" if shard else "10GB")
    return path


def hf_file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def litgpt_folder(path: Path, seed: int = 7) -> Path:
    """A tiny litgpt checkpoint folder as litgpt writes one: ``lit_model.pth`` and ``model_config.yaml``."""
    pytest.importorskip("litgpt")
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    torch.manual_seed(seed)
    config = Config.from_name(**adapter_fit.LITGPT_PYTHIA)
    model = GPT(config)
    with torch.no_grad():  # litgpt zeroes biases at init: give them values, so that loading them is checked too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    path.mkdir(parents=True)
    torch.save(model.state_dict(), path / "lit_model.pth")
    save_config(config, path)
    return path


def equals_file(weights: dict[str, torch.Tensor], file: dict[str, torch.Tensor], tied: dict[str, str]) -> list[str]:
    """The names whose value is not exactly the file's (a tied name the file lacks compared with the file's name of
    that tensor)."""
    return [k for k, v in weights.items() if not torch.equal(v, file[k] if k in file else file[tied[k]])]


HF_TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def word_tokenizer(folder: Path, specials: tuple[str, ...] = ("<unk>", "<pad>", "<s>", "</s>")) -> Path:
    """A word-level ``tokenizer.json`` in ``folder``: ``specials`` then a few words (``</s>`` at id 3 by default,
    where Llama's default eos is 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([*specials, "the", "stage", "sends"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


# ---- Hugging Face in -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied, shard", [(True, True), (False, False)])
def test_hf_from_pretrained_holds_the_file_weights_and_gives_the_upstream_loss(tmp_path, tied, shard):
    folder = hf_folder(tmp_path / "hf", tied=tied, shard=shard)
    assert (folder / "model.safetensors.index.json").exists() == shard
    ours = HuggingFaceCausalLM.from_pretrained(folder, init_seed=3)
    ours.configure_model()  # eager, as under plain Lightning
    upstream = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not equals_file(ours.state_dict(), hf_file_tensors(folder), HF_TIED)
    assert ours.config.to_dict() == upstream.config.to_dict() | {"_name_or_path": ours.config._name_or_path}
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    batch = tokens()
    logits = ours.eval()(batch)
    torch.testing.assert_close(logits, upstream(batch[:, :-1]).logits, rtol=0, atol=0)
    torch.testing.assert_close(ours.pipeline_loss(logits, batch), upstream(batch, labels=batch).loss)


def test_hf_one_device_pipeline_from_pretrained_then_consolidate_hf_loads_in_transformers(tmp_path):
    # Two stages on one device: embedding + block 0 | block 1 + norm + head, the tied matrix on both.
    folder = word_tokenizer(hf_folder(tmp_path / "hf"))
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2  # Llama's default
    cfg = {"adapter": "hf", "pretrained": str(folder), "zero_lr_first": True, "steps": 2, "partition": [2, 3],
           "checkpoint_dir": str(tmp_path / "ckpt")}
    result = run_here_on_one_device(adapter_fit.run, cfg)
    # After the lr-0 update the weights are the file's, exactly; the first loss is the upstream model's.
    assert not equals_file(result["first_step"], hf_file_tensors(folder), HF_TIED)
    upstream = AutoModelForCausalLM.from_pretrained(folder).eval()
    first = next(iter(adapter_fit.loader(cfg)))
    torch.testing.assert_close(result["first_loss"], upstream(first, labels=first).loss, rtol=0, atol=1e-6)
    # The second update trained; consolidate --hf writes a folder transformers loads with exactly those weights.
    out = tmp_path / "out"
    assert consolidate_main([str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"), str(out), "--hf"]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = result["state_dict"]
    assert max(float((trained[k] - v).abs().max()) for k, v in reloaded.state_dict().items()) == 0.0
    assert not torch.equal(trained["model.norm.weight"], upstream.state_dict()["model.norm.weight"])
    ours = HuggingFaceCausalLM(reloaded.config)
    ours.configure_model()
    ours.load_state_dict(trained, strict=True)
    batch = tokens()
    torch.testing.assert_close(reloaded(batch[:, :-1]).logits, ours.eval()(batch), rtol=0, atol=0)
    # The folder the run started from named the tokenizer and generation config: both came along, the ids of the
    # tokenizer's EOS (</s>: 3, also the BOS as the tokenizer names none) in place of the config's defaults.
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    assert (out / "generation_config.json").exists() and (out / "config.json").exists()
    for name in ("config.json", "generation_config.json"):
        assert {k: json.loads((out / name).read_text()).get(k) for k in ("bos_token_id", "eos_token_id")} == \
            {"bos_token_id": 3, "eos_token_id": 3}, name


def test_consolidate_hf_takes_the_tokenizer_argument_and_refuses_another_models_checkpoint(tmp_path, capsys):
    folder = hf_folder(tmp_path / "hf", shard=False)
    tok = word_tokenizer(tmp_path / "tok")
    (tok / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "custom": 1}))
    model = HuggingFaceCausalLM.from_pretrained(folder)
    model.configure_model()
    ckpt = tmp_path / "one.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, ckpt)
    out = tmp_path / "out"
    assert consolidate_main([str(ckpt), str(out), "--hf", "--tokenizer", str(tok)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert not equals_file(AutoModelForCausalLM.from_pretrained(out).state_dict(), hf_file_tensors(folder), HF_TIED)
    # The tokenizer's own config, with the generic class and the EOS found added; its pad id in the model's config.
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "custom": 1,
        "model_input_names": ["input_ids", "attention_mask"], "pad_token": "<pad>", "eos_token": "</s>",
        "bos_token": "</s>", "unk_token": "<unk>"}
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (3, 3, 1)
    big = word_tokenizer(tmp_path / "big", specials=tuple(f"<{i}>" for i in range(300)))
    with pytest.raises(SystemExit):
        consolidate_main([str(ckpt), str(tmp_path / "o3"), "--hf", "--tokenizer", str(big)])
    assert "has 303 ids, more than the model's vocab_size 256" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()
    with pytest.raises(SystemExit):
        consolidate_main([str(ckpt), str(tmp_path / "lit"), "--litgpt"])
    assert "--litgpt needs a checkpoint of LitGPT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        consolidate_main([str(ckpt), str(tmp_path / "o2"), "--hf", "--tokenizer", str(tmp_path)])
    assert "holds no tokenizer files" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()  # refused before anything was written


def test_consolidate_warns_of_a_run_tokenizer_not_found_and_refuses_a_non_empty_folder(tmp_path, capsys):
    model = HuggingFaceCausalLM.from_pretrained(hf_folder(tmp_path / "hf", shard=False))
    model.configure_model()
    for name, tokenizer in (("lost", "relative/tok"), ("none", None)):
        torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                    "datamodule_hyper_parameters": {"data_path": None, "tokenizer": tokenizer}}, tmp_path / name)
    assert consolidate_main([str(tmp_path / "lost"), str(tmp_path / "out"), "--hf"]) == 0
    err = capsys.readouterr().err
    assert "'relative/tok' was not found" in err and "--tokenizer" in err
    assert consolidate_main([str(tmp_path / "none"), str(tmp_path / "out2"), "--hf"]) == 0
    assert "tokenizer" not in capsys.readouterr().err  # a run without a tokenizer: nothing to say
    (tmp_path / "out2" / "stale.txt").write_text("old")
    before = sorted(os.listdir(tmp_path / "out2"))
    with pytest.raises(SystemExit):
        consolidate_main([str(tmp_path / "none"), str(tmp_path / "out2"), "--hf"])
    assert "is not empty" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "out2")) == before


@pytest.mark.parametrize("data_path", ["tokens", "tokens/train"])
def test_consolidate_hf_takes_the_tokenizer_a_prepared_data_path_carries(tmp_path, data_path):
    # A run given only data_path (a `prepare` output, its tokenizer left out as docs/guide/data.md says it may be): the
    # checkpoint names no tokenizer, the prepared folder holds one (tokenizer/ beside COMPLETE.json).
    prepared = tmp_path / "tokens"
    (prepared / "train").mkdir(parents=True)
    (prepared / "COMPLETE.json").write_text(json.dumps({"vocab_size": 256}))
    word_tokenizer(prepared / "tokenizer", specials=("<unk>", "</s>"))
    (prepared / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    model = HuggingFaceCausalLM.from_pretrained(hf_folder(tmp_path / "hf", shard=False))
    model.configure_model()
    ckpt = tmp_path / "one.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "datamodule_hyper_parameters": {"data_path": str(tmp_path / data_path), "tokenizer": None}}, ckpt)
    assert consolidate_main([str(ckpt), str(tmp_path / "out"), "--hf"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (prepared / "tokenizer" / "tokenizer.json").read_text()
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (written["eos_token"], written["tokenizer_class"]) == ("</s>", "PreTrainedTokenizerFast")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 1


def test_hf_pretrained_mismatches_are_refused_and_unused_tensors_warned_naming_the_keys(tmp_path):
    folder = hf_folder(tmp_path / "hf", shard=False)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HuggingFaceCausalLM.from_pretrained(tmp_path / "nowhere")
    wider = HuggingFaceCausalLM({**adapter_fit.HF_LLAMA, "intermediate_size": 48}, pretrained=str(folder))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' of shape \(64, 32\).*\(48, 32\)"):
        wider.configure_model()
    untied = HuggingFaceCausalLM({**adapter_fit.HF_LLAMA, "tie_word_embeddings": False}, pretrained=str(folder))
    with pytest.raises(KeyError, match="hold no 'lm_head.weight'"):
        untied.configure_model()  # the file has no head of its own: the model would keep a random one
    shallower = HuggingFaceCausalLM({**adapter_fit.HF_LLAMA, "num_hidden_layers": 1}, pretrained=str(folder))
    with pytest.warns(UserWarning, match=r"hold 9 tensor\(s\) the model has no place for.*model.layers.1"):
        shallower.configure_model()


def test_hf_pretrained_tied_weight_missing_under_every_name_and_misspelled_overrides_are_refused(tmp_path):
    from safetensors.torch import save_file

    folder = hf_folder(tmp_path / "hf", tied=True, shard=False)
    with pytest.raises(ValueError, match=r"overrides \['hiden_size'\] are not fields of LlamaConfig"):
        HuggingFaceCausalLM({"hiden_size": 64}, pretrained=str(folder))  # transformers alone would ignore it
    tensors = hf_file_tensors(folder)
    del tensors["model.embed_tokens.weight"]  # the tied embedding/head, under neither of its names now
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = HuggingFaceCausalLM.from_pretrained(folder)
    with pytest.raises(KeyError, match="hold no 'model.embed_tokens.weight' \\(nor any other name"):
        model.configure_model()  # it stayed the random init, silently


def test_hf_pretrained_is_an_init_arg_of_the_cli(tmp_path, monkeypatch):
    from lightning_async_pp.cli import AsyncPipelineCLI

    folder = hf_folder(tmp_path / "hf", shard=False)
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    config = {"model": {"class_path": "lightning_async_pp.models.HuggingFaceCausalLM",
                        "init_args": {"pretrained": str(folder), "lr": 0.0, "config": {"rms_norm_eps": 1e-3}}}}
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    cli = AsyncPipelineCLI(args=["--config", str(tmp_path / "c.yaml")], run=False)
    assert cli.model.config.rms_norm_eps == 1e-3 and cli.model.config.hidden_size == 32  # the folder's, one override
    cli.model.configure_model()
    assert not equals_file(cli.model.state_dict(), hf_file_tensors(folder), HF_TIED)


# ---- load_state_dict onto meta inside configure_model is never silent ---------------------------------------------------
class LoadsInConfigureModel(HuggingFaceCausalLM):
    """The pattern a user writes: the model built, then the pretrained state dict loaded, in configure_model()."""

    def __init__(self, config, state, assign: bool) -> None:
        super().__init__(config, lr=0.0)
        self.state, self.assign = state, assign

    def configure_model(self) -> None:
        if self._layers is None:
            super().configure_model()
            self.load_state_dict(self.state, assign=self.assign)


def one_device_fit(model, steps: int = 1) -> None:
    L.Trainer(strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2), accelerator="cpu", devices=1,
              max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model, adapter_fit.loader({"batch": 4, "samples": 8}))


def test_load_state_dict_onto_meta_parameters_in_configure_model_raises_naming_from_pretrained(tmp_path):
    folder = hf_folder(tmp_path / "hf", shard=False)
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    config = AutoConfig.from_pretrained(folder)
    for assign in (False, True):  # assign=True too: what it assigns inside configure_model goes back to meta
        with pytest.raises(RuntimeError, match=r"would copy nothing.*HuggingFaceCausalLM.from_pretrained\(path\)"):
            one_device_fit(LoadsInConfigureModel(config, state, assign=assign))


# ---- litgpt in and out --------------------------------------------------------------------------------------------
def test_litgpt_one_device_pipeline_from_checkpoint_then_consolidate_litgpt_loads_in_litgpt(tmp_path):
    folder = litgpt_folder(tmp_path / "lit")  # skips without litgpt
    from litgpt import GPT, Config

    file = torch.load(folder / "lit_model.pth")
    cfg = {"adapter": "litgpt", "pretrained": str(folder), "zero_lr_first": True, "steps": 2, "partition": [2, 3],
           "checkpoint_dir": str(tmp_path / "ckpt")}
    result = run_here_on_one_device(adapter_fit.run, cfg)
    assert not equals_file(result["first_step"], file, {})
    upstream = GPT(Config.from_file(folder / "model_config.yaml")).eval()
    upstream.load_state_dict(file, strict=True)
    first = next(iter(adapter_fit.loader(cfg)))
    expected = torch.nn.functional.cross_entropy(upstream(first[:, :-1]).flatten(0, 1), first[:, 1:].flatten())
    torch.testing.assert_close(result["first_loss"], expected, rtol=0, atol=1e-6)
    out = tmp_path / "out"
    assert consolidate_main([str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"), str(out), "--litgpt"]) == 0
    reloaded = GPT(Config.from_file(out / "model_config.yaml")).eval()
    reloaded.load_state_dict(torch.load(out / "lit_model.pth"), strict=True)
    trained = result["state_dict"]
    assert max(float((trained[k] - v).abs().max()) for k, v in reloaded.state_dict().items()) == 0.0
    ours = LitGPT.from_checkpoint(out)
    ours.configure_model()
    batch = tokens()
    torch.testing.assert_close(reloaded(batch[:, :-1]), ours.eval()(batch), rtol=0, atol=0)


# ---- the user's own tokenizer through export -------------------------------------------------------------------------
EOS = "<|endoftext|>"
CORPUS = ("the pipeline sends activations forward while gradients flow back, and every stage keeps \"two\" versions "
          "of its weights so that the delay stays bounded. ")


def bare_bpe(folder: Path, specials: tuple[str, ...] = (EOS,)):
    """A byte-level BPE trained here and saved as a bare ``tokenizer.json`` (no tokenizer_config.json), as
    ``tokenizers`` users save one; the end-of-text token is not id 2, Llama's default eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


class RecordedLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_bare_tokenizer_json_survives_export_to_autotokenizer_and_generate_with_its_own_special_ids(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from lightning_async_pp.data import TextDataModule

    tok = bare_bpe(tmp_path / "tok", specials=("<pad>", "<unk>", EOS))
    vocab, eos = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(EOS)
    assert eos == 2 and tok.token_to_id("<pad>") == 0  # Llama's default eos id is another token here: its EOS
    (tmp_path / "corpus.txt").write_text(CORPUS * 30)
    dm = TextDataModule(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tok"), block_size=8,
                        batch_size=4, val_fraction=0.0, cache_dir=str(tmp_path / "cache"), num_workers=0)
    L.seed_everything(0, verbose=False)
    model = HuggingFaceCausalLM({**adapter_fit.HF_LLAMA, "vocab_size": vocab}, lr=0.01)
    trainer = L.Trainer(strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2), accelerator="cpu",
                        devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    out = tmp_path / "out"
    assert consolidate_main([str(tmp_path / "run.ckpt"), str(out), "--hf"]) == 0  # the tokenizer from the data module

    loaded = AutoTokenizer.from_pretrained(out)
    assert type(loaded).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend") and len(loaded) == vocab
    text = "the pipeline keeps \"two\" versions of its weights"
    assert loaded(text)["input_ids"] == tok.encode(text).ids and loaded.decode(tok.encode(text).ids) == text
    assert (loaded.eos_token, loaded.eos_token_id, loaded.bos_token_id) == (EOS, eos, eos)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    generation = GenerationConfig.from_pretrained(out)
    for config in (reloaded.config, generation, reloaded.generation_config):
        assert (config.eos_token_id, config.bos_token_id) == (eos, eos)
    # No pad token named: the EOS pads in the generation config and the tokenizer, not in config.json (there it
    # would be the embedding's padding_idx), so generate() does not warn "Setting `pad_token_id`" at every call.
    assert reloaded.config.pad_token_id is None and generation.pad_token_id == eos and loaded.pad_token_id == eos
    prompt = loaded(text, return_tensors="pt")
    warned = RecordedLog()
    logging.getLogger("transformers").addHandler(warned)
    try:
        generated = reloaded.generate(**prompt, max_new_tokens=6, do_sample=False)
    finally:
        logging.getLogger("transformers").removeHandler(warned)
    assert not [m for m in warned.messages if "pad_token_id" in m], warned.messages
    assert generated.shape[1] > prompt["input_ids"].shape[1] and int(generated.max()) < vocab
    assert torch.equal(generated[:, : prompt["input_ids"].shape[1]], prompt["input_ids"])


def test_consolidate_litgpt_writes_a_tokenizer_config_litgpts_tokenizer_reads_the_runs_eos_from(tmp_path):
    folder = litgpt_folder(tmp_path / "lit")  # skips without litgpt
    from litgpt.tokenizer import Tokenizer

    model = LitGPT.from_checkpoint(folder)
    model.configure_model()
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, tmp_path / "one.ckpt")
    tok = word_tokenizer(tmp_path / "tok")  # a bare tokenizer.json, </s> at id 3
    out = tmp_path / "out"
    assert consolidate_main([str(tmp_path / "one.ckpt"), str(out), "--litgpt", "--tokenizer", str(tok)]) == 0
    loaded = Tokenizer(out)
    assert (loaded.eos_id, loaded.bos_id, loaded.encode("the stage sends").tolist()) == (3, 3, [4, 5, 6])


# ---- the guide's fine-tuning recipe -------------------------------------------------------------------------------
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "models.md"


def recipe_code() -> str:
    section = GUIDE.read_text().split("## Fine-tuning: pretrained weights, part of the model frozen", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_guides_fine_tuning_recipe_trains_the_upper_layers_from_the_file_and_keeps_the_lower_ones(tmp_path):
    # The recipe's code as the page shows it, on a tiny sharded save_pretrained folder, one device (2 stages), one
    # epoch: the frozen embedding (tied head) and first decoder layer end exactly at the file's values, the rest
    # moved from them; at epoch 1 the callback adds the frozen layers as a group at a tenth of the model's rate.
    folder = hf_folder(tmp_path / "SmolLM-135M")
    code = recipe_code()
    for old, new in [('"checkpoints/SmolLM-135M"', repr(str(folder))),
                     ("num_microbatches=4)", "num_microbatches=4, num_stages=2)"),
                     ("devices=2, max_epochs=2", "devices=1, max_epochs=1, accelerator='cpu', logger=False, "
                                                 "enable_checkpointing=False, enable_progress_bar=False")]:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace = {"train_loader": adapter_fit.loader({"samples": 16, "batch": 8})}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    model, trainer = namespace["model"], namespace["trainer"]
    assert trainer.global_step == 2
    file = hf_file_tensors(folder)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    lower = [k for k in weights if k.startswith(("model.embed_tokens.", "model.layers.0.", "lm_head."))]
    assert len(lower) > 3 and not equals_file({k: weights[k] for k in lower}, file, HF_TIED)
    upper = [k for k in weights if k not in lower]
    assert sorted(equals_file({k: weights[k] for k in upper}, file, HF_TIED)) == sorted(upper)  # all trained
    callback = namespace["FreezeLowerLayersForAnEpoch"]()
    optimizer = model.configure_optimizers()
    before = len(optimizer.param_groups)
    callback.finetune_function(model, 1, optimizer)
    added = optimizer.param_groups[before:]
    assert len(added) == 1 and added[0]["lr"] == pytest.approx(1e-5)
    lower_params = {id(p) for m in callback.lower(model) for p in m.parameters()}
    assert {id(p) for p in added[0]["params"]} == lower_params
