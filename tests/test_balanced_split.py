"""partition="balanced": the cost per layer (FLOPs on the meta device), the exact split, and the engine's use of it."""
from __future__ import annotations

import itertools
import random
import time
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from helpers import one_device_trainer
from lightning_async_pp import AsyncPipelineStrategy, PipelineModule
from lightning_async_pp.models import Llama
from lightning_async_pp.pipeline.config import PipelineConfig
from lightning_async_pp.plan.balanced import (LayerCost, MemoryModel, balanced_split, layer_costs, split_and_run_ahead,
                                              stage_memory_bytes, stage_peak)
from lightning_async_pp.plan.memory import StageMemory
from lightning_async_pp.plan.timing import measure_layer_times


def brute_force(times, p, memory=None, cap=None):
    """The least slowest-stage time over every contiguous split (None: none fits the cap)."""
    n, best = len(times), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        stages = [(bounds[s], bounds[s + 1]) for s in range(p)]
        if memory is not None and any(memory(i, j, s) > cap for s, (i, j) in enumerate(stages)):
            continue
        slowest = max(sum(times[i:j]) for i, j in stages)
        best = slowest if best is None else min(best, slowest)
    return best


def test_balanced_split_is_the_fastest_contiguous_split_under_the_memory_cap():
    rng = random.Random(41)
    for case in range(400):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        times = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
        mem = [rng.randint(1, 10) for _ in range(n)]
        in_flight = [p - s for s in range(p)]
        memory = lambda i, j, s: sum(mem[i:j]) * in_flight[s]  # noqa: E731
        cap = rng.choice([None, rng.randint(5, 60)])
        expected = brute_force(times, p, memory if cap else None, cap)
        where = f"case {case}: times={times} mem={mem} p={p} cap={cap}"
        if expected is None:
            with pytest.raises(ValueError, match="no split of the"):
                balanced_split(times, p, memory=memory, memory_cap=cap)
            continue
        counts = balanced_split(times, p, memory=memory, memory_cap=cap)
        assert len(counts) == p and all(c >= 1 for c in counts) and sum(counts) == n, where
        bounds = [0, *itertools.accumulate(counts)]
        slowest = max(sum(times[bounds[s]:bounds[s + 1]]) for s in range(p))
        assert slowest == expected, f"{where}: got {counts} (slowest {slowest}), brute force {expected}"
        if cap:
            assert all(memory(bounds[s], bounds[s + 1], s) <= cap for s in range(p)), where


def test_layer_costs_count_a_linear_layer_as_two_flops_per_weight_forward_and_twice_that_backward():
    tokens, d_in, d_out = 6, 8, 16
    layers = [nn.Linear(d_in, d_out, bias=False), nn.Linear(d_out, 4, bias=False)]
    batch = torch.zeros(tokens, d_in)
    costs = layer_costs(layers, batch, lambda b: b, lambda out, b: out.square().mean())
    assert costs[0].forward_flops == 2 * tokens * d_in * d_out
    # backward: the weight's gradient and the input's (the input of layer 0 is the batch: no gradient wanted)
    assert costs[1].backward_flops == 2 * costs[1].forward_flops
    assert costs[0].backward_flops == costs[0].forward_flops
    assert costs[0].param_bytes == d_in * d_out * 4
    assert costs[1].activation_bytes >= tokens * d_out * 4  # it keeps its input for the weight's gradient
    assert all(p.device.type == "cpu" for layer in layers for p in layer.parameters())  # the layers untouched


def smollm_width(num_layers=12):
    model = Llama("smollm-135m", vocab_size=49152, num_layers=num_layers)
    model._configured = True  # the cost model needs no memory: the layers stay on the meta device
    return model


def test_a_tied_head_with_its_loss_costs_several_blocks_and_the_embedding_none():
    model = smollm_width()
    layers = model.pipeline_layers()
    costs = layer_costs(layers, torch.zeros(1, 257, dtype=torch.long), model.pipeline_input, model.pipeline_loss)
    assert costs[0].flops == 0
    assert costs[-1].flops > 5 * costs[1].flops  # hidden 576 x vocabulary 49152 against one block
    times = [c.flops for c in costs]
    # The split the issue measured fastest by hand: stage 0 the embedding and 10 blocks.
    assert balanced_split(times, 2) == [11, 3]


def test_a_memory_cap_moves_layers_off_the_stage_that_holds_the_most_microbatches():
    model = smollm_width()
    costs = layer_costs(model.pipeline_layers(), torch.zeros(1, 257, dtype=torch.long), model.pipeline_input,
                        model.pipeline_loss)
    mm = MemoryModel("1f1b", 2, 8)
    memory = lambda i, j, s: stage_memory_bytes(costs, i, j, s, mm)  # noqa: E731
    free = balanced_split([c.flops for c in costs], 2, memory=memory)
    cap = memory(0, free[0], 0) - 1  # stage 0's predicted peak, less one byte
    capped = balanced_split([c.flops for c in costs], 2, memory=memory, memory_cap=cap)
    assert capped[0] < free[0] and memory(0, capped[0], 0) <= cap
    with pytest.raises(ValueError, match="no split of the 14 layers into 2 stages.*stage_memory_gib"):
        balanced_split([c.flops for c in costs], 2, memory=memory, memory_cap=1.0)


def test_the_last_stage_of_2bw_holds_two_gradients_only_without_data_parallelism():
    # One layer of 10 parameter bytes keeping nothing for its backward, so each peak is parameter-sized buffers only,
    # counted by hand: the weights, 2bw's stashed version, one gradient per batch whose gradients exist, AdamW's two
    # moments (halved over 2 replicas by ZeRO-1), a correction's buffer and, in the update, its transient copy.
    layer = [LayerCost(0, 0, param_bytes=10, activation_bytes=0)]

    def peak(stage, *args, **kwargs):
        return stage_peak(layer, 0, 1, stage, MemoryModel(*args, **kwargs))

    assert peak(1, "2bw", 2, 4) == StageMemory(10, 10, 20, 20, 0, 0)  # the last stage runs ahead: two gradients
    assert peak(0, "2bw", 2, 4) == StageMemory(10, 10, 10, 20, 0, 0)
    assert peak(1, "2bw", 2, 4, run_ahead=False) == StageMemory(10, 10, 10, 20, 0, 0)
    assert peak(1, "2bw", 2, 4, data_parallel_size=2) == StageMemory(10, 10, 10, 20, 0, 0)  # never ahead with replicas
    assert peak(1, "1f1b", 2, 4, data_parallel_size=2, shard_optimizer=True) == StageMemory(10, 0, 10, 10, 0, 0)
    assert peak(1, "1f1b", 2, 4, optimizer="sgd") == StageMemory(10, 0, 10, 10, 0, 0)
    assert peak(1, "1f1b", 2, 4, correction_buffers=1.0) == StageMemory(10, 0, 10, 20, 10, 10)  # peaks in the update
    assert peak(1, "2bw", 2, 4).total == 6 * 10 and peak(1, "2bw", 2, 4, data_parallel_size=2).total == 5 * 10


class Plain(PipelineModule):
    """Layers of very different cost and no example batch."""

    def __init__(self, example=None):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8)])
        self.example_input_array = example

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return output.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_and_split(model, precision=None, **strategy):
    data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    trainer = one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, **{"num_stages": 2, **strategy}), steps=1,
                                 **({"precision": precision} if precision else {}))
    trainer.fit(model, data)
    return trainer.strategy.engine.stats.split


def test_the_default_split_is_balanced_by_cost_and_reported_through_the_stats_view():
    split = fit_and_split(Plain(example=torch.zeros(2, 8)))
    # FLOPs per layer, forward + backward (layer 0 computes no input gradient): 512, 768, 6144, 6144.
    assert split.method == "balanced" and split.counts == (3, 1)
    assert split.time_share == pytest.approx((7424 / 13568, 6144 / 13568))
    assert split.imbalance == pytest.approx(2 * 7424 / 13568)
    assert len(split.memory_bytes) == 2 and all(b > 0 for b in split.memory_bytes)
    uniform = fit_and_split(Plain(example=torch.zeros(2, 8)), partition="uniform")
    assert uniform.method == "uniform" and uniform.counts == (2, 2)
    assert uniform.time_share == pytest.approx((1280 / 13568, 12288 / 13568))  # reported for any method


def test_the_setup_report_names_its_memory_figure_a_predicted_peak_of_allocated_tensors_not_process_memory():
    # PipelineMonitor's pipeline/peak_memory_mb is the process's resident set size on CPU: the report must not
    # read as the same quantity.
    from lightning_async_pp.plan.balanced import SplitReport, format_bytes
    from lightning_async_pp.parallel.mesh import describe_layout

    split = fit_and_split(Plain(example=torch.zeros(2, 8)))
    quantity = "predicted peak of allocated tensors per {} (weights, gradients, optimizer state, activations; not " \
               "the process's memory) "
    assert quantity.format("stage") + ", ".join(format_bytes(b) for b in split.memory_bytes) in split.describe()
    tensor_parallel = replace(split, layout=describe_layout(2, 2)).describe()  # each device holds 1/t of a stage
    assert quantity.format("device") in tensor_parallel and quantity.format("stage") not in tensor_parallel
    assert "peak" not in SplitReport("explicit", (3, 3), (), ()).describe()  # nothing costed, nothing predicted


def test_without_an_example_batch_the_split_falls_back_to_parameters_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fit_and_split(Plain())
    assert split.method == "parameters" and split.time_share == ()
    assert any("example_input_array" in str(w.message) and "partition='parameters'" in str(w.message) for w in caught)


class SlowFirst(Plain):
    """Plain with a sleep before its first layer's every forward: that layer is the cheapest in FLOPs and, by far,
    the slowest in time (100 ms against microseconds), on any CPU."""

    def __init__(self, example=None):
        torch.manual_seed(0)
        super().__init__(example)
        self.layers[0].register_forward_pre_hook(lambda module, args: time.sleep(0.1))


def test_measured_layer_cost_splits_by_time_where_flops_miss_the_slow_layer_and_trains_the_same_numbers():
    flops = fit_and_split(SlowFirst(example=torch.zeros(2, 8)))
    assert (flops.counts, flops.cost) == ((3, 1), "flops")  # by FLOPs the sleeping layer costs least
    measured_model = SlowFirst(example=torch.zeros(2, 8))
    measured = fit_and_split(measured_model, layer_cost="measured")
    assert (measured.method, measured.counts, measured.cost) == ("balanced", (1, 3), "measured")
    # Its FLOPs share is 512 / 13568 = 0.04; its measured share is the sleep's, above a half even where a loaded
    # machine stretches the other layers' microseconds to tens of milliseconds.
    assert measured.time_share[0] > 0.5 and "predicted compute share (measured time)" in measured.describe()
    assert len(measured.memory_bytes) == 2  # the memory account is the same one
    # Timing runs the layers on stand-ins: the fit trains exactly what the same split given explicitly trains (the
    # random state is checked directly below: these forwards are reseeded per stage and microbatch anyway).
    explicit_model = SlowFirst(example=torch.zeros(2, 8))
    assert fit_and_split(explicit_model, partition=[1, 3]).cost == "flops"
    for (name, a), b in zip(measured_model.state_dict().items(), explicit_model.state_dict().values()):
        assert torch.equal(a, b), name
    # Any method reports measured shares when asked; one stage measures nothing.
    uniform = fit_and_split(SlowFirst(example=torch.zeros(2, 8)), partition="uniform", layer_cost="measured")
    assert uniform.counts == (2, 2) and uniform.cost == "measured" and uniform.time_share[0] > 0.5
    assert fit_and_split(SlowFirst(example=torch.zeros(2, 8)), layer_cost="measured", num_stages=1).cost == "flops"


def test_resuming_under_another_split_of_as_many_stages_warns_and_names_the_checkpoints_split(tmp_path):
    """The split decides dropout's streams: a resume that splits otherwise (a measured split timed again) says so."""
    data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    first = one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, num_stages=2, partition=[1, 3]),
                               steps=1)
    first.fit(Plain(example=torch.zeros(2, 8)), data)
    first.save_checkpoint(tmp_path / "one.ckpt")
    for partition, warns in (([2, 2], True), ([1, 3], False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, num_stages=2, partition=partition),
                               steps=2).fit(Plain(example=torch.zeros(2, 8)), data, ckpt_path=tmp_path / "one.ckpt")
        named = [w for w in caught if "the checkpoint was trained with [1, 3]" in str(w.message)]
        assert bool(named) == warns, [str(w.message) for w in caught]
        if warns:
            assert "layers per stage [2, 2]" in str(named[0].message) and "partition=[1, 3]" in str(named[0].message)


def test_measured_layer_times_are_taken_under_the_precision_training_computes_in():
    """Under bf16-mixed every forward of the training runs in autocast; so must the forwards that time the layers
    (bf16 kernels take other times than fp32's)."""
    autocast = []
    model = Plain(example=torch.zeros(2, 8))
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda module, args: autocast.append(torch.is_autocast_enabled("cpu"))
                                        if not isinstance(args[0], FakeTensor) else None)
    split = fit_and_split(model, layer_cost="measured", precision="bf16-mixed")
    assert split.cost == "measured"
    trained = 2 * 4  # one step: 2 microbatches through 4 layers
    assert len(autocast) == trained + 4 * 4 and all(autocast), autocast  # timing: a warm-up and 3 runs per layer
    # bf16-true: the example batch reaches the timed layers converted as training batches are (a float sample left in
    # fp32 against bf16 weights made the timing fail and fall back to FLOPs)
    assert fit_and_split(Plain(example=torch.zeros(2, 8)), layer_cost="measured", precision="bf16-true").cost == "measured"


def test_measuring_layer_times_leaves_the_layers_and_the_random_state_untouched():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 8), nn.BatchNorm1d(8))]
    with torch.device("meta"):  # a layer built without memory (configure_model on meta) is timed on random values
        layers.append(nn.Linear(8, 8))
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers[:2]]
    sample = torch.randn(4, 8)
    rng = torch.get_rng_state()
    times = measure_layer_times(layers, sample, lambda batch: batch, lambda out, batch: out.square().mean(),
                                torch.device("cpu"), repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout and the random stand-ins drew on a forked state
    for layer, state in zip(layers, before):
        assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())  # BatchNorm's statistics too
        assert all(p.grad is None for p in layer.parameters())
    assert layers[2].weight.is_meta
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        measure_layer_times(layers, sample, lambda b: b, lambda o, b: o.sum(), torch.device("cpu"), repeats=0)


def test_layer_cost_must_be_flops_or_measured():
    with pytest.raises(ValueError, match=r"Unknown layer_cost 'flop' \(did you mean 'flops'\?\); valid ones are "
                                         r"'flops', 'measured'"):
        AsyncPipelineStrategy(layer_cost="flop")


def test_stage_memory_gib_must_be_a_positive_number():
    with pytest.raises(ValueError, match=r"stage_memory_gib must be None \(no cap\) or a number of GiB > 0, got -1"):
        AsyncPipelineStrategy(stage_memory_gib=-1)


def test_where_memory_is_short_the_last_stage_stops_running_ahead_before_the_split_is_refused():
    # Issue 41, item 5: 2bw's last stage holds a second gradient while it runs the next batch ahead; under a cap that
    # no split meets with it, the split is chosen with one gradient there (and the engine runs without the run-ahead).
    times = [1.0] * 8
    layers = [LayerCost(0, 0, param_bytes=10, activation_bytes=1) for _ in times]
    model = MemoryModel("2bw", 2, 2)

    def memory(i, j, s, mm):
        return stage_memory_bytes(layers, i, j, s, mm)

    # 4 layers each: stage 0 holds 5 parameter-sized copies and, under 2bw's lookahead, 3 microbatches (212);
    # stage 1 6 copies with the run-ahead (240, its second gradient freeing the microbatch), 5 without (204)
    assert stage_peak(layers, 0, 4, 0, model) == StageMemory(40, 40, 40, 80, 0, 3 * 4)
    assert stage_peak(layers, 4, 8, 1, model) == StageMemory(40, 40, 2 * 40, 80, 0, 0)
    assert stage_peak(layers, 4, 8, 1, replace(model, run_ahead=False)) == StageMemory(40, 40, 40, 80, 0, 4)
    counts, used = split_and_run_ahead(times, 2, model, memory=memory, memory_cap=None)
    assert (counts, used.run_ahead) == ([4, 4], True)
    fits_ahead = max(memory(0, 4, 0, model), memory(4, 8, 1, model))
    counts, used = split_and_run_ahead(times, 2, model, memory=memory, memory_cap=fits_ahead)
    assert (counts, used.run_ahead) == ([4, 4], True)
    behind = replace(model, run_ahead=False)
    tight = max(memory(0, 4, 0, behind), memory(4, 8, 1, behind))
    assert tight < fits_ahead and brute_force(times, 2, lambda i, j, s: memory(i, j, s, model), tight) is None
    counts, used = split_and_run_ahead(times, 2, model, memory=memory, memory_cap=tight)
    assert (counts, used.run_ahead) == ([4, 4], False)
    assert stage_peak(layers, 4, 8, 1, used).gradients == stage_peak(layers, 4, 8, 1, model).gradients - 40
    with pytest.raises(ValueError, match="no split"):  # asked for explicitly: refused, not switched off
        split_and_run_ahead(times, 2, model, memory=memory, memory_cap=tight, run_ahead=True)
    # Only 2bw's last stage, with one pipeline, ever runs ahead: elsewhere the choice changes nothing.
    for other in (MemoryModel("1f1b", 2, 2), MemoryModel("2bw", 2, 2, data_parallel_size=2)):
        assert split_and_run_ahead(times, 2, other, memory=memory, memory_cap=tight * 10)[1].runs_ahead(1) is False


def test_last_stage_run_ahead_must_be_none_true_or_false():
    with pytest.raises(ValueError, match=r"last_stage_run_ahead must be None .* True or False, got 'no'"):
        PipelineConfig(last_stage_run_ahead="no")
    assert PipelineConfig(last_stage_run_ahead=False).last_stage_run_ahead is False


def test_a_measured_split_is_timed_once_per_trainer_and_a_later_call_keeps_it(monkeypatch):
    """Issue 54, item 10: a validate after fit on the same Trainer timed the layers again; where noise changed the
    split, it ran on other stages than the fit (a KeyError on the stages' weights, or a silent change)."""
    from lightning_async_pp.plan import timing as timing_module

    timings = iter([[10.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 10.0]])  # the second timing would split (3, 1)
    calls = []

    def noisy(layers, *args, **kwargs):
        calls.append(len(layers))
        return next(timings)

    monkeypatch.setattr(timing_module, "measure_layer_times", noisy)
    data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)
    trainer = one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, num_stages=2,
                                                       layer_cost="measured"), steps=1)
    model = Plain(example=torch.zeros(2, 8))
    trainer.fit(model, data)
    fitted = trainer.strategy.engine.stats.split
    assert fitted.counts == (1, 3) and fitted.cost == "measured"
    trainer.validate(model, data)
    assert trainer.strategy.engine.stats.split == fitted and calls == [4]
    trainer.fit(model, data)  # a further call of the same Trainer: the same split again, untimed
    assert trainer.strategy.engine.stats.split == fitted and calls == [4]


# ---- issue 54, item 4: the account counts what training keeps (checkpointing, autocast, the configured optimizer)
B, D, H = 4, 64, 256  # microbatch rows, model width, hidden width of each block's MLP


class Blocks(PipelineModule):
    """Four MLP blocks (Linear, ReLU, Linear), SGD without momentum unless ``optimizer`` builds another."""

    def __init__(self, optimizer=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(4)])
        self.example_input_array = torch.zeros(B, D)
        self.make_optimizer = optimizer or (lambda named: torch.optim.SGD([p for _, p in named], lr=0.01))

    def pipeline_layers(self):
        return list(self.blocks)

    def pipeline_loss(self, output, batch):
        return output.square().mean()

    def configure_optimizers(self):
        return self.make_optimizer(list(self.named_parameters()))


def block_trainer(model, precision=None, **strategy):
    data = torch.utils.data.DataLoader(torch.randn(2 * B, D), batch_size=2 * B)
    trainer = one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, num_stages=2,
                                                       **{"partition": [2, 2], **strategy}),
                                 steps=1, **({"precision": precision} if precision else {}))
    trainer.fit(model, data)
    return trainer


def test_a_block_keeps_its_input_and_its_relu_output_and_checkpointed_only_its_input():
    """Counted by hand (an independent reference): a later block keeps its input (B x D, for the first Linear's
    weight gradient) and the ReLU's output (B x H, for the ReLU and the second Linear), never its weights again
    (a linear layer saves its weight transposed: a view of the parameter, not an activation); checkpointed, it keeps
    its input only and allocates the rest again in its backward, whose FLOPs then include the forward's."""
    layers = Blocks().pipeline_layers()
    loss = lambda out, batch: out.square().mean()  # noqa: E731
    plain = layer_costs(layers, torch.zeros(B, D), lambda b: b, loss)
    ckpt = layer_costs(layers, torch.zeros(B, D), lambda b: b, loss, checkpointed={1, 2})
    assert plain[1].activation_bytes == plain[2].activation_bytes == 4 * (B * D + B * H)
    assert ckpt[1].activation_bytes == ckpt[2].activation_bytes == 4 * B * D
    assert ckpt[1].transient_bytes == plain[1].activation_bytes and ckpt[0] == plain[0] and ckpt[3] == plain[3]
    assert ckpt[1].backward_flops == plain[1].backward_flops + plain[1].forward_flops
    # under bf16 autocast a Linear keeps bf16 copies of its input and weight, the ReLU its bf16 output; the weight
    # copies are autocast's cached casts, made once per region and weight leaf, shared by the batch's microbatches
    bf16 = layer_costs(layers, torch.zeros(B, D), lambda b: b, loss,
                       context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert bf16[1].activation_bytes == 2 * (B * D + B * H) and bf16[1].cast_bytes == 2 * (D * H + H * D)


def test_the_engine_costs_the_split_with_checkpointing_and_a_cap_it_makes_room_for_is_accepted():
    """With checkpointing on, the engine's predicted peaks drop by the block's kept bytes less its input for
    each microbatch in flight, and a cap that only checkpointing meets is accepted (it was refused, suggesting
    activation checkpointing while it was on)."""
    # under a cap (any cap: the account counts the configured optimizer's state, here SGD's: none)
    off = block_trainer(Blocks(), stage_memory_gib=1.0).strategy.engine.stats.split
    on = block_trainer(Blocks(), activation_checkpointing=True, stage_memory_gib=1.0).strategy.engine.stats.split
    # Stage 0 of 1f1b at m = 2 peaks beside one batch's gradients: off, with one microbatch's two blocks kept (their
    # inputs and ReLU outputs) and its output; on, in the second backward, where the two blocks' inputs and the
    # output are kept and one block's forward is recomputed (its input and ReLU output again).
    kept_off = 2 * 4 * (B * D + B * H) + 4 * B * D
    kept_on = 2 * 4 * B * D + 4 * B * D + 4 * (B * D + B * H)
    assert off.memory_bytes[0] - on.memory_bytes[0] == kept_off - kept_on > 0, (on, off)
    cap = (on.memory_bytes[0] + off.memory_bytes[0]) / 2 / 2**30
    with pytest.raises(ValueError, match="no split"):
        block_trainer(Blocks(), partition="balanced", stage_memory_gib=cap)
    capped = block_trainer(Blocks(), partition="balanced", stage_memory_gib=cap, activation_checkpointing=True)
    assert max(capped.strategy.engine.stats.split.memory_bytes) <= cap * 2**30


def test_the_engine_costs_the_layers_in_the_precisions_autocast():
    seen = []
    model = Blocks()
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu"))
                                        if isinstance(args[0], FakeTensor) else None)
    block_trainer(model, precision="bf16-mixed")
    assert len(seen) == 2 * 4 and all(seen), seen  # under autocast each forward runs twice (to find the casts)


def real_state_bytes(trainer):
    """What the run's optimizers keep per stage after their steps (the reference: real tensors, real steps)."""
    engine = trainer.strategy.engine
    out = []
    for stage in engine.stages:
        mine = {id(p) for p in stage.params}
        out.append(sum(t.numel() * t.element_size() for o in trainer.optimizers for p, state in o.state.items()
                       if id(p) in mine for t in state.values() if isinstance(t, torch.Tensor)))
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "error_feedback_muon"])
def test_the_split_counts_the_optimizer_state_the_configured_optimizer_keeps(optimizer):
    """The account assumed AdamW; now each stage's predicted peak holds what the configured optimizer keeps, as
    a real step leaves it (here: the predicted peak less SGD's, which keeps nothing)."""
    from lightning_async_pp.optim import ErrorFeedback, Muon

    make = {"adamw": lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3),
            "muon": lambda named: Muon(named, lr=1e-3),
            "error_feedback_muon": lambda named: ErrorFeedback(named, optimizer=lambda ps: Muon(ps, lr=1e-3))}[optimizer]
    capped = {"partition": "balanced", "stage_memory_gib": 1.0}  # the split reads it under a cap only
    sgd = block_trainer(Blocks(), **capped).strategy.engine.stats.split
    trainer = block_trainer(Blocks(make), **capped)
    assert trainer.strategy.engine.stats.split.counts == sgd.counts
    predicted = [a - b for a, b in zip(trainer.strategy.engine.stats.split.memory_bytes, sgd.memory_bytes)]
    real = real_state_bytes(trainer)
    assert all(r > 0 for r in real)
    assert predicted == real, (predicted, real)


class CachingLayer(nn.Module):
    """A layer whose forward caches what it computes: on an attribute that was ``None``, in a dict and in a list
    filled in place (as rotary tables and masks are cached)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.table, self.by_length, self.seen = None, {}, []

    def forward(self, x):
        T = x.shape[1]
        if self.table is None:
            self.table = torch.arange(T, device=x.device, dtype=x.dtype)
        if T not in self.by_length:
            self.by_length[T] = torch.arange(T, device=x.device, dtype=x.dtype)
        self.seen.append(x.shape)
        return self.lin(x) + self.table[:, None] + self.by_length[T][:, None]


def test_costing_leaves_a_layer_that_caches_in_its_forward_as_it_was():
    """Issue 54, item 12: costing never changes a module. An attribute set from ``None`` to a tensor was deleted
    (the next forward raised AttributeError) and caches filled in place kept fake tensors (the next forward
    returned one); after costing, the layer's attributes are as before and its forward equals an uncosted copy's."""
    layer, reference = CachingLayer(), CachingLayer()
    batch = torch.randn(2, 5, 8)
    layer_costs([layer], batch, lambda b: b, lambda out, b: out.sum())
    assert layer.table is None and layer.by_length == {} and layer.seen == []
    out = layer(batch)
    assert type(out) is torch.Tensor and torch.equal(out, reference(batch))


def capped_state_bytes(model):
    """Per layer, the optimizer state the split under a cap counts (AdamW: two moments of each parameter)."""
    trainer = block_trainer(model, partition="balanced", stage_memory_gib=1.0)
    return trainer.strategy.engine.optimizer_state_bytes


def test_the_optimizer_state_is_counted_on_the_whole_model_after_a_multi_process_call():
    """After a multi-process call each process's tree holds placeholders for other stages' layers (here: what rank
    1 of 2 keeps); the state was found on that tree, layers outside it counting 0, so the processes chose
    different splits under a cap. Counted on the whole model, every process sees a fresh model's numbers."""
    from lightning_async_pp.parallel.placement import layer_paths, remove_other_stages

    model = Blocks(lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    layers = model.pipeline_layers()
    paths = layer_paths(model, layers)
    object.__setattr__(model, "_pipeline_all_layers", layers)
    object.__setattr__(model, "_pipeline_layer_paths", paths)
    remove_other_stages(model, layers, paths, [0, 0, 1, 1], 1)
    fresh = capped_state_bytes(Blocks(lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3)))
    assert all(n >= 2 * 4 * sum(p.numel() for p in layer.parameters()) for n, layer in zip(fresh, layers))  # 2 moments
    assert capped_state_bytes(model) == fresh


def test_a_weight_tied_within_a_stage_counts_its_optimizer_state_once():
    """Stage 0 holds two blocks sharing one weight: the optimizer keeps one state for it (the reference: what the
    real optimizer holds after its step), not one per block using it."""
    model = Blocks(lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    model.blocks[1][0].weight = model.blocks[0][0].weight
    capped = {"partition": "balanced", "stage_memory_gib": 1.0}
    sgd = Blocks()
    sgd.blocks[1][0].weight = sgd.blocks[0][0].weight
    sgd_split = block_trainer(sgd, **capped).strategy.engine.stats.split
    trainer = block_trainer(model, **capped)
    split = trainer.strategy.engine.stats.split
    assert split.counts == sgd_split.counts == (2, 2)
    real = real_state_bytes(trainer)
    assert [a - b for a, b in zip(split.memory_bytes, sgd_split.memory_bytes)] == real, real


def test_a_weight_tied_within_a_stage_counts_its_bytes_once_in_the_account_against_a_hand_count():
    """Stage 0 holds two blocks sharing their first matrix (D x H): one tensor, one gradient, one pair of AdamW
    moments (the account's rule without a cap). Counted by hand: D * H * 4 bytes less for each of the four than two
    untied blocks; the account counted the shared matrix once per block holding it."""
    from lightning_async_pp.plan.balanced import shared_parameters

    tied = Blocks()
    tied.blocks[1][0].weight = tied.blocks[0][0].weight
    assert shared_parameters(tied.pipeline_layers()) == ((D * H * 4, (0, 1)),)
    untied_split = block_trainer(Blocks()).strategy.engine.stats.split
    tied_split = block_trainer(tied).strategy.engine.stats.split
    assert tied_split.counts == untied_split.counts == (2, 2)
    saved = [a - b for a, b in zip(untied_split.memory_bytes, tied_split.memory_bytes)]
    assert saved == [4 * D * H * 4, 0], saved  # weights, gradient, two moments; stage 1 holds no tie
    # the account's parts, by hand: two blocks of D*H + H + H*D + D parameters, the tied D*H once
    costs = layer_costs(tied.pipeline_layers(), torch.zeros(B, D), lambda x: x, tied.pipeline_loss)
    held = 2 * (D * H + H + H * D + D) - D * H
    peak = stage_peak(costs, 0, 2, 0, MemoryModel("1f1b", 2, 2, param_shared=shared_parameters(tied.pipeline_layers())))
    assert (peak.weights, peak.gradients, peak.optimizer_state) == (held * 4, held * 4, 2 * held * 4)


class CountsConfigureOptimizers(Blocks):
    def __init__(self):
        super().__init__()
        self.calls = []

    def configure_optimizers(self):
        self.calls.append(self.trainer.state.fn.value)
        return super().configure_optimizers()


def test_configure_optimizers_runs_once_in_fit_and_never_in_validate_test_or_predict():
    """The optimizer state is found only where the split reads it (a cap, in fit): configure_optimizers ran a second
    time in each fit and in validate, test and predict (where Lightning never calls it), with its side effects."""
    model = CountsConfigureOptimizers()
    trainer = block_trainer(model)
    data = torch.utils.data.DataLoader(torch.randn(2 * B, D), batch_size=2 * B)
    trainer.validate(model, data, verbose=False)
    fresh = one_device_trainer(AsyncPipelineStrategy("1f1b", num_microbatches=2, num_stages=2, partition="balanced",
                                                     stage_memory_gib=1.0), steps=1)
    fresh.validate(model, data, verbose=False)
    fresh.predict(model, data)
    assert model.calls == ["fit"], model.calls


def test_cached_weight_casts_are_held_once_per_cast_set_alive_and_lightnings_bf16_mixed_keeps_them_per_microbatch():
    """Issue 54, item 4 (review): a cache-enabled autocast caches one cast per weight leaf for one step's region,
    and each batch has its own leaves; under 2bw the lookahead forwards of batch k + 1 run in step k's region (the
    last stage's run-ahead forward too), so two sets are alive there, where the account held one per step. Counted
    by hand, and measured: the bf16 weight copies autograd saves, alive at once, in a real 2-process run with a
    cache-enabled MixedPrecision were 2 per block under 2bw and 1 under 1f1b (m = 4)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    cast = 1000
    costs = [LayerCost(1, 2, 0, 0, cast_bytes=cast)] * 2
    for schedule, sets in (("2bw", 2), ("1f1b", 1), ("gpipe", 1)):
        for stage in range(2):
            peak = stage_peak(costs, stage, stage + 1, stage, MemoryModel(schedule, 2, 4))
            assert peak.activations == sets * cast, (schedule, stage, peak)
    # Lightning's bf16-mixed turns autocast's cache off: every forward casts the weights again and its microbatch
    # keeps its own copies, which the costing finds among what the layer keeps (no cached casts).
    layers = Blocks().pipeline_layers()
    lightning = layer_costs(layers, torch.zeros(B, D), lambda b: b, lambda out, batch: out.square().mean(),
                            context=MixedPrecision("bf16-mixed", "cpu").train_step_context)
    assert lightning[1].cast_bytes == 0
    assert lightning[1].activation_bytes == 2 * (B * D + B * H) + 2 * (D * H + H * D)
