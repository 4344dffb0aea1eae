"""The model, the data and the optimizer of ``pipeline_throughput.py``: identical in every system measured."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.harness import one_thread, total_steps

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
CPU_STEPS = (20, 5)  # default timed and warm-up steps per run on CPU
CUDA_STEPS = (50, 10)  # on CUDA: steps take milliseconds, and the first ones pay for cuBLAS's set-up


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


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
