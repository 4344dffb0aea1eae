"""Systems of ``pipeline_throughput.py`` timed in turn, so that the machine's drift reaches all alike: the plain
loop and the bare engine with both stages in one process, step by step (:func:`run_interleaved`), and 2bw against
torch's schedules in one process pair, blocks of steps in turn (:func:`run_paired_blocks`;
``benchmarks/paired_rounds.py --blocks`` prints the rounds)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness import (
    CHILD_TIMEOUT, block_median, in_turn, median_ratio, own_cpu_seconds, peak_rss_mib, run_pairs, system_busy_seconds,
)
from benchmarks.throughput.systems import EngineLoop, PlainLoop, TorchLoop, init_group, run_lightning
from benchmarks.throughput.workload import STAGES, TORCH_SCHEDULES, device_of, setup_threads, total_steps


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
            start = (time.perf_counter(), own_cpu_seconds(), system_busy_seconds())
        for name in in_turn(names, i):
            t = time.perf_counter()
            loops[name].step(i)
            times[name].append(time.perf_counter() - t)
        if i == last - 1:
            end = (time.perf_counter(), own_cpu_seconds(), system_busy_seconds())
    # The machine-wide window is shared: each system gets it whole (others' CPU is then the same for all).
    window = {"wall_s": end[0] - start[0], "cpu_s": end[1] - start[1], "system_busy_s": end[2] - start[2],
              "rss_mib": peak_rss_mib()}
    timed = {n: t[first:last] for n, t in times.items()}
    out = {}
    for name in names:
        result = {**window, "sec_per_step": statistics.median(timed[name]),
                  "mean_sec_per_step": statistics.fmean(timed[name])}
        if name != "single_mb":
            result["paired_ratio"] = median_ratio(timed["single_mb"], timed[name])
        if name in schedules:
            result["paired_ratio_split_bw"] = median_ratio(timed["single_split_bw"], timed[name])
        out[name] = [result]
    return out



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
    paired = {n: median_ratio([r[n] for r in rounds], [r[ours] for r in rounds]) for n in TORCH_SCHEDULES}
    step = {n: statistics.median(r[n] for r in rounds) for n in TORCH_SCHEDULES}
    return {"ours": ours, "rounds": rounds, "paired": paired, "step": step, "fastest": min(step, key=step.get),
            "ours_step": statistics.median(r[ours] for r in rounds)}
