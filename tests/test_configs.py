"""Every YAML under configs/ stays valid for the CLI, and the GPU comparison configs stay comparable.

Parsing (``--print_config``) resolves every ``class_path`` and checks every ``init_args`` against the signatures,
without building anything, so a GPU config is checked on a CPU machine too. A tiny-size run of one GPU config on
CPU checks what parsing cannot: that the options work together.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_async_pp.callbacks import TextSamples
from lightning_async_pp.callbacks.text import decode_bytes, encode_bytes
from lightning_async_pp.cli import AsyncPipelineCLI
from lightning_async_pp.models import Llama

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STUDY_BASE = CONFIGS / "study" / "base.yaml"
#: The tokenized Hugging Face run (a user's own data and checkpoint), not a cell of the comparison.
HF_TOKENIZED = CONFIGS / "gpu" / "smollm_135m_hf_tokenized_2bw.yaml"
GPU = sorted(p for p in (CONFIGS / "gpu").glob("smollm_135m_*.yaml") if p != HF_TOKENIZED)


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])


def config_sets() -> list[list[Path]]:
    """Each runnable combination: a study cell goes after the study's base.yaml (its header says so)."""
    sets = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        if path.parent.name == "study" and path != STUDY_BASE or path.parent == CONFIGS / "study" / "corrections":
            sets.append([STUDY_BASE, path])
        else:
            sets.append([path])
    return sets


@pytest.mark.parametrize("paths", config_sets(), ids=lambda ps: str(ps[-1].relative_to(CONFIGS)))
def test_every_config_parses_with_the_cli(paths, capsys):
    args = ["fit"] + [a for p in paths for a in ("--config", str(p))] + ["--print_config"]
    with pytest.raises(SystemExit) as exit_:
        AsyncPipelineCLI(args=args)
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    merged = {}
    for p in paths:
        merge(merged, yaml.safe_load(p.read_text()))
    assert printed["model"]["class_path"] == merged["model"]["class_path"]
    assert printed["trainer"]["max_steps"] == merged["trainer"]["max_steps"]


def merge(into: dict, update: dict) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict) and "class_path" not in v:
            merge(into[k], v)
        else:
            into[k] = v


def test_the_gpu_comparison_has_six_cells():
    names = {p.stem for p in GPU}
    assert names == {f"smollm_135m_{o}{s}" for o in ("", "muon_") for s in ("2bw", "1f1b", "2bw_ef")}


def test_gpu_configs_differ_only_in_schedule_and_optimizer():
    def without_cell(path: Path) -> dict:
        config = yaml.safe_load(path.read_text())
        config["trainer"]["strategy"]["init_args"].pop("schedule")
        config.pop("optimizer")
        config["trainer"]["logger"]["init_args"].pop("name")  # each cell logs under its own name
        return config

    first = without_cell(GPU[0])
    for path in GPU[1:]:
        assert without_cell(path) == first, path.name


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.stem)
def test_gpu_config_states_its_budget_and_matches_its_cell(path):
    config = yaml.safe_load(path.read_text())
    text = path.read_text()
    trainer, data, strategy = config["trainer"], config["data"], config["trainer"]["strategy"]["init_args"]
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 1, "bf16-true")
    assert strategy["num_stages"] > 1 and strategy["num_microbatches"] >= strategy["num_stages"]
    assert strategy["schedule"] == ("1f1b" if "1f1b" in path.stem else "2bw")
    optimizer = config["optimizer"]
    if path.stem.endswith("_ef"):
        assert optimizer["class_path"] == "lightning_async_pp.optim.ErrorFeedback"
        optimizer = optimizer["init_args"]["optimizer"]
    assert optimizer["class_path"] == ("lightning_async_pp.optim.Muon" if "muon" in path.stem else "torch.optim.AdamW")
    # The schedule: warmup, then cosine over exactly the run.
    scheduler = config["lr_scheduler"]
    assert scheduler["class_path"] == "lightning_async_pp.optim.WarmupCosine"
    assert scheduler["init_args"]["total_steps"] == trainer["max_steps"] > scheduler["init_args"]["warmup_steps"] > 0
    assert config["model"]["init_args"]["max_seq_len"] >= data["block_size"]
    assert config["model"]["init_args"]["size"] == "smollm-135m"
    # The header's budget is the config's: rows x tokens per step, and the total.
    tokens_per_step = data["batch_size"] * data["block_size"]
    batch = f"batch {data['batch_size']} rows x {data['block_size']} tokens = {tokens_per_step:,} tokens per step"
    assert batch in text
    total = tokens_per_step * trainer["max_steps"]
    assert f"{trainer['max_steps']:,} steps = {total / 1e6:.1f}M tokens" in text
    assert trainer["val_check_interval"] < trainer["max_steps"]
    assert trainer["logger"]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"
    assert trainer["logger"]["init_args"]["name"] == path.stem


def test_a_gpu_config_trains_two_steps_at_tiny_size_on_cpu(tmp_path, monkeypatch):
    """Everything of smollm_135m_muon_2bw_ef.yaml but the hardware and the size: bf16-true, the one-device 4-stage
    emulation, the scheduler, the callbacks (TextSamples included)."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "gpu" / "smollm_135m_muon_2bw_ef.yaml").read_text())
    config["trainer"].update(accelerator="cpu", max_steps=2, val_check_interval=2, limit_val_batches=1,
                             log_every_n_steps=1, enable_checkpointing=False, default_root_dir=str(tmp_path))
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    text_samples = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("TextSamples"))
    text_samples["init_args"].update(every_n_steps=2, max_new_tokens=3)
    config["model"]["init_args"].update(size="tiny", max_seq_len=32)
    config["lr_scheduler"]["init_args"].update(warmup_steps=1, total_steps=2)
    config["data"].update(block_size=32, batch_size=8, num_workers=0, max_bytes=60_000, cache_dir=str(tmp_path / "c"))
    path = tmp_path / "gpu_on_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    assert next(p for p in cli.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
    (samples,) = [c for c in cli.trainer.callbacks if isinstance(c, TextSamples)]
    assert [step for step, _ in samples.history] == [2] and len(samples.history[0][1]) == 3


def test_text_samples_is_built_from_yaml_with_a_tokenizer_given_by_import_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "llama_tiny.yaml").read_text())
    config["trainer"].update(devices=1)
    config["trainer"]["strategy"]["init_args"].pop("partition")
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["callbacks"].append({"class_path": "lightning_async_pp.callbacks.TextSamples", "init_args": {
        "prompts": ["x"], "every_n_steps": 7, "max_new_tokens": 5, "temperature": 0.8, "top_k": 40, "tag": "sampled",
        "decode": "lightning_async_pp.callbacks.text.decode_bytes",
        "encode": "lightning_async_pp.callbacks.text.encode_bytes",
    }})
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["--config", str(path)], run=False)
    greedy, sampled = [c for c in cli.trainer.callbacks if isinstance(c, TextSamples)]
    assert isinstance(cli.model, Llama)
    assert greedy.temperature == 0.0 and greedy.prompts == ["def ", "import os\n", "class Stack:\n    def "]
    assert (sampled.every_n_steps, sampled.max_new_tokens, sampled.temperature, sampled.top_k, sampled.tag) == (
        7, 5, 0.8, 40, "sampled")
    assert sampled.decode is decode_bytes and sampled.encode is encode_bytes


def test_the_guides_llama_yaml_parses_with_the_cli(tmp_path, capsys):
    page = (CONFIGS.parent / "docs" / "guide" / "models.md").read_text()
    section = page.split("## Pretraining a Llama-style model", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "readme_llama.yaml"
    path.write_text(block)
    with pytest.raises(SystemExit) as exit_:
        AsyncPipelineCLI(args=["fit", "--config", str(path), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["tie_embeddings"] is True
    assert printed["trainer"]["callbacks"][0]["class_path"] == "lightning_async_pp.callbacks.TextSamples"


def test_the_tokenized_hf_gpu_config_is_the_readme_recipe_on_two_gpus():
    """smollm_135m_hf_tokenized_2bw.yaml: a local save_pretrained folder and a prepared folder with its tokenizer,
    2BW over two GPUs, sharded checkpoints; the header's commands make and use exactly the config's paths."""
    config, text = yaml.safe_load(HF_TOKENIZED.read_text()), HF_TOKENIZED.read_text()
    trainer, data, model = config["trainer"], config["data"], config["model"]
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 2, "bf16-true")
    strategy = trainer["strategy"]["init_args"]
    assert strategy["schedule"] == "2bw" and strategy["save_distributed_checkpoint"] is True
    assert "num_stages" not in strategy  # one stage per GPU
    assert model["class_path"] == "lightning_async_pp.models.HuggingFaceCausalLM"
    pretrained = model["init_args"]["pretrained"]
    assert data["tokenizer"] == pretrained  # the checkpoint's folder holds its tokenizer too
    assert f"--tokenizer {pretrained} --output {data['data_path']} " in text
    assert f"save_pretrained('{pretrained}')" in text
    (checkpoint,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert f"python -m lightning_async_pp.consolidate {checkpoint['init_args']['dirpath']}/" in text and " --hf" in text
    assert f"lightning-async-pp fit --config configs/gpu/{HF_TOKENIZED.name}" in text
    assert config["lr_scheduler"]["init_args"]["total_steps"] == trainer["max_steps"]
    assert data["block_size"] <= 2048  # SmolLM-135M's max_position_embeddings
    tokens_per_step = data["batch_size"] * data["block_size"]
    assert (f"batch {data['batch_size']} rows x {data['block_size']} tokens = {tokens_per_step:,} tokens per step; "
            f"{trainer['max_steps']:,} steps = {tokens_per_step * trainer['max_steps'] / 1e6:.1f}M tokens") in text


def test_the_tokenized_hf_gpu_config_trains_two_steps_at_tiny_size_on_cpu(tmp_path, monkeypatch):
    """Everything of smollm_135m_hf_tokenized_2bw.yaml but the hardware, the size and the paths (a tiny random
    Llama and a BPE trained here, saved into one folder as the header says; a corpus prepared with it): bf16-true,
    the pretrained folder, the prepared data with its tokenizer checked, sharded checkpoints, the scheduler and
    TextSamples with the data's tokenizer. The 2-process run of the same pieces: tests/test_recipe.py."""
    pytest.importorskip("transformers")
    from helpers import load_example
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_async_pp.data.prepare import prepare

    monkeypatch.chdir(tmp_path)
    recipe = load_example("recipe")
    files = recipe.write_corpus(tmp_path / "corpus")
    folder = tmp_path / "checkpoint"
    tokenizer = recipe.train_tokenizer(files, folder)
    torch.manual_seed(0)
    llama = AutoConfig.for_model(**recipe.tiny_llama(tokenizer.get_vocab_size(with_added_tokens=True)))
    AutoModelForCausalLM.from_config(llama).save_pretrained(folder)
    prepare(files, folder, tmp_path / "tokens", val_fraction=0.2, num_workers=1)

    config = yaml.safe_load(HF_TOKENIZED.read_text())
    # limit_val_batches 2, not 1: the CLI reads a 1 as 1.0, all the batches.
    config["trainer"].update(accelerator="cpu", devices=1, max_steps=2, val_check_interval=2, limit_val_batches=2,
                             log_every_n_steps=1, default_root_dir=str(tmp_path))
    config["trainer"]["strategy"]["init_args"]["num_stages"] = 2  # the one-device emulation of the two GPUs
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    callbacks = {c["class_path"].rsplit(".", 1)[1]: c for c in config["trainer"]["callbacks"]}
    callbacks["ModelCheckpoint"]["init_args"].update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    callbacks["TextSamples"]["init_args"].update(every_n_steps=2, max_new_tokens=3)
    config["model"]["init_args"]["pretrained"] = str(folder)
    config["lr_scheduler"]["init_args"].update(warmup_steps=1, total_steps=2)
    config["data"].update(data_path=str(tmp_path / "tokens"), tokenizer=str(folder), block_size=16, batch_size=8,
                          num_workers=0)
    path = tmp_path / "hf_tokenized_on_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    assert next(p for p in cli.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
    assert (tmp_path / "ckpt" / "epoch=0-step=2.ckpt").is_dir()  # sharded
    (samples,) = [c for c in cli.trainer.callbacks if isinstance(c, TextSamples)]
    assert [step for step, _ in samples.history] == [2] and len(samples.history[0][1]) == 2
    assert cli.trainer.num_val_batches == [2]
