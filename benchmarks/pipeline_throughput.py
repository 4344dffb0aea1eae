#!/usr/bin/env python
"""Pipeline throughput, CPU or CUDA: this package's schedules against ``torch.distributed.pipelining`` and one process.

One run on CPU (the default, ``--accelerator cpu``) measures, on the same model (8 x [Linear(512, 512) + GELU],
``--width`` changes 512; mean-squared-error regression), the same batches and the same optimizer, with one thread
per process:

- ``2bw``, ``1f1b``, ``gpipe`` through ``lightning.Trainer(strategy=AsyncPipelineStrategy(...), devices=2)``, which
  is what users run (each run is this script started again as a subprocess: Lightning's launcher re-executes
  ``sys.argv`` for rank 1);
- the same three schedules on the bare engine (``PipelineEngine`` driven by a plain loop, no Lightning), to
  separate Lightning's per-step cost from the engine's;
- ``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleGPipe`` with ``PipelineStage`` (gloo), and its
  multi-stage schedules with two stages per rank (each a quarter of the layers): ``ScheduleInterleaved1F1B``
  (rank r holds stages r and r+2), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (the V: rank r holds
  stages r and 3-r, so rank 0 computes the loss);
- the whole model in one process (plain loop, whole batch at once): the baseline; and the same with the batch
  split into the pipeline's microbatches (gradients accumulated), which has the pipeline's matrix shapes: twice
  its rate is what two stages could reach without any overhead;
- every schedule of the bare engine with both stages in this one process, against that microbatched loop and
  against the same loop cut where the stages meet (a detached input and two backward calls per microbatch, as in
  any pipeline): what a stage's compute costs over a plain loop's, without transfers or a second process on the
  cores. These run in one process taking steps in turn (step ``i`` of each system, then step ``i + 1``), and the
  ratio is the median of the per-step ratios: a shared VM's speed drifts by 10-90% within minutes, which a ratio
  between two runs made one after the other would also measure;
- two independent one-process runs side by side: what two processes can reach on this machine (the ceiling).

Throughput is samples (rows) per second over the steady state: ``--warmup`` steps are skipped, the next
``--steps`` are timed between the ends of consecutive steps on rank 0, and one more step runs untimed after them
(2BW drains there). For ``2bw`` under Lightning it also prints where each stage's wall time went
(``strategy.engine.stats.last_times``) and every process's peak RSS.

Last (not with ``--quick`` or ``--no-paired``), per m, 2bw under Lightning and torch's five schedules in one
process pair, taking blocks of 6 steps in turn (torch's schedules run from a callback between Lightning's
blocks, each on a process group of its own): each schedule's step over 2bw's a second apart, the median over 12
block rounds (``run_paired_blocks``; ``benchmarks/paired_rounds.py --blocks`` prints the rounds).

``--rounds N`` measures everything N times in turn; the tables show each system's median round, and a table of
the targets gives each round's ratios (both sides from the same round) and their median.

Other processes on the machine distort such numbers, so before each measurement the benchmark waits (up to
``--wait-idle`` seconds) for an idle machine, records which share of the CPUs others used during the timed window
(the *others' CPU* column), and measures again (``--retries``) when that share exceeds 5%.

``--profile`` (or ``--profile-only``) additionally profiles both stages of torch's ``Schedule1F1B``, of this
engine's ``1f1b`` and ``2bw`` and of ``2bw`` under Lightning: main-thread CPU per step by kind (cProfile timed with
``thread_time``, so waits and other processes do not count) and a wall-clock split, to show where per-microbatch
and per-step overhead comes from. ``--only-engines`` measures one process, the bare engine and torch's schedules
only (a quick check of engine changes).

``--predict`` runs only the bare engine's three schedules, traced (``engine.start_trace()``), and reports the
planner's prediction against the measurement: each stage's mean forward, backward and optimizer span and the
measured activation transfer time are fed to ``pipeline.simulate.simulate()``, whose steady-state step time is
compared with the measured one (see BENCHMARKS.md, "Predicted vs measured").

``--compile`` runs only the bare engine's schedules (``2bw``, ``1f1b``, ``gpipe``; ``zb_h1`` cannot split a
compiled layer's backward), each with eager layers and with compiled ones (``PipelineConfig(compile=True)``:
torch.compile's default backend, inductor), in the same process pair, and reports the step times side by side.
Compilation happens in the warm-up steps, which are not timed. With ``--accelerator cuda`` it runs both stages on
``cuda:0`` in this process (the engine overhead setting below) and, with two or more GPUs, the 2-process pairs too.

``--accelerator cuda`` (width 4096 unless ``--width`` is given, 10 warm-up + 50 timed steps unless given, torch's
own thread settings) measures on ``cuda:0`` in this process the whole model (whole batch, and microbatched) and the
bare engine with both stages on that one GPU (``num_stages=2``, one process: the stages cannot overlap, so its
ratio to the whole model is the engine's overhead); with two or more GPUs also the ceiling, the bare engine's three
schedules and torch's two over NCCL, one GPU per process. Lightning is not measured there, nor ``--predict`` or
``--profile``. Each step's end is taken after ``torch.cuda.synchronize()``. Without a CUDA device it stops at once.

Run: ``make bench`` (= ``.venv/bin/python benchmarks/pipeline_throughput.py``); see BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys


def requested_accelerator(argv: list[str]) -> str:
    """``--accelerator`` as given on the command line, read before torch is imported (see below)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--accelerator", default="cpu")
    return pre.parse_known_args(argv)[0].accelerator


# On CPU one thread per process, set before torch is imported (intra-op pools are sized at import). On CUDA the
# CPU only launches kernels, so torch keeps its own thread defaults. Spawned workers see the parent's argv.
if requested_accelerator(sys.argv[1:]) == "cpu":
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_var] = "1"

import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

WIDTH = 512  # the CPU default; --width changes it
CUDA_WIDTH = 4096  # the CUDA default: large enough that the GPU, not the launching CPU, sets the pace
DEPTH = 8
STAGES = 2
SCHEDULES = ("2bw", "1f1b", "gpipe")  # under Lightning
ENGINE_SCHEDULES = SCHEDULES + ("zb_h1",)  # on the bare engine
ONE_PROCESS_SCHEDULES = ENGINE_SCHEDULES  # the bare engine with both stages in one process, against the plain loop
TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
#: torch's schedules with two stages per rank, and which stages rank r holds (of 2 x STAGES).
TORCH_MULTI_STAGE = {"ScheduleInterleaved1F1B": lambda r: (r, r + STAGES),
                     "ScheduleZBVZeroBubble": lambda r: (r, 2 * STAGES - 1 - r),
                     "ScheduleDualPipeV": lambda r: (r, 2 * STAGES - 1 - r)}
CHILD_TIMEOUT = 240.0  # seconds any child run may take before it is killed
CPU_STEPS = (20, 5)  # default timed and warm-up steps per run on CPU
CUDA_STEPS = (50, 10)  # on CUDA: steps take milliseconds, and the first ones pay for cuBLAS's set-up

# ---------------------------------------------------------------------------------------------------------------
# The model, the data and the optimizer: identical in every system measured.
# ---------------------------------------------------------------------------------------------------------------


def make_layers(width: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(DEPTH)]


def stage_layers(layers: list[nn.Module], stage: int) -> list[nn.Module]:
    per = DEPTH // STAGES
    return layers[stage * per : (stage + 1) * per]


def make_batches(cfg: dict, device: Optional[torch.device] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's batch, made in advance on the CPU (the same values on every rank and device) and, for a GPU,
    copied onto it before the clock starts."""
    g = torch.Generator().manual_seed(1)
    rows, width = cfg["rows"] * cfg["m"], cfg["width"]
    batches = [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g))
               for _ in range(total_steps(cfg))]
    if device is not None and device.type != "cpu":
        batches = [(x.to(device), y.to(device)) for x, y in batches]
    return batches


def device_of(cfg: dict, rank: int = 0) -> torch.device:
    """The device a process works on: the CPU, or on CUDA one GPU per rank."""
    return torch.device("cuda", rank) if cfg["accelerator"] == "cuda" else torch.device("cpu")


def setup_threads(cfg: dict) -> None:
    """One thread per process is a CPU measure; a process driving a GPU keeps torch's defaults."""
    if cfg["accelerator"] == "cpu":
        one_thread()


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


def total_steps(cfg: dict) -> int:
    return cfg["warmup"] + cfg["steps"] + 1  # + 1 untimed step at the end (2BW drains there)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _system_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used since boot (from /proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process (gloo's included)
    return usage.ru_utime + usage.ru_stime


class StepClock:
    """End times of every step; CPU use of this process and of the whole machine over the timed window.

    The timed window runs from the end of step ``warmup - 1`` to the end of step ``warmup + steps - 1``. The
    machine-wide CPU use minus what the measured processes used tells whether something else was running.
    On a GPU a step ends when its kernels have finished: each tick waits for the device first (CUDA kernels run
    asynchronously to the CPU that launched them), and the result adds the device's peak allocated memory.
    """

    def __init__(self, cfg: dict, device: Optional[torch.device] = None) -> None:
        self.first, self.last = cfg["warmup"] - 1, cfg["warmup"] + cfg["steps"] - 1
        self.stamps: list[float] = []
        self._start = self._end = (0.0, 0.0)
        self.cuda = device if device is not None and device.type == "cuda" else None
        if self.cuda is not None:
            # The allocator's statistics exist only once CUDA is initialized on that device; a process that has
            # not touched the GPU yet gets "Invalid device argument" from reset_peak_memory_stats.
            torch.cuda.init()
            torch.cuda.reset_peak_memory_stats(self.cuda)

    def in_window(self) -> bool:
        """Whether the step about to run is a timed one."""
        return self.first < len(self.stamps) <= self.last

    def tick(self) -> None:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        self.stamps.append(time.perf_counter())
        i = len(self.stamps) - 1
        if i == self.first:
            self._start = (_own_cpu_seconds(), _system_busy_seconds())
        elif i == self.last:
            self._end = (_own_cpu_seconds(), _system_busy_seconds())

    def result(self) -> dict:
        window = self.stamps[self.first : self.last + 1]
        steps = [b - a for a, b in zip(window, window[1:])]
        result = {
            "sec_per_step": statistics.median(steps),  # robust to a step slowed by something else on the machine
            "mean_sec_per_step": (window[-1] - window[0]) / len(steps),
            "wall_s": window[-1] - window[0],
            "cpu_s": self._end[0] - self._start[0],
            "system_busy_s": self._end[1] - self._start[1],
            "rss_mib": peak_rss_mib(),
        }
        if self.cuda is not None:
            result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(self.cuda) / 2**20
        return result


def peak_rss_mib() -> float:
    """Peak resident memory of this process (VmHWM). Not ``getrusage``'s ``ru_maxrss``: that survives ``exec``,
    so a child started by fork and exec would report at least its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def one_thread() -> None:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # may be set only once per process, before any inter-op work
        pass


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


# ---------------------------------------------------------------------------------------------------------------
# Spawned process pairs (torch.distributed.pipelining, the bare engine, the ceiling), each bounded by a timeout.
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_pair(target: Callable, args: tuple, timeout: float) -> None:
    """Start ``target(rank, *args)`` in two fresh processes; kill both if either fails or time runs out."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(STAGES)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.__name__} did not finish within {timeout:.0f}s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{target.__name__} failed: exit codes {codes}")


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


class _TorchSplit:
    """Times the pieces of torch's schedule on one stage: pure forward, pure backward, their wrappers, p2p waits."""

    def __init__(self, stage: Any) -> None:
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage_mod

        self.active = False
        self.totals = {"fwd_pure": 0.0, "bwd_pure": 0.0, "fwd_chunk": 0.0, "bwd_chunk": 0.0, "p2p_wait": 0.0,
                       "p2p_post": 0.0}
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrap(stage, "forward_one_chunk", "fwd_chunk")
        self._wrap(stage, "backward_one_chunk", "bwd_chunk")
        self._wrap(stage.submod, "forward", "fwd_pure")
        self._wrap(stage_mod, "stage_backward", "bwd_pure")
        self._wrap(schedules, "_wait_batch_p2p", "p2p_wait")
        self._wrap(schedules, "_batch_p2p", "p2p_post")

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def remove(self) -> None:
        for owner, name, original in reversed(self._restore):
            if isinstance(owner, nn.Module):
                delattr(owner, name)  # the instance attribute shadowed the class method
            else:
                setattr(owner, name, original)


def _engine_worker(rank: int, port: int, cfgs: list[dict], out_dir: str, profile: bool) -> None:
    """This package's ``PipelineEngine``, one stage per process (see :func:`run_engine`)."""
    setup_threads(cfgs[0])
    init_group(rank, port, cfgs[0])
    traced = any(c.get("trace") for c in cfgs)
    transfer_s = transfer_seconds(rank, cfgs[0]["rows"], cfgs[0]["width"]) if traced else None
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
        result["costs"] = {**span_costs(spans, rank, cfg["steps"]), "transfer_s": transfer_s}
    if prof is not None:
        result["profile"] = _profile_text(prof)
        result["cpu_profile"] = _profile_summary(prof, cfg["steps"])
    return result


def in_turn(names: list[str], turn: int) -> list[str]:
    """``names`` rotated by ``turn``: systems taking steps (or blocks) in turn start with another one each time."""
    turn %= len(names)
    return names[turn:] + names[:turn]


def block_median(loop: Any, first: int, k: int) -> float:
    """Steps ``first .. first + k - 1`` of ``loop``; the median step time, the block's first step not counted (in a
    process pair the other rank may still be finishing the previous system's step)."""
    ends = [time.perf_counter()]
    for i in range(first, first + k):
        loop.step(i)
        ends.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))


def run_interleaved(cfg: dict, schedules: tuple[str, ...]) -> dict[str, list[dict]]:
    """The plain loop on the pipeline's microbatches and the bare engine with both stages, one per schedule, all
    in this one process (CPU), taking steps in turn: step ``i`` of each, in an order that rotates with ``i``.

    A ratio between two runs measured one after the other also measures how the machine's speed moved between
    them (on a shared VM by 10-90% within minutes); steps taken in turn see the same machine, so the median of
    the per-step ratios (plain loop's step over the engine's step ``i``) is the engine's cost over a plain loop's
    alone. The plain loop split where the stages meet (``single_split``) runs in turn with them: the part of the
    engine's cost that any pipeline pays; so does the cut loop with zb_h1's split backward (``single_split_bw``),
    zb_h1's own reference. Returns ``{"single_mb": [result], "single_split": [result], "single_split_bw":
    [result], schedule: [result], ...}``; each result but the first adds ``paired_ratio``, and each schedule's
    ``paired_ratio_split_bw`` (``single_split_bw``'s step over its own).
    """
    setup_threads(cfg)
    device = torch.device("cpu")
    loops: dict[str, Any] = {"single_mb": PlainLoop(cfg, device, microbatched=True),
                             "single_split": PlainLoop(cfg, device, microbatched=True, split=True),
                             "single_split_bw": PlainLoop(cfg, device, microbatched=True, split_backward=True)}
    loops.update({s: EngineLoop({**cfg, "schedule": s}, 0, 1, device) for s in schedules})
    names = list(loops)
    times: dict[str, list[float]] = {n: [] for n in names}
    first, last = cfg["warmup"], cfg["warmup"] + cfg["steps"]
    for i in range(total_steps(cfg)):
        if i == first:
            start = (time.perf_counter(), _own_cpu_seconds(), _system_busy_seconds())
        for name in in_turn(names, i):
            t = time.perf_counter()
            loops[name].step(i)
            times[name].append(time.perf_counter() - t)
        if i == last - 1:
            end = (time.perf_counter(), _own_cpu_seconds(), _system_busy_seconds())
    # The machine-wide window is shared: each system gets it whole (others' CPU is then the same for all).
    window = {"wall_s": end[0] - start[0], "cpu_s": end[1] - start[1], "system_busy_s": end[2] - start[2],
              "rss_mib": peak_rss_mib()}
    timed = {n: t[first:last] for n, t in times.items()}
    out = {}
    for name in names:
        result = {**window, "sec_per_step": statistics.median(timed[name]),
                  "mean_sec_per_step": statistics.fmean(timed[name])}
        if name != "single_mb":
            result["paired_ratio"] = statistics.median(p / e for p, e in zip(timed["single_mb"], timed[name]))
        if name in schedules:
            result["paired_ratio_split_bw"] = statistics.median(
                p / e for p, e in zip(timed["single_split_bw"], timed[name]))
        out[name] = [result]
    return out


def _times_dict(t: Any) -> dict:
    return {"total": t.total, "compute": t.compute, "comm_wait": t.comm_wait, "optimizer": t.optimizer, "idle": t.idle}


def _mean_times(times: list[dict]) -> dict:
    return {k: statistics.fmean(t[k] for t in times) for k in times[0]} if times else {}


def transfer_seconds(rank: int, rows: int, width: int, rounds: int = 30) -> float:
    """One activation's (rows x width float32) transfer between the two processes: half the median round trip."""
    x = torch.zeros(rows, width)
    trips = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def span_costs(spans: list, rank: int, steps: int) -> dict:
    """This stage's mean forward, backward and optimizer span (seconds) and its waits per step, from a trace."""
    own = [s for s in spans if s.stage == rank]

    def mean(name: str) -> float:
        durations = [s.end - s.start for s in own if s.name == name]
        return statistics.fmean(durations) if durations else 0.0

    return {"forward_s": mean("forward"), "backward_s": mean("backward"), "optimizer_s": mean("optimizer"),
            "spans": {name: sum(s.name == name for s in own) for name in ("forward", "backward", "optimizer")},
            "wait_per_step_s": sum(s.end - s.start for s in own if s.name in ("send", "recv")) / steps}


def _profile_text(prof: cProfile.Profile, sort: str = "tottime", limit: int = 18) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(limit)
    return buf.getvalue()


def _profile_summary(prof: cProfile.Profile, steps: int) -> dict:
    """Main-thread CPU milliseconds per step by kind, from a profile timed with ``time.thread_time``.

    CPU time, not wall time: blocking in a wait costs none, and other processes on the machine do not inflate
    it, so this attributes overhead even on a busy machine. *kernels* are torch's C++ calls (forward kernels,
    the whole autograd backward, optimizer math); *p2p calls* are torch.distributed's isend/irecv/wait calls;
    *python* is everything else: the schedule, the runtime's bookkeeping, Lightning's loop.
    """
    kernels = comm = python = optimizer = 0.0
    for (file, _line, name), (_cc, _nc, tottime, cumtime, _callers) in pstats.Stats(prof).stats.items():
        if file == "~" and "_distributed_c10d" in name:
            comm += tottime
        elif file == "~" and "torch" in name:
            kernels += tottime
        else:
            python += tottime
        if name == "step" and "torch/optim/" in file.replace(os.sep, "/") and not file.endswith("optimizer.py"):
            optimizer = max(optimizer, cumtime)
    per = 1e3 / steps
    return {"kernels": kernels * per, "p2p_calls": comm * per, "python": python * per, "optimizer": optimizer * per}


# ---------------------------------------------------------------------------------------------------------------
# Lightning: this script started again with --child lightning; Lightning starts rank 1 by re-executing it.
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
            medians = {"lightning/2bw": statistics.median(b - a for a, b in zip(self.ends[1:], self.ends[2:]))}
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
    return run_ranks([os.path.abspath(__file__), "--child", "lightning", "--config", json.dumps(cfg)], "lightning*.json",
                     f"Lightning run {cfg}", timeout)


def run_ranks(argv: list[str], pattern: str, what: str, timeout: float, ranks: int = STAGES) -> list[dict]:
    """``python argv --out-dir DIR`` in a subprocess of its own session (Lightning re-executes it for the other
    ranks; all are killed together on timeout); the JSON files matching ``pattern`` each rank wrote into DIR."""
    with tempfile.TemporaryDirectory() as out_dir:
        env = {k: v for k, v in os.environ.items() if k not in (
            "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")}
        env["PYTHONWARNINGS"] = "ignore"
        proc = subprocess.Popen([sys.executable, *argv, "--out-dir", out_dir], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TimeoutError(f"{what} did not finish within {timeout:.0f}s")
        files = sorted(Path(out_dir).glob(pattern))
        if proc.returncode != 0 or len(files) != ranks:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{output[-4000:]}")
        return [json.loads(f.read_text()) for f in files]


def run_pairs(target: Callable, cfgs: list[dict], name: str, profile: bool, timeout: float) -> list[list[dict]]:
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_pair(target, (free_port(), cfgs, out_dir, profile), timeout)
        per_rank = [json.loads(Path(out_dir, f"{name}{r}.json").read_text()) for r in range(STAGES)]
    return [list(pair) for pair in zip(*per_rank)]  # one [rank0, rank1] per config


def _blocks_worker(rank: int, port: int, cfgs: list[dict], out_dir: str, profile: bool) -> None:
    """The bare engine's 2bw and torch's schedules in this process pair, blocks of steps in turn (see
    :func:`run_paired_blocks`)."""
    cfg = cfgs[0]
    setup_threads(cfg)
    init_group(rank, port, cfg)
    device = device_of(cfg, rank)
    loops: dict[str, Any] = {"2bw": EngineLoop({**cfg, "schedule": "2bw"}, rank, STAGES, device)}
    for s in TORCH_SCHEDULES:  # each on a group of its own: its traffic never meets another system's
        loops[s] = TorchLoop({**cfg, "schedule": s}, rank, device, group=dist.new_group(backend="gloo"))
    k, rounds = cfg["block_steps"], []
    for b in range(cfg["blocks"] + 1):  # block round 0 warms every system up; not reported
        medians = {name: block_median(loops[name], b * k, k) for name in in_turn(list(loops), b)}
        if b:
            rounds.append(medians)
    dist.barrier()
    Path(out_dir, f"blocks{rank}.json").write_text(json.dumps([rounds]))
    dist.destroy_process_group()


def run_paired_blocks(base: dict, blocks: int = 12, block_steps: int = 6, lightning: bool = True) -> dict:
    """2bw (through Lightning, or on the bare engine) and torch's five schedules in one process pair (torch's each
    on a process group of its own), taking blocks of ``block_steps`` steps in turn, ``blocks`` block rounds, the
    order rotating; the first step of each block is not counted (the other rank may still be finishing the
    previous system's step). Per schedule: the median over rounds of its step time over 2bw's in the same round
    (``paired``), and its median step (``step``); ``fastest`` is the schedule with the lowest median step. Systems
    a second apart see the same machine, which on a shared VM two runs minutes apart do not."""
    # Batches for every step any system takes, plus 2BW's lookahead (total_steps adds one).
    cfg = dict(base, blocks=blocks, block_steps=block_steps, warmup=0, steps=(blocks + 1) * block_steps + 1)
    if lightning:  # torch's schedules run from a callback between Lightning's blocks (lightning_child)
        rounds = run_lightning(dict(cfg, schedule="2bw"), CHILD_TIMEOUT * 2)[0]["block_rounds"]
        ours = "lightning/2bw"
    else:
        (rounds, _), = run_pairs(_blocks_worker, [cfg], "blocks", False, CHILD_TIMEOUT * 2)
        ours = "2bw"
    paired = {n: statistics.median(r[n] / r[ours] for r in rounds) for n in TORCH_SCHEDULES}
    step = {n: statistics.median(r[n] for r in rounds) for n in TORCH_SCHEDULES}
    return {"ours": ours, "rounds": rounds, "paired": paired, "step": step, "fastest": min(step, key=step.get),
            "ours_step": statistics.median(r[ours] for r in rounds)}


def run_ceiling(cfg: dict, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_pair(_single_worker, (cfg, out_dir), timeout)
        return [json.loads(Path(out_dir, f"single{r}.json").read_text()) for r in range(STAGES)]


# ---------------------------------------------------------------------------------------------------------------
# Other processes on the machine: measured, waited out, and measured around.
# ---------------------------------------------------------------------------------------------------------------

DISTURBED = 0.05  # others used more than this fraction of all CPUs during a measurement


def others_cpu(procs: list[dict]) -> float:
    """Fraction of the machine's CPU time used by processes other than ``procs`` during their timed window."""
    wall = max(r["wall_s"] for r in procs)
    busy = max(r["system_busy_s"] for r in procs)
    own = sum(r["cpu_s"] for r in procs)
    return max(0.0, busy - own) / ((os.cpu_count() or 1) * wall) if wall > 0 else 0.0


class Quiet:
    """Waits for an idle machine before each measurement and repeats measurements that others disturbed."""

    def __init__(self, wait_idle: float, retries: int) -> None:
        self.wait_idle, self.retries = wait_idle, retries

    def wait(self) -> None:
        deadline = time.monotonic() + self.wait_idle
        while True:
            before = _system_busy_seconds()
            time.sleep(0.5)
            busy = (_system_busy_seconds() - before) / (0.5 * (os.cpu_count() or 1))
            if busy < 0.1 or time.monotonic() > deadline:
                return

    def measure(self, run: Callable[[], Any], disturbance: Callable[[Any], float] = others_cpu) -> Any:
        """``run()`` on a quiet machine, again (``retries`` times) while ``disturbance(result)`` (by default others'
        CPU share of a list of per-process results) exceeds 5%; the least disturbed result."""
        best: Any = None
        for _ in range(1 + self.retries):
            self.wait()
            res = run()
            if best is None or disturbance(res) < disturbance(best):
                best = res
            if disturbance(best) <= DISTURBED:
                break
        return best

    def measure_keyed(self, run: Callable[[], dict[str, list[dict]]]) -> dict[str, list[dict]]:
        """:meth:`measure` for a run that measures several systems in one window: ``{system: [result]}``."""
        return self.measure(run, lambda res: max(others_cpu(v) for v in res.values()))

    def measure_group(self, worker: Callable, name: str, cfgs: list[dict]) -> list[list[dict]]:
        """Several configurations in one process pair; the disturbed ones are measured again."""
        self.wait()
        best = run_pairs(worker, cfgs, name, False, CHILD_TIMEOUT)
        for _ in range(self.retries):
            again = [i for i, pair in enumerate(best) if others_cpu(pair) > DISTURBED]
            if not again:
                break
            self.wait()
            for i, pair in zip(again, run_pairs(worker, [cfgs[i] for i in again], name, False, CHILD_TIMEOUT)):
                if others_cpu(pair) < others_cpu(best[i]):
                    best[i] = pair
        return best


def _rate(key: str, procs: list[dict], rows: int) -> float:
    """Samples per second: rank 0's step clock for a pipeline, the sum of both for two independent processes."""
    if key.startswith("ceiling"):
        return sum(rows / r["sec_per_step"] for r in procs)
    return rows / procs[0]["sec_per_step"]


def print_run(m: int, key: str, res: list[dict], rows: int, detail: str, digits: int = 1) -> None:
    """One line of the progress a run prints as each system finishes: its step time, rate and ``detail``."""
    sec = rows / _rate(key, res, rows)
    print(f"  m={m} {key.split('/m')[0]:<26} {sec * 1e3:8.{digits}f} ms/step {rows / sec:9.0f} samples/s   {detail}",
          flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------------------------


def measure_round(args: argparse.Namespace, base: dict, quiet: "Quiet") -> dict[str, list[dict]]:
    """Every system at every ``--microbatches``, once: ``{"<system>/m<m>": [result per process]}``."""
    runs: dict[str, list[dict]] = {}
    for m in args.microbatches:
        cfg = {**base, "m": m}
        rows = cfg["rows"] * m

        def record(key: str, res: list[dict]) -> None:
            runs[key] = res
            extra = f"   plain loop / engine, paired steps {res[0]['paired_ratio']:.3f}" if "paired_ratio" in res[0] else ""
            print_run(m, key, res, rows, f"others' CPU {others_cpu(res):5.1%}{extra}")

        record(f"single/m{m}", quiet.measure(lambda: [run_single(cfg)]))
        # The engine's stages in this one process on the same microbatches, against the plain loop, steps in turn.
        mixed = quiet.measure_keyed(lambda: run_interleaved(cfg, ONE_PROCESS_SCHEDULES))
        record(f"single_mb/m{m}", mixed["single_mb"])
        record(f"single_split/m{m}", mixed["single_split"])
        record(f"single_split_bw/m{m}", mixed["single_split_bw"])
        for schedule in ONE_PROCESS_SCHEDULES:
            record(f"onedev/{schedule}/m{m}", mixed[schedule])
        if args.only_engines:
            for pair in quiet.measure_group(_engine_worker, "engine", [{**cfg, "schedule": s} for s in ENGINE_SCHEDULES]):
                record(f"engine/{pair[0]['schedule']}/m{m}", pair)
            for pair in quiet.measure_group(_torchpp_worker, "torchpp", [{**cfg, "schedule": s} for s in TORCH_SCHEDULES]):
                record(f"torch/{pair[0]['schedule']}/m{m}", pair)
            continue
        record(f"ceiling/m{m}", quiet.measure(lambda: run_ceiling(cfg, CHILD_TIMEOUT)))
        for schedule in SCHEDULES:
            record(f"lightning/{schedule}/m{m}", quiet.measure(lambda: run_lightning({**cfg, "schedule": schedule}, CHILD_TIMEOUT)))
        groups = [("torch", _torchpp_worker, "torchpp", TORCH_SCHEDULES)]
        if not args.no_engine:
            groups.insert(0, ("engine", _engine_worker, "engine", ENGINE_SCHEDULES))
        for prefix, worker, name, schedules in groups:
            for pair in quiet.measure_group(worker, name, [{**cfg, "schedule": s} for s in schedules]):
                record(f"{prefix}/{pair[0]['schedule']}/m{m}", pair)
    return runs


def median_runs(rounds: list[dict[str, list[dict]]], rows: int) -> dict[str, list[dict]]:
    """Per system, the run of the round with the median rate (the lower middle one of an even count)."""
    if not rounds:
        return {}
    return {key: sorted((r[key] for r in rounds), key=lambda res: _rate(key, res, rows))[(len(rounds) - 1) // 2]
            for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="microbatches per batch (m)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: every system, one thread per process, gloo; cuda: one process on cuda:0 and, with "
                             "2+ GPUs, the 2-process runs over NCCL (one GPU per process), no Lightning runs")
    parser.add_argument("--steps", type=int, help=f"timed steady-state steps per run (default {CPU_STEPS[0]} on CPU, "
                                                  f"{CUDA_STEPS[0]} on CUDA)")
    parser.add_argument("--warmup", type=int, help=f"untimed steps before the timed ones (default {CPU_STEPS[1]} on "
                                                   f"CPU, {CUDA_STEPS[1]} on CUDA)")
    parser.add_argument("--width", type=int, help=f"features of every layer (default {WIDTH} on CPU, {CUDA_WIDTH} on CUDA)")
    parser.add_argument("--rows-per-microbatch", type=int, default=128, help="samples in one microbatch")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--quick", action="store_true", help="m=4 only, fewer steps, no engine-only runs (on CUDA: kept)")
    parser.add_argument("--no-engine", action="store_true", help="skip the bare-engine (no Lightning) runs (on CUDA: the 2-GPU ones)")
    parser.add_argument("--only-engines", action="store_true",
                        help="measure only one process, the bare engine and torch's schedules (no Lightning); no report")
    parser.add_argument("--predict", action="store_true",
                        help="only the bare engine's schedules, traced: the planner's predicted step time vs the measured one")
    parser.add_argument("--compile", action="store_true",
                        help="only the bare engine's schedules, eager layers against compiled ones (compile=True)")
    parser.add_argument("--profile", action="store_true", help="also profile one stage of torch 1F1B and ours")
    parser.add_argument("--profile-only", action="store_true", help="only the profiles (at the first --microbatches)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every system this many times, in turn; the tables show each system's median "
                             "round and the targets each round's ratios (on CPU)")
    parser.add_argument("--no-paired", action="store_true",
                        help="skip 2bw (Lightning) against torch's schedules in blocks of steps in turn in one process "
                             "pair (about 1.5 minutes per m; skipped with --quick)")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--wait-idle", type=float, default=20.0,
                        help="before each measurement wait up to this many seconds for the machine to be idle")
    parser.add_argument("--retries", type=int, default=1,
                        help="measure again (keeping the least disturbed) when other processes used > 5%% of the CPUs")
    parser.add_argument("--child", choices=("lightning",), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child == "lightning":
        lightning_child(json.loads(args.config), args.out_dir)
        return
    cuda = args.accelerator == "cuda"
    default_steps, default_warmup = CUDA_STEPS if cuda else CPU_STEPS
    args.steps = default_steps if args.steps is None else args.steps
    args.warmup = default_warmup if args.warmup is None else args.warmup
    args.width = (CUDA_WIDTH if cuda else WIDTH) if args.width is None else args.width
    if args.quick:
        args.microbatches, args.steps, args.warmup = [4], min(args.steps, 10), min(args.warmup, 3)
        args.no_engine = args.no_engine or not cuda  # on CUDA the bare engine stands in for Lightning: kept
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error(f"--warmup, --steps and --rounds must be >= 1, got {args.warmup}, {args.steps} and {args.rounds}")
    if args.width < 1 or args.rows_per_microbatch < 1:
        parser.error(f"--width and --rows-per-microbatch must be >= 1, got {args.width} and {args.rows_per_microbatch}")
    if cuda:
        for flag in ("predict", "profile", "profile_only"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} measures on CPU only; drop it or use --accelerator cpu")
        if not torch.cuda.is_available():
            sys.exit(f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
                     f"{torch.version.cuda or 'none'}); run on a machine with an NVIDIA GPU, or with --accelerator cpu")
        if args.compile:
            run_compile_comparison(args, cuda=True)
            return
        main_cuda(args)
        return

    one_thread()
    started = time.perf_counter()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cpu"}
    load = os.getloadavg()[0]
    print(f"# pipeline throughput: {DEPTH} x [Linear({args.width},{args.width}) + GELU], {STAGES} stages, "
          f"{args.rows_per_microbatch} rows per microbatch, optimizer {args.optimizer}, "
          f"{args.warmup} warmup + {args.steps} timed steps, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"1 thread per process, load average before start {load:.2f}", flush=True)

    results: dict[str, Any] = {"config": base, "load_before": load, "runs": {}}
    runs = results["runs"]
    quiet = Quiet(args.wait_idle, args.retries)
    if args.compile:
        run_compile_comparison(args, cuda=False)
        return
    if args.predict:
        results["predict"] = run_predict(base, args.microbatches, quiet)
        print()
        print(predict_report(results["predict"], base))
        print(f"\n(benchmark wall time {time.perf_counter() - started:.0f}s; load average now {os.getloadavg()[0]:.2f})")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    rounds: list[dict[str, list[dict]]] = []
    for rnd in range(0 if args.profile_only else args.rounds):
        if args.rounds > 1:
            print(f"# round {rnd + 1} of {args.rounds}", flush=True)
        rounds.append(measure_round(args, base, quiet))
    results["rounds"] = rounds
    runs.update(median_runs(rounds, base["rows"]))
    if not (args.quick or args.no_paired or args.only_engines or args.profile_only):
        # The >= 1.1 target, measured so that the host's drift cancels: 2bw under Lightning and torch's schedules
        # in one process pair, blocks of steps in turn.
        results["paired"] = {}
        for m in args.microbatches:
            quiet.wait()
            res = results["paired"][str(m)] = run_paired_blocks({**base, "m": m})
            print(f"  m={m} paired blocks: 2bw (Lightning) / torch's fastest ({res['fastest']}) "
                  f"{res['paired'][res['fastest']]:.3f}", flush=True)

    if args.profile or args.profile_only:
        m = args.microbatches[0]
        cfg = {**base, "m": m}
        prof: dict[str, Any] = {}
        for (r0, r1) in run_pairs(_torchpp_worker, [{**cfg, "schedule": "Schedule1F1B"}], "torchpp", True, CHILD_TIMEOUT):
            prof["torch/Schedule1F1B"] = [r0, r1]
        for (r0, r1) in run_pairs(_engine_worker, [{**cfg, "schedule": s} for s in ("1f1b", "2bw")], "engine", True,
                                  CHILD_TIMEOUT):
            prof[f"engine/{r0['schedule']}"] = [r0, r1]
        prof["lightning/2bw"] = quiet.measure(lambda: run_lightning({**cfg, "schedule": "2bw", "profile": True}, CHILD_TIMEOUT))
        results["profile"] = prof

    if args.only_engines:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    print()
    print(report(results, args) if not args.profile_only else profile_report(results["profile"], base, m))
    print(f"\n(benchmark wall time {time.perf_counter() - started:.0f}s; "
          f"load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main_cuda(args: argparse.Namespace) -> None:
    """The CUDA measurements: one process on ``cuda:0`` (the whole model; the engine with both stages), and with
    two or more GPUs the 2-process pairs over NCCL, one GPU per process. Lightning's runs are not measured."""
    started = time.perf_counter()
    ngpu = torch.cuda.device_count()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cuda"}
    load = os.getloadavg()[0]
    gpus = ", ".join(f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}"
                     f" GiB)" for i in range(ngpu))
    tf32 = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
    print(f"# pipeline throughput on CUDA: {DEPTH} x [Linear({args.width},{args.width}) + GELU], {STAGES} stages, "
          f"{args.rows_per_microbatch} rows per microbatch, fp32 (TF32 matmul {tf32}), optimizer {args.optimizer}, "
          f"{args.warmup} warmup + {args.steps} timed steps, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{ngpu} GPU(s): {gpus}; {os.cpu_count()} CPUs, load average before start {load:.2f}", flush=True)
    two = ngpu >= STAGES
    if not two:
        print(f"  only {ngpu} GPU: the {STAGES}-process runs (NCCL needs one GPU per process) are skipped", flush=True)
    print("  Lightning runs are not measured on CUDA (bare engine and torch's schedules only)", flush=True)

    results: dict[str, Any] = {"config": base, "load_before": load, "gpus": gpus, "runs": {}}
    runs = results["runs"]
    quiet = Quiet(args.wait_idle, args.retries)

    def in_process(run: Callable[[], dict]) -> list[dict]:
        try:
            return [run()]
        finally:
            torch.cuda.empty_cache()  # give the GPU back before the next run (or the spawned processes) starts

    for m in args.microbatches:
        cfg = {**base, "m": m}
        rows = cfg["rows"] * m

        def record(key: str, res: list[dict]) -> None:
            runs[key] = res
            peak = " / ".join(f"{r['cuda_peak_mib']:,.0f}" for r in res)
            print_run(m, key, res, rows, f"peak GPU memory {peak} MiB   others' CPU {others_cpu(res):5.1%}", digits=2)

        record(f"single/m{m}", quiet.measure(lambda: in_process(lambda: run_single(cfg))))
        record(f"single_mb/m{m}", quiet.measure(lambda: in_process(lambda: run_single(cfg, microbatched=True))))
        for schedule in SCHEDULES:
            one = {**cfg, "schedule": schedule}
            record(f"engine1/{schedule}/m{m}", quiet.measure(lambda: in_process(lambda: run_engine(one, 0, 1))))
        if not two:
            continue
        record(f"ceiling/m{m}", quiet.measure(lambda: run_ceiling(cfg, CHILD_TIMEOUT)))
        groups = [("torch", _torchpp_worker, "torchpp", TORCH_SCHEDULES)]
        if not args.no_engine:
            groups.insert(0, ("engine", _engine_worker, "engine", ENGINE_SCHEDULES))
        for prefix, worker, name, schedules in groups:
            for pair in quiet.measure_group(worker, name, [{**cfg, "schedule": s} for s in schedules]):
                record(f"{prefix}/{pair[0]['schedule']}/m{m}", pair)

    print()
    print(cuda_report(results, args, two))
    print(f"\n(benchmark wall time {time.perf_counter() - started:.0f}s; "
          f"load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _throughput_table(lines: list[str], systems: list[tuple[str, str]], results: dict, ms: list[int], *,
                      baseline: str, ms_digits: int, peak: Optional[tuple[str, Callable[[list], str]]] = None) -> None:
    """One row per ``(label, key)`` system: samples/s, ms per step, the ratio to ``single`` (column ``baseline``),
    ``peak`` (a column name and a cell from the run's processes) if given, and others' CPU; per m."""
    runs, rows = results["runs"], results["config"]["rows"]
    rate = lambda key, m: _rate(key, runs[key], rows * m)  # noqa: E731
    columns = ["samples/s", "ms/step", baseline] + ([peak[0]] if peak else []) + ["others' CPU"]
    lines.append("| system | " + " | ".join(f"m={m}: " + " | ".join(columns) for m in ms) + " |")
    lines.append("|---|" + "---:|" * len(columns) * len(ms))
    for label, key in systems:
        cells = []
        for m in ms:
            k = f"{key}/m{m}"
            r = rate(k, m)
            cell = [f"{r:,.0f}", f"{rows * m / r * 1e3:.{ms_digits}f}", f"{r / rate(f'single/m{m}', m):.2f}x"]
            cell += [peak[1](runs[k])] if peak else []
            cells.append(" | ".join(cell + [f"{others_cpu(runs[k]):.0%}"]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")


def _ratio_table(lines: list[str], results: dict, ms: list[int]) -> Callable[..., None]:
    """Starts the ratios section; returns ``ratio_row(label, num, den, target, scale=...)``, which adds the row of
    ``num``'s rate over ``den``'s (times ``scale(m)``) per m."""
    runs, rows = results["runs"], results["config"]["rows"]
    rate = lambda key, m: _rate(key, runs[key], rows * m)  # noqa: E731
    lines.append("\n## Ratios against peers measured in this run\n")
    lines.append("| ratio | " + " | ".join(f"m={m}" for m in ms) + " | target |")
    lines.append("|---|" + "---:|" * len(ms) + "---|")

    def ratio_row(label: str, num: str, den: str, target: str, scale: Callable[[int], float] = lambda m: 1.0) -> None:
        vals = [rate(f"{num}/m{m}", m) / rate(f"{den}/m{m}", m) * scale(m) for m in ms]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {target} |")

    return ratio_row


def fastest_synchronous(results: dict, m: int) -> str:
    """The key of torch's fastest schedule at ``m`` in this run."""
    runs, rows = results["runs"], results["config"]["rows"]
    return max((f"torch/{s}" for s in TORCH_SCHEDULES), key=lambda k: _rate(k, runs[f"{k}/m{m}"], rows * m))


def fastest_row(lines: list[str], results: dict, ms: list[int], label: str, num: str, target: str) -> None:
    """A ratio row against torch's fastest synchronous schedule, per m (named in the cell)."""
    runs, rows = results["runs"], results["config"]["rows"]
    cells = []
    for m in ms:
        best = fastest_synchronous(results, m)
        ratio = _rate(f"{num}/m{m}", runs[f"{num}/m{m}"], rows * m) / _rate(best, runs[f"{best}/m{m}"], rows * m)
        cells.append(f"{ratio:.2f} ({best.split('/')[1].removeprefix('Schedule')})")
    lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")


def cuda_report(results: dict, args: argparse.Namespace, two: bool) -> str:
    ms = args.microbatches
    lines = ["## Throughput on CUDA (samples/s from the median steady-state step time on rank 0)\n",
             "Every step ends with `torch.cuda.synchronize()` before its time is taken. *vs one GPU*: against the "
             "whole model in one process on one GPU, whole batch at once. The engine with both stages on one GPU "
             "cannot overlap them: its ratio to one GPU is the engine's overhead (1.00 = none). *peak GPU MiB*: "
             "`torch.cuda.max_memory_allocated` of rank 0's device.\n"]
    systems = [("one GPU, whole batch (baseline)", "single"),
               ("one GPU, m microbatches accumulated", "single_mb")]
    systems += [(f"{s} (bare engine, {STAGES} stages on one GPU)", f"engine1/{s}") for s in SCHEDULES]
    if two:
        systems.append((f"{STAGES} independent processes, one GPU each (sum)", "ceiling"))
        if not args.no_engine:
            systems += [(f"**{s}** (bare engine, {STAGES} GPUs, NCCL)", f"engine/{s}") for s in ENGINE_SCHEDULES]
        systems += [(f"torch {s} ({STAGES} GPUs, NCCL)", f"torch/{s}") for s in TORCH_SCHEDULES]
    _throughput_table(lines, systems, results, ms, baseline="vs one GPU", ms_digits=2,
                      peak=("peak GPU MiB", lambda procs: f"{procs[0]['cuda_peak_mib']:,.0f}"))
    ratio_row = _ratio_table(lines, results, ms)
    for s in SCHEDULES:
        ratio_row(f"{s} bare engine, {STAGES} stages on one GPU / one GPU (engine overhead)", f"engine1/{s}", "single",
                  "1.00 = no overhead")
    ratio_row("one GPU, microbatched / one GPU (cost of the microbatches' smaller matrices)", "single_mb", "single", "-")
    if two:
        if not args.no_engine:
            fastest_row(lines, results, ms, "2bw bare engine / torch's fastest synchronous schedule", "engine/2bw", "-")
            ratio_row("2bw bare engine / torch Schedule1F1B", "engine/2bw", "torch/Schedule1F1B", "-")
            ratio_row("1f1b bare engine / torch Schedule1F1B", "engine/1f1b", "torch/Schedule1F1B", "-")
            ratio_row("gpipe bare engine / torch ScheduleGPipe", "engine/gpipe", "torch/ScheduleGPipe", "-")
            ratio_row(f"2bw bare engine ({STAGES} GPUs) / one GPU", "engine/2bw", "single", "-")
        ratio_row(f"{STAGES} independent processes / one GPU (ceiling)", "ceiling", "single", "-")
        ratio_row(f"{STAGES} x (one GPU, microbatched) / one GPU (no-overhead pipeline)", "single_mb", "single", "-",
                  scale=lambda m: float(STAGES))
    else:
        lines.append(f"\n(one GPU: the {STAGES}-process runs over NCCL were skipped; they need {STAGES} GPUs)")
    lines.append("\nLightning (`Trainer` with `AsyncPipelineStrategy`) is not measured on CUDA by this benchmark.")
    return "\n".join(lines)


def round_targets(runs: dict, cfg: dict, m: int) -> list[tuple[str, float, str]]:
    """Issue 33's targets at ``m`` as one round measured them: ``(label, value, target)``."""
    rows = cfg["rows"] * m
    rate = lambda key: _rate(f"{key}/m{m}", runs[f"{key}/m{m}"], rows)  # noqa: E731
    best = fastest_synchronous({"runs": runs, "config": cfg}, m)
    out = [("2bw (Lightning) / torch's fastest synchronous schedule", rate("lightning/2bw") / rate(best), ">= 1.1"),
           ("2bw (Lightning) / one process, microbatched", rate("lightning/2bw") / rate("single_mb"), ">= 1.9")]
    out += [(f"{s} bare engine in one process / plain loop, steps in turn", runs[f"onedev/{s}/m{m}"][0]["paired_ratio"],
             ">= 0.95") for s in ONE_PROCESS_SCHEDULES]
    return out


def rounds_table(lines: list[str], results: dict, ms: list[int]) -> None:
    """The targets round by round, each ratio within its round (both sides measured minutes apart at most), and
    their median: the machine's speed drifts between rounds, a ratio inside a round much less."""
    rounds, cfg = results["rounds"], results["config"]
    lines.append(f"\n## Targets round by round ({len(rounds)} rounds; each ratio between systems of the same round)\n")
    lines.append("| m | ratio | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median | target |")
    lines.append("|---:|---|" + "---:|" * (len(rounds) + 1) + "---|")
    for m in ms:
        per_round = [round_targets(r, cfg, m) for r in rounds]
        fastest = [fastest_synchronous({"runs": r, "config": cfg}, m).split("/")[1].removeprefix("Schedule")
                   for r in rounds]
        for j, (label, _, target) in enumerate(per_round[0]):
            vals = [pr[j][1] for pr in per_round]
            if j == 0:  # which schedule was torch's fastest, round by round
                label += " (" + ", ".join(fastest) + ")"
            lines.append(f"| {m} | {label} | " + " | ".join(f"{v:.2f}" for v in vals)
                         + f" | {statistics.median(vals):.2f} | {target} |")


def paired_table(lines: list[str], paired: dict, ms: list[int]) -> None:
    """2bw (Lightning) against each of torch's schedules, paired a second apart (:func:`run_paired_blocks`)."""
    lines.append("\n## 2bw (Lightning) against torch's schedules, paired a second apart\n")
    lines.append("Both in one process pair, blocks of 6 steps in turn (12 block rounds, the first step of each block "
                 "not counted): the median over rounds of the schedule's step over 2bw's in the same round. The "
                 "host's drift between runs minutes apart does not enter these ratios.\n")
    lines.append("| m | " + " | ".join(s.removeprefix("Schedule") for s in TORCH_SCHEDULES)
                 + " | against the fastest (lowest median step) | target |")
    lines.append("|---:|" + "---:|" * (len(TORCH_SCHEDULES) + 1) + "---|")
    for m in ms:
        res = paired[str(m)]
        cells = [f"{res['paired'][s]:.2f}" for s in TORCH_SCHEDULES]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {res['paired'][res['fastest']]:.2f} "
                     f"({res['fastest'].removeprefix('Schedule')}) | >= 1.1 |")


def report(results: dict, args: argparse.Namespace) -> str:
    runs, cfg = results["runs"], results["config"]
    lines = []
    lines.append("## Throughput (samples/s from the median steady-state step time on rank 0)\n")
    lines.append("*others' CPU*: share of the machine's CPU time used by processes other than the measured ones during "
                 "the timed window (0% on an otherwise idle machine).\n")
    systems = [("one process, whole batch (baseline)", "single"),
               ("one process, m microbatches accumulated", "single_mb"),
               ("one process, microbatched, split where the stages meet", "single_split"),
               ("the same, the last stage's backward split in input and weight passes (zb_h1's)", "single_split_bw"),
               ("2 independent processes (sum)", "ceiling")]
    systems += [(f"**{s}** (Lightning)", f"lightning/{s}") for s in SCHEDULES]
    systems += [(f"{s} (bare engine, both stages in one process)", f"onedev/{s}") for s in ONE_PROCESS_SCHEDULES]
    if not args.no_engine:
        systems += [(f"{s} (bare engine)", f"engine/{s}") for s in ENGINE_SCHEDULES]
    systems += [(f"torch {s}", f"torch/{s}") for s in TORCH_SCHEDULES]
    ms = args.microbatches
    _throughput_table(lines, systems, results, ms, baseline="vs 1 process", ms_digits=1)
    ratio_row = _ratio_table(lines, results, ms)
    fastest_row(lines, results, ms, "2bw (Lightning) / torch's fastest synchronous schedule", "lightning/2bw", ">= 1.1")
    ratio_row("2bw (Lightning) / torch Schedule1F1B", "lightning/2bw", "torch/Schedule1F1B", ">= 1.3")
    ratio_row("1f1b (Lightning) / torch Schedule1F1B", "lightning/1f1b", "torch/Schedule1F1B", "-")
    ratio_row("gpipe (Lightning) / torch ScheduleGPipe", "lightning/gpipe", "torch/ScheduleGPipe", "-")
    ratio_row("2bw (Lightning) / one process", "lightning/2bw", "single", ">= 1.6")
    ratio_row("2 independent processes / one process (ceiling)", "ceiling", "single", "-")
    ratio_row("2 x (one process, microbatched) / one process (no-overhead pipeline)", "single_mb", "single", "-",
              scale=lambda m: 2.0)
    # The engine's per-microbatch compute against a plain loop's, no transfers: steps in turn, medians over rounds.
    for label, key, target in [("plain loop split where the stages meet", "single_split", "-"),
                               ("the same with zb_h1's split backward", "single_split_bw", "-")] + [
            (f"{s} bare engine in one process", f"onedev/{s}", ">= 0.95") for s in ONE_PROCESS_SCHEDULES]:
        vals = [statistics.median(r[f"{key}/m{m}"][0]["paired_ratio"] for r in results["rounds"]) for m in ms]
        lines.append(f"| {label} / one process, microbatched (plain loop), steps in turn | "
                     + " | ".join(f"{v:.2f}" for v in vals) + f" | {target} |")
    if "zb_h1" in ONE_PROCESS_SCHEDULES:  # zb_h1 against the plain loop with the same split backward
        vals = [statistics.median(r[f"onedev/zb_h1/m{m}"][0]["paired_ratio_split_bw"] for r in results["rounds"])
                for m in ms]
        lines.append("| zb_h1 bare engine in one process / the plain loop with zb_h1's split backward, steps in turn | "
                     + " | ".join(f"{v:.2f}" for v in vals) + " | - |")
    if not args.no_engine:
        fastest_row(lines, results, ms, "2bw bare engine / torch's fastest synchronous schedule", "engine/2bw", "-")
        ratio_row("2bw bare engine / torch Schedule1F1B", "engine/2bw", "torch/Schedule1F1B", "-")
        ratio_row("zb_h1 bare engine / torch Schedule1F1B", "engine/zb_h1", "torch/Schedule1F1B", "-")
        ratio_row("2bw Lightning / 2bw bare engine", "lightning/2bw", "engine/2bw", "-")

    if len(results["rounds"]) > 1:
        rounds_table(lines, results, ms)
    if "paired" in results:
        paired_table(lines, results["paired"], ms)

    lines.append("\n## 2bw under Lightning: where each stage's wall time goes (steady state, per step)\n")
    lines.append("Fractions of the wall time between consecutive step ends. *in engine, other* is the engine's own "
                 "Python and scheduling outside forward/backward and waits (the step's actions, sends, receives "
                 "posted, weight-version copy); *outside engine* is Lightning's loop, data loading, hooks and "
                 "logging. Target: *busy incl. optimizer* >= 0.9 on the critical (busiest) stage.\n")
    lines.append("| m | stage | ms/step | fwd+bwd (busy) | optimizer | busy incl. optimizer | comm wait | "
                 "in engine, other | outside engine | peak RSS MiB |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in ms:
        for r in runs[f"lightning/2bw/m{m}"]:
            t, wall = r["times"], r["mean_sec_per_step"]  # means over the same steps as the breakdown
            outside = max(0.0, wall - t["total"])
            lines.append(
                f"| {m} | {r['rank']} | {wall * 1e3:.1f} | {t['compute'] / wall:.3f} | {t['optimizer'] / wall:.3f} | "
                f"{(t['compute'] + t['optimizer']) / wall:.3f} | {t['comm_wait'] / wall:.3f} | {t['idle'] / wall:.3f} | "
                f"{outside / wall:.3f} | {r['rss_mib']:.0f} |"
            )

    lines.append("\n## Peak RSS per process (MiB)\n")
    lines.append("Mostly the interpreter with torch (about 560 MiB after `import torch` here) and Lightning (about 200 "
                 "MiB more); the model is 1 MiB of weights per layer. The bare-engine and torch rows run their "
                 "schedules one after another in the same two processes, so a later row's peak includes the "
                 "earlier ones'.\n")
    lines.append("| system | " + " | ".join(f"m={m} rank 0 / rank 1" for m in ms) + " |")
    lines.append("|---|" + "---:|" * len(ms))
    lines.append("| one process (each of the 2 independent runs, fresh processes) | " + " | ".join(
        " / ".join(f"{r['rss_mib']:.0f}" for r in runs[f"ceiling/m{m}"]) for m in ms) + " |")
    for label, key in systems[4:]:  # after the one-process rows and the ceiling (above)
        lines.append(f"| {label} | " + " | ".join(
            " / ".join(f"{r['rss_mib']:.0f}" for r in runs[f"{key}/m{m}"]) for m in ms) + " |")

    if "profile" in results:
        lines.append(profile_report(results["profile"], cfg, args.microbatches[0]))
    return "\n".join(lines)


def profile_report(prof: dict, cfg: dict, m: int) -> str:
    lines = [f"\n## Main-thread CPU per step by kind (m={m}, ms, cProfile timed with thread_time)\n"]
    lines.append("CPU time of the process's main thread, so waits cost nothing and other processes on the machine "
                 "do not inflate it. *kernels*: torch's C++ calls (forward kernels, the whole autograd backward, "
                 "optimizer math); *p2p calls*: posting and completing isend/irecv; *python*: everything else (the "
                 "schedule, runtime bookkeeping, Lightning's loop). Profiling inflates *python* (roughly 2x).\n")
    lines.append("| system | stage | kernels | p2p calls | python | of which optimizer step |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for key, pair in prof.items():
        for r in pair:
            c = r["cpu_profile"]
            lines.append(f"| {key} | {r['rank']} | {c['kernels']:.1f} | {c['p2p_calls']:.1f} | {c['python']:.1f} | "
                         f"{c['optimizer']:.1f} |")
    lines.append(f"\n## Where the wall time goes per step while profiled (m={m}, ms)\n")
    lines.append("| system | stage | wall | fwd+bwd compute | p2p wait | optimizer | everything else |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for r in prof["torch/Schedule1F1B"]:
        s, wall = r["split"], r["mean_sec_per_step"]
        compute = s["fwd_pure"] + s["bwd_pure"]
        lines.append(f"| torch Schedule1F1B | {r['rank']} | {wall * 1e3:.1f} | {compute * 1e3:.1f} | "
                     f"{s['p2p_wait'] * 1e3:.1f} | {r['optimizer_s'] * 1e3:.1f} | "
                     f"{(wall - compute - s['p2p_wait'] - r['optimizer_s']) * 1e3:.1f} |")
    for key in ("engine/1f1b", "engine/2bw", "lightning/2bw"):
        for r in prof[key]:
            t, wall = r["times"], r["mean_sec_per_step"]
            where = "bare engine" if key.startswith("engine") else "Lightning, profiled"
            lines.append(f"| ours {key.split('/')[1]} ({where}) | {r['rank']} | {wall * 1e3:.1f} | "
                         f"{t['compute'] * 1e3:.1f} | {t['comm_wait'] * 1e3:.1f} | {t['optimizer'] * 1e3:.1f} | "
                         f"{(wall - t['compute'] - t['comm_wait'] - t['optimizer']) * 1e3:.1f} |")
    lines.append("\ntorch's wrappers: forward_one_chunk / backward_one_chunk around the pure module forward / "
                 "stage_backward (ms per step, rank 0 then rank 1): " + "; ".join(
                     f"fwd {r['split']['fwd_chunk'] * 1e3:.1f} vs {r['split']['fwd_pure'] * 1e3:.1f}, "
                     f"bwd {r['split']['bwd_chunk'] * 1e3:.1f} vs {r['split']['bwd_pure'] * 1e3:.1f}, "
                     f"posting p2p {r['split']['p2p_post'] * 1e3:.2f}" for r in prof["torch/Schedule1F1B"]))
    for key, pair in prof.items():
        for r in pair:
            lines.append(f"\n### cProfile, {key}, rank {r['rank']} (main-thread CPU seconds over the timed steps)\n")
            lines.append("```\n" + _trim_profile(r["profile"]) + "\n```")
    return "\n".join(lines)


def run_predict(base: dict, microbatches: list[int], quiet: "Quiet") -> list[dict]:
    """Each schedule on the bare engine, traced; the planner's prediction from the traced costs."""
    from lightning_async_pp.pipeline.simulate import simulate

    rows = []
    for m in microbatches:
        cfg = {**base, "m": m}
        for pair in quiet.measure_group(_engine_worker, "engine", [{**cfg, "schedule": s, "trace": True} for s in SCHEDULES]):
            costs = [r["costs"] for r in pair]
            schedule = pair[0]["schedule"]
            fwd, bwd = [c["forward_s"] for c in costs], [c["backward_s"] for c in costs]
            opt, comm = [c["optimizer_s"] for c in costs], costs[0]["transfer_s"]
            compute_only = simulate(schedule, STAGES, m, fwd, bwd, comm_s=comm, optimizer_s=opt)
            # The engine's own work per action (inside the step, outside compute and waits) and per step (outside
            # the step: the weight-version copy, setting gradients), as the stages measured them.
            per_action = [r["times"]["idle"] / (2 * m) for r in pair]
            per_step = [max(0.0, r["mean_sec_per_step"] - r["times"]["total"]) for r in pair]
            with_overhead = simulate(schedule, STAGES, m, [f + o for f, o in zip(fwd, per_action)],
                                     [b + o for b, o in zip(bwd, per_action)], comm_s=comm,
                                     optimizer_s=[o + e for o, e in zip(opt, per_step)])
            rows.append({"m": m, "schedule": schedule, "costs": costs, "per_action_s": per_action,
                         "per_step_s": per_step, "measured_s": pair[0]["mean_sec_per_step"],
                         "measured_median_s": pair[0]["sec_per_step"], "others_cpu": others_cpu(pair),
                         "predicted_s": compute_only.step_time_s, "predicted_bubble": compute_only.bubble_fraction,
                         "predicted_with_overhead_s": with_overhead.step_time_s})
            r = rows[-1]
            print(f"  m={m} {schedule:<6} measured {r['measured_s'] * 1e3:7.1f} ms/step, predicted "
                  f"{r['predicted_s'] * 1e3:7.1f} (compute only), {r['predicted_with_overhead_s'] * 1e3:7.1f} "
                  f"(+ engine overhead)   others' CPU {r['others_cpu']:5.1%}", flush=True)
    return rows


#: The schedules measured eager against compiled (zb_h1's split backward does not take compiled layers).
COMPILE_SCHEDULES = SCHEDULES


def run_compile_comparison(args: argparse.Namespace, cuda: bool) -> None:
    """``--compile``: each schedule on the bare engine with eager and with compiled layers, side by side."""
    started = time.perf_counter()
    base = {"rows": args.rows_per_microbatch, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
            "width": args.width, "accelerator": "cuda" if cuda else "cpu"}
    two = not cuda or torch.cuda.device_count() >= STAGES
    where = ["one process, both stages on cuda:0"] if cuda else []
    where += [f"{STAGES} processes" + (", one GPU each (NCCL)" if cuda else " (gloo, 1 thread each)")] if two else []
    print(f"# eager vs compiled layers (bare engine): {DEPTH} x [Linear({args.width},{args.width}) + GELU], "
          f"{STAGES} stages, {args.rows_per_microbatch} rows per microbatch, optimizer {args.optimizer}, "
          f"{args.warmup} warmup (compilation included) + {args.steps} timed steps, torch {torch.__version__}; "
          f"{'; '.join(where)}; load average before start {os.getloadavg()[0]:.2f}", flush=True)
    quiet = Quiet(args.wait_idle, args.retries)
    rows = []
    for m in args.microbatches:
        cfgs = [{**base, "m": m, "schedule": s, "compile": c} for s in COMPILE_SCHEDULES for c in (False, True)]
        measured: list[tuple[str, dict, list[dict]]] = []
        if cuda:
            for cfg in cfgs:
                def one_gpu(cfg: dict = cfg) -> list[dict]:
                    try:
                        return [run_engine(cfg, 0, 1)]
                    finally:
                        torch.cuda.empty_cache()
                measured.append(("one GPU", cfg, quiet.measure(one_gpu)))
        if two:
            for cfg, pair in zip(cfgs, quiet.measure_group(_engine_worker, "engine", cfgs)):
                measured.append((f"{STAGES} processes", cfg, pair))
        for where_run, cfg, res in measured:
            rows.append({"where": where_run, "m": m, "schedule": cfg["schedule"], "compile": cfg["compile"],
                         "sec_per_step": res[0]["sec_per_step"], "others_cpu": others_cpu(res)})
            print(f"  m={m} {where_run:<12} {cfg['schedule']:<6} {'compiled' if cfg['compile'] else 'eager':<9}"
                  f"{res[0]['sec_per_step'] * 1e3:9.2f} ms/step   others' CPU {rows[-1]['others_cpu']:5.1%}",
                  flush=True)
    print()
    print(compile_report(rows))
    print(f"\n(benchmark wall time {time.perf_counter() - started:.0f}s; load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": base, "compile": rows}, indent=1))


def compile_report(rows: list[dict]) -> str:
    lines = ["## Eager vs compiled layers (bare engine, ms per step on rank 0, median of the timed steps)\n",
             "| where | m | schedule | eager ms/step | compiled ms/step | eager / compiled | others' CPU (eager, compiled) |",
             "|---|---:|---|---:|---:|---:|---|"]
    index = {(r["where"], r["m"], r["schedule"], r["compile"]): r for r in rows}
    for (where, m, schedule, compiled), eager in index.items():
        if compiled:
            continue
        comp = index[(where, m, schedule, True)]
        lines.append(f"| {where} | {m} | {schedule} | {eager['sec_per_step'] * 1e3:.2f} | "
                     f"{comp['sec_per_step'] * 1e3:.2f} | {eager['sec_per_step'] / comp['sec_per_step']:.2f}x | "
                     f"{eager['others_cpu']:.0%}, {comp['others_cpu']:.0%} |")
    return "\n".join(lines)


def predict_report(rows: list[dict], cfg: dict) -> str:
    lines = ["## Predicted vs measured, p=2 (bare engine, traced)\n",
             f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps per run, {cfg['rows']} rows per microbatch. Costs "
             "fed to the planner: each stage's mean forward / backward / optimizer span from the trace of the timed "
             "steps, and half the median round trip of one activation between the two processes. *compute only* "
             "uses just these; *+ engine overhead* adds each stage's own work per action (the step's time outside "
             "compute, waits and optimizer, over 2m actions) and per step (outside the engine's step). Measured: "
             "rank 0's mean time between step ends over the same steps.\n",
             "| m | schedule | fwd / bwd stage 0 (ms) | fwd / bwd stage 1 (ms) | transfer (ms) | measured ms/step | "
             "predicted, compute only | predicted / measured | predicted, + engine overhead | predicted / measured | "
             "others' CPU |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c0, c1 = r["costs"]
        lines.append(
            f"| {r['m']} | {r['schedule']} | {c0['forward_s'] * 1e3:.2f} / {c0['backward_s'] * 1e3:.2f} | "
            f"{c1['forward_s'] * 1e3:.2f} / {c1['backward_s'] * 1e3:.2f} | {c0['transfer_s'] * 1e3:.3f} | "
            f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['predicted_s'] / r['measured_s']:.2f} | "
            f"{r['predicted_with_overhead_s'] * 1e3:.1f} | {r['predicted_with_overhead_s'] / r['measured_s']:.2f} | "
            f"{r['others_cpu']:.0%} |")
    return "\n".join(lines)


def _trim_profile(text: str) -> str:
    keep = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced"))]
    return "\n".join(keep)


if __name__ == "__main__":
    main()
