"""The planner's --tensor-parallel (plan/tensor.py): per-device costs against numbers worked by hand, the one-device
account at t = 1, the collectives' seconds, and the layouts it shows for Llama-3-8B and a 70B shape on 80 GB."""
from __future__ import annotations

import pytest

from lightning_async_pp.plan import MODELS, Shape, parser, plan
from lightning_async_pp.plan.cli import main
from lightning_async_pp.plan.tensor import (NOT_RUN_YET, tensor_parallel_collective_seconds,
                                            tensor_parallel_layer_costs)

TINY = Shape(hidden=8, layers=2, heads=2, kv_heads=2, intermediate=16, vocab=32, seq_len=4)


@pytest.mark.parametrize("split_blocks", [False, True])
def test_one_tensor_parallel_rank_is_the_one_device_account(split_blocks):
    shape = MODELS["smollm-135m"]
    kw = dict(split_blocks=split_blocks, tokens=2048, value_bytes=2, param_bytes=4, backward_ratio=2.0)
    assert tensor_parallel_layer_costs(shape, 1, **kw) == shape.layer_costs(split_blocks, 2048, 2, 4, 2.0)


def test_two_ranks_hold_the_costs_worked_by_hand():
    # hidden 8, key/value dim 8, head_dim 4, intermediate 16, vocabulary 32; 4 tokens, 2-byte values, fp32 weights
    first, block, last = tensor_parallel_layer_costs(
        Shape(**{**TINY.__dict__, "layers": 3}), 2, split_blocks=False, tokens=4, value_bytes=2, param_bytes=4,
        backward_ratio=2.0)
    # parameters: attention 2*64 + 2*64 = 256 split + norm 8 whole; MLP 3*8*16 = 384 split + norm 8 whole
    assert block.param_bytes == 4 * (256 // 2 + 8 + 384 // 2 + 8) == 1344
    assert block.matrix_param_bytes == 4 * (128 + 192)
    assert first.param_bytes == 1344 + 4 * 32 * 8 // 2  # the embedding's vocabulary split
    assert last.param_bytes == 1344 + 4 * (32 * 8 // 2 + 8)  # the head split, the final norm whole
    # kept: a norm 4 * (4*8 + 4 + 2*8) / 2 split + its gathered output 4*2*8 whole = 168; rotary 2*2*4*4 = 64;
    # attention 168 + 4 * (2*2*8 + 2*2*8 + 4*2) / 2 + 64 = 376; MLP 168 + 4*4*2*16 / 2 = 424
    assert block.activation_bytes == 376 + 424
    assert first.activation_bytes == 800 + 4 * 8  # token ids
    assert last.activation_bytes == 800 + 168 + 4 * 4 * 32 // 2 + 4 * 8  # final norm, log-probs split, labels
    assert block.transient_bytes == 4 * 2 * 2 * (16 + 8) // 2 == 192
    assert last.transient_bytes == 4 * 8 * 32 // 2 == 512
    assert block.input_bytes == block.output_bytes == 4 * 8 * 2 // 2  # a sequence shard crosses
    # forward FLOPs per token: attention 2 * (2*64 + 2*64) + 4*4*8 = 640, MLP 2*3*8*16 = 768, head 2*8*32 = 512
    assert block.forward_flops == (640 + 768) * 4 // 2 and block.backward_flops == 2 * block.forward_flops
    assert last.forward_flops == (640 + 768 + 512) * 4 // 2


def test_collectives_are_four_rings_each_way_per_block_and_one_more_at_each_end():
    shape = Shape(**{**TINY.__dict__, "layers": 3})
    one = 3 / 4 * (4 * 8 * 2) / 1e9 + 3 * 1e-6  # a ring over 4 ranks of a 64-byte tensor at 1 GB/s, 1 µs a step
    forward, backward = tensor_parallel_collective_seconds(shape, 4, split_blocks=False, tokens=4, value_bytes=2,
                                                           gbps=1.0, latency_s=1e-6)
    assert forward == pytest.approx([5 * one, 4 * one, 5 * one]) and backward == forward
    split, _ = tensor_parallel_collective_seconds(shape, 4, split_blocks=True, tokens=4, value_bytes=2, gbps=1.0,
                                                  latency_s=1e-6)
    assert split == pytest.approx([3 * one, 2 * one, 2 * one, 2 * one, 2 * one, 3 * one])
    assert tensor_parallel_collective_seconds(shape, 1, split_blocks=False, tokens=4, value_bytes=2, gbps=1.0,
                                              latency_s=1e-6)[0] == [0.0, 0.0, 0.0]


def _tp_records(argv):
    lines, records = plan(parser().parse_args(argv))
    return lines, next(r["tensor_parallel"] for r in records if "tensor_parallel" in r)


def test_llama_3_8b_at_8192_tokens_fits_80_gb_with_two_ranks_per_stage_where_one_does_not():
    lines, records = _tp_records(["--model", "llama-3-8b", "--stages", "2", "--microbatches", "8", "--schedules",
                                  "2bw", "--tensor-parallel", "1", "2"])
    assert NOT_RUN_YET in lines
    one, two = (next(r for r in records if r["t"] == t) for t in (1, 2))
    assert not one["fits"] and two["fits"] and two["peak"].total <= 76 * 2**30
    assert two["devices"] == 4 and two["step_time_s"] < one["step_time_s"]
    assert two["peak"].total < 0.6 * one["peak"].total  # about half: all but the gathered inputs split in two


def test_a_70b_shape_fits_80_gb_at_8_stages_only_with_8_ranks_per_stage():
    _, records = _tp_records(["--model", "llama-3-70b", "--stages", "8", "--microbatches", "16", "--schedules", "2bw",
                              "--tensor-parallel", "4", "8"])
    assert [(r["t"], r["fits"]) for r in records] == [(4, False), (8, True)]


def test_a_tensor_parallel_size_that_does_not_split_the_shape_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "llama-3-8b", "--stages", "2", "--tensor-parallel", "3"])
    assert "--tensor-parallel 3: tensor_parallel_size=3 does not divide the model's heads=32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--layers", "8", "--forward-s", "0.001", "--tensor-parallel", "2"])
    assert "--tensor-parallel needs a model shape" in capsys.readouterr().err
