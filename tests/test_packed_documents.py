"""Packed rows with document masks (models/packing.py, TextDataModule(document_mask=True)).

The reference for the models is the same model run on each document alone, as its own sequence (positions from 0,
causal attention): a packed row must give every token the logits it gets there, and the loss the mean over the
documents' own targets. For the data module, the reference is the token stream itself: positions restart after
each end-of-document token, and with the flag off the batches are today's tensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_async_pp.data import TextDataModule
from lightning_async_pp.models import GPT, Llama
from lightning_async_pp.models import packing

VOCAB = 64
DOCS = (5, 9, 1, 7)  # document lengths of one packed row (one of a single token)


def packed_row(lengths=DOCS, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """A packed batch of one row (T + 1 = sum(lengths) tokens) and its documents."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos}, docs


def logits_of(model, batch):
    return model.pipeline_forward(batch)


@pytest.fixture(params=["per-document", "mask"])
def attention_path(request, monkeypatch):
    """Packed attention document by document (SDPA's causal kernel on each) or through the block-diagonal mask:
    the choice packing.Documents makes by cost, forced either way."""
    monkeypatch.setattr(packing, "CALL_COST_PAIRS", 0 if request.param == "per-document" else 10**12)
    return request.param


def assert_path(batch, path):
    assert packing.Documents(batch["position_ids"][:, :-1]).per_document == (path == "per-document")


def models():
    torch.manual_seed(0)
    llama = Llama("tiny", vocab_size=VOCAB, init_seed=0)
    llama.configure_model()
    torch.manual_seed(0)
    gpt = GPT(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return {"llama": llama, "gpt": gpt}


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_a_packed_row_gives_each_token_the_logits_its_document_alone_gives(name, attention_path):
    model = models()[name].eval()
    batch, docs = packed_row()
    assert_path(batch, attention_path)
    with torch.no_grad():
        packed = logits_of(model, batch)[0]  # (T, V): inputs are all but the row's last token
        # a document alone: its tokens as the inputs (a last column appended, which pipeline_input drops)
        alone = torch.cat([logits_of(model, torch.cat([d, d[:1]]).unsqueeze(0))[0] for d in docs])
    # Each document's logits at its tokens; the row's last token has no logits (it is only a target).
    assert packed.shape[0] == sum(DOCS) - 1
    torch.testing.assert_close(packed, alone[: packed.shape[0]], rtol=1e-5, atol=1e-5)
    # Without the mask the documents see each other: the comparison above could fail.
    with torch.no_grad():
        unmasked = logits_of(model, batch["input_ids"])[0]
    assert (unmasked - alone[: unmasked.shape[0]]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_skipping_document_ends_makes_the_loss_the_mean_over_each_documents_own_targets(name):
    model = models()[name].eval()
    model.hparams.skip_document_ends = True
    batch, docs = packed_row()
    with torch.no_grad():
        loss = model.pipeline_loss(logits_of(model, batch), batch)
        total, count = 0.0, 0
        for d in docs:
            if len(d) < 2:
                continue
            logits = logits_of(model, d.unsqueeze(0))[0]
            total += F.cross_entropy(logits.float(), d[1:], reduction="sum")
            count += len(d) - 1
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)
    model.hparams.skip_document_ends = False  # then the documents' first tokens are targets too
    with torch.no_grad():
        assert not torch.allclose(model.pipeline_loss(logits_of(model, batch), batch), total / count)


def test_the_documents_are_found_once_per_positions_tensor_not_per_layer(monkeypatch, attention_path):
    model = models()["llama"].eval()
    batch, _ = packed_row()
    calls = []
    real = packing.Documents.__init__
    monkeypatch.setattr(packing.Documents, "__init__", lambda self, p: calls.append(1) or real(self, p))
    with torch.no_grad():
        logits_of(model, batch)
    assert len(model.blocks) == 4 and len(calls) == 1


def test_a_receive_into_a_pooled_buffer_makes_the_stage_find_the_documents_again(attention_path):
    """With pooled receive buffers (CUDA's default) a microbatch's positions arrive in an earlier microbatch's
    tensor, written by the transport outside autograd (issue 54). The link bumps a pooled buffer's version as it
    hands it to a receive and the stage's cache keys on tensor and version (packing.per_positions): the layers
    attend over the new documents, with no comparison of positions (a host wait per layer on CUDA)."""
    import torch.distributed as dist

    from lightning_async_pp.pipeline.comm import FailureBoard, StageLink
    from lightning_async_pp.pipeline.structure import Layout, flatten, unflatten

    model = models()["llama"].eval()
    blocks = torch.nn.Sequential(*model.blocks)
    first, second = (packing.packed_input(packed_row(lengths, seed)[0]) for lengths, seed in ((DOCS, 0), ((9, 4, 9), 1)))
    assert not torch.equal(first["position_ids"], second["position_ids"])
    with torch.no_grad():
        sent = [{"hidden": model.embed(b)["hidden"], "position_ids": b["position_ids"]} for b in (first, second)]
        reference = blocks(sent[1])["hidden"]
    leaves, spec = flatten(sent[0])
    received = [t.clone() for t in leaves]  # a stage's receive buffers, holding the first microbatch
    initialized_here = not dist.is_initialized()
    if initialized_here:  # the receive's operation names its process group; nothing is sent
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        link = StageLink(stage=1, rank=0, prev_rank=0, next_rank=None, device=torch.device("cpu"), timeout=60.0,
                         board=FailureBoard(None), rank_to_stage={0: 1})
        link.reuse_buffers, link.in_layout = True, Layout.of(received, spec, with_grad=False)
        with torch.no_grad():
            blocks(unflatten(received, spec))  # the first microbatch's forward: its documents are cached
        link.release_microbatch(received, [], None)  # its backward ran: the buffers go back to the pool
        link.post_activations(("act", 1, 0))  # the second microbatch's receive, into them
        posted = link.take(("act", 1, 0))
    finally:
        if initialized_here:
            dist.destroy_process_group()
    assert link.buffers_reused == 1 and all(a is b for a, b in zip(posted.tensors, received))
    versions = [t._version for t in received]
    for buffer, value in zip(received, flatten(sent[1])[0]):  # the transfer: a write autograd does not see
        buffer.untyped_storage().copy_(value.clone().untyped_storage())
    assert [t._version for t in received] == versions
    with torch.no_grad():
        got = blocks(unflatten(received, spec))["hidden"]
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_at_8192_tokens_no_token_by_token_mask_is_made_and_each_document_attends_alone(monkeypatch):
    """The fast path at 8192 tokens, 24 documents: attention goes document by document, and the (T, T) mask
    (64 MiB a row) is never built, in the forward or the backward."""
    lengths = [341] * 23 + [8192 + 1 - 341 * 23]
    pos = torch.cat([torch.arange(n) for n in lengths])[:-1].unsqueeze(0)
    docs = packing.documents(pos)
    assert docs.per_document and docs.skips_masked_blocks
    monkeypatch.setattr(packing, "_document_causal_mask", lambda p: pytest.fail("a (T, T) mask was built"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8192, 8, generator=g, requires_grad=True) for _ in range(3))
    out = packing.document_attention(q, k, v, pos)
    out.square().sum().backward()
    # each document as SDPA gives it alone (its own causal attention), the first and the last
    for start, end in ((0, 341), (341 * 23, 8192)):
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, start:end], k[:, :, start:end],
                                                                 v[:, :, start:end], is_causal=True)
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=1e-6, atol=1e-6)


def test_the_cheaper_path_is_chosen_per_microbatch():
    """Few long documents attend one by one; very many tiny ones through the mask, whose one call is then
    cheaper than their many (packing.CALL_COST_PAIRS)."""
    long = torch.cat([torch.arange(n) for n in (700, 600, 748)]).unsqueeze(0)
    tiny = torch.arange(256).remainder(4).unsqueeze(0)  # 64 documents of 4 tokens
    assert packing.Documents(long).per_document and not packing.Documents(tiny).per_document
    assert packing.Documents(long).spans == [[(0, 700), (700, 1300), (1300, 2048)]]


def test_the_mask_is_block_diagonal_and_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = packing.document_causal_mask(pos)[0, 0]
    docs = torch.tensor([0, 0, 0, 1, 1, 2])
    expected = (docs[:, None] == docs[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)


def test_positions_restart_after_each_end_of_document_token():
    ids = torch.tensor([[3, 4, 1, 5, 1, 1, 6], [1, 2, 3, 4, 5, 6, 7]])
    assert packing.packed_positions(ids, eos=1).tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_a_batch_that_is_neither_tokens_nor_packed_is_refused_by_name():
    with pytest.raises(TypeError, match=r"Llama takes a token tensor .* got \['labels'\]"):
        models()["llama"].pipeline_input({"labels": torch.zeros(1, 3, dtype=torch.long)})


# ---- the data module -------------------------------------------------------------------------------------------
BLOCK = 15


@pytest.fixture
def small_files(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(12):
        (folder / f"f{i:02d}.txt").write_text(f"document {i} " + "abcdefgh"[: i % 8 + 1] * (i + 1) + "\n")
    return folder


def rows(dm, n=None):
    dm.setup("fit")
    out = []
    for batch in dm.train_dataloader():
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def test_bytes_with_document_mask_yield_positions_restarting_after_each_file(tmp_path, small_files):
    dm = TextDataModule(data_path=str(small_files), cache_dir=str(tmp_path / "c"), block_size=BLOCK, batch_size=2,
                        val_fraction=0.0, document_mask=True)
    batches = rows(dm)
    assert batches and all(set(b) == {"input_ids", "position_ids"} for b in batches)
    ends = 0
    for b in batches:
        ids, pos = b["input_ids"], b["position_ids"]
        assert ids.shape == pos.shape == (2, BLOCK + 1) and pos.dtype == torch.long
        assert torch.equal(pos, packing.packed_positions(ids, 0))
        assert (pos[:, 0] == 0).all()
        ends += int((ids == 0).sum())
        # a NUL ends each file: the text before it is the end of one of the files
        for row in ids.tolist():
            text = bytes(row)
            for piece in text.split(b"\0")[:-1]:
                assert piece.endswith(b"\n") or piece == b""
    assert ends > 0


def test_off_keeps_todays_tensor_batches_and_cache(tmp_path, small_files):
    kwargs = dict(data_path=str(small_files), cache_dir=str(tmp_path / "c"), block_size=BLOCK, batch_size=2,
                  val_fraction=0.0)
    plain = rows(TextDataModule(**kwargs))
    assert all(isinstance(b, torch.Tensor) and b.shape == (2, BLOCK + 1) for b in plain)
    assert not any((b == 0).any() for b in plain)  # no end-of-document bytes in today's cache
    masked = TextDataModule(**kwargs, document_mask=True)
    assert masked.optimized_dirs()[0] != TextDataModule(**kwargs).optimized_dirs()[0]  # a cache of its own


def test_a_tokenizers_end_of_text_ends_each_record(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    lines = [json.dumps({"text": " ".join(f"w{(i + j) % 20}" for j in range(i % 5 + 1))}) for i in range(40)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    dm = TextDataModule(data_path=str(tmp_path / "data"), tokenizer=str(tmp_path / "tokenizer.json"),
                        cache_dir=str(tmp_path / "c"), block_size=BLOCK, batch_size=2, val_fraction=0.0,
                        document_mask=True)
    batches = rows(dm)
    assert batches
    for b in batches:
        ids, pos = b["input_ids"], b["position_ids"]
        after_eos = torch.zeros_like(ids, dtype=torch.bool)
        after_eos[:, 1:] = ids[:, :-1] == 1
        assert (pos[after_eos] == 0).all() and (pos[:, 1:][~after_eos[:, 1:]] > 0).all()


# ---- transformers families -------------------------------------------------------------------------------------
def hf_pair(family: str, attention: str = "sdpa", positions: int | None = None, **overrides):
    """The adapter on a tiny config of ``family`` and the upstream model with its weights (fp32, ``attention``;
    ``positions``: the config's max_position_embeddings, else the tiny config's 128)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_async_pp.models import HuggingFaceCausalLM
    from lightning_async_pp.models.hf_probe import tiny_config

    config = tiny_config(AutoConfig.for_model(family, **overrides))
    config.vocab_size = VOCAB
    if positions is not None:
        config.max_position_embeddings = positions
    config._attn_implementation = attention
    ours = HuggingFaceCausalLM(config, init_seed=0)
    ours.configure_model()
    upstream = AutoModelForCausalLM.from_config(config)
    upstream.load_state_dict(ours.state_dict(), strict=True)
    assert ours.model.config._attn_implementation == upstream.config._attn_implementation == attention
    return ours.eval(), upstream.eval()


@pytest.mark.hf
@pytest.mark.parametrize("family,overrides", [("llama", {}), ("llama", {"attention": "eager"}),
                                              ("mistral", {"sliding_window": 4}), ("qwen2", {}), ("qwen3", {})],
                         ids=["llama", "llama-eager", "mistral-sliding", "qwen2", "qwen3"])
def test_each_accepted_family_gives_a_packed_token_the_logits_upstream_gives_its_document_alone(family, overrides,
                                                                                                attention_path):
    ours, upstream = hf_pair(family, **overrides)
    ours.skip_document_ends = True
    batch, docs = packed_row()
    assert_path(batch, attention_path)
    with torch.no_grad():
        packed = ours.pipeline_forward(batch)[0]
        alone = torch.cat([upstream(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
        loss = ours.pipeline_loss(ours.pipeline_forward(batch), batch)
        upstream_losses = [(upstream(input_ids=d.unsqueeze(0), labels=d.unsqueeze(0)).loss, len(d) - 1)
                           for d in docs if len(d) > 1]
        unmasked = ours.pipeline_forward(batch["input_ids"])[0]
    torch.testing.assert_close(packed, alone[: packed.shape[0]], rtol=1e-5, atol=1e-5)
    expected = sum(l * n for l, n in upstream_losses) / sum(n for _, n in upstream_losses)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert (unmasked - alone[: unmasked.shape[0]]).abs().max() > 1e-3  # the documents would see each other


@pytest.mark.hf
def test_the_upstream_mask_is_made_once_per_microbatch_not_per_layer(monkeypatch):
    ours, _ = hf_pair("llama", attention="eager")  # eager attends through upstream's mask
    calls = []
    real = ours._layer_inputs[0].make_mask
    assert all(inputs.make_mask is real for inputs in ours._layer_inputs)  # llama: one kind of attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for inputs in ours._layer_inputs:
        monkeypatch.setattr(inputs, "make_mask", counted)
    batch, _ = packed_row()
    with torch.no_grad():
        ours.pipeline_forward(batch)
    assert len(ours._layer_inputs) > 1 and len(calls) == 1


@pytest.mark.hf
def test_sdpa_packed_rows_attend_document_by_document_without_upstreams_mask(monkeypatch):
    """sdpa's full-attention layers take the microbatch's documents (found once per microbatch on the stage) in
    place of upstream's (T, T) mask, which is never made; each document's logits are upstream's for it alone."""
    monkeypatch.setattr(packing, "CALL_COST_PAIRS", 0)
    ours, upstream = hf_pair("llama")
    for inputs in ours._layer_inputs:
        monkeypatch.setattr(inputs, "make_mask", lambda *a, **k: pytest.fail("upstream's mask was made"))
    monkeypatch.setattr(packing, "_document_causal_mask", lambda p: pytest.fail("a (T, T) mask was built"))
    calls = []
    real = packing.Documents.__init__
    monkeypatch.setattr(packing.Documents, "__init__", lambda self, p: calls.append(1) or real(self, p))
    batch, docs = packed_row(lengths=(12, 20, 9))
    packed = ours.pipeline_forward(batch)[0]
    packed.sum().backward()
    with torch.no_grad():
        alone = torch.cat([upstream(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone[: packed.shape[0]], rtol=1e-5, atol=1e-5)
    assert len(ours._layer_inputs) > 1 and len(calls) == 1


@pytest.mark.hf
@pytest.mark.parametrize("family", ["gemma", "granitemoe"])
def test_a_family_not_verified_with_packed_rows_is_refused_by_name(family):
    ours, _ = hf_pair(family)
    batch, _ = packed_row()
    with pytest.raises(ValueError, match=f"cannot take packed batches with document masks .* model_type '{family}'"):
        ours.pipeline_input(batch)


DYNAMIC = {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
LONGROPE = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [3.0] * 32},
            "original_max_position_embeddings": 8}  # factors per frequency of the full head (64), cut for the tiny one


@pytest.mark.hf
@pytest.mark.parametrize("overrides, positions, rope", [(DYNAMIC, 16, "dynamic"), (LONGROPE, 64, "longrope")],
                         ids=["dynamic", "longrope"])
def test_a_rope_whose_tables_follow_the_longest_document_is_refused_by_name_past_its_length(overrides, positions, rope):
    """Past ``max_position_embeddings`` (dynamic) or ``original_max_position_embeddings`` (longrope) transformers
    recomputes the rotary tables from the microbatch's largest position: a short document of a packed row would not
    get the logits it gets alone. Rows within that length are exact per document."""
    ours, upstream = hf_pair("llama", positions=positions, **overrides)
    long_row, _ = packed_row()  # 21 tokens, documents of up to 9
    with pytest.raises(ValueError, match=f"packed rows of 21 tokens with rope_type '{rope}': past (16|8) positions"):
        ours.pipeline_input(long_row)
    batch, docs = packed_row(lengths=(3, 5), seed=1)  # 7 tokens: within 8
    with torch.no_grad():
        packed = ours.pipeline_forward(batch)[0]
        alone = torch.cat([upstream(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone[: packed.shape[0]], rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_rows_longer_than_max_position_embeddings_are_refused_before_any_update_naming_both_numbers():
    import lightning as L
    from torch.utils.data import DataLoader

    ours, _ = hf_pair("llama", positions=16)
    rows = torch.randint(0, VOCAB, (4, 21), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="rows of 20 tokens are longer than the config's max_position_embeddings 16"):
        ours.pipeline_input(rows)
    with pytest.raises(ValueError, match="rows of 20 tokens"):
        ours.pipeline_input({"input_ids": rows, "position_ids": torch.arange(21).expand(4, 21)})
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="max_position_embeddings 16"):
        trainer.fit(ours.train(), DataLoader(rows, batch_size=2))
    assert trainer.global_step == 0 and all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    ours.pipeline_input(rows[:, :17])  # 16 tokens: taken


@pytest.mark.hf
@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["dynamic", "yarn-as-qwen2.5"])
def test_token_rows_up_to_the_length_a_scaled_rope_supports_match_upstream_and_longer_ones_are_refused(rope):
    """A dynamic rope, and a yarn one whose max_position_embeddings stays the original length (Qwen2.5: 32768,
    factor 4), are for rows past max_position_embeddings: up to factor times it. Packed rows stay refused past the
    length where dynamic's tables change (test above)."""
    from torch.utils.data import DataLoader

    from helpers import one_device_trainer
    from lightning_async_pp import AsyncPipelineStrategy

    ours, upstream = hf_pair("llama", positions=16, rope_scaling=rope)
    rows = torch.randint(0, VOCAB, (4, 65), generator=torch.Generator().manual_seed(0))  # 64 tokens: 4 x 16
    loss = ours.pipeline_loss(ours.pipeline_forward(rows), rows)
    expected = F.cross_entropy(upstream(input_ids=rows[:, :-1]).logits.flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grads = dict(upstream.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    ours.zero_grad(set_to_none=True)
    one_device_trainer(AsyncPipelineStrategy(num_microbatches=2), steps=1).fit(
        ours.train(), DataLoader(rows, batch_size=4))
    upstream.load_state_dict(ours.state_dict())
    with torch.no_grad():  # the trained weights give upstream's logits (the rotary tables as upstream's, not stale)
        torch.testing.assert_close(ours.eval().pipeline_forward(rows), upstream(input_ids=rows[:, :-1]).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=f"rows of 65 tokens are longer than the 64 positions the config's "
                                         f"{rope['rope_type']} rope scaling supports .*max_position_embeddings 16"):
        ours.pipeline_input(torch.randint(0, VOCAB, (2, 66)))
    if rope["rope_type"] == "dynamic":
        with pytest.raises(ValueError, match="packed rows of 20 tokens with rope_type 'dynamic'"):
            ours.pipeline_input({"input_ids": rows[:, :21], "position_ids": torch.arange(21).expand(4, 21)})


@pytest.mark.hf
def test_the_supported_length_of_published_rope_configs_is_the_length_they_are_published_for():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, Phi3Config

    from lightning_async_pp.models.huggingface import supported_positions

    qwen25 = LlamaConfig(max_position_embeddings=32768,  # Qwen2.5's config.json for 128K tokens (its README)
                         rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    llama31 = LlamaConfig(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    phi3 = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    assert [supported_positions(c) for c in (qwen25, llama31, phi3, LlamaConfig(max_position_embeddings=2048))] == [
        131072, 131072, 131072, 2048]


@pytest.mark.hf
def test_an_hf_dict_batch_without_position_ids_is_told_the_key_it_lacks():
    ours, _ = hf_pair("llama")
    with pytest.raises(TypeError, match="needs 'position_ids' beside 'input_ids'.*got keys \\['input_ids'\\]"):
        ours.pipeline_input({"input_ids": packed_row()[0]["input_ids"]})


@pytest.mark.hf
def test_an_attention_implementation_not_verified_with_packed_rows_is_refused_by_name():
    ours, _ = hf_pair("llama")
    ours.model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation 'flex_attention'"):
        ours.pipeline_input(packed_row()[0])


# ---- two processes ---------------------------------------------------------------------------------------------
# (HuggingFaceCausalLM on packed rows on 2 processes: tests/test_adapters.py, the from_pretrained run, which also
# checks its first loss against upstream on each document alone.)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_validate_predict_and_test_packed_rows_exactly_as_one_device(tmp_path):
    """models.Llama on packed rows (positions restarting every 1..7 tokens, document ends skipped) under the
    2-stage pipeline: 2 processes give the one-device run's weights, losses and predictions, ragged last evaluation
    batch included (32 rows in batches of 6); the traffic is replayed under NCCL's rules (tests/conftest.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import llama_fit
    from pipeline_runs import max_difference, run_here_on_one_device, script_ranks

    cfg = {"tie": True, "steps": 3, "partition": [3, 3], "packed": True, "eval_batch": 6, "timeout": 60.0, "lr": 3e-3,
           "sequence": ["fit", "validate", "predict", "test"]}
    reference = run_here_on_one_device(llama_fit.run, cfg)
    ranks = script_ranks(Path(__file__).parent / "scripts" / "llama_fit.py", cfg, tmp_path, timeout=300)
    calls = ranks[0]["calls"]
    assert len(calls) == len(reference["calls"]) == 4
    for i, (got, want) in enumerate(zip(calls, reference["calls"])):
        assert max_difference(got["state_dict"], want["state_dict"]) < 1e-5, f"weights after call {i}"
        for key, value in want.items():
            if key == "logits":
                assert got["logits"].shape == value.shape == (32, 16, 256)
                torch.testing.assert_close(got["logits"], value, atol=1e-5, rtol=0)
            elif key != "state_dict":
                assert abs(got[key] - value) < 1e-5, (i, key, got[key], value)
    # The packed rows changed the model's view: the same fit on the same tokens without positions differs.
    plain = run_here_on_one_device(llama_fit.run, {**cfg, "packed": False, "sequence": ["fit"]})
    assert abs(plain["calls"][0]["train_loss"] - reference["calls"][0]["train_loss"]) > 1e-4


def test_a_yaml_flag_turns_document_masks_on_for_the_clis_data_module(tmp_path, small_files, monkeypatch):
    import sys

    import yaml

    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "packed.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "auto", "logger": False},
        "model": {"class_path": "lightning_async_pp.models.Llama",
                  "init_args": {"skip_document_ends": True, "max_seq_len": 32}},
        "data": {"data_path": str(small_files), "cache_dir": str(tmp_path / "c"), "block_size": BLOCK,
                 "batch_size": 2, "val_fraction": 0.0, "document_mask": True},
    }))
    cli = AsyncPipelineCLI(args=["--config", str(config)], run=False)
    assert cli.datamodule.document_mask and cli.model.hparams.skip_document_ends
    batch = rows(cli.datamodule, 1)[0]
    assert set(batch) == {"input_ids", "position_ids"}
    # The example batch partition="balanced" costs the layers on is a packed batch too (it was token rows): the
    # loaders' keys, dtypes and row length, each row one document.
    example = cli.model.pipeline_sample()
    assert set(example) == set(batch)
    for key, value in batch.items():
        assert (example[key].dtype, example[key].shape[1:]) == (value.dtype, value.shape[1:]), key
    assert torch.equal(example["position_ids"], torch.arange(BLOCK + 1).expand_as(example["position_ids"]))


def test_the_layers_are_costed_on_a_packed_example_batch_with_its_positions(tmp_path, small_files):
    """TextDataModule(document_mask=True).example_batch(), costed on fake tensors: the positions reach the layers
    (their values unknown there: each row one document, the FLOPs of plain rows), where reading them failed."""
    from lightning_async_pp.plan.balanced import layer_costs

    dm = TextDataModule(data_path=str(small_files), cache_dir=str(tmp_path / "c"), block_size=BLOCK, batch_size=4,
                        document_mask=True)
    example = dm.example_batch(2)
    assert example["input_ids"].shape == example["position_ids"].shape == (2, BLOCK + 1)
    assert isinstance(TextDataModule(block_size=BLOCK).example_batch(2), torch.Tensor)  # without: token rows
    for model in (Llama(max_seq_len=BLOCK + 1), GPT(block_size=BLOCK + 1)):
        model.configure_model()
        layers = model.pipeline_layers()
        seen = []
        handle = layers[1].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        try:
            packed = layer_costs(layers, example, model.pipeline_input, model.pipeline_loss)
            plain = layer_costs(layers, example["input_ids"], model.pipeline_input, model.pipeline_loss)
        finally:
            handle.remove()
        assert set(seen[0]) == {"hidden", "position_ids"} and isinstance(seen[1], torch.Tensor)
        assert [c.flops for c in packed] == [c.flops for c in plain], type(model).__name__


def test_a_byte_folder_prepared_without_document_ends_is_refused_with_document_mask(tmp_path, small_files):
    from lightning_async_pp.data import corpus

    # a byte corpus optimized by other code than the data module (its marker records no end-of-text id)
    train, val = corpus.split_corpus(corpus.text_files(small_files), 0.2)
    corpus.build_token_cache(train, val, tmp_path / "prepared")
    dm = TextDataModule(data_path=str(tmp_path / "prepared"), block_size=BLOCK, batch_size=2, document_mask=True)
    dm.setup("fit")
    with pytest.raises(ValueError, match="document_mask=True needs to know where documents end.*records no end-of-text id"):
        dm.train_dataloader()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_packed_rows_through_a_synchronous_pipeline_on_one_device_train_as_plain_lightning(checkpointing):
    """GPipe (one version, a flush every batch) on packed rows equals Lightning's own loop on the whole batch
    (without skipped targets every microbatch has as many targets, so the mean of their means is the batch mean),
    with the layers' activations recomputed or kept."""
    import sys

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from llama_fit import packed_rows, token_rows

    rows = packed_rows(token_rows(16, 16))
    weights = []
    for strategy in (AsyncPipelineStrategy(schedule="gpipe", num_microbatches=4, num_stages=2,
                                           activation_checkpointing=checkpointing), "auto"):
        L.seed_everything(0, verbose=False)
        model = Llama("tiny", vocab_size=256, max_seq_len=32, lr=3e-3)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(rows, batch_size=8))
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[1]) < 1e-5


def test_a_batch_with_skipped_targets_trains_and_validates_as_plain_lightning_whatever_the_microbatch_count():
    """With skip_document_ends the microbatches hold different numbers of kept targets: the pipeline's batch loss,
    and so its gradient, is the mean over the batch's kept targets (as Lightning's loop on the whole batch gives it),
    not the mean of the microbatch means, at any microbatch count; validation's loss likewise."""
    import sys

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from llama_fit import packed_rows, token_rows

    rows = packed_rows(token_rows(16, 16))
    kept = [int((r["position_ids"][1:] != 0).sum()) for r in rows[:8]]
    assert len(set(kept)) > 2  # the first batch's rows keep unequal numbers of targets
    runs = {}
    for name, strategy in (("plain", "auto"), ("m=4", AsyncPipelineStrategy(schedule="gpipe", num_microbatches=4,
                                                                            num_stages=2)),
                           ("m=8", AsyncPipelineStrategy(schedule="1f1b", num_microbatches=8, num_stages=2))):
        L.seed_everything(0, verbose=False)
        model = Llama("tiny", vocab_size=256, max_seq_len=32, lr=3e-3, skip_document_ends=True)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(rows, batch_size=8))
        train_loss = float(trainer.callback_metrics["train_loss"])
        val_loss = trainer.validate(model, DataLoader(rows, batch_size=16), verbose=False)[0]["val_loss"]
        runs[name] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, train_loss, val_loss)
    weights, train_loss, val_loss = runs.pop("plain")
    for name, (w, t, v) in runs.items():
        assert max((w[k] - weights[k]).abs().max().item() for k in weights) < 1e-5, name
        assert abs(t - train_loss) < 1e-5 and abs(v - val_loss) < 1e-5, (name, t, train_loss, v, val_loss)


def test_packed_batches_resume_and_shard_by_data_parallel_rank_as_token_batches_do(tmp_path, monkeypatch):
    from types import SimpleNamespace

    folder = tmp_path / "numbered"  # every window of these files is unique
    folder.mkdir()
    for f in range(8):
        (folder / f"f{f}.txt").write_text("".join(f"f{f} l{i:03d}\n" for i in range(4 + 3 * f)))

    monkeypatch.setenv("WORLD_SIZE", "4")  # two stages x two replicas: litdata would see four processes

    def loader(rank: int, replicas: int = 2):
        dm = TextDataModule(data_path=str(folder), cache_dir=str(tmp_path / "c"), block_size=7, batch_size=2,
                            val_fraction=0.0, document_mask=True)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}))
        dm.setup("fit")
        return dm.train_dataloader()

    def ids(batches):
        return [tuple(r) for b in batches for r in b["input_ids"].tolist()]

    rank0, rank1 = list(loader(0)), list(loader(1))
    assert len(rank0) == len(rank1) >= 3 and not set(ids(rank0)) & set(ids(rank1))
    assert any((b["position_ids"][:, 1:] == 0).any() for b in rank0)  # documents do end inside the windows
    first = loader(0)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    resumed = loader(0)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert ids(head + rest) == ids(rank0)
    for got, want in zip(head + rest, rank0):
        assert torch.equal(got["position_ids"], want["position_ids"])


def test_a_microbatch_whose_every_target_is_skipped_has_loss_zero_not_nan():
    model = models()["llama"]
    model.hparams.skip_document_ends = True
    batch, _ = packed_row(lengths=(1, 1, 1, 1))  # every target is a document's first token
    loss = model.pipeline_loss(logits_of(model, batch), batch)
    loss.backward()
    assert loss.item() == 0.0 and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_position_ids_of_a_dtype_that_wraps_are_refused_naming_the_dtype_and_what_is_taken():
    model = models()["llama"]
    ids = torch.randint(0, VOCAB, (1, 301))
    positions = torch.arange(301).unsqueeze(0)  # one document of 301 tokens
    assert positions.to(torch.uint8)[0, 256] == 0  # uint8 wraps: the 257th token would sit at position 0
    with pytest.raises(ValueError, match="position_ids of dtype torch.uint8 .* give them as torch.int64 or torch.int32"):
        model.pipeline_input({"input_ids": ids, "position_ids": positions.to(torch.uint8)})
    for dtype in (torch.int16, torch.bool):
        with pytest.raises(ValueError, match=f"{dtype}"):
            model.pipeline_input({"input_ids": ids, "position_ids": positions.to(dtype)})
    model.pipeline_input({"input_ids": ids, "position_ids": positions.to(torch.int32)})  # taken


def test_a_dict_batch_without_position_ids_is_told_the_key_it_lacks():
    with pytest.raises(TypeError, match="Llama: a dict batch is a packed batch and needs 'position_ids' beside "
                                        "'input_ids'.*got keys \\['input_ids'\\]"):
        models()["llama"].pipeline_input({"input_ids": torch.zeros(2, 9, dtype=torch.long)})


def test_skip_document_ends_without_document_mask_is_refused_before_training(tmp_path, small_files):
    import lightning as L

    model = GPT(vocab_size=256, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16, skip_document_ends=True)
    dm = TextDataModule(data_path=str(small_files), cache_dir=str(tmp_path / "c"), block_size=BLOCK, batch_size=2,
                        val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="skip_document_ends=True but TextDataModule has document_mask=False"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0
    dm.check_model_documents(False)  # taken: nothing to skip
    TextDataModule(data_path=str(small_files), document_mask=True).check_model_documents(True)  # taken


@pytest.mark.parametrize("family", ["gpt", "llama", pytest.param("hf", marks=pytest.mark.hf)])
def test_skip_document_ends_on_a_users_own_token_rows_is_refused_at_the_first_batch_naming_the_option(family):
    """Without the data module (which refuses its own token rows at setup) the rows reach the loss: they have no
    documents, and the loss took every target without a word. Costing the layers on a row of tokens (as the data
    module's example batch is, with document masks too) is not refused."""
    import warnings

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    if family == "hf":
        from lightning_async_pp.models import HuggingFaceCausalLM

        model = HuggingFaceCausalLM({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1}, skip_document_ends=True)
        who = "HuggingFaceCausalLM"
    elif family == "gpt":
        model, who = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16, skip_document_ends=True), "GPT"
    else:
        model, who = Llama("tiny", vocab_size=VOCAB, num_layers=1, skip_document_ends=True), "Llama"
    rows = torch.randint(0, VOCAB, (8, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=2))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not cost the layers.*")
        with pytest.raises(ValueError, match=rf"{who} has skip_document_ends=True but got a batch of token rows "
                                             rf"\(torch.int64 \(4, {BLOCK + 1}\)\), which has no documents .* or set "
                                             rf"skip_document_ends=False"):
            trainer.fit(model, DataLoader(list(rows), batch_size=8))
    assert trainer.global_step == 0


def test_throughput_counts_a_packed_batchs_tokens_once_not_its_positions():
    from lightning_async_pp.callbacks.pipeline import token_count

    ids = torch.zeros(2, 8, dtype=torch.long)
    assert token_count(packing.packed_input({"input_ids": ids, "position_ids": ids.clone()})) == 2 * 7
    assert token_count(ids[:, :-1]) == 2 * 7  # a plain batch: unchanged


@pytest.mark.multiprocess
@pytest.mark.slow
def test_packed_rows_with_pooled_receive_buffers_train_exactly_as_one_device(tmp_path):
    """Issue 54, item 1: with the receive buffers pooled (CUDA's default; switched on here on CPU), a stage's
    positions arrive in a buffer an earlier microbatch used. models.Llama under 2bw and 1f1b and the transformers
    adapter (whose rotary tables follow the positions too) still give the one-device run's weights: no document
    structure is taken from an earlier microbatch; through the mask and document by document (zb_h1 too). The traffic is replayed under NCCL's rules (tests/conftest.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    pytest.importorskip("transformers")
    import packed_pooled_fit
    from pipeline_runs import max_difference, run_here_on_one_device, script_ranks

    runs = [{"model": "llama", "schedule": "2bw"}, {"model": "llama", "schedule": "1f1b"},
            {"model": "hf", "schedule": "2bw"},
            # attention document by document (issue 56), zb_h1's split backward included
            {"model": "llama", "schedule": "zb_h1", "per_document": True},
            {"model": "hf", "schedule": "2bw", "per_document": True}]
    cfg = {"runs": runs, "pooled": True, "steps": 4}
    ranks = script_ranks(Path(__file__).parent / "scripts" / "packed_pooled_fit.py", cfg, tmp_path, timeout=400)
    reference = run_here_on_one_device(packed_pooled_fit.run, cfg)
    differences = {}
    for spec, got, want, other in zip(runs, ranks[0]["runs"], reference["runs"], ranks[1]["runs"]):
        assert got["reused"] > 0 and other["reused"] > 0, spec  # the pools were used on both stages
        differences[f"{spec['model']} {spec['schedule']}{' per-document' * bool(spec.get('per_document'))}"] = max_difference(got["state_dict"], want["state_dict"])
    assert all(d < 1e-5 for d in differences.values()), differences  # stale masks: 2e-2 and more


@pytest.mark.multiprocess
@pytest.mark.slow
def test_packed_rows_attended_document_by_document_on_two_replicas_train_as_one_device_on_both_batches(tmp_path):
    """Data parallelism on packed rows (issue 56): 2 replicas x 2 stages, attention document by document, pooled
    receive buffers, give the weights one device gets on the replicas' batches together (the mean of the replicas'
    gradients is the gradient of their concatenation). Every target is kept: with skip_document_ends each replica's
    batch weighs as one, as Lightning's DDP weighs its ranks (docs/design/update-rule.md), which one device on the
    concatenation does not. The traffic is replayed under NCCL's rules (tests/conftest.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    pytest.importorskip("transformers")
    import packed_pooled_fit
    from pipeline_runs import max_difference, run_here_on_one_device, script_ranks

    runs = [{"model": "llama", "schedule": "2bw", "per_document": True},
            {"model": "llama", "schedule": "zb_h1", "per_document": True},
            {"model": "hf", "schedule": "2bw", "per_document": True}]
    cfg = {"runs": runs, "pooled": True, "steps": 3, "dp": 2, "devices": 4, "skip_document_ends": False}
    ranks = script_ranks(Path(__file__).parent / "scripts" / "packed_pooled_fit.py", cfg, tmp_path, ranks=4,
                         timeout=400)
    reference = run_here_on_one_device(packed_pooled_fit.run, cfg)
    differences = {}
    for i, (spec, want) in enumerate(zip(runs, reference["runs"])):
        assert all(rank["runs"][i]["reused"] > 0 for rank in ranks), spec  # the pools were used on every rank
        differences[f"{spec['model']} {spec['schedule']}"] = max_difference(ranks[0]["runs"][i]["state_dict"],
                                                                            want["state_dict"])
    assert all(d < 1e-5 for d in differences.values()), differences


def fit_packed_on_one_device(schedule: str, attention: str, monkeypatch, **options) -> dict[str, torch.Tensor]:
    """models.Llama trained 2 steps by SGD on packed rows (documents of 1..7 tokens) on one device, 2 stages, attention
    ``per-document`` or through the ``mask``; the weights after."""
    import sys

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from llama_fit import packed_rows, token_rows
    from pipeline_runs import sgd_model

    monkeypatch.setattr(packing, "CALL_COST_PAIRS", 0 if attention == "per-document" else 10**12)
    L.seed_everything(0, verbose=False)
    # SGD: AdamW's first step (about lr * sign(g)) would blow the float rounding of near-zero gradients up to lr
    model = sgd_model(Llama)("tiny", vocab_size=256, max_seq_len=32, skip_document_ends=True)
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=4, num_stages=2, **options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(packed_rows(token_rows(16, 16)), batch_size=8))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("schedule,options", [
    ("gpipe", {}), ("1f1b", {"activation_checkpointing": True}), ("2bw", {}), ("zb_h1", {}),
    ("zb_h1", {"activation_checkpointing": True}),
    pytest.param("2bw", {"compile": True}, marks=pytest.mark.slow)],
    ids=["gpipe", "1f1b-checkpointing", "2bw", "zb_h1", "zb_h1-checkpointing", "2bw-compiled"])
def test_every_schedule_trains_packed_rows_document_by_document_as_through_the_mask(schedule, options, monkeypatch):
    """Attention document by document under each schedule (zb_h1's weight-gradient pass reusing what its
    input-gradient pass kept), recomputed under activation checkpointing or with compiled layers, trains as the
    block-diagonal mask does (whose logits are each document's alone: the tests above)."""
    by_document = fit_packed_on_one_device(schedule, "per-document", monkeypatch, **options)
    masked = fit_packed_on_one_device(schedule, "mask", monkeypatch, **options)
    assert max((by_document[k] - masked[k]).abs().max().item() for k in masked) < 1e-5


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "activation-checkpointing"])
def test_each_stage_finds_a_microbatchs_documents_once_zb_h1s_weight_pass_and_recomputation_included(checkpointing,
                                                                                                    monkeypatch):
    """zb_h1's weight-gradient pass, and the forward recomputed under activation checkpointing, attend over the
    documents the stage found in the microbatch's forward: one packing.Documents per microbatch and stage (the
    tiny Llama's 4 blocks on 2 stages would find them 4 times per microbatch if each layer did)."""
    calls = []
    real = packing.Documents.__init__
    monkeypatch.setattr(packing.Documents, "__init__", lambda self, p: calls.append(1) or real(self, p))
    fit_packed_on_one_device("zb_h1", "per-document", monkeypatch, activation_checkpointing=checkpointing)
    steps, microbatches, stages = 2, 4, 2
    assert len(calls) == steps * microbatches * stages
