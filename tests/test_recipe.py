"""The recipe a user starts from, end to end: ``examples/recipe.py`` (their tokenizer and corpus, a Hugging Face
checkpoint, a 2-process 2BW fit through the ``lightning-async-pp`` CLI, a ``save_pretrained`` folder out, text
generated from it), run as a user runs it, then checked.

Everything is made by the example (a BPE tokenizer trained on its own text, a tiny random Llama); nothing is
downloaded. The references are independent of the code under test: the trained weights are read from the sharded
checkpoint with ``torch.distributed.checkpoint`` itself, the tokenizer is the ``tokenizers`` object saved there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from helpers import load_example  # noqa: E402

recipe = load_example("recipe")
EOS = recipe.EOS


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recipe_tokenizer_prepare_two_process_fit_consolidate_hf_loads_in_transformers_and_generates(tmp_path, capfd):
    work = tmp_path / "work"
    out = recipe.main(["--workdir", str(work)])
    printed = capfd.readouterr().out
    tokenizer = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)

    # 1-2. The user's tokenizer and corpus -> `python -m lightning_async_pp.data.prepare`.
    info = json.loads(next(line for line in printed.splitlines() if line.startswith("{")))
    assert (info["vocab_size"], info["eos_id"], info["dtype"]) == (vocab, tokenizer.token_to_id(EOS), "uint16")
    assert info["train_tokens"] > 4 * 8 * 17 and info["val_tokens"] > 0  # enough rows for the run

    # 4. `lightning-async-pp fit` on 2 processes wrote one sharded checkpoint at the last step.
    (ckpt,) = (work / "ckpt").glob("*.ckpt")
    assert ckpt.name == "epoch=0-step=4.ckpt" and ckpt.is_dir()  # sharded: one directory, each stage its tensors

    # 5. `consolidate --hf`: the tokenizer comes from the run.
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))

    # The trained weights, read from the checkpoint by torch.distributed.checkpoint alone (the newest version is
    # under "model.", a tied parameter once), in the upstream class built from the config.
    dcp_to_torch_save(ckpt, tmp_path / "flat.pt")
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)
    trained = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    llama = recipe.tiny_llama(vocab)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**llama)).eval()
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    initial = AutoModelForCausalLM.from_pretrained(work / "pretrained")
    moved = max(float((v - initial.state_dict()[k]).abs().max()) for k, v in reference.state_dict().items())
    assert moved > 1e-3  # the four updates trained

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.vocab_size == vocab and reloaded.config.tie_word_embeddings
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in reloaded.state_dict().items())
    text = "the delay stays bounded while every weight version is kept"
    ids = torch.tensor([tokenizer.encode(text).ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=0, atol=0)

    # The folder's tokenizer is the one trained by the example: the same ids, the same end-of-text token.
    for loaded in (AutoTokenizer.from_pretrained(out), PreTrainedTokenizerFast.from_pretrained(out)):
        assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
        assert loaded.eos_token == EOS and loaded.eos_token_id == tokenizer.token_to_id(EOS)
        assert loaded.decode(tokenizer.encode(text).ids) == text

    # 6. What the example printed is the greedy continuation of the reference weights, token by token.
    prompt_ids = tokenizer.encode("the pipeline stage").ids
    sequence = list(prompt_ids)
    with torch.no_grad():
        for _ in range(16):
            next_id = int(reference(torch.tensor([sequence])).logits[0, -1].argmax())
            sequence.append(next_id)
            if next_id == tokenizer.token_to_id(EOS):
                break
    continuation = tokenizer.decode(sequence[len(prompt_ids):], skip_special_tokens=True)
    assert f"'the pipeline stage' -> {continuation!r}" in printed, printed[-2000:]
