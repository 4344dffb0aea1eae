"""Every family of the installed transformers' causal-LM auto mapping, through ``models.HuggingFaceCausalLM``: exact
(the upstream logits and training loss at the same weights) or refused when the model is built, never a silent
difference and never a crash after the build.

Each family is built from a tiny copy of its default config (``hf_probe.tiny_config``). The reference is the
upstream class (``AutoModelForCausalLM.from_config``) loaded with the adapter's weights. Runs under transformers
4.x and 5.x. ``python tests/test_hf_families.py`` rewrites the installed version's table in docs/models.md from
this sweep; ``test_the_family_table_in_the_docs_is_current`` checks it.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf  # make test also runs these on transformers 5.x
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from lightning_async_pp.models import HuggingFaceCausalLM  # noqa: E402
from lightning_async_pp.models.hf_probe import tiny_config  # noqa: E402
from lightning_async_pp.models.hf_config import TensorParallelRefusal  # noqa: E402
from lightning_async_pp.models.huggingface import tensor_parallel_plan  # noqa: E402

TOL = 1e-5
#: A "tiny" copy larger than this was not made tiny by the generic shrink (nested sub-configs, fixed sizes).
MAX_PARAMETERS = 3_000_000
DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
EXACT, REFUSED, NOT_BUILT = "exact", "refused", "not built"


def batch_of(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(1))


def short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:240]}"


def parameter_count(config) -> int:
    """The upstream model's parameter count, before anything is built in memory: built on the meta device without
    its weight initialization, which sets values and cannot add or remove a parameter (on the meta device it ran
    through torch's Python reference kernels: xLSTM's took 8 s, all families' about 25 s of the sweep), then with
    its weights tied as its initialization ties them (a tied head is counted once)."""
    from transformers import modeling_utils

    skip_init = getattr(modeling_utils, "no_init_weights", contextlib.nullcontext)
    with torch.device("meta"), skip_init():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    return sum(p.numel() for p in model.parameters())


def outcome(model_type: str) -> tuple[str, str]:
    """(outcome, detail) for one family. Outcomes other than exact / refused / not built are failures."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(AutoConfig.for_model(model_type))
            size = parameter_count(config)
        except Exception as err:  # the family's own code, at its defaults
            return NOT_BUILT, short(err)
        if size > MAX_PARAMETERS:
            return NOT_BUILT, f"the generic shrink leaves {size:,} parameters (sub-configs or fixed sizes)"
        try:  # with its weight initialization: a family whose initialization fails is not built
            upstream = AutoModelForCausalLM.from_config(config).eval()
        except Exception as err:
            return NOT_BUILT, short(err)
        try:
            ours = HuggingFaceCausalLM(config, init_seed=0)
            ours.configure_model()
        except ValueError as err:
            return REFUSED, " ".join(str(err).split())
        except Exception as err:
            return "CRASH AT BUILD", short(err)
        try:
            upstream.load_state_dict(ours.state_dict(), strict=True)
            ours.eval()
            batch = batch_of(config.vocab_size)
            with torch.no_grad():
                logits = ours(batch)
                loss = ours.pipeline_loss(logits, batch)
                expected = upstream(batch, labels=batch)
        except Exception as err:
            return "CRASH AFTER BUILD", short(err)
        gap = (logits - expected.logits[:, :-1]).abs().max().item()
        loss_gap = (loss - expected.loss).abs().item()
        if gap <= TOL and loss_gap <= TOL:
            return EXACT, ""
        return "DIFFERENT", f"logits {gap:.3g}, loss {loss_gap:.3g}"


@lru_cache(maxsize=1)
def sweep() -> dict[str, tuple[str, str]]:
    # One intra-op thread: the tiny models' kernels gain nothing from more, and on a busy machine torch's thread
    # pool waited on its descheduled threads (the sweep took 197 s beside another job on two cores, 96 s on one
    # thread; 36 s either way alone). Both sides of every comparison run on the same thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {model_type: outcome(model_type) for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(1500)  # the sweep builds every family twice (eval and training mode)
def test_every_family_is_exact_or_refused_at_build_never_different_or_crashing():
    results = sweep()
    bad = {family: result for family, result in results.items() if result[0] not in (EXACT, REFUSED, NOT_BUILT)}
    assert not bad, "\n".join(f"{family}: {kind} {detail}" for family, (kind, detail) in bad.items())
    # The families the issue named, as they are now (4.x and 5.x alike).
    for family in ("llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3", "smollm3", "gemma", "gemma2", "cohere",
                   "cohere2", "granite", "nemotron", "stablelm", "qwen2_moe", "olmoe", "mixtral"):
        if family in results:
            assert results[family][0] == EXACT, (family, results[family])
    assert results["gpt2"][0] == REFUSED  # another layout


def tensor_parallel_outcome(model_type: str) -> tuple[str, str]:
    """(outcome, reason) of ``tensor_parallel_size=2`` for a family exact on one device: the plan read from its
    config and checked on a tiny copy split over two simulated ranks (``hf_probe.check_tensor_parallel``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tensor_parallel_plan(tiny_config(AutoConfig.for_model(model_type)), 2)
        except TensorParallelRefusal as err:
            return REFUSED, err.reason
        except ValueError as err:  # a size two ranks do not divide
            return REFUSED, " ".join(str(err).split())
        except Exception as err:
            return "CRASH", short(err)
    return EXACT, ""


@lru_cache(maxsize=1)
def tensor_parallel_sweep() -> dict[str, tuple[str, str]]:
    """:func:`tensor_parallel_outcome` of every family the sweep finds exact on one device."""
    exact = [family for family, (kind, _) in sweep().items() if kind == EXACT]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the sweep (each simulated rank is a thread of its own)
    try:
        return {family: tensor_parallel_outcome(family) for family in exact}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(1500)  # the sweep, then the tensor-parallel check of each exact family
def test_every_exact_family_is_tensor_parallel_exact_or_refused_with_its_reason():
    results = tensor_parallel_sweep()
    bad = {family: result for family, result in results.items() if result[0] not in (EXACT, REFUSED)}
    assert not bad, bad
    for family in ("llama", "qwen2", "qwen3", "mistral"):  # trained on 2 x 2 (tests/test_tensor_parallel_models.py)
        assert results[family] == (EXACT, ""), (family, results[family])
    assert all(reason for kind, reason in results.values() if kind == REFUSED)


@pytest.mark.timeout(1500)  # the sweep, then the tensor-parallel check of each exact family
def test_every_tensor_parallel_exact_family_runs_torchs_styles_of_its_plan_forward_and_backward():
    # The check simulates the ranks; the adapter runs torch's DTensor styles (and the vocabulary split of the
    # embedding and head, with any work a family does there). Each family the check accepts is parallelized as
    # under the strategy and run forward and backward under loss_parallel on rank 0 of a fake 2-process group
    # (torch's test backend: collectives return their input, so the numbers are not checked here, only that
    # DTensor runs every operation the family's code asks of it).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_async_pp.parallel.placement import replace_meta_tensors

    exact = [family for family, (kind, _) in tensor_parallel_sweep().items() if kind == EXACT]
    failed = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for family in exact:
                config = tiny_config(AutoConfig.for_model(family))
                model = HuggingFaceCausalLM(config, init_seed=0)
                model.configure_model()
                replace_meta_tensors(model, lambda t: torch.zeros_like(t, device="cpu"))
                try:
                    model.parallelize(mesh, tensor_parallel_plan(config, 2))
                    batch = batch_of(config.vocab_size)
                    x = model.pipeline_input(batch)
                    for layer in model.pipeline_layers():
                        x = layer(x)
                    with loss_parallel():
                        model.pipeline_loss(x, batch).backward()
                except Exception as err:
                    failed[family] = short(err)
    finally:
        dist.destroy_process_group()
    assert len(exact) > 10 and not failed, failed


@pytest.mark.timeout(1500)  # the sweep builds every family twice (eval and training mode)
def test_the_refusal_names_the_family_and_what_it_cannot_do():
    results = sweep()
    for family, (kind, detail) in results.items():
        if kind == REFUSED:
            assert "HuggingFaceCausalLM" in detail and (family in detail or "Model" in detail), (family, detail)
    if "doge" in results and results["doge"][0] == REFUSED:  # outside work nobody listed: the build-time check
        assert "tiny copy" in results["doge"][1] and "logits" in results["doge"][1]


def test_every_familys_default_config_passes_the_key_check_and_a_misspelt_key_is_refused():
    # The check (hf_config.check_config_keys) must not refuse a key a family knows: each family's own default
    # config, as a mapping with model_type (what YAML gives), builds the same config; with one key misspelt it is
    # refused, naming the key meant.
    from lightning_async_pp.models.hf_config import as_pretrained_config

    checked = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                fields = AutoConfig.for_model(model_type).to_dict()
                del fields["transformers_version"]  # a mapping written by hand (one transformers wrote is not checked)
                AutoConfig.for_model(**fields)  # the family's own round trip; a few families fail it
            except Exception:
                continue
            width = next((k for k in ("hidden_size", "n_embd", "d_model") if isinstance(fields.get(k), int)), None)
            assert as_pretrained_config(fields).to_dict() == AutoConfig.for_model(**fields).to_dict(), model_type
            if width is not None:
                typo = {**{k: v for k, v in fields.items() if k != width}, width[:3] + width[4:]: fields[width] // 2}
                meant = rf"'{re.escape(fields['model_type'])}'.*no key '{width[:3] + width[4:]}' \(did you mean '{width}'"
                with pytest.raises(ValueError, match=meant):
                    as_pretrained_config(typo)
            checked.append(model_type)
    assert len(checked) > 0.8 * len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(checked))


def test_an_unknown_model_type_is_refused_with_the_close_family_not_a_list_of_every_model_type():
    from lightning_async_pp.models.hf_config import as_pretrained_config

    with pytest.raises(ValueError) as caught:
        HuggingFaceCausalLM({"model_type": "llamma", "hidden_size": 64})
    message = str(caught.value)
    assert "model_type 'llamma' is not one transformers knows; did you mean 'llama'" in message
    assert len(message) < 400, message  # transformers' own lists its every model type (300 of them)
    with pytest.raises(ValueError, match=r"model_type 'zzzz' is not one transformers knows; Its causal-LM families"):
        as_pretrained_config({"model_type": "zzzz"})


def test_a_family_whose_init_leaves_its_norms_to_their_constructors_is_exact_built_on_meta_as_under_the_strategy():
    # HunYuan's _init_weights sets only linear and embedding weights; its RMSNorm gains keep the constructor's ones.
    # Built on the meta device (the model's __init__, the strategy's configure_model) those values were lost: the
    # norms were uninitialized memory, and the build-time check refused the family under the strategy only.
    from lightning_async_pp.parallel.placement import materialize_layers, parameters_on_meta

    if "hunyuan_v1_dense" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip("this transformers has no hunyuan_v1_dense")
    config = tiny_config(AutoConfig.for_model("hunyuan_v1_dense"))
    ours = HuggingFaceCausalLM(config, init_seed=0)
    with parameters_on_meta():  # as AsyncPipelineStrategy's tensor_init_context; the check runs here too
        ours.configure_model()
    layers = ours.pipeline_layers()
    assert all(p.is_meta for p in ours.parameters())
    materialize_layers(layers, list(range(len(layers))), torch.device("cpu"), ours.init_layer)
    upstream = AutoModelForCausalLM.from_config(config).eval()
    norms = [n for n in upstream.state_dict() if "norm" in n]
    assert norms and all(torch.equal(ours.state_dict()[n], upstream.state_dict()[n]) for n in norms)  # ones
    upstream.load_state_dict(ours.state_dict(), strict=True)
    batch = batch_of(config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(batch), upstream(batch[:, :-1]).logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("heads, kv_heads, tiny_heads, tiny_kv_heads", [
    (3, 3, 3, 3),  # the config: 3 key/value heads were cut to 2, which do not divide 3 query heads
    (32, 32, 4, 4), (32, 8, 4, 2), (9, 3, 4, 2), (32, 1, 4, 1), (4, 2, 4, 2), (6, 4, 6, 4)])
def test_the_tiny_copy_keeps_the_configs_kind_of_attention_and_a_config_transformers_runs_passes_the_check(
        heads, kv_heads, tiny_heads, tiny_kv_heads):
    """The probe's tiny copy shrinks the heads keeping multi-head, multi-query and grouped-query attention as they
    are, and the width a multiple of the heads; a config whose key/value heads do not divide its heads (6 and 4)
    keeps both, so the copy fails as the model would."""
    config = AutoConfig.for_model("llama", hidden_size=16 * heads, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=16, intermediate_size=64, vocab_size=256)
    tiny = tiny_config(config)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (tiny_heads, tiny_kv_heads)
    assert tiny.hidden_size % tiny.num_attention_heads == 0
    if heads % kv_heads == 0:  # transformers runs it: the adapter passes its build-time check on the copy
        HuggingFaceCausalLM(config).configure_model()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_router_loss_family_passes_the_build_time_check_with_its_balancing_term(family, monkeypatch):
    """The tiny-copy check compares the loss with upstream's, router term included (models/moe.py): it runs and
    passes; with the term dropped from the pipeline loss it refuses the family."""
    config = tiny_config(AutoConfig.for_model(family, output_router_logits=True, router_aux_loss_coef=0.5))
    HuggingFaceCausalLM(config).configure_model()
    from lightning_async_pp.models.moe import RouterLoss

    monkeypatch.setattr(RouterLoss, "loss", lambda self, statistics: 0.0)
    with pytest.raises(ValueError, match=r"refuses .*loss .* away from the upstream forward"):
        HuggingFaceCausalLM(config).configure_model()


def test_the_upstream_way_of_calling_the_adopted_base_model_is_unchanged():
    # The embedding hook (Gemma's sqrt(hidden) scale) acts on pipeline calls only: model.forward scales itself.
    config = tiny_config(AutoConfig.for_model("gemma"))
    ours = HuggingFaceCausalLM(config, init_seed=0)
    ours.configure_model()
    upstream = AutoModelForCausalLM.from_config(config).eval()
    upstream.load_state_dict(ours.state_dict())
    ids = batch_of(config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.model.eval()(ids).last_hidden_state, upstream.model(ids).last_hidden_state,
                                   rtol=0, atol=0)


def test_starcoder2_embedding_dropout_is_done_in_training_and_a_family_skipping_train_only_work_is_refused(monkeypatch):
    # Upstream drops half of the embedding's output entering block 0 in training; the pipeline did not (0.00 zeros).
    from lightning_async_pp.models import hf_outside

    config = tiny_config(AutoConfig.for_model("starcoder2", embedding_dropout=0.5, residual_dropout=0.1))
    ours = HuggingFaceCausalLM(config, init_seed=0)
    ours.configure_model()  # accepted: the build-time check compares training mode too
    upstream = AutoModelForCausalLM.from_config(config)
    upstream.load_state_dict(ours.state_dict(), strict=True)
    entering = {}
    for key, model in (("ours", ours.model), ("upstream", upstream.model)):
        model.layers[0].register_forward_pre_hook(lambda m, args, key=key: entering.__setitem__(key, args[0].clone()))
    batch = batch_of(config.vocab_size)
    for training in (True, False):
        ours.train(training), upstream.train(training)
        with torch.no_grad():
            torch.manual_seed(5)
            x = ours.pipeline_input(batch)
            for layer in ours.pipeline_layers():
                x = layer(x)
            torch.manual_seed(5)
            expected = upstream(batch[:, :-1]).logits
        assert torch.equal(entering["ours"], entering["upstream"]) and (x - expected).abs().max().item() <= TOL
        dropped = (entering["ours"] == 0).float().mean().item()
        assert 0.4 < dropped < 0.6 if training else dropped == 0.0, (training, dropped)
        with torch.no_grad():  # the upstream call of the adopted base model drops once, not twice
            torch.manual_seed(6)
            own = ours.model(batch).last_hidden_state
            torch.manual_seed(6)
            torch.testing.assert_close(own, upstream.model(batch).last_hidden_state, rtol=0, atol=0)
    # Without the hook the embedding dropout is skipped in training only: the check refuses the family, naming it.
    monkeypatch.setattr(hf_outside, "KINDS", tuple(k for k in hf_outside.KINDS if k.name != "embedding dropout"))
    with pytest.raises(ValueError, match=r"refuses Starcoder2Model \(model_type 'starcoder2'\).* in training mode"):
        HuggingFaceCausalLM(config).configure_model()


def test_phi3_longrope_is_checked_on_a_tiny_copy_with_its_rope_factors_cut_to_the_tiny_head_and_is_exact():
    # Phi-3-mini-128k / Phi-3.5-mini shape: one longrope factor per rotary frequency of the head (here 64 / 2 = 32);
    # the tiny copy's head (8) takes 4 of them. Sequences past original_max_position_embeddings use long_factor.
    short, long = [1.0 + i / 40 for i in range(32)], [1.0 + i / 8 for i in range(32)]
    config = AutoConfig.for_model("phi3", hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                  intermediate_size=64, num_hidden_layers=2, vocab_size=256, pad_token_id=None,
                                  bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
                                  original_max_position_embeddings=16,
                                  rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
    tiny = tiny_config(config)
    rope = getattr(tiny, "rope_parameters", None) or tiny.rope_scaling  # 5.x / 4.x
    assert (rope["short_factor"], rope["long_factor"]) == (short[::8], long[::8])
    ours = HuggingFaceCausalLM(config, init_seed=0)
    ours.configure_model()  # the build-time check on the tiny copy passes (it was refused: 48 factors for 4)
    upstream = AutoModelForCausalLM.from_config(config).eval()
    upstream.load_state_dict(ours.state_dict(), strict=True)
    for length in (8, 32):  # short_factor, then long_factor
        batch = torch.randint(0, 256, (2, length + 1), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            gap = (ours.eval()(batch) - upstream(batch[:, :-1]).logits).abs().max().item()
        assert gap <= TOL, (length, gap)


# ---- one pipeline step on one device (2 stages) equals one AdamW step on the upstream loss -------------------------
@pytest.mark.parametrize("family, schedule", [("gemma2", "2bw"), ("granite", "1f1b"), ("cohere", "2bw")])
def test_one_pipeline_step_of_a_family_with_outside_work_equals_a_step_on_the_upstream_loss(family, schedule):
    pytest.importorskip("lightning")
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    sys.path.insert(0, str(Path(__file__).parent))
    from pipeline_runs import SGD_LR, sgd_model, sgd_step_bounds

    config = tiny_config(AutoConfig.for_model(family))
    rows = torch.randint(0, config.vocab_size, (8, 17), generator=torch.Generator().manual_seed(2))
    model = sgd_model(HuggingFaceCausalLM)(config, init_seed=0)  # the update is the gradient (see sgd_model)
    upstream = AutoModelForCausalLM.from_config(config)
    model.configure_model()
    upstream.load_state_dict(model.state_dict())
    model._layers = None  # built again by the strategy, from the same seed
    L.Trainer(strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=4, num_stages=2), accelerator="cpu",
              devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0).fit(model, DataLoader(rows, batch_size=8))
    # The reference, written out: one SGD step on the upstream loss of the whole batch; the bound follows from
    # float32 rounding along the longest sums (the vocabulary's softmax, the batch's tokens).
    upstream(rows, labels=rows).loss.backward()
    gradients = {name: p.grad.clone() for name, p in upstream.named_parameters()}
    torch.optim.SGD(upstream.parameters(), lr=SGD_LR).step()
    got, want = model.state_dict(), upstream.state_dict()
    assert list(got) == list(want)
    bounds = sgd_step_bounds(want, gradients, SGD_LR, config.vocab_size + rows[:, :-1].numel())
    over = {k: ((got[k] - want[k]).abs().max().item(), bounds[k]) for k in gradients
            if not (got[k] - want[k]).abs().max().item() <= bounds[k]}
    assert not over, over


# ---- padded batches: refused before the first update ------------------------------------------------------------
def test_a_padded_dict_batch_is_refused_before_the_first_update_naming_the_batch_form_taken():
    pytest.importorskip("lightning")
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    config = tiny_config(AutoConfig.for_model("llama"))
    rows = torch.randint(0, config.vocab_size, (8, 17), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(rows)
    mask[:, -3:] = 0
    samples = [{"input_ids": r, "attention_mask": m, "labels": r.masked_fill(m == 0, -100)} for r, m in zip(rows, mask)]
    model = HuggingFaceCausalLM(config, init_seed=0)
    model.configure_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model._layers = None
    trainer = L.Trainer(strategy=AsyncPipelineStrategy(num_microbatches=2, num_stages=2), accelerator="cpu", devices=1,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    with pytest.raises(TypeError, match=r"takes batches of token ids, an integer tensor \(B, T \+ 1\).*"
                                        r"keys \['attention_mask', 'input_ids', 'labels'\].*not supported"):
        trainer.fit(model, DataLoader(samples, batch_size=8))
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- the table in the docs ----------------------------------------------------------------------------------------
def table() -> str:
    lines = ["| family | outcome | why | tensor-parallel (t = 2) |", "|---|---|---|---|"]
    tensor_parallel = tensor_parallel_sweep()
    for family, (kind, detail) in sweep().items():
        tp_kind, reason = tensor_parallel.get(family, ("", ""))
        tp = f"{tp_kind}: {reason}" if reason else tp_kind
        lines.append(f"| `{family}` | {kind} | {detail.replace('|', '/')} | {tp.replace('|', '/')} |")
    return "\n".join(lines)


def section_markers() -> tuple[str, str]:
    version = transformers.__version__
    return f"<!-- families: transformers {version} -->", f"<!-- end: transformers {version} -->"


def documented_outcomes(text: str) -> dict[str, str]:
    start, end = section_markers()
    if start not in text:
        return {}
    body = text[text.index(start):text.index(end)]
    return {m.group(1): (m.group(2).strip(), m.group(3).split(":")[0].strip())
            for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+) \|[^|]*\| ([^|]*) \|$", body, re.M)}


@pytest.mark.timeout(1500)  # the sweep, then the tensor-parallel check of each exact family
def test_the_family_table_in_the_docs_is_current():
    documented = documented_outcomes(DOC.read_text())
    if not documented:
        pytest.skip(f"docs/models.md has no table for transformers {transformers.__version__}")
    tensor_parallel = tensor_parallel_sweep()
    assert documented == {family: (kind, tensor_parallel.get(family, ("", ""))[0])
                          for family, (kind, _) in sweep().items()}, \
        "docs/models.md is out of date: python tests/test_hf_families.py rewrites it"


def write_table() -> None:
    """Replace (or add) the installed transformers version's table in docs/models.md."""
    start, end = section_markers()
    text = DOC.read_text()
    block = f"{start}\n### transformers {transformers.__version__}\n\n{table()}\n{end}"
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


if __name__ == "__main__":
    sys.exit(write_table())
