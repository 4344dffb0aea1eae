#!/usr/bin/env python
"""A transformers Llama at SmolLM-135M's width, trained through Lightning on two CPU processes as users run it:
2bw against 1f1b at m = p and m = 2p, with AdamW and with Muon; the planner's prediction from the costs each run
measured; peak memory and 2BW's extra weight version.

    .venv/bin/python benchmarks/realistic_llama.py                 # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/realistic_llama.py --layers 8 --json out.json
    .venv/bin/python benchmarks/realistic_llama.py --memory --optimizers adamw muon muon-ef   # memory, not time

The model: ``LlamaForCausalLM`` through ``models.HuggingFaceCausalLM`` with SmolLM-135M's widths (hidden 576,
9 query / 3 key-value heads, SwiGLU 1536, tied embedding and head), ``--layers`` decoder layers (SmolLM has 30)
and a vocabulary of 8192; batches of ``--batch`` rows of ``--seq`` random tokens, made before training (nothing
is downloaded). ``Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(schedule, m))`` with the
strategy's default partition; threads are as Lightning sets them (one per process on 2 cores).

Each run reports the median step time on rank 0 over the timed steps and, from a trace of those steps, each
stage's mean forward, backward and optimizer span; the planner (``pipeline.simulate``) predicts the step time from
them, without and with the tied embedding's gradient sum (``simulate(tied_stages=...)``, the all-reduce timed
after training): the first and last stage hold the tied weight and sum its gradient before every update, so the
last stage's update waits for the first stage's last backward. Each stage's forward + backward per microbatch is
set against the same layers run on one microbatch in a plain loop after training (both processes at once, as
during training): the engine's cost over a plain loop's at this shape. Peak RSS per rank and the stashed weight
version's bytes (``stats.stash_nbytes``) say what 2BW's second version costs.

``--memory`` runs each configuration under torch's profiler (``profile_memory``) instead, from ``Callback.setup``
(before the stage is materialized) to the end of training: the CPU allocator's peak per process, against the
planner's memory model (``plan.memory.stage_memory``) fed the parameters' bytes, the optimizer's state by its
rule, and what one microbatch through the process's layers and one optimizer step hold in a plain loop.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import (  # noqa: E402
    StepClock, one_thread_env, others_cpu, peak_rss_mib, run_ranks, span_costs, total_steps, transfer_seconds,
    wall_time_line, write_json,
)

one_thread_env()  # on CPU one thread per process in the runs this starts (Lightning's ranks)

STAGES = 2
SMOLLM_WIDTHS = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)


def llama_config(cfg: dict) -> dict:
    return dict(model_type="llama", vocab_size=cfg["vocab"], num_hidden_layers=cfg["layers"],
                max_position_embeddings=cfg["seq"], tie_word_embeddings=not cfg.get("untied"), **SMOLLM_WIDTHS)


def model_and_data(cfg: dict) -> tuple[Any, Any]:
    """The model (AdamW or Muon in ``configure_optimizers``) and a loader of batches made in advance."""
    from torch.utils.data import DataLoader, Dataset

    from lightning_async_pp.models import HuggingFaceCausalLM
    from lightning_async_pp.optim import ErrorFeedback, Muon

    class Model(HuggingFaceCausalLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            if cfg["optimizer"] == "muon":
                return Muon(self.named_parameters(), lr=3e-3, weight_decay=0.1)
            if cfg["optimizer"] == "muon-ef":
                return ErrorFeedback(self.named_parameters(), optimizer=partial(Muon, lr=3e-3, weight_decay=0.1))
            return super().configure_optimizers()  # AdamW, decay on matrices only

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=generator)
               for _ in range(total_steps(cfg))]

    class Batches(Dataset):
        def __len__(self) -> int:
            return len(batches)

        def __getitem__(self, i: int) -> Any:
            return batches[i]

    return Model(config=llama_config(cfg), lr=3e-3), DataLoader(Batches(), batch_size=None)


def smollm_shape(layers: int, vocab: int, seq: int) -> Any:
    """The planner's ``Shape`` of the model this benchmark trains: SmolLM-135M's widths, ``layers`` deep."""
    from lightning_async_pp.plan import Shape

    return Shape(hidden=SMOLLM_WIDTHS["hidden_size"], layers=layers, heads=SMOLLM_WIDTHS["num_attention_heads"],
                 kv_heads=SMOLLM_WIDTHS["num_key_value_heads"], intermediate=SMOLLM_WIDTHS["intermediate_size"],
                 vocab=vocab, seq_len=seq)


def train_flops_per_token(cfg: dict) -> float:
    """Forward + backward FLOPs per token (3x the forward's: the planner's shape formulas)."""
    shape = smollm_shape(cfg["layers"], cfg["vocab"], cfg["seq"])
    return 3.0 * (shape.layers * (shape.attention_flops() + shape.mlp_flops()) + shape.head_flops())


def one_device_child(cfg: dict, out_dir: str) -> None:
    """On one device: plain Lightning (``schedule == "plain"``: no strategy, the whole batch at once) or the
    strategy's one-device emulation of ``STAGES`` stages; step time, tokens/s, MFU, peak memory."""
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    device = torch.device("cuda", 0) if cfg["accelerator"] == "cuda" else None

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.clock = StepClock(cfg, device)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.clock.tick()

    clock = Clock()
    plain = cfg["schedule"] == "plain"
    strategy = "auto" if plain else AsyncPipelineStrategy(schedule=cfg["schedule"], num_microbatches=cfg["m"],
                                                          num_stages=STAGES)
    model, loader = model_and_data(cfg)
    trainer = L.Trainer(
        strategy=strategy, accelerator=cfg["accelerator"], devices=1, precision=cfg["precision"],
        max_steps=total_steps(cfg), callbacks=[clock], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, loader)
    result = {**cfg, "rank": 0, **clock.clock.result()}
    tokens = cfg["batch"] * cfg["seq"]
    result["tokens_per_s"] = tokens / result["sec_per_step"]
    result["tflops"] = result["tokens_per_s"] * train_flops_per_token(cfg) / 1e12
    result["mfu"] = result["tflops"] / cfg["peak_tflops"] if cfg.get("peak_tflops") else None
    Path(out_dir, "rank0.json").write_text(json.dumps(result))


def two_process_trainer(cfg: dict, callback: Any) -> Any:
    """The Trainer of the two-process runs: the strategy's default partition unless ``--partition`` names another,
    nothing but ``callback`` added."""
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    return L.Trainer(
        strategy=AsyncPipelineStrategy(schedule=cfg["schedule"], num_microbatches=cfg["m"],
                                       partition=cfg.get("partition") or "balanced"),
        accelerator="cpu", devices=STAGES, max_steps=total_steps(cfg), callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )


def keep_stage_input(trainer: Any, pl_module: Any, holder: Any) -> Any:
    """Keep in ``holder.input`` a copy of the first training input that reaches this process's first layer (the
    tokens on the first stage, the received activation on the others); returns the hook's handle."""
    first = pl_module.pipeline_layers()[trainer.strategy.engine.own_layer_indices()[0]]

    def keep(module: Any, args: tuple) -> None:
        if holder.input is None and torch.is_grad_enabled():
            holder.input = torch.utils._pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, args[0])

    return first.register_forward_pre_hook(keep)


def own_layers_and_loss(model: Any, engine: Any, loader: Any, cfg: dict, rank: int) -> tuple[list, Any]:
    """This process's layers and, on the last stage, the loss on the first microbatch: what the plain loop runs."""
    microbatch = next(iter(loader))[: cfg["batch"] // cfg["m"]]
    layers = [model.pipeline_layers()[i] for i in engine.own_layer_indices()]
    return layers, (lambda out: model.pipeline_loss(out, microbatch)) if rank == STAGES - 1 else None


def leaf_input(x: Any) -> Any:
    """A fresh copy of a stage's input whose floating tensors are leaves that need a gradient, as received ones do."""
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t, x)


def forward_through(layers: list, x: Any, loss: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x if loss is None else loss(x)


def backward_from(out: Any) -> None:
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def plain_microbatch_seconds(layers: list, x: Any, loss: Any, rounds: int = 5) -> float:
    """One microbatch's forward and backward through ``layers`` (and ``loss``) in a plain loop: the median of
    ``rounds`` after one warm-up, each started at a barrier so the other process runs its own beside it, as during
    training. The engine's forward + backward spans per microbatch are set against it."""
    x = leaf_input(x)
    times = []
    for _ in range(rounds + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        backward_from(forward_through(layers, x, loss))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def child(cfg: dict, out_dir: str) -> None:
    """One Lightning run (rank 0 here; Lightning re-executes this script for rank 1)."""
    if cfg.get("one_device"):
        one_device_child(cfg, out_dir)
        return
    if cfg.get("memory"):
        memory_child(cfg, out_dir)
        return
    import lightning as L

    class Clock(L.Callback):
        """Step ends, and a trace of the timed steps (the planner's inputs)."""

        def __init__(self) -> None:
            self.clock = StepClock(cfg)
            self.times: list[Any] = []
            self.spans: list[Any] = []
            self.prof = cProfile.Profile(time.perf_counter) if cfg.get("profile") else None
            self.input: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.hook = keep_stage_input(trainer, pl_module, self)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.hook.remove()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            engine = trainer.strategy.engine
            if self.clock.in_window():
                self.times.append(engine.stats.last_times)
            self.clock.tick()
            if len(self.clock.stamps) == self.clock.first + 1:
                engine.start_trace()
                if self.prof is not None:
                    self.prof.enable()
            elif len(self.clock.stamps) == self.clock.last + 1:
                self.spans = engine.stop_trace()
                if self.prof is not None:
                    self.prof.disable()
                    self.prof.dump_stats(Path(cfg["profile"], f"{cfg['optimizer']}-m{cfg['m']}-{cfg['schedule']}-"
                                                                f"rank{trainer.global_rank}.prof"))

    clock = Clock()
    trainer = two_process_trainer(cfg, clock)
    model, loader = model_and_data(cfg)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    stats = trainer.strategy.engine.stats
    layers, loss = own_layers_and_loss(model, trainer.strategy.engine, loader, cfg, rank)
    plain = plain_microbatch_seconds(layers, clock.input, loss)
    # One activation crossing the boundary: (rows per microbatch, seq, hidden) float32, here as a 2-D tensor.
    transfer = transfer_seconds(rank, cfg["batch"] // cfg["m"] * cfg["seq"], SMOLLM_WIDTHS["hidden_size"], rounds=10)
    tied = torch.zeros(cfg["vocab"] * SMOLLM_WIDTHS["hidden_size"])  # the embedding tied to the head, fp32 (timed
    # even when --untied: the planner's tied column then says what a tie would cost)
    sums = []
    for _ in range(5):
        torch.distributed.barrier()
        start = time.perf_counter()
        torch.distributed.all_reduce(tied)
        sums.append(time.perf_counter() - start)
    times = clock.times
    result = {
        **cfg, "rank": rank, **clock.clock.result(), "transfer_s": transfer, "tied_reduce_s": statistics.median(sums),
        "costs": span_costs(clock.spans, rank, cfg["steps"]), "plain_microbatch_s": plain,
        "times": {k: statistics.fmean(getattr(t, k) for t in times) for k in ("total", "compute", "comm_wait", "optimizer", "tied_sum")},
        "stash_mib": stats.stash_nbytes / 2**20,
        "params_mib": sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters()) / 2**20,
        "peak_rss_mib": peak_rss_mib(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def allocator_bytes(prof: Any) -> tuple[int, int]:
    """Net and peak bytes torch's CPU allocator handed out while ``prof`` (``profile_memory=True``) recorded: its
    memory events (+ allocation, - free) summed in time order."""
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:  # the profiler's result object moved: this benchmark must follow it
        raise RuntimeError(f"torch {torch.__version__}'s profiler has no kineto_results: update allocator_bytes()")
    net = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]"):
        net += nbytes
        peak = max(peak, net)
    return net, peak


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def one_microbatch(layers: list, x: Any, loss: Any) -> tuple[int, int]:
    """What one microbatch holds through ``layers`` in a plain loop (the memory model's inputs): what its forward
    keeps for the backward (its input, output and saved tensors) and the peak of its forward and backward, the
    gradients it allocates included (none if the parameters have them already: then its accumulation counts)."""
    from torch.profiler import ProfilerActivity, profile

    x = leaf_input(x)
    held = tensor_bytes(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward_through(layers, x, loss)
    saved, forward_peak = allocator_bytes(prof)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backward_from(out)
        del out
    _, backward_peak = allocator_bytes(prof)
    return held + saved, held + max(forward_peak, saved + backward_peak)


def memory_child(cfg: dict, out_dir: str) -> None:
    """One Lightning run under torch's profiler (``profile_memory``, from ``Callback.setup``, before the stage is
    materialized): the allocator's peak over the whole fit, what holds memory after it, and one microbatch through
    this process's layers in a plain loop."""
    import lightning as L
    from torch.profiler import ProfilerActivity, profile

    from lightning_async_pp.optim.error_feedback import PREV_UPDATE

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.input: Any = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.prof.start()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.hook = keep_stage_input(trainer, pl_module, self)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.prof.stop()
            self.hook.remove()

    recorder = Recorder()
    trainer = two_process_trainer(cfg, recorder)
    model, loader = model_and_data(cfg)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    _, peak = allocator_bytes(recorder.prof)
    engine = trainer.strategy.engine
    params = [p for view in engine.stats.stages for p in view.params]
    optimizer = trainer.optimizers[0]
    state = {id(p): entry for p, entry in optimizer.state.items()}
    correction = sum(tensor_bytes(entry.get(PREV_UPDATE)) for entry in state.values())
    # What the optimizer's rule says it keeps: AdamW two moments per parameter, Muon's matrices one (its momentum),
    # ErrorFeedback one more per parameter.
    rule = sum((1 if group.get("use_muon") else 2) * tensor_bytes(p) for group in optimizer.param_groups
               for p in group["params"] if id(p) in state)
    layers, loss = own_layers_and_loss(model, engine, loader, cfg, rank)
    for p in params:
        p.grad = None
    saved, first_working = one_microbatch(layers, recorder.input, loss)  # the step's first: allocates the gradients
    _, working = one_microbatch(layers, recorder.input, loss)  # a later one: accumulates into them
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()  # its transient copies (the gradients exist; its state already does)
    update = allocator_bytes(prof)[1]
    result = {
        **cfg, "rank": rank, "allocator_peak": peak, "peak_rss_mib": peak_rss_mib(),
        "weights": tensor_bytes(params), "stash": engine.stats.stash_nbytes,
        "optimizer_state": sum(tensor_bytes(entry) for entry in state.values()) - correction,
        "optimizer_state_rule": rule, "correction": correction,
        "correction_rule": tensor_bytes(params) if cfg["optimizer"].endswith("-ef") else 0,
        "saved": saved, "working": working, "first_working": first_working,
        "update": update, "pipeline_layers": len(layers),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def memory_predict(pair: list[dict]) -> list[dict]:
    """The memory model (``plan.memory.stage_memory``) for each rank, from the schedule's simulated timeline,
    the parameters' bytes, the optimizer's rule and what the plain loop's microbatch and optimizer step held."""
    from lightning_async_pp.plan.memory import stage_memory
    from lightning_async_pp.pipeline.simulate import simulate

    r0 = pair[0]
    result = simulate(r0["schedule"], STAGES, r0["m"], [1.0] * STAGES, [2.0] * STAGES)  # memory needs the order only
    return [stage_memory(result, r["rank"], weight_bytes=r["weights"], saved_bytes=r["saved"],
                         working_bytes=r["working"], first_working_bytes=r["first_working"],
                         optimizer_state_bytes=r["optimizer_state_rule"], correction_bytes=r["correction_rule"],
                         update_bytes=r["update"]).as_dict() | {"in_flight": result.peak_activations[r["rank"]]}
            for r in pair]


def shape_model(pair: list[dict], args: argparse.Namespace) -> list[Any]:
    """The planner's memory table from the shape alone (``plan.device_memory``: no measured input), each rank's
    decoder layers as the run split them (the embedding with the first, the final norm and the head with the
    last): what ``lightning-async-pp-plan`` prints for this shape and split."""
    from lightning_async_pp.plan import device_memory
    from lightning_async_pp.pipeline.simulate import simulate

    r0 = pair[0]
    shape = smollm_shape(args.layers, args.vocab, args.seq)
    counts = [r["pipeline_layers"] - (r["rank"] == 0) - 2 * (r["rank"] == STAGES - 1) for r in pair]
    result = simulate(r0["schedule"], STAGES, r0["m"], [1.0] * STAGES, [2.0] * STAGES)
    return device_memory(shape, counts, result, tokens=args.batch // r0["m"] * args.seq, value_bytes=4, param_bytes=4,
                         optimizer=r0["optimizer"].removesuffix("-ef"), correction_buffers=float(r0["optimizer"].endswith("-ef")))


def memory_report(rows: list[dict], args: argparse.Namespace) -> str:
    mib = 2**20
    lines = [
        f"## Memory per process: HF Llama at SmolLM-135M's width, {args.layers} layers, vocabulary {args.vocab} "
        f"({'head of its own' if args.untied else 'tied'}), {args.batch} x {args.seq} tokens per step, {STAGES} "
        f"CPU processes through Lightning\n",
        "Measured: the CPU allocator's peak over the whole fit (torch's profiler, `profile_memory`, from "
        "`Callback.setup`), and what holds memory after it (the stage's parameters, `stats.stash_nbytes`, the "
        "optimizer's state tensors). Model: `plan.memory.stage_memory` from the simulated in-flight "
        "timeline, the parameters, the optimizer's rule (AdamW 2, Muon's matrices 1, ErrorFeedback +1 per "
        "parameter) and what one microbatch through the process's layers in a plain loop holds (what it keeps / its "
        "peak with the gradients there / its peak allocating them) and one optimizer step's transient peak. *gradients*, *activations*: what "
        "the model holds at its peak. MiB.\n",
        "| optimizer | m | schedule | rank | weights | versions (model / stash) | gradients (model) | optimizer state "
        "(model / held) | correction (model / held) | in flight | microbatch keeps / peak / first peak | update "
        "transient | activations (model) "
        "| model total | allocator peak | model / measured | peak RSS |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for x, model in zip(r["pair"], r["model"]):
            lines.append(
                f"| {r['optimizer']} | {r['m']} | {r['schedule']} | {x['rank']} | {x['weights'] / mib:.0f} | "
                f"{model['versions'] / mib:.0f} / {x['stash'] / mib:.0f} | {model['gradients'] / mib:.0f} | "
                f"{model['optimizer_state'] / mib:.0f} / {x['optimizer_state'] / mib:.0f} | "
                f"{model['correction'] / mib:.0f} / {x['correction'] / mib:.0f} | {model['in_flight']} | "
                f"{x['saved'] / mib:.0f} / {x['working'] / mib:.0f} / {x['first_working'] / mib:.0f} | "
                f"{x['update'] / mib:.0f} | {model['activations'] / mib:.0f} | "
                f"{model['total'] / mib:.0f} | {x['allocator_peak'] / mib:.0f} | "
                f"{model['total'] / x['allocator_peak']:.3f} | {x['peak_rss_mib']:.0f} |")
    if all("pipeline_layers" in x for r in rows for x in r["pair"]):
        lines += ["", "From the shape alone: `lightning-async-pp-plan`'s memory table (`plan.device_memory`: the "
                  "shape's per-layer parameters and activations, fp32, the optimizer's state by its rule, "
                  "ErrorFeedback's buffer and its update's copy per parameter, no measured input) against the "
                  "allocator's peak, MiB:", "",
                  "| optimizer | m | schedule | rank | activations (shape) | total (shape) | allocator peak | "
                  "shape / measured |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            for x, shaped in zip(r["pair"], shape_model(r["pair"], args)):
                lines.append(f"| {r['optimizer']} | {r['m']} | {r['schedule']} | {x['rank']} | "
                             f"{shaped.activations / mib:.0f} | {shaped.total / mib:.0f} | "
                             f"{x['allocator_peak'] / mib:.0f} | {shaped.total / x['allocator_peak']:.3f} |")
    lines += ["", "2bw's extra over 1f1b (allocator peak, measured / model), MiB:", "",
              "| optimizer | m | rank 0 | rank 1 |", "|---|---:|---:|---:|"]
    for opt, m, r, other in schedule_pairs(rows):
        cells = [f"{(a['allocator_peak'] - b['allocator_peak']) / mib:+.0f} / {(ma['total'] - mb['total']) / mib:+.0f}"
                 for a, b, ma, mb in zip(r["pair"], other["pair"], r["model"], other["model"])]
        lines.append(f"| {opt} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def schedule_pairs(rows: list[dict]) -> Any:
    """Each (optimizer, m) measured under both 2bw and 1f1b: ``(optimizer, m, 2bw's row, 1f1b's row)``."""
    index = {(r["optimizer"], r["m"], r["schedule"]): r for r in rows}
    for (opt, m, schedule), r in index.items():
        other = index.get((opt, m, "1f1b"))
        if schedule == "2bw" and other is not None:
            yield opt, m, r, other


def run(cfg: dict, timeout: float) -> list[dict]:
    """One Lightning run (this script's ``--child``); each rank's result."""
    return run_ranks([os.path.abspath(__file__), "--child", json.dumps(cfg)], "rank*.json", f"run {cfg}", timeout,
                     ranks=1 if cfg.get("one_device") else STAGES)


def one_device_report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"## HF Llama at SmolLM-135M's width on one {args.accelerator} device: {args.layers} layers, vocabulary "
        f"{args.vocab}, {args.batch} x {args.seq} tokens per step, precision {args.precision}, optimizer "
        f"{', '.join(args.optimizers)}\n",
        f"Plain Lightning (no strategy, the whole batch at once) against the strategy's one-device emulation of "
        f"{STAGES} stages (the same updates as on {STAGES} devices, no transfers). MFU against "
        f"{args.peak_tflops or '-'} TFLOP/s; FLOPs per token from the planner's shape formulas (3x forward).\n",
        "| optimizer | system | m | s/step (median) | tokens/s | TFLOP/s | MFU | x plain | peak memory MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = {r["optimizer"]: r["pair"][0] for r in rows if r["schedule"] == "plain"}
    for r in rows:
        x = r["pair"][0]
        base = plain.get(r["optimizer"])
        memory = x.get("cuda_peak_mib", x["rss_mib"])
        mfu = f"{x['mfu']:.1%}" if x["mfu"] is not None else "-"
        speed = f"{base['sec_per_step'] / x['sec_per_step']:.2f}" if base else "-"
        lines.append(f"| {r['optimizer']} | {r['schedule']} | {r['m'] if r['schedule'] != 'plain' else '-'} | "
                     f"{x['sec_per_step']:.4f} | {x['tokens_per_s']:,.0f} | {x['tflops']:.2f} | {mfu} | {speed} | "
                     f"{memory:.0f} |")
    return "\n".join(lines)


def predict(pair: list[dict]) -> dict:
    """The planner's step time from the costs the run measured (each stage's mean forward, backward and optimizer
    spans, the transfer time): without the tied embedding, and with it (the first and last stage sum its gradient
    before every update, in the all-reduce time measured after training)."""
    from lightning_async_pp.pipeline.simulate import simulate

    r0 = pair[0]
    schedule, m = r0["schedule"], r0["m"]
    fwd = [r["costs"]["forward_s"] for r in pair]
    bwd = [r["costs"]["backward_s"] for r in pair]
    opt = [r["costs"]["optimizer_s"] for r in pair]
    comm = max(r["transfer_s"] for r in pair)
    untied = simulate(schedule, STAGES, m, fwd, bwd, comm_s=comm, optimizer_s=opt)
    tied = simulate(schedule, STAGES, m, fwd, bwd, comm_s=comm, optimizer_s=opt, tied_stages=(0, STAGES - 1),
                    tied_reduce_s=max(r["tied_reduce_s"] for r in pair))
    return {"untied_s": untied.step_time_s, "tied_s": tied.step_time_s}


def report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"## HF Llama at SmolLM-135M's width: {args.layers} layers, vocabulary {args.vocab} "
        f"({'head of its own' if args.untied else 'tied embedding and head'}), {args.batch} x "
        f"{args.seq} tokens per step, {STAGES} CPU processes through Lightning\n",
        "| optimizer | m | schedule | s/step (median) | fwd / bwd per microbatch, stage 0 (ms) | stage 1 (ms) "
        "| engine fwd + bwd / plain loop's (stage 0 / 1) | optimizer (ms, stage 0 / 1) | tied sum (ms, stage 0 / 1) | planner, untied | planner, tied "
        "| peak RSS MiB (rank 0 / 1) "
        "| stashed version MiB (rank 0 / 1) | others' CPU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def overhead(x: dict) -> str:  # the engine's compute per microbatch over the plain loop's on the same layers
        return f"{(x['costs']['forward_s'] + x['costs']['backward_s']) / x['plain_microbatch_s']:.3f}"

    for r in rows:
        p0, p1 = r["pair"]
        c0, c1 = p0["costs"], p1["costs"]
        measured = p0["mean_sec_per_step"]
        pred = r["predicted"]
        lines.append(
            f"| {r['optimizer']} | {r['m']} | {r['schedule']} | {p0['sec_per_step']:.2f} | "
            f"{c0['forward_s'] * 1e3:.0f} / {c0['backward_s'] * 1e3:.0f} | {c1['forward_s'] * 1e3:.0f} / "
            f"{c1['backward_s'] * 1e3:.0f} | {overhead(p0)} / {overhead(p1)} | {c0['optimizer_s'] * 1e3:.0f} / {c1['optimizer_s'] * 1e3:.0f} | "
            f"{p0['times']['tied_sum'] * 1e3:.0f} / {p1['times']['tied_sum'] * 1e3:.0f} | "
            f"{pred['untied_s']:.2f} ({pred['untied_s'] / measured - 1:+.0%}) | "
            f"{pred['tied_s']:.2f} ({pred['tied_s'] / measured - 1:+.0%}) | "
            f"{p0['peak_rss_mib']:.0f} / {p1['peak_rss_mib']:.0f} | {p0['stash_mib']:.0f} / {p1['stash_mib']:.0f} | "
            f"{others_cpu(r['pair']):.0%} |")
    lines += ["", "Predictions are against the mean step over the timed steps (in brackets: predicted / measured - 1).", "",
              "| optimizer | m | 2bw / 1f1b (speed-up, medians) | target | 2bw - 1f1b peak RSS, rank 0 / 1 (MiB) "
              "| stashed version, rank 0 / 1 (MiB) |", "|---|---:|---:|---|---:|---:|"]
    for opt, m, r, other in schedule_pairs(rows):
        a, b = r["pair"], other["pair"]
        lines.append(f"| {opt} | {m} | {b[0]['sec_per_step'] / a[0]['sec_per_step']:.2f}x | >= 1.1 | "
                     f"{a[0]['peak_rss_mib'] - b[0]['peak_rss_mib']:+.0f} / {a[1]['peak_rss_mib'] - b[1]['peak_rss_mib']:+.0f} | "
                     f"{a[0]['stash_mib']:.0f} / {a[1]['stash_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (SmolLM-135M has 30)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="rows per step")
    ap.add_argument("--untied", action="store_true", help="a head of its own instead of SmolLM's tied embedding")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4], help="m (p = 2: m = p and m = 2p)")
    ap.add_argument("--schedules", nargs="+", choices=["plain", "2bw", "1f1b", "gpipe"],
                    help="default: 2bw 1f1b (--one-device: plain 2bw 1f1b)")
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "muon"], choices=["adamw", "muon", "muon-ef"],
                    help="muon-ef: ErrorFeedback(Muon)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--one-device", action="store_true",
                    help=f"on one device: plain Lightning against the strategy's emulation of {STAGES} stages "
                         f"(--schedules may include 'plain'; default: plain 2bw 1f1b)")
    ap.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu", help="with --one-device (default cpu)")
    ap.add_argument("--precision", default="32-true", help="with --one-device: the Trainer's precision, e.g. bf16-true")
    ap.add_argument("--peak-tflops", type=float, help="with --one-device: the device's peak, for MFU (H200 bf16: 989)")
    ap.add_argument("--memory", action="store_true",
                    help="instead of timing: each process's memory, measured and by the planner's memory model")
    ap.add_argument("--partition", type=lambda v: [int(c) for c in v.split(",")] if v[0].isdigit() else v,
                    default=None, help="the strategy's partition: balanced (default), parameters, uniform, or "
                                       "layers per stage as 4,2 (the embedding and the head count as layers)")
    ap.add_argument("--json", help="also write every measurement to this file")
    ap.add_argument("--profile", help="write each rank's cProfile (wall clock) of the timed steps into this folder")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child), args.out_dir)
        return
    if args.schedules is None:
        args.schedules = ["plain", "2bw", "1f1b"] if args.one_device else ["2bw", "1f1b"]
    if "plain" in args.schedules and not args.one_device:
        ap.error("'plain' (no strategy) is measured with --one-device only")
    if not args.one_device and (args.accelerator != "cpu" or args.precision != "32-true" or args.peak_tflops):
        ap.error("--accelerator, --precision and --peak-tflops need --one-device (the two-process runs are fp32, "
                 "gloo on CPU)")
    if args.memory and (args.one_device or args.profile):
        ap.error("--memory measures the two-process runs under torch's profiler: drop --one-device and --profile")
    if args.one_device and args.profile:
        ap.error("--profile profiles the two-process runs; drop --one-device or --profile")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: torch.cuda.is_available() is False")
    for m in args.microbatches:
        if m < 1 or args.batch % m:
            ap.error(f"--batch {args.batch} must split into m={m} equal microbatches")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.layers < STAGES - 1 or args.steps < 2 or args.warmup < 1:
        ap.error(f"need --layers >= {STAGES - 1}, --steps >= 2 and --warmup >= 1")
    started = time.perf_counter()
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for opt in args.optimizers:
        for m in args.microbatches:
            for schedule in args.schedules:
                if schedule == "plain" and m != args.microbatches[0]:
                    continue  # plain Lightning does not split the batch
                cfg = dict(layers=args.layers, vocab=args.vocab, seq=args.seq, batch=args.batch, m=m,
                           schedule=schedule, optimizer=opt, steps=args.steps, warmup=args.warmup,
                           profile=os.path.abspath(args.profile) if args.profile else None,
                           one_device=args.one_device, accelerator=args.accelerator, precision=args.precision,
                           peak_tflops=args.peak_tflops, untied=args.untied, memory=args.memory,
                           partition=args.partition)
                pair = run(cfg, timeout=1200)
                rows.append({"optimizer": opt, "m": m, "schedule": schedule, "pair": pair})
                if args.memory:
                    rows[-1]["model"] = memory_predict(pair)
                    print(f"  {opt:<7} m={m} {schedule:<4} allocator peak "
                          + ", ".join(f"{x['allocator_peak'] / 2**20:.0f}" for x in pair) + " MiB, model "
                          + ", ".join(f"{y['total'] / 2**20:.0f}" for y in rows[-1]["model"]) + " MiB", flush=True)
                    continue
                if args.one_device:
                    print(f"  {opt:<5} m={m} {schedule:<5} {pair[0]['sec_per_step']:.4f} s/step, "
                          f"{pair[0]['tokens_per_s']:,.0f} tokens/s", flush=True)
                    continue
                rows[-1]["predicted"] = predict(pair)
                print(f"  {opt:<5} m={m} {schedule:<4} {pair[0]['sec_per_step']:.2f} s/step, predicted "
                      f"{rows[-1]['predicted']['untied_s']:.2f} untied / {rows[-1]['predicted']['tied_s']:.2f} tied",
                      flush=True)
    print()
    print(one_device_report(rows, args) if args.one_device else memory_report(rows, args) if args.memory
          else report(rows, args))
    print(wall_time_line(started, "wall time"))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
