"""The systems ``pipeline_throughput.py`` measures, each one step per ``step(i)``, and the processes they run in:
the plain loop in one process (:class:`PlainLoop`: the baseline, and the two-independent-processes ceiling),
``torch.distributed.pipelining``'s schedules (:class:`TorchLoop`), this package's bare engine
(:class:`EngineLoop`), and ``Trainer(strategy=AsyncPipelineStrategy(...))`` (:func:`lightning_child`, this
benchmark's script started again with ``--child lightning``)."""
from __future__ import annotations

import cProfile
import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness
from benchmarks.harness import StepClock, block_median, in_turn, median_gap, one_thread, run_ranks, spawn_pair
from benchmarks.throughput.profiling import _mean_times, _profile_summary, _profile_text, _times_dict, _TorchSplit
from benchmarks.throughput.workload import (
    DEPTH, STAGES, TORCH_MULTI_STAGE, TORCH_SCHEDULES, device_of, make_batches, make_layers, make_optimizer, mse,
    setup_threads, stage_layers, total_steps,
)

#: The script Lightning's runs start (``--child lightning``) and re-execute for rank 1.
SCRIPT = Path(__file__).resolve().parents[1] / "pipeline_throughput.py"


# ---------------------------------------------------------------------------------------------------------------
# One process: the baseline, and the two-independent-processes ceiling.
# ---------------------------------------------------------------------------------------------------------------


class PlainLoop:
    """The whole model in this process, one step per :meth:`step`: the whole batch at once, or (``microbatched``)
    as the pipeline splits it, accumulating the microbatch gradients; the latter has the pipeline's matrix shapes,
    so twice its rate is what two stages could reach with no overhead at all. ``split`` also cuts each
    microbatch's autograd graph where the stages meet (a detached input, two backward calls), as every pipeline
    must: what that costs alone. ``split_backward`` (with ``split``) also splits the last stage's backward in an
    input pass and a weight pass, with the package's ``backward_input`` / ``backward_weight`` (torch's graph
    surgery), as zb_h1 does; the first stage's input is data, so its backward stays whole there too."""

    def __init__(self, cfg: dict, device: torch.device, microbatched: bool = False, split: bool = False,
                 split_backward: bool = False) -> None:
        self.model = nn.Sequential(*make_layers(cfg["width"])).to(device)
        self.opt = make_optimizer(self.model.parameters(), cfg["optimizer"])
        self.batches = make_batches(cfg, device)
        self.parts = cfg["m"] if microbatched else 1
        self.split = split or split_backward
        self.split_backward = split_backward
        if split_backward:
            from lightning_async_pp.pipeline.backward import backward_input, backward_weight

            self.backward_input, self.backward_weight = backward_input, backward_weight

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        self.opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(self.parts), y.chunk(self.parts)):
            if not self.split:
                (mse(self.model(xs), ys) / self.parts).backward()
                continue
            cut = DEPTH // STAGES
            h = self.model[:cut](xs)
            received = h.detach().requires_grad_()
            loss = mse(self.model[cut:](received), ys) / self.parts
            if not self.split_backward:
                loss.backward()
                h.backward(received.grad)
                continue
            pending = self.backward_input([loss], [None], [received], list(self.model[cut:].parameters()))
            h.backward(received.grad)
            self.backward_weight(pending)
        self.opt.step()


def run_single(cfg: dict, microbatched: bool = False, rank: int = 0) -> dict:
    """:class:`PlainLoop` over every batch, timed."""
    setup_threads(cfg)
    device = device_of(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # in a spawned process of the ceiling, nothing lands on another rank's GPU
    loop = PlainLoop(cfg, device, microbatched)
    clock = StepClock(cfg, device)
    for i in range(len(loop.batches)):
        loop.step(i)
        clock.tick()
    return clock.result()


def _single_worker(rank: int, cfg: dict, out_dir: str) -> None:
    result = run_single(cfg, rank=rank)
    Path(out_dir, f"single{rank}.json").write_text(json.dumps(result))



def run_ceiling(cfg: dict, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_pair(_single_worker, (cfg, out_dir), timeout, STAGES)
        return [json.loads(Path(out_dir, f"single{r}.json").read_text()) for r in range(STAGES)]



# ---------------------------------------------------------------------------------------------------------------
# Spawned process pairs (torch.distributed.pipelining, the bare engine), each bounded by a timeout.
# ---------------------------------------------------------------------------------------------------------------


def init_group(rank: int, port: int, cfg: dict) -> None:
    """gloo on CPU; NCCL on CUDA, this rank on GPU ``rank`` (NCCL needs one GPU per rank)."""
    backend = "nccl" if cfg["accelerator"] == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES, timeout=timedelta(seconds=120)
    )


class TorchLoop:
    """``torch.distributed.pipelining``'s schedule ``cfg["schedule"]`` over ``PipelineStage``s on ``group`` (the
    default one when ``None``), this rank's part, one step per :meth:`step`. A multi-stage schedule holds two
    stages per rank, each a quarter of the same layers: the same model and work per rank."""

    def __init__(self, cfg: dict, rank: int, device: torch.device, group: Any = None) -> None:
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        cls = getattr(pipelining, cfg["schedule"])
        layers = make_layers(cfg["width"])
        if cfg["schedule"] in TORCH_MULTI_STAGE:
            held = TORCH_MULTI_STAGE[cfg["schedule"]](rank)
            per = DEPTH // (2 * STAGES)
            modules = [nn.Sequential(*layers[i * per:(i + 1) * per]).to(device) for i in held]
            self.stage = [PipelineStage(mod, i, 2 * STAGES, device=device, group=group) for mod, i in zip(modules, held)]
            self.schedule = cls(self.stage, cfg["m"], loss_fn=mse)
            module: nn.Module = nn.ModuleList(modules)
            self.first, self.last = 0 in held, 2 * STAGES - 1 in held
        else:
            module = nn.Sequential(*stage_layers(layers, rank)).to(device)
            self.stage = PipelineStage(module, rank, STAGES, device=device, group=group)
            self.schedule = cls(self.stage, cfg["m"], loss_fn=mse)
            self.first, self.last = rank == 0, rank == STAGES - 1
        self.opt = make_optimizer(module.parameters(), cfg["optimizer"])
        self.batches = make_batches(cfg, device)
        self.optimizer_s = 0.0  # the last step's

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        self.opt.zero_grad(set_to_none=True)
        inputs = (x,) if self.first else ()
        if self.last:
            self.schedule.step(*inputs, target=y, losses=[], return_outputs=False)
        else:
            self.schedule.step(*inputs)
        t = time.perf_counter()
        self.opt.step()
        self.optimizer_s = time.perf_counter() - t


def _torchpp_worker(rank: int, port: int, cfgs: list[dict], out_dir: str, profile: bool) -> None:
    setup_threads(cfgs[0])
    init_group(rank, port, cfgs[0])
    device = device_of(cfgs[0], rank)
    results = []
    for cfg in cfgs:
        loop = TorchLoop(cfg, rank, device)
        split = _TorchSplit(loop.stage) if profile else None
        prof = cProfile.Profile(time.thread_time) if profile else None
        clock, opt_s = StepClock(cfg, device), 0.0
        for i in range(len(loop.batches)):
            timed = clock.in_window()
            if split is not None:
                split.active = timed
            if prof is not None and timed:
                prof.enable()
            loop.step(i)
            if timed:
                opt_s += loop.optimizer_s
            clock.tick()
            if prof is not None and timed:
                prof.disable()
        dist.barrier()
        result = {**cfg, "rank": rank, **clock.result(), "optimizer_s": opt_s / cfg["steps"]}
        if split is not None:
            split.remove()
            result["split"] = {k: v / cfg["steps"] for k, v in split.totals.items()}
            result["profile"] = _profile_text(prof)
            result["cpu_profile"] = _profile_summary(prof, cfg["steps"])
        results.append(result)
    Path(out_dir, f"torchpp{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()



def _engine_worker(rank: int, port: int, cfgs: list[dict], out_dir: str, profile: bool) -> None:
    """This package's ``PipelineEngine``, one stage per process (see :func:`run_engine`)."""
    setup_threads(cfgs[0])
    init_group(rank, port, cfgs[0])
    traced = any(c.get("trace") for c in cfgs)
    transfer_s = harness.transfer_seconds(rank, cfgs[0]["rows"], cfgs[0]["width"]) if traced else None
    results = [run_engine(cfg, rank, STAGES, profile, transfer_s) for cfg in cfgs]
    Path(out_dir, f"engine{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


class EngineLoop:
    """This package's ``PipelineEngine`` driven by a plain loop doing what the strategy does, without Lightning,
    one step per :meth:`step`: this process's stage of ``world_size`` processes or, with ``world_size=1``, all
    ``STAGES`` stages in this one process (on one GPU the stages cannot overlap: this measures the engine's
    overhead)."""

    def __init__(self, cfg: dict, rank: int, world_size: int, device: torch.device) -> None:
        from lightning_async_pp.pipeline.config import PipelineConfig
        from lightning_async_pp.pipeline.engine import PipelineEngine

        # What the Lightning runs give AsyncPipelineStrategy, with the timeout the other pairs use.
        config = PipelineConfig(schedule=cfg["schedule"], num_microbatches=cfg["m"], partition="uniform",
                                pipeline_timeout=120.0, num_stages=STAGES if world_size == 1 else None,
                                compile=cfg.get("compile", False))
        root = nn.ModuleList(make_layers(cfg["width"]))
        self.engine = PipelineEngine.build(root, list(root), config, input_fn=lambda b: b[0],
                                           loss_fn=lambda out, b: mse(out, b[1]), device=device,
                                           world_size=world_size, rank=rank)
        root.to(device)
        self.engine.start()
        self.opt = make_optimizer(self.engine.params, cfg["optimizer"])
        self.batches = make_batches(cfg, device)

    def step(self, i: int) -> None:
        engine, batches = self.engine, self.batches
        # As AsyncPipelineStrategy.train_loss: the next batch is the 2BW lookahead, except on the last step.
        last = i + 1 == len(batches)
        engine.train_step(batches[i], None if last or not engine.uses_lookahead() else batches[i + 1])
        # As AsyncPipelineStrategy.backward and optimizer_step.
        for p, g in zip(engine.params, engine.gradients):
            p.grad = g
        engine.prepare_update()
        t = time.perf_counter()
        self.opt.step()
        engine.record_optimizer(t, time.perf_counter())


def run_engine(cfg: dict, rank: int, world_size: int, profile: bool = False,
               transfer_s: Optional[float] = None) -> dict:
    """:class:`EngineLoop` over every batch, timed (and, as ``cfg`` and ``profile`` ask, traced or profiled)."""
    device = device_of(cfg, rank)
    loop = EngineLoop(cfg, rank, world_size, device)
    engine = loop.engine
    prof = cProfile.Profile(time.thread_time) if profile else None
    clock, times, spans = StepClock(cfg, device), [], None
    for i in range(len(loop.batches)):
        timed = clock.in_window()
        if cfg.get("trace") and i == cfg["warmup"]:  # the timed steps, traced
            engine.start_trace()
        if prof is not None and timed:
            prof.enable()
        loop.step(i)
        clock.tick()
        if prof is not None and timed:
            prof.disable()
        if timed:
            times.append(_times_dict(engine.stats.last_times))
        if cfg.get("trace") and i == cfg["warmup"] + cfg["steps"] - 1:
            spans = engine.stop_trace()
    if world_size > 1:
        dist.barrier()
    result = {**cfg, "rank": rank, **clock.result(), "times": _mean_times(times)}
    if spans is not None:
        result["costs"] = {**harness.span_costs(spans, rank, cfg["steps"]), "transfer_s": transfer_s}
    if prof is not None:
        result["profile"] = _profile_text(prof)
        result["cpu_profile"] = _profile_summary(prof, cfg["steps"])
    return result



# ---------------------------------------------------------------------------------------------------------------
# Lightning: pipeline_throughput.py started again with --child lightning; Lightning re-executes it for rank 1.
# ---------------------------------------------------------------------------------------------------------------


def lightning_child(cfg: dict, out_dir: str) -> None:
    one_thread()
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_async_pp import AsyncPipelineStrategy, PipelineModule

    class MLPRegressor(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(make_layers(cfg["width"]))

        def pipeline_layers(self) -> list[nn.Module]:
            return list(self.layers)

        def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
            return mse(output, batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), cfg["optimizer"])

    class Clock(L.Callback):
        """Ends of steps (``StepClock``) and the engine's breakdown of the timed steps."""

        def __init__(self) -> None:
            self.clock = StepClock(cfg)
            self.times: list[dict] = []
            self.prof = cProfile.Profile(time.thread_time) if cfg.get("profile") else None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.clock.in_window():
                self.times.append(_times_dict(trainer.strategy.engine.stats.last_times))
            self.clock.tick()
            if self.prof is not None and self.clock.in_window():
                self.prof.enable()
            elif self.prof is not None:
                self.prof.disable()

    class Batches(Dataset):
        """Whole batches made in advance, as the other systems get them: the loader costs one list lookup."""

        def __init__(self, batches: list) -> None:
            self.batches = batches

        def __len__(self) -> int:
            return len(self.batches)

        def __getitem__(self, i: int) -> Any:
            return self.batches[i]

    class TorchBlocks(L.Callback):
        """``cfg["blocks"]``: after every ``block_steps`` Lightning steps, ``block_steps`` steps of each of torch's
        schedules in these same processes (each on a process group of its own), the order rotating; each system's
        median step per block round on rank 0, the first step of each block not counted (the other rank may still
        be finishing the previous system's step). See ``benchmarks/paired_rounds.py --blocks --lightning``."""

        def __init__(self) -> None:
            self.k, self.ends, self.rounds, self.loops = cfg["block_steps"], [], [], {}

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            for s in TORCH_SCHEDULES:  # every rank creates the groups in the same order
                self.loops[s] = TorchLoop({**cfg, "schedule": s}, trainer.global_rank, torch.device("cpu"),
                                          group=dist.new_group(backend="gloo"))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) < self.k + 1:  # a block: k + 1 step ends give k steps, the first not counted
                return
            medians = {"lightning/2bw": median_gap(self.ends[1:])}
            done = len(self.rounds)  # block rounds of torch's schedules so far, k steps each
            for name in in_turn(list(self.loops), done):
                medians[name] = block_median(self.loops[name], done * self.k, self.k)
            self.rounds.append(medians)
            self.ends = [time.perf_counter()]  # the next Lightning step starts here

    loader = DataLoader(Batches(make_batches(cfg)), batch_size=None, shuffle=False)
    blocks = TorchBlocks() if cfg.get("blocks") else None
    clock = Clock()
    trainer = L.Trainer(
        strategy=AsyncPipelineStrategy(schedule=cfg["schedule"], num_microbatches=cfg["m"], partition="uniform"),
        accelerator="cpu", devices=STAGES, max_steps=total_steps(cfg), callbacks=[clock if blocks is None else blocks],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(MLPRegressor(), loader)
    if blocks is not None:
        result = {**cfg, "rank": trainer.global_rank, "block_rounds": blocks.rounds[1:]}  # round 0 warms up
    else:
        result = {**cfg, "rank": trainer.global_rank, **clock.clock.result(), "times": _mean_times(clock.times)}
    if clock.prof is not None:
        result["profile"] = _profile_text(clock.prof, sort="tottime", limit=30)
        result["cpu_profile"] = _profile_summary(clock.prof, cfg["steps"])
    Path(out_dir, f"lightning{trainer.global_rank}.json").write_text(json.dumps(result))


def run_lightning(cfg: dict, timeout: float) -> list[dict]:
    """One Lightning run of this script's ``--child lightning``; each rank's result."""
    return run_ranks([str(SCRIPT), "--child", "lightning", "--config", json.dumps(cfg)], "lightning*.json",
                     f"Lightning run {cfg}", timeout)
