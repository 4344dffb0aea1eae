"""Expert parallelism's memory: per-process expert parameters and peak memory at ``expert_parallel_size`` 2 against
1 for the same ``models.Llama`` with routed experts, the same 2 stages x 2 data-parallel replicas (4 processes in
both runs), and the step time (docs/design/expert-parallel.md).

Each configuration is one ``Trainer.fit`` under ``2bw`` with AdamW through the public strategy
(``AsyncPipelineStrategy(data_parallel_size=2, expert_parallel_size=e)``), the same layers per stage
(``partition="parameters"``). The experts dominate the model's parameters (wide experts, a byte vocabulary, short
rows): a stage keeps two weight versions of what it holds, the gradients and AdamW's two moments, about ``5 x`` its
weights, and ``e = 2`` holds half of each stage's experts on each replica. Every process reports the expert
parameters it holds (those of its stage's ``experts.*``, in bytes), every parameter it holds, its peak memory
(``VmHWM`` on CPU, ``max_memory_allocated`` on CUDA), the same before the model got memory (the interpreter, torch
and Lightning: equal in both runs, not the model's) and its median step time after the warm-up. On CPU the runs
set glibc's ``MALLOC_MMAP_THRESHOLD_`` (128 KiB) so that the resident peak counts live memory, not blocks malloc
kept after they were freed. The ratios are ``e = 2`` over ``e = 1`` in the same invocation; ``--rounds N`` runs
both N times in turn (each round starting with the other) and reports the median of each round's step ratio,
which the machine's drift between rounds does not move.

    .venv/bin/python benchmarks/expert_parallel_memory.py --rounds 3          # CPU, gloo
    .venv/bin/python benchmarks/expert_parallel_memory.py --accelerator cuda  # needs 4 GPUs (2 stages x 2 replicas)

On this CPU the step time says nothing of speed on GPUs: the 4 processes share the machine's cores in both runs,
and ``e = 2`` adds two all-to-alls per MoE layer each way over gloo while each process computes half the experts
on twice the rows. ``--json PATH`` keeps every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import (in_turn, load_line, median_gap, median_ratio, one_thread_env,  # noqa: E402
                                peak_rss_mib, resident_mib, resident_peak_env, run_ranks, step_recorder,
                                wall_time_line, write_json)

one_thread_env()

import torch  # noqa: E402

REPLICAS, STAGES = 2, 2


def held_bytes(module: torch.nn.Module, experts_only: bool) -> int:
    """Bytes of the parameters this process holds (materialized, not on the meta device), of its experts alone
    where ``experts_only``."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters()
               if p.device.type != "meta" and (not experts_only or ".experts." in f".{n}"))


def worker(cfg: dict, out_dir: str) -> None:
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.models import Llama

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    e, cuda = cfg["expert_parallel"], cfg["accelerator"] == "cuda"
    record = step_recorder()
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=cfg["microbatches"], partition="parameters",
                                     data_parallel_size=REPLICAS, expert_parallel_size=e, gather_final_weights=False)
    trainer = L.Trainer(
        strategy=strategy, accelerator=cfg["accelerator"], devices=STAGES * REPLICAS,
        max_steps=cfg["warmup"] + cfg["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record],
    )
    model = Llama("tiny", vocab_size=256, hidden_size=cfg["hidden"], num_layers=cfg["layers"], num_heads=cfg["heads"],
                  num_kv_heads=cfg["heads"] // 2, intermediate_size=4 * cfg["hidden"], max_seq_len=cfg["seq"],
                  num_experts=cfg["experts"], experts_per_token=cfg["top_k"],
                  expert_intermediate_size=cfg["expert_width"], init_seed=0)  # on the meta device until configure_model
    # each replica draws its own batches (Lightning's distributed sampler): enough rows for every step of both
    rows = torch.randint(0, 256, (REPLICAS * cfg["batch"] * (cfg["warmup"] + cfg["steps"] + 1), cfg["seq"] + 1))
    loader = torch.utils.data.DataLoader(list(rows), batch_size=cfg["batch"], drop_last=True)
    before = resident_mib() * 2**20
    trainer.fit(model, loader)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_mib() * 2**20
    module = trainer.lightning_module
    out = {"rank": trainer.global_rank, "stage": trainer.strategy.engine.stage_views[0].index, "peak_bytes": peak,
           "before_bytes": 0 if cuda else before, "expert_bytes": held_bytes(module, True),
           "param_bytes": held_bytes(module, False), "sec_per_step": median_gap(record.ends[cfg["warmup"]:]),
           "loss": float(trainer.callback_metrics["train_loss"])}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def run(cfg: dict) -> list[dict]:
    """One ``Trainer.fit`` over 4 processes (this script's ``--worker``; Lightning starts the other ranks)."""
    return run_ranks([os.path.abspath(__file__), "--worker", json.dumps(cfg)], "rank*.json", f"run {cfg}",
                     timeout=3600, ranks=STAGES * REPLICAS,
                     env=resident_peak_env())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=1024, help="each expert's intermediate size")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="a replica's batch")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of e = 1 and e = 2 in turn (the step ratio is each round's, their median reported)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out_dir)
        return
    base = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "experts", "top_k", "expert_width", "seq",
                                          "batch", "microbatches", "steps", "warmup", "accelerator")}
    started = time.perf_counter()
    rounds: list[dict[int, list[dict]]] = []
    for turn in range(args.rounds):  # e = 1 and e = 2 in turn, each round starting with the other
        rounds.append({e: run(dict(base, expert_parallel=e)) for e in in_turn([1, 2], turn)})
        step = {e: statistics.median(r["sec_per_step"] for r in rows) for e, rows in rounds[-1].items()}
        print(f"round {turn}: step e = 2 / e = 1 {step[2] / step[1]:.2f} ({step[2]:.2f} s / {step[1]:.2f} s; load "
              f"average {load_line()})", flush=True)
    runs = {e: rounds[-1][e] for e in (1, 2)}
    mib = 2**20
    print(f"\n## Llama hidden {args.hidden}, {args.layers} layers of {args.experts} experts (top-{args.top_k}, width "
          f"{args.expert_width}), vocab 256, {STAGES} stages x {REPLICAS} replicas, 2bw + AdamW, a replica's batch "
          f"{args.batch} x {args.seq} tokens, {args.microbatches} microbatches, {args.accelerator}\n")
    print("| e | rank | stage | expert weights held MiB | all weights held MiB | peak MiB | before the model MiB | "
          "peak - before MiB | s/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e, rows in runs.items():
        for r in rows:
            print(f"| {e} | {r['rank']} | {r['stage']} | {r['expert_bytes'] / mib:.1f} | {r['param_bytes'] / mib:.1f} | "
                  f"{r['peak_bytes'] / mib:.0f} | {r['before_bytes'] / mib:.0f} | "
                  f"{(r['peak_bytes'] - r['before_bytes']) / mib:.0f} | {r['sec_per_step']:.2f} |")
    experts = {e: max(r["expert_bytes"] for r in rows) for e, rows in runs.items()}
    largest = {e: max(r["peak_bytes"] for r in rows) for e, rows in runs.items()}
    model = {e: max(r["peak_bytes"] - r["before_bytes"] for r in rows) for e, rows in runs.items()}
    steps = {e: [statistics.median(r["sec_per_step"] for r in rnd[e]) for rnd in rounds] for e in (1, 2)}
    print(f"\ne = 2 / e = 1 (largest process, last round): expert weights held {experts[2] / experts[1]:.2f}x, peak "
          f"{largest[2] / largest[1]:.2f}x, peak above the interpreter's {model[2] / model[1]:.2f}x; step (median "
          f"over processes, median over {len(rounds)} rounds of each round's ratio) "
          f"{median_ratio(steps[2], steps[1]):.2f}x")
    print(wall_time_line(started))
    write_json(args.json, {"config": base, "rounds": rounds})


if __name__ == "__main__":
    main()
