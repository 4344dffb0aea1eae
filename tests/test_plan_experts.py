"""The planner's routed-expert shapes and --expert-parallel (plan/shapes.py, plan/experts.py): parameter counts
against the models they describe, built on the meta device (the built-in models.Llama with experts, each rank's
share after its experts are sharded; transformers' Qwen3-MoE and Qwen2-MoE), the one-device account at t = e = 1,
the all-to-all's seconds worked by hand, the layouts shown for a Qwen3-30B-A3B-like model on 80 GB, and the
refusals."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lightning_async_pp.models import Llama
from lightning_async_pp.parallel.expert import LocalExperts
from lightning_async_pp.plan import MODELS, Shape, parser, plan
from lightning_async_pp.plan.cli import main
from lightning_async_pp.plan.experts import all_to_all_seconds, expert_parallel_layer_costs

TINY = dict(hidden=32, layers=3, heads=4, kv_heads=2, intermediate=48, vocab=64, seq_len=16, experts=4,
            experts_per_token=2, expert_intermediate=24)
KW = dict(split_blocks=False, tokens=16, value_bytes=2, param_bytes=4, backward_ratio=2.0)


def _llama(tied: bool) -> Llama:
    return Llama("tiny", vocab_size=64, tie_embeddings=tied, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                 intermediate_size=48, max_seq_len=16, num_experts=4, experts_per_token=2, expert_intermediate_size=24)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight once


@pytest.mark.parametrize("tied", [True, False])
def test_the_shape_counts_the_built_in_moe_llamas_parameters_and_each_ranks_share_of_its_experts(tied):
    model = _llama(tied)  # parameters on the meta device until configure_model
    shape = Shape(**TINY, tied=tied)
    assert _count(model) == shape.parameters()
    assert _count(model.blocks[0].mlp.experts) == shape.expert_parameters() == 4 * 3 * 32 * 24
    assert sum(shape.layer_parameters(False)) - (32 * 64 if tied else 0) == shape.parameters()
    for e in (2, 4):
        for rank in range(e):  # each rank's share, as LocalExperts.shard keeps it
            block = _llama(tied).blocks[0]
            block.mlp.experts.shard(SimpleNamespace(size=lambda e=e: e, get_local_rank=lambda r=rank: r))
            held = expert_parallel_layer_costs(shape, 1, e, **KW)[1].param_bytes
            assert held == 4 * _count(block)
            assert _count(block.mlp.experts) == shape.expert_parameters() // e


def _meta_count(model_class, config) -> int:
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith("bias"))


@pytest.mark.hf
def test_the_qwen3_30b_a3b_preset_counts_transformers_qwen3_moe_at_its_widths():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = MODELS["qwen3-30b-a3b"]
    config = Qwen3MoeConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=2,
                            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                            head_dim=shape.head_dim, moe_intermediate_size=shape.expert_width,
                            num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                            tie_word_embeddings=False)
    assert _meta_count(Qwen3MoeForCausalLM, config) == replace(shape, layers=2).parameters()
    # the whole model: Qwen3-30B-A3B's 30.5 B, of which 29.0 B in experts
    assert round(shape.parameters() / 1e8) == 305 and round(shape.layers * shape.expert_parameters() / 1e8) == 290


@pytest.mark.hf
def test_a_shared_expert_counts_transformers_qwen2_moe_without_its_attention_biases():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    shape = Shape(**{**TINY, "layers": 2}, shared_intermediate=40, tied=False)
    assert _meta_count(Qwen2MoeForCausalLM, config) == shape.parameters()


@pytest.mark.parametrize("split_blocks", [False, True])
def test_one_rank_without_tensor_or_expert_parallelism_is_the_one_device_account(split_blocks):
    shape = replace(MODELS["qwen3-30b-a3b"], layers=4, shared_intermediate=512)
    kw = {**KW, "split_blocks": split_blocks, "tokens": 4096}
    assert expert_parallel_layer_costs(shape, 1, 1, **kw) == shape.layer_costs(split_blocks, 4096, 2, 4, 2.0)


def test_expert_parallelism_divides_the_experts_and_only_them():
    shape = MODELS["qwen3-30b-a3b"]
    one, eight = (expert_parallel_layer_costs(shape, 1, e, **{**KW, "tokens": 4096}) for e in (1, 8))
    for a, b in zip(one, eight):
        assert a.param_bytes - b.param_bytes == 4 * shape.expert_parameters() * 7 // 8
        assert (a.forward_flops, a.activation_bytes) == (b.forward_flops, b.activation_bytes)


def test_the_all_to_alls_move_what_leaves_a_rank_twice_each_way():
    shape = Shape(**TINY)
    # 16 tokens over t = 2: 8 routed per rank, 2 copies each, 32 values of 2 bytes; 3/4 of them leave over 1 GB/s
    one = 3 / 4 * 8 * 2 * 32 * 2 / 1e9 + 1e-6
    forward, backward = all_to_all_seconds(shape, 2, 4, tokens=16, value_bytes=2, gbps=1.0, latency_s=1e-6)
    assert forward == pytest.approx(2 * one + 1e-6) and backward == pytest.approx(2 * one)
    assert all_to_all_seconds(shape, 2, 1, tokens=16, value_bytes=2, gbps=1.0, latency_s=1e-6) == (0.0, 0.0)


def _ep_records(argv):
    lines, records = plan(parser().parse_args(argv))
    return lines, next(r["expert_parallel"] for r in records if "expert_parallel" in r)


def test_qwen3_30b_a3b_fits_80_gb_at_4_stages_only_with_its_experts_split():
    lines, records = _ep_records(["--model", "qwen3-30b-a3b", "--stages", "4", "--microbatches", "8", "--schedules",
                                  "2bw", "--data-parallel", "8", "--expert-parallel", "1", "8"])
    one, eight = (next(r for r in records if r["e"] == e) for e in (1, 8))
    states = {e: r["peak"].total - r["peak"].activations for e, r in ((1, one), (8, eight))}
    # the largest device (13 of the 48 blocks and the embedding) before activations: about 150 GB at 12 blocks
    assert not one["fits"] and 140e9 < states[1] < 180e9
    assert eight["fits"] and states[8] < 35e9 and eight["peak"].total <= 76 * 2**30
    assert eight["devices"] == 32 and any(line.startswith("| 4 | 1 | 8 | 8 | 32 | 8 | 2bw |") for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--expert-parallel", "3"], "--expert-parallel 3: expert_parallel_size=3 does not divide the 128 experts"),
    (["--expert-parallel", "4", "--data-parallel", "2"],
     "--expert-parallel 4: expert_parallel_size=4 does not divide the 2 ranks of a stage (data_parallel_size=2 x "
     "tensor_parallel_size=1)"),
    (["--expert-parallel", "2", "--data-parallel", "2", "--shard-optimizer"], "--shard-optimizer with --expert-parallel"),
    (["--experts", "8", "--experts-per-token", "9"], "--experts-per-token must be between 1 and the 8 experts, got 9"),
])
def test_bad_expert_parallel_sizes_are_refused_naming_them(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["--model", "qwen3-30b-a3b", "--stages", "2", *argv])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "llama-3-8b", "--stages", "2", "--expert-parallel", "2", "--data-parallel", "2"])
    assert "--expert-parallel needs a shape with routed experts" in capsys.readouterr().err


def test_the_planning_guides_expert_parallel_table_is_what_its_command_prints():
    import re
    import shlex
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "planning.md").read_text()
    section = page.split("## Mixture of experts", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(lightning-async-pp-plan .*?)\n```", section, re.S).group(1)
    lines, _ = plan(parser().parse_args(shlex.split(command.replace("\\\n", " "))[1:]))
    row = re.compile(r"\| \d+ \| \d+ \| \d+ \| \d+ \|")  # p, t, e, r: the expert-parallel table's rows alone
    shown = [line for line in section.splitlines() if row.match(line)]
    assert shown and shown == [line for line in lines if row.match(line)]
