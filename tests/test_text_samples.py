"""callbacks.TextSamples: continuations decoded through the pipeline's predict path, logged to TensorBoard.

References: a greedy loop written out here with the model's sequential forward (``model(batch)``), and the
one-device run for 2 processes (scripts/llama_fit.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from test_llama_pipeline import one_device, run_two_processes  # noqa: E402

from lightning_async_pp.callbacks import TextSamples  # noqa: E402
from lightning_async_pp.callbacks.text import as_markdown  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402

PROMPTS = ["def f(", "ab"]


def greedy(model: Llama, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding: run the whole sequence forward, take the most likely next token, append it."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            batch = torch.tensor([ids + [0]])  # the model reads all but the last column
            ids.append(int(model(batch)[0, -1].argmax()))
    return ids[len(prompt_ids):]


def trained_llama(state_dict: dict | None = None, **kwargs) -> Llama:
    torch.manual_seed(0)
    model = Llama("tiny", vocab_size=256, max_seq_len=64, **kwargs)
    model.configure_model()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def text_cfg(**overrides) -> dict:
    return {"tie": True, "steps": 4, "val_every": 2, "partition": [3, 3],
            "text_samples": {"prompts": PROMPTS, "every_n_steps": 2, "max_new_tokens": 6, **overrides}}


# ---- decoding ---------------------------------------------------------------------------------------------------
def test_greedy_continuations_equal_a_plain_greedy_loop_without_a_trainer():
    model = trained_llama()
    callback = TextSamples(PROMPTS, every_n_steps=1, max_new_tokens=5)
    texts = callback.generate(model)
    expected = [bytes(greedy(model, list(p.encode()), 5)).decode("utf-8", errors="replace") for p in PROMPTS]
    assert texts == expected


def test_gpt_continuations_equal_a_plain_greedy_loop_and_respect_its_block_size():
    from lightning_async_pp.models import GPT

    torch.manual_seed(0)
    gpt = GPT(block_size=8, n_layer=1, n_head=2, n_embd=16).eval()
    prompt = "0123456789"  # longer than block_size: the context is the last 8 tokens
    texts = TextSamples([prompt], max_new_tokens=4).generate(gpt)
    ids = list(prompt.encode())
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(gpt(torch.tensor([ids[-8:] + [0]]))[0, -1].argmax()))
    assert texts == [bytes(ids[len(prompt):]).decode("utf-8", errors="replace")]


def test_top_k_one_sampling_is_greedy():
    model = trained_llama()
    greedy_texts = TextSamples(PROMPTS, max_new_tokens=5).generate(model)
    assert TextSamples(PROMPTS, max_new_tokens=5, temperature=1.0, top_k=1).generate(model) == greedy_texts


def test_sampling_with_a_seed_repeats_and_depends_on_the_seed():
    model = trained_llama()
    draws = [TextSamples(["x"], max_new_tokens=12, temperature=2.0, seed=s).generate(model) for s in (1, 1, 2)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_context_is_cut_to_max_context():
    model = trained_llama()
    long_prompt = "abcdefghij" * 4
    texts = TextSamples([long_prompt], max_new_tokens=3, max_context=8).generate(model)
    expected = greedy(model, list(long_prompt.encode())[-8:], 1)
    assert texts[0].encode()[:1] == bytes(expected)  # the first token sees only the last 8 prompt bytes


def test_a_user_tokenizer_encodes_prompts_and_decodes_continuations():
    model = trained_llama()
    words = [f"w{i}" for i in range(256)]
    encode = lambda text: [words.index(w) for w in text.split()]  # noqa: E731
    decode = lambda ids: " ".join(words[i] for i in ids)  # noqa: E731
    texts = TextSamples(["w3 w7 w1"], max_new_tokens=4, encode=encode, decode=decode).generate(model)
    assert texts == [decode(greedy(model, [3, 7, 1], 4))]


# ---- in training: one device, 2 processes, TensorBoard -------------------------------------------------------------
def test_one_device_run_logs_the_greedy_text_of_the_newest_weights(tmp_path):
    result = one_device({**text_cfg(), "log_dir": str(tmp_path / "logs")})
    steps = [step for step, _ in result["texts"]]
    assert steps == [2, 4]
    # Validation at step 4 is the last thing fit does, so the final weights are the ones step 4 decoded with.
    model = trained_llama(result["state_dict"])
    expected = [bytes(greedy(model, list(p.encode()), 6)).decode("utf-8", errors="replace") for p in PROMPTS]
    assert result["texts"][-1][1] == expected
    logged = tensorboard_texts(tmp_path / "logs")
    assert set(logged) == {("samples/0", 2), ("samples/1", 2), ("samples/0", 4), ("samples/1", 4)}
    for i, prompt in enumerate(PROMPTS):
        assert logged[(f"samples/{i}", 4)] == as_markdown(prompt, expected[i])


def test_trainer_validate_decodes_and_fit_without_validation_does_not(monkeypatch):
    import llama_fit

    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them; restored after the test
        monkeypatch.delenv(name, raising=False)
    model, loader, trainer = llama_fit.build({**text_cfg(), "devices": 1, "steps": 2})
    trainer.fit(model, loader)  # no validation loader: no validation during fit, so no samples
    (callback,) = [c for c in trainer.callbacks if isinstance(c, TextSamples)]
    assert callback.history == []
    trainer.validate(model, loader, verbose=False)
    reference = trained_llama({k: v.detach().clone() for k, v in model.state_dict().items()})
    expected = [bytes(greedy(reference, list(p.encode()), 6)).decode("utf-8", errors="replace") for p in PROMPTS]
    assert callback.history == [(2, expected)]


def test_two_processes_log_the_text_one_device_logs(tmp_path):
    cfg = text_cfg()
    reference = one_device(cfg)["texts"]
    ranks = run_two_processes({**cfg, "log_dir": str(tmp_path / "logs")}, tmp_path)
    assert ranks[0]["texts"] == reference  # rank 0 is the first stage: it picks the tokens
    assert ranks[1]["texts"] == []  # the last stage only passed activations on
    logged = tensorboard_texts(tmp_path / "logs")
    for (step, texts) in reference:
        for i, prompt in enumerate(PROMPTS):
            assert logged[(f"samples/{i}", step)] == as_markdown(prompt, texts[i])


def tensorboard_texts(log_dir: Path) -> dict[tuple[str, int], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = log_dir.rglob("events.out.tfevents.*")  # one run, one file (rank 0's)
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0}).Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            out[(tag.removesuffix("/text_summary"), event.step)] = event.tensor_proto.string_val[0].decode()
    return out


# ---- arguments ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts="hello"), r"list of strings.*\['hello'\]"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=["ok", ""]), r"prompts\[1\] must be a non-empty string"),
    (dict(prompts=["a"], every_n_steps=0), "every_n_steps must be a positive integer, got 0"),
    (dict(prompts=["a"], max_new_tokens=2.5), "max_new_tokens must be a positive integer, got 2.5"),
    (dict(prompts=["a"], temperature=-1.0), r"temperature must be a number >= 0 \(0: greedy\), got -1.0"),
    (dict(prompts=["a"], top_k=0), "top_k must be a positive integer, got 0"),
    (dict(prompts=["a"], decode="gpt2"), "decode must be callable"),
    (dict(prompts=["a"], decode=str), "give the tokenizer's encode too"),
])
def test_bad_arguments_name_the_value_and_what_is_valid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextSamples(**kwargs)


def test_a_vocabulary_beyond_bytes_needs_a_tokenizer():
    torch.manual_seed(0)
    big = Llama("tiny", vocab_size=300)
    big.configure_model()
    with pytest.raises(ValueError, match="300 tokens.*pass the tokenizer's decode and encode"):
        TextSamples(["a"]).generate(big)


def test_prompt_ids_outside_the_vocabulary_are_refused():
    torch.manual_seed(0)
    small = Llama("tiny", vocab_size=100)
    small.configure_model()
    with pytest.raises(ValueError, match=r"prompts\[0\] \('z'\) encodes to ids outside the model's vocabulary of 100"):
        TextSamples(["z"]).generate(small)


# ---- tokenizers -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from test_tokenized_data import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe"))  # 120 tokens


def test_the_data_modules_tokenizer_encodes_prompts_and_decodes_continuations(bpe, tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from lightning_async_pp.data import TextDataModule

    torch.manual_seed(0)
    model = Llama("tiny", vocab_size=120, max_seq_len=64)
    model.configure_model()
    model.eval()
    dm = TextDataModule(tokenizer=str(bpe), cache_dir=str(tmp_path))
    callback = TextSamples(["the pipeline sends", "every stage"], max_new_tokens=5)
    callback.setup(SimpleNamespace(datamodule=dm), model, "fit")
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    expected = [tok.decode(greedy(model, tok.encode(p, add_special_tokens=False).ids, 5))
                for p in ["the pipeline sends", "every stage"]]
    assert callback.generate(model) == expected
    assert callback._prompt_ids[0] == tok.encode("the pipeline sends").ids and len(callback._prompt_ids[0]) > 1


def test_an_adapters_vocabulary_is_checked_and_encoders_may_return_encodings(bpe):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from lightning_async_pp.models import HuggingFaceCausalLM

    def hf(vocab: int) -> HuggingFaceCausalLM:
        torch.manual_seed(0)
        model = HuggingFaceCausalLM({"model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
                                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "max_position_embeddings": 64})
        model.configure_model()
        return model.eval()

    with pytest.raises(ValueError, match="vocabulary has 300 tokens.*give the data module a tokenizer"):
        TextSamples(["a"]).generate(hf(300))  # bytes under a 300-token model: refused (its hparams had no vocab)
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    model = hf(120)
    texts = TextSamples(["every stage"], max_new_tokens=4, encode=tok.encode, decode=tok.decode).generate(model)
    assert texts == [tok.decode(greedy(model, tok.encode("every stage").ids, 4))]
    with pytest.raises(ValueError, match="outside the model's vocabulary of 100"):
        TextSamples(["microbatches"], encode=tok.encode, decode=tok.decode).generate(hf(100))  # ids 85, 52, 116


def test_fit_on_tokenized_data_logs_text_in_the_tokenizers_words(bpe, tmp_path):
    import lightning as L
    from tokenizers import Tokenizer

    from lightning_async_pp.data import TextDataModule
    from test_tokenized_data import SENTENCES

    (tmp_path / "corpus.txt").write_text("\n".join(SENTENCES * 20))
    dm = TextDataModule(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(bpe), cache_dir=str(tmp_path / "c"),
                        block_size=16, batch_size=4, val_fraction=0.2)
    torch.manual_seed(0)
    model = Llama("tiny", vocab_size=120, max_seq_len=32)
    callback = TextSamples(["the pipeline"], every_n_steps=2, max_new_tokens=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    trainer.fit(model, datamodule=dm)
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    expected = tok.decode(greedy(model.eval(), tok.encode("the pipeline").ids, 4))
    assert callback.history == [(2, [expected])]
