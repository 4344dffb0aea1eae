"""Mixture-of-experts models through models.HuggingFaceCausalLM and models.LitGPT: upstream's loss, load-balancing
term included, and its gradients, on one device and across stages (models/moe.py).

The references are the upstream models themselves: ``AutoModelForCausalLM.from_config(config)`` at the same
weights, called the upstream way (``model(input_ids, labels=..., shift_labels=...)``: the row's first T tokens in,
the next T tokens as targets, as the adapter reads a (B, T + 1) row), and ``litgpt.GPT``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytestmark = pytest.mark.hf  # make test also runs these on transformers 5.x
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import adapter_fit  # noqa: E402
from pipeline_runs import (FLOAT32_EPS, SGD_LR, max_difference, run_here_on_one_device, script_ranks,  # noqa: E402
                           sgd_model, sgd_step_bounds)

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import HuggingFaceCausalLM  # noqa: E402

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.7)
MOE_CASES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32),
    # a dense first layer: the statistics start at the second
    "qwen2_moe-dense-first": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=32, mlp_only_layers=[0], num_hidden_layers=3),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=3),
}


def moe_config(case: str, **overrides):
    return AutoConfig.for_model(**{**TINY, **MOE_CASES[case], **overrides})


def tokens(b: int = 4, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(seed))


def upstream_at(model: HuggingFaceCausalLM):
    upstream = AutoModelForCausalLM.from_config(model.config)
    upstream.load_state_dict(model.state_dict(), strict=True)
    return upstream


def upstream_output(upstream, batch: torch.Tensor):
    """Upstream's training loss on what the adapter reads: inputs batch[:, :-1], targets batch[:, 1:]."""
    return upstream(batch[:, :-1], labels=batch[:, :-1], shift_labels=batch[:, 1:].contiguous())


# ---- one device, the model alone ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_loss_with_the_balancing_term_and_its_gradients_equal_upstream(case):
    ours = HuggingFaceCausalLM(moe_config(case), init_seed=3)
    ours.configure_model()
    upstream = upstream_at(ours)
    batch = tokens()
    want = upstream_output(upstream, batch)
    want.loss.backward()
    output = ours(batch)
    got = ours.pipeline_loss(output, batch)
    got.backward()
    torch.testing.assert_close(got, want.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.pipeline_metrics()["train_aux_loss"], want.aux_loss, rtol=1e-6, atol=1e-6)
    assert want.aux_loss * 0.7 > 1.0  # the term is a visible part of the loss here
    torch.testing.assert_close(output[0], want.logits, rtol=0, atol=0)
    grads = {n: p.grad for n, p in upstream.named_parameters()}
    for name, p in ours.named_parameters():
        if grads[name] is None:  # an expert no row chose
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    routers = [n for n, p in ours.named_parameters() if n.endswith("gate.weight") and p.shape[0] == 4]
    assert routers and all(ours.get_parameter(n).grad.abs().sum() > 0 for n in routers)


@pytest.mark.parametrize("case", MOE_CASES)
def test_a_packed_row_gives_each_document_upstreams_logits_and_the_loss_upstream_gives_its_documents(case):
    """Packed rows (positions restarting per document, models/packing.py): each document's logits are upstream's for
    it alone, and the loss is upstream's over the documents: the mean of their language-model losses over their own
    targets (skip_document_ends) plus the balancing term upstream computes on the documents as a padded batch with
    their attention mask (padding excluded), gradients included."""
    ours = HuggingFaceCausalLM(moe_config(case), init_seed=3, skip_document_ends=True)
    ours.configure_model()
    upstream = upstream_at(ours)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 11, 1, 9)]
    ids = torch.cat(docs).unsqueeze(0)
    batch = {"input_ids": ids, "position_ids": torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)}
    inputs = [*docs[:-1], docs[-1][:-1]]  # what the row feeds the model: all but its last token
    output = ours.pipeline_forward(batch)
    got = ours.pipeline_loss(output, batch)
    got.backward()

    alone = [upstream(input_ids=d.unsqueeze(0)) for d in inputs]
    torch.testing.assert_close(output[0][0], torch.cat([o.logits[0] for o in alone]), rtol=1e-5, atol=1e-5)
    # upstream's loss given labels would include each document's own balancing term: the language-model part alone
    targets = torch.cat([d[1:] for d in docs])
    lm = F.cross_entropy(torch.cat([o.logits[0, : len(d) - 1] for o, d in zip(alone, docs)]), targets)
    width = max(len(d) for d in inputs)
    padded = torch.stack([F.pad(d, (0, width - len(d))) for d in inputs])
    mask = torch.stack([torch.arange(width) < len(d) for d in inputs]).long()
    aux = upstream(input_ids=padded, attention_mask=mask).aux_loss
    want = lm + 0.7 * aux
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.pipeline_metrics()["train_aux_loss"], aux, rtol=1e-5, atol=1e-6)
    unpadded = upstream(input_ids=padded).aux_loss  # the padding routed too: what a mask-free term would be
    assert (unpadded - aux).abs() > 1e-4
    grads = {n: p.grad for n, p in upstream.named_parameters()}
    for name, p in ours.named_parameters():
        if grads[name] is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", MOE_CASES)
def test_a_packed_microbatchs_attention_inputs_are_built_once_not_per_layer(case, monkeypatch):
    """What a layer needs from a packed microbatch's positions (its documents or mask, the rotary tables;
    packing.per_positions) is built once per microbatch, not per layer: the positions keep their tensor through
    the MoE layers, whose router statistics ride beside them."""
    from lightning_async_pp.models import packing

    ours = HuggingFaceCausalLM(moe_config(case, num_hidden_layers=4), init_seed=3, skip_document_ends=True)
    ours.configure_model()
    built = []
    real = packing.per_positions
    monkeypatch.setattr(packing, "per_positions",
                        lambda positions, key, build: real(positions, key, lambda: built.append(key) or build()))
    batch = {"input_ids": tokens(b=1, t=20), "position_ids": torch.cat([torch.arange(n) for n in (6, 11, 4)])[None]}
    with torch.no_grad():
        ours.pipeline_forward(batch)
    assert built and len(built) == len(set(built)) <= 2, built  # the layers' inputs, and the documents


def test_moe_without_output_router_logits_has_no_balancing_term():
    ours = HuggingFaceCausalLM(moe_config("mixtral", output_router_logits=False), init_seed=3)
    ours.configure_model()
    batch = tokens()
    logits = ours(batch)
    assert isinstance(logits, torch.Tensor)  # nothing else crosses the stages
    torch.testing.assert_close(ours.pipeline_loss(logits, batch), upstream_output(upstream_at(ours), batch).loss)


def test_moe_family_whose_balancing_term_is_not_reproduced_is_refused_at_construction():
    config = AutoConfig.for_model("granitemoe", **{**TINY, "num_local_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match=r"'granitemoe' with output_router_logits=True.*supported: mixtral, olmoe"):
        HuggingFaceCausalLM(config)


# ---- under the pipeline on one device ---------------------------------------------------------------------------------
#: AdamW's steps would hide the gradient and amplify rounding (pipeline_runs.sgd_model): these checks use SGD.
SGDStep = sgd_model(HuggingFaceCausalLM)


def fit_one_device(cfg: dict, batches: list[torch.Tensor], microbatches: int, steps: int, schedule: str = "2bw",
                   model_class: type = HuggingFaceCausalLM, **strategy_kwargs):
    L.seed_everything(0, verbose=False)
    model = model_class(cfg, lr=3e-3, init_seed=0)
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=microbatches, num_stages=2, partition=[2, 3],
                                     **strategy_kwargs)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(torch.cat(batches), batch_size=batches[0].shape[0]))
    return model, trainer


def test_pipeline_trains_on_the_microbatch_mean_of_upstream_losses_and_logs_the_aux_loss():
    """2 stages, 2bw, 2 microbatches on one device against the update rule written out with upstream's loss: each
    microbatch's loss (its own balancing term included) averaged, one-step delay. ``train_aux_loss`` is the mean
    of upstream's ``aux_loss`` over the microbatches of the last batch."""
    cfg = {**TINY, **MOE_CASES["mixtral"], "tie_word_embeddings": True}
    batches = [tokens(seed=s) for s in range(3)]
    model, trainer = fit_one_device(cfg, batches, microbatches=2, steps=3, model_class=SGDStep)

    L.seed_everything(0, verbose=False)
    reference = HuggingFaceCausalLM(cfg, init_seed=0)
    reference.configure_model()
    upstream = upstream_at(reference)
    named = dict(upstream.named_parameters())  # the tied embedding and head once
    params = list(named.values())
    optimizer = torch.optim.SGD(params, lr=SGD_LR)
    history = [[p.detach().clone() for p in params]]
    # Each step's float32 rounding bound (see the one-microbatch test below), added up over the steps.
    accumulations = VOCAB + batches[0][:, :-1].numel()
    bounds = dict.fromkeys(named, 0.0)
    for k, batch in enumerate(batches):
        newest = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, history[max(k - 1, 0)]):
                p.copy_(w)
        optimizer.zero_grad()
        outputs = [upstream_output(upstream, half) for half in batch.chunk(2)]
        torch.stack([o.loss for o in outputs]).mean().backward()
        with torch.no_grad():
            for p, w in zip(params, newest):
                p.copy_(w)
        step = sgd_step_bounds({n: p.detach() for n, p in named.items()}, {n: p.grad for n, p in named.items()},
                               SGD_LR, accumulations)
        bounds = {n: bounds[n] + step[n] for n in named}
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    got, expected = model.state_dict(), upstream.state_dict()
    assert got.keys() == expected.keys()
    over = {n: (float((got[n] - expected[n]).abs().max()), bounds[n]) for n in named
            if not (got[n] - expected[n]).abs().max() <= bounds[n]}
    assert not over, over
    last = torch.stack([o.aux_loss for o in outputs]).mean()
    metrics = trainer.callback_metrics
    rel = 2 * accumulations * FLOAT32_EPS
    assert metrics["train_aux_loss"].item() == pytest.approx(last.item(), rel=rel)
    assert metrics["train_loss"].item() == pytest.approx(torch.stack([o.loss for o in outputs]).mean().item(), rel=rel)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe-dense-first"])
def test_packed_rows_through_two_stages_train_as_plain_lightning_router_loss_included(case):
    """Packed rows (the statistics riding beside the positions across the stage boundary) under gpipe with one
    microbatch, 2 stages on one device: the weights after 2 steps and the logged aux loss are Lightning's own loop's
    on the same batches (whose loss, router term included, the test above checks against upstream)."""
    from torch.utils.data import DataLoader

    from llama_fit import packed_rows, token_rows

    rows = packed_rows(token_rows(8, 16))
    got = []
    for strategy in (AsyncPipelineStrategy(schedule="gpipe", num_microbatches=1, num_stages=2), "auto"):
        L.seed_everything(0, verbose=False)
        model = SGDStep(moe_config(case), init_seed=0, skip_document_ends=True)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(rows, batch_size=4))
        got.append(({k: v.detach().clone() for k, v in model.state_dict().items()},
                    trainer.callback_metrics["train_aux_loss"].item()))
    (pipelined, aux), (plain, plain_aux) = got
    assert max_difference(pipelined, plain) < 1e-5
    assert aux == pytest.approx(plain_aux, rel=1e-5) and aux > 0


def test_pipeline_with_one_microbatch_logs_upstreams_whole_batch_aux_loss_and_predicts_logits():
    # Block 1 recomputed in backward: its router statistics are computed again, the same.
    cfg = {**TINY, **MOE_CASES["qwen3_moe"]}
    batch = tokens(seed=5)
    model, trainer = fit_one_device(cfg, [batch], microbatches=1, steps=1, schedule="1f1b", activation_checkpointing=[2],
                                    model_class=SGDStep)
    L.seed_everything(0, verbose=False)
    reference = HuggingFaceCausalLM(cfg, init_seed=0)
    reference.configure_model()
    upstream = upstream_at(reference)
    want = upstream_output(upstream, batch)  # the weights the first batch trained on
    # The bounds follow from float32 rounding along the longest sums: the softmax over the vocabulary and the sums
    # over the batch's tokens (the losses: one value each; the gradients: see sgd_step_bounds).
    accumulations = VOCAB + batch[:, :-1].numel()
    for name, value in (("train_aux_loss", want.aux_loss), ("train_loss", want.loss)):
        assert trainer.callback_metrics[name].item() == pytest.approx(value.item(), rel=2 * accumulations * FLOAT32_EPS)
    # ... and the update is upstream's whole-batch gradient.
    want.loss.backward()
    gradients = {name: p.grad for name, p in upstream.named_parameters()}
    torch.optim.SGD(upstream.parameters(), lr=SGD_LR).step()
    got, expected = model.state_dict(), upstream.state_dict()
    bounds = sgd_step_bounds(expected, gradients, SGD_LR, accumulations)
    assert got.keys() == expected.keys() and set(gradients) <= set(got)
    over = {k: (float((got[k] - expected[k]).abs().max()), bounds[k]) for k in gradients
            if not (got[k] - expected[k]).abs().max() <= bounds[k]}
    assert not over, over
    predicted = trainer.predict(model, torch.utils.data.DataLoader(batch, batch_size=4))
    assert isinstance(predicted[0], torch.Tensor) and predicted[0].shape == (4, 16, VOCAB)
    torch.testing.assert_close(predicted[0], upstream_at(model)(batch[:, :-1]).logits, rtol=1e-5, atol=1e-5)


# ---- two processes ----------------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_two_processes_under_2bw_equal_one_device(tmp_path):
    """Mixtral with its balancing term, embedding + block 0 | block 1 + norm + head (the statistics cross the boundary
    forward, their gradient back), tied embedding and head on different processes, 2 microbatches."""
    moe = {k: v for k, v in {**TINY, **MOE_CASES["mixtral"]}.items() if k not in adapter_fit.HF_LLAMA or k == "model_type"}
    cfg = {"adapter": "hf", "steps": 3, "partition": [2, 3], "microbatches": 2, "model": moe}
    ranks = script_ranks(Path(__file__).parent / "scripts" / "adapter_fit.py", cfg, tmp_path)
    reference = run_here_on_one_device(adapter_fit.run, cfg)
    assert max_difference(ranks[0]["state_dict"], reference["state_dict"]) < 1e-5
    initial = HuggingFaceCausalLM({**adapter_fit.HF_LLAMA, **moe}, init_seed=0)
    initial.configure_model()
    assert max_difference(ranks[0]["state_dict"], initial.state_dict()) > 1e-3
    # The last stage's process computed the term; it travels with the loss, so rank 0 (the logger's) logs it too.
    for rank in ranks:
        assert rank["metrics"]["train_aux_loss"] == pytest.approx(reference["metrics"]["train_aux_loss"], rel=1e-6)
        assert rank["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-6)


# ---- litgpt ----------------------------------------------------------------------------------------------------------
def test_litgpt_moe_config_gives_litgpts_logits_loss_and_gradients():
    """litgpt's LLaMAMoE has no balancing term (litgpt trains on the cross entropy alone), so the adapter, which adds
    nothing, is exact: the same logits as litgpt.GPT, and the same gradients of the cross entropy."""
    pytest.importorskip("litgpt")
    from litgpt import GPT, Config

    from lightning_async_pp.models import LitGPT

    config = Config.from_name("Mixtral-8x7B-v0.1", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64,
                              moe_intermediate_size=16, n_expert=4, n_expert_per_token=2, vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, block_size=64)
    ours = LitGPT(config, init_seed=3)
    ours.configure_model()
    upstream = GPT(config)
    upstream.load_state_dict(ours.state_dict(), strict=True)
    batch = tokens()
    logits = upstream(batch[:, :-1])
    torch.testing.assert_close(ours(batch), logits, rtol=0, atol=0)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    ours.pipeline_loss(ours(batch), batch).backward()
    grads = dict(upstream.named_parameters())
    routers = 0
    for name, p in ours.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
        routers += name.endswith("mlp.gate.weight")
    assert routers == 2


# ---- the metrics that travel with the loss ------------------------------------------------------------------------------
def test_without_a_strategy_the_module_logs_upstreams_aux_loss_too():
    cfg = {**TINY, **MOE_CASES["olmoe"]}
    batch = tokens(seed=7)
    L.seed_everything(0, verbose=False)
    model = HuggingFaceCausalLM(cfg, init_seed=0)
    reference = HuggingFaceCausalLM(cfg, init_seed=0)
    reference.configure_model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(batch, batch_size=4))
    want = upstream_output(upstream_at(reference), batch)
    assert trainer.callback_metrics["train_aux_loss"].item() == pytest.approx(want.aux_loss.item(), rel=1e-6)


def test_metrics_that_differ_from_the_declared_names_are_a_clear_error():
    from helpers import TinyLM, make_dataset

    class Declares(TinyLM):
        def pipeline_metric_names(self):
            return ("train_extra",)

    model = Declares()
    trainer = L.Trainer(strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=2, num_stages=2),
                        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"pipeline_metrics\(\) returned \[\]; pipeline_metric_names\(\) declared \['train_extra'\]"):
        trainer.fit(model, torch.utils.data.DataLoader(make_dataset(8), batch_size=4))
