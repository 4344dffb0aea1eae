"""The one-device exactness checks on a CUDA device (fp32 and bf16) and 2 processes over NCCL.

Skipped without CUDA (CI has none); ``benchmarks/gpu_check.sh`` runs them on a machine with a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from helpers import delayed_loop  # noqa: E402
from scale_fit import ConfiguredMLP, build_loader  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 6


def delayed_reference(dtype: torch.dtype) -> dict:
    """2bw written out on CUDA: W_{k+1} = W_k - U(grad f(W_{max(k-1,0)}; B_k)), AdamW, in ``dtype``."""
    L.seed_everything(0, verbose=False)
    model = ConfiguredMLP()
    with torch.device("cuda"):
        model.configure_model()
    for i, layer in enumerate(model.pipeline_layers()):
        model.init_layer(i, layer)
    model.to(dtype)
    batches = [[t.cuda().to(dtype) for t in batch] for _, batch in zip(range(STEPS), build_loader({}))]
    return {k: v.float().cpu() for k, v in delayed_loop(model, batches, delay=1).items()}


def pipeline_run(precision: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = ConfiguredMLP()
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=STEPS, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=AsyncPipelineStrategy(num_stages=2, num_microbatches=4))
    trainer.fit(model, build_loader({}))
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_stages_on_one_cuda_device_follow_the_delayed_recurrence_in_fp32():
    assert max_difference(pipeline_run("32-true"), delayed_reference(torch.float32)) < 1e-5


def test_two_stages_on_one_cuda_device_follow_the_delayed_recurrence_in_bf16():
    # bf16 rounds at every step: the pipeline's microbatch sums may round differently from the whole batch's.
    assert max_difference(pipeline_run("bf16-true"), delayed_reference(torch.bfloat16)) < 5e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_processes_over_nccl_equal_one_cuda_device(tmp_path):
    script = Path(__file__).parent / "scripts" / "scale_fit.py"
    cfg = dict(devices=2, steps=STEPS, accelerator="cuda")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "RANK")}
    proc = subprocess.run([sys.executable, str(script), "--config", json.dumps(cfg), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = torch.load(tmp_path / "rank0.pt", weights_only=False)["state_dict"]
    assert max_difference({k: v.float().cpu() for k, v in two.items()}, pipeline_run("32-true")) < 1e-5


def test_measured_layer_times_on_cuda_synchronize_and_leave_the_layers_and_the_cuda_random_state_untouched():
    """layer_cost="measured" on the device it will run on: a layer of about 190x the FLOPs of another takes longer (the
    timing waits for the device, not just the launch), and nothing of the model or the random state changes."""
    from lightning_async_pp.plan.timing import measure_layer_times

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256), torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(256, 16384),
                                                              torch.nn.Linear(16384, 256))]
    layers = [layer.cuda() for layer in layers]
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    sample = torch.randn(4096, 256, device="cuda")
    rng = torch.cuda.get_rng_state()
    times = measure_layer_times(layers, sample, lambda b: b, lambda out, b: out.square().mean(), torch.device("cuda"))
    assert times[1] > 4 * times[0], times
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    for layer, state in zip(layers, before):
        assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())
        assert all(p.grad is None for p in layer.parameters())


def test_costing_on_cuda_leaves_the_hf_rotary_module_and_litgpts_rope_cache_on_the_cpu_and_real():
    """Issue 54, item 12: the engine costs the layers (still on the CPU or meta) on fake CUDA tensors; the hooks
    that move the shared rotary tables to the input's device must not leave fake CUDA tensors behind. The CPU suite
    checks the same on the meta device (tests/test_adapters.py)."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import AutoConfig

    from lightning_async_pp.models import HuggingFaceCausalLM
    from lightning_async_pp.plan.balanced import layer_costs

    models = [HuggingFaceCausalLM(AutoConfig.for_model(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), init_seed=3)]
    try:
        from lightning_async_pp.models import LitGPT
        models.append(LitGPT({"name": "pythia-14m", "n_layer": 2, "vocab_size": 256, "padded_vocab_size": 256},
                             init_seed=3))
    except ImportError:  # litgpt not installed
        pass
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for model in models:
        model.configure_model()
        model.eval()
        with torch.no_grad():
            before = model.pipeline_loss(model(batch), batch)
        costs = layer_costs(model.pipeline_layers(), batch, model.pipeline_input, model.pipeline_loss,
                            device=torch.device("cuda"))
        assert costs[1].forward_flops > 0
        for layer in model.pipeline_layers():
            for hook in layer._forward_pre_hooks.values():
                held = [*getattr(getattr(hook, "rotary", None), "buffers", lambda: [])(),
                        *[t for t in vars(getattr(hook, "rope", object())).values() if isinstance(t, torch.Tensor)]]
                assert all(not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in held), type(model)
        with torch.no_grad():
            assert torch.equal(model.pipeline_loss(model(batch), batch), before)  # the next real forward runs
        model.cuda()
        with torch.no_grad():  # and on the device, where the hooks move the tables for real
            torch.testing.assert_close(model.pipeline_loss(model(batch.cuda()), batch.cuda()).cpu(), before)


def test_what_the_account_says_a_layer_keeps_is_what_the_cuda_allocator_holds_after_its_forward():
    """Issue 54, item 4, against the allocator: after a block's forward the allocator holds its output plus what
    the account says it keeps (its saved activations and, under bf16 autocast, the cached bf16 weights); a
    checkpointed block holds only its output and those casts (its input, which the account charges it, was there
    before)."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint

    from lightning_async_pp.plan.balanced import layer_costs

    torch.manual_seed(0)
    b, d, h = 64, 512, 2048
    layers = [torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, d)).cuda()
              for _ in range(3)]
    loss = lambda out, batch: out.square().mean()  # noqa: E731
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    for context in (nullcontext, autocast):
        for checkpointed in (set(), {1}):
            cost = layer_costs(layers, torch.zeros(b, d), lambda x: x, loss, device=torch.device("cuda"),
                               checkpointed=checkpointed, context=context)[1]
            x = torch.randn(b, d, device="cuda", requires_grad=True)
            with context():
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                out = (checkpoint(layers[1], x, use_reentrant=False) if checkpointed else layers[1](x))
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes()
            if checkpointed:
                # (autocast caches the bf16 weights in a checkpointed forward too)
                assert held == cost.cast_bytes and cost.activation_bytes == x.untyped_storage().nbytes()
            else:
                assert held == cost.activation_bytes + cost.cast_bytes, (context, held, cost)
            del out, x


# ---- packed rows: attention over each document's blocks only (issue 56) ------------------------------------------
def _packed_row_cuda(lengths: tuple[int, ...], vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    batch = {"input_ids": torch.cat(docs).unsqueeze(0).cuda(),
             "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()}
    return batch, [d.cuda() for d in docs]


def test_packed_llama_on_cuda_attends_by_flex_attention_and_gives_each_document_its_logits_alone(monkeypatch):
    from lightning_async_pp.models import Llama, packing

    monkeypatch.setattr(packing, "_document_causal_mask", lambda p: pytest.fail("a (T, T) mask was built"))
    torch.manual_seed(0)
    model = Llama("tiny", vocab_size=64, init_seed=0, max_seq_len=512)
    model.configure_model()
    model = model.cuda()
    batch, docs = _packed_row_cuda((130, 7, 200, 64), 64)
    assert packing.documents(batch["position_ids"][:, :-1]).flex
    packed = model.pipeline_forward(batch)[0]
    packed.float().square().mean().backward()  # flex attention's backward on CUDA
    with torch.no_grad():
        alone = torch.cat([model.pipeline_forward(torch.cat([d, d[:1]]).unsqueeze(0))[0] for d in docs])
    torch.testing.assert_close(packed.detach(), alone[: packed.shape[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention", "flash_attention_2"])
def test_packed_hf_llama_on_cuda_gives_each_document_upstreams_logits_alone(attention):
    pytest.importorskip("transformers")
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_async_pp.models import HuggingFaceCausalLM
    from lightning_async_pp.models.hf_probe import tiny_config

    dtype = torch.bfloat16 if attention == "flash_attention_2" else torch.float32
    config = tiny_config(AutoConfig.for_model("llama"))
    config.vocab_size, config.max_position_embeddings = 64, 512
    ours = HuggingFaceCausalLM(config, init_seed=0)
    ours.configure_model()
    upstream = AutoModelForCausalLM.from_config(config)
    upstream.load_state_dict(ours.state_dict(), strict=True)
    ours, upstream = ours.to("cuda", dtype).eval(), upstream.to("cuda", dtype).eval()
    ours.model.config._attn_implementation = attention
    batch, docs = _packed_row_cuda((130, 7, 200, 64), 64)
    packed = ours.pipeline_forward(batch)[0]
    packed.float().sum().backward()
    with torch.no_grad():
        alone = torch.cat([upstream(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(packed.detach().float(), alone[: packed.shape[0]].float(), rtol=tolerance, atol=tolerance)
    if attention == "flash_attention_2":  # transformers' variable-length path finds documents in one row only
        two_rows = {k: v.repeat(2, 1) for k, v in batch.items()}
        with pytest.raises(ValueError, match="flash_attention_2.*one row"):
            ours.pipeline_forward(two_rows)


def test_packed_attention_at_8192_tokens_on_cuda_allocates_no_token_by_token_mask():
    from lightning_async_pp.models import packing

    lengths = [341] * 23 + [8192 - 341 * 23]
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    q, k, v = (torch.randn(1, 9, 8192, 64, device="cuda", requires_grad=True) for _ in range(3))
    packing.document_attention(q, k, v, pos).sum().backward()  # compiles flex attention once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pos = pos.clone()  # new microbatch: its documents found again
    packing.document_attention(q, k, v, pos).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 8192 * 8192 // 2  # a bool (T, T) mask alone is 64 MiB
