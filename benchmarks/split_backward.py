#!/usr/bin/env python
"""Where zb_h1's split backward spends its time: one microbatch through the last stage of ``make bench``'s model
(``pipeline_throughput.py``: four ``Linear(width, width) + GELU`` layers and the MSE loss), its backward run
whole (``loss.backward()``), split as zb_h1 runs it (``pipeline/backward.py``: the input pass, then the weight
pass) and as the input gradient alone (``torch.autograd.grad`` to the input: the input pass's kernels without the
graph surgery), taking steps in turn so that the machine's drift reaches all three alike.

Two differences locate the split's extra: the input pass against the input gradient alone is what the
surgery and its recording hooks add to the input pass; the weight pass against the whole backward less the
input gradient alone (the whole backward's weight-gradient share) is what a second autograd call per weight's
node, and its matmuls run later on data that left the cache, add. At a few rows the kernels are cheap and what
remains is the fixed cost per call.

    .venv/bin/python benchmarks/split_backward.py                     # widths 512 and 1024, 8 and 128 rows
    .venv/bin/python benchmarks/split_backward.py --widths 512 --rows 64 256 --steps 40

One thread, as ``make bench`` gives each process. BENCHMARKS.md, "zb_h1's split backward".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import in_turn, one_thread  # noqa: E402
from benchmarks.throughput.workload import STAGES, make_layers, mse, stage_layers  # noqa: E402  (one thread first)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_async_pp.pipeline.backward import backward_input, backward_weight  # noqa: E402

Phase = Callable[[], None]


def phases(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], list[Phase]]]:
    """Each way of running the backward: a fresh forward, then the backward's parts to time one by one."""
    weights = list(stage.parameters())

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        received = x.detach().requires_grad_()  # what a last stage receives
        return received, mse(stage(received), y)

    def whole() -> list[Phase]:
        _, loss = forward()
        return [loss.backward]

    def split() -> list[Phase]:
        received, loss = forward()
        pending = []
        return [lambda: pending.append(backward_input([loss], [None], [received], weights)),
                lambda: backward_weight(pending.pop())]

    def input_only() -> list[Phase]:
        received, loss = forward()
        return [lambda: torch.autograd.grad([loss], [received])]

    return {"whole": whole, "split": split, "input only": input_only}


def measure(width: int, rows: int, steps: int) -> dict[str, float]:
    """Median seconds of each part: ``{"whole": ..., "split B": ..., "split W": ..., "input only": ...}``."""
    stage = nn.Sequential(*stage_layers(make_layers(width), STAGES - 1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    ways = phases(stage, x, y)
    names = {"whole": ["whole"], "split": ["split B", "split W"], "input only": ["input only"]}
    wall: dict[str, list[float]] = {n: [] for ns in names.values() for n in ns}
    order = list(ways)

    def steps_in_turn(first: int, count: int, timed: bool) -> None:
        for step in range(first, first + count):
            for way in in_turn(order, step):
                for name, part in zip(names[way], ways[way]()):
                    start = time.perf_counter()
                    part()
                    if timed:
                        wall[name].append(time.perf_counter() - start)
            stage.zero_grad(set_to_none=True)

    steps_in_turn(0, 3, timed=False)  # warm up
    steps_in_turn(3, steps, timed=True)
    return {n: statistics.median(t) for n, t in wall.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 128], help="rows per microbatch (make bench: 128)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each (after three to warm up)")
    args = ap.parse_args()
    one_thread()
    torch.manual_seed(0)
    print("Milliseconds per microbatch on the last stage (medians of steps taken in turn):\n")
    print("| width | rows | whole backward | input gradient alone | split: input pass | split: weight pass | "
          "split / whole | input pass - input gradient alone | weight pass - (whole - input gradient alone) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for width in args.widths:
        for rows in args.rows:
            r = measure(width, rows, args.steps)
            whole, alone, b, w = (r[k] * 1e3 for k in ("whole", "input only", "split B", "split W"))
            print(f"| {width} | {rows} | {whole:.2f} | {alone:.2f} | {b:.2f} | {w:.2f} | {(b + w) / whole:.3f} | "
                  f"{b - alone:+.2f} | {w - (whole - alone):+.2f} |")


if __name__ == "__main__":
    main()
