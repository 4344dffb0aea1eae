"""The README's recipe end to end, as a user runs it: their tokenizer and corpus, a Hugging Face checkpoint, a
2-process 2BW fit through the ``lightning-async-pp`` CLI, and a ``save_pretrained`` folder out.

Everything is made here (a BPE tokenizer trained on the test's own text, a tiny random Llama); nothing is
downloaded. The references are independent of the code under test: the trained weights are read from the sharded
checkpoint with ``torch.distributed.checkpoint`` itself, the tokenizer is the ``tokenizers`` object trained here.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from lightning_async_pp.consolidate import main as consolidate_main  # noqa: E402
from lightning_async_pp.data.prepare import main as prepare_main  # noqa: E402

EOS = "<|endoftext|>"
WORDS = ("the pipeline stage sends activations forward while gradients flow back and every weight version is kept "
         "for the update of one step before so the delay stays bounded").split()
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def write_corpus(folder: Path) -> list[Path]:
    """Three text files and a .jsonl of documents, of seeded word salad."""
    rng = random.Random(0)

    def document(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)) + ".\n"

    folder.mkdir()
    files = []
    for i in range(3):
        files.append(folder / f"part{i}.txt")
        files[-1].write_text("".join(document(40) for _ in range(8)))
    files.append(folder / "docs.jsonl")
    files[-1].write_text("".join(json.dumps({"text": document(30), "id": i}) + "\n" for i in range(25)))
    return files


def train_tokenizer(files: list[Path], folder: Path) -> Tokenizer:
    """A byte-level BPE with an end-of-text token, saved as transformers saves one (tokenizer.json and
    tokenizer_config.json naming the eos_token)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(f) for f in files if f.suffix == ".txt"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(folder)
    return tokenizer


def tiny_llama(vocab_size: int) -> dict:
    """A tiny Llama config (tied embedding and head, as SmolLM) with the tokenizer's vocabulary."""
    return dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def recipe_config(tmp_path: Path, pretrained: Path, data: Path) -> Path:
    """What a user writes: 2 CPU processes, 2BW, the HF checkpoint and the prepared folder (its tokenizer comes
    with it), a sharded checkpoint at the last step."""
    config = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "max_steps": 4, "limit_val_batches": 0, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "strategy": {"class_path": "lightning_async_pp.AsyncPipelineStrategy",
                         "init_args": {"schedule": "2bw", "num_microbatches": 4, "pipeline_timeout": 120.0,
                                       "save_distributed_checkpoint": True}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 4}}],
        },
        "model": {"class_path": "lightning_async_pp.models.HuggingFaceCausalLM",
                  "init_args": {"pretrained": str(pretrained), "lr": 0.01}},
        "data": {"data_path": str(data), "block_size": 16, "batch_size": 8, "num_workers": 0},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recipe_tokenizer_prepare_two_process_fit_consolidate_hf_loads_in_transformers(tmp_path, capsys):
    # 1. The user's tokenizer and corpus -> `python -m lightning_async_pp.data.prepare`.
    files = write_corpus(tmp_path / "corpus")
    tokenizer = train_tokenizer(files, tmp_path / "tokenizer")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    data = tmp_path / "tokens"
    prepare_main(["--tokenizer", str(tmp_path / "tokenizer"), "--output", str(data), "--val-fraction", "0.2",
                  "--num-workers", "1", *map(str, files)])
    info = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert (info["vocab_size"], info["eos_id"], info["dtype"]) == (vocab, tokenizer.token_to_id(EOS), "uint16")
    assert info["train_tokens"] > 4 * 8 * 17 and info["val_tokens"] > 0  # enough rows for the run

    # 2. A Hugging Face checkpoint with the tokenizer's vocabulary (random weights from a tiny Llama config).
    torch.manual_seed(0)
    llama = tiny_llama(vocab)
    initial = AutoModelForCausalLM.from_config(AutoConfig.for_model(**llama))
    initial.save_pretrained(tmp_path / "pretrained")

    # 3. `lightning-async-pp fit --config recipe.yaml` on 2 processes (Lightning's launcher starts the second).
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    config = recipe_config(tmp_path, tmp_path / "pretrained", data)
    proc = subprocess.run([sys.executable, "-m", "lightning_async_pp.cli", "fit", "--config", str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    assert ckpt.name == "epoch=0-step=4.ckpt" and ckpt.is_dir()  # sharded: one directory, each stage its tensors

    # 4. `python -m lightning_async_pp.consolidate CKPT OUT --hf`: the tokenizer comes from the run.
    out = tmp_path / "hf"
    assert consolidate_main([str(ckpt), str(out), "--hf"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))

    # The trained weights, read from the checkpoint by torch.distributed.checkpoint alone (the newest version is
    # under "model.", a tied parameter once), in the upstream class built from the config.
    dcp_to_torch_save(ckpt, tmp_path / "flat.pt")
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)
    trained = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**llama)).eval()
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    moved = max(float((v - initial.state_dict()[k]).abs().max()) for k, v in reference.state_dict().items())
    assert moved > 1e-3  # the four updates trained

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.vocab_size == vocab and reloaded.config.tie_word_embeddings
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in reloaded.state_dict().items())
    text = "the delay stays bounded while every weight version is kept"
    ids = torch.tensor([tokenizer.encode(text).ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=0, atol=0)

    # The folder's tokenizer is the one trained here: the same ids, the same end-of-text token.
    for loaded in (AutoTokenizer.from_pretrained(out), PreTrainedTokenizerFast.from_pretrained(out)):
        assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
        assert loaded.eos_token == EOS and loaded.eos_token_id == tokenizer.token_to_id(EOS)
        assert loaded.decode(tokenizer.encode(text).ids) == text
