"""Tensor parallelism's memory: per-process peak memory at ``tensor_parallel_size`` 2 against 1 for the same
``models.Llama`` and the same 2 stages, and the step time (docs/design/tensor-parallel.md).

Each configuration is one ``Trainer.fit`` under ``2bw`` with AdamW: ``t = 1`` on 2 processes, ``t = 2`` on 4 (gloo on
CPU, NCCL on CUDA), the same layers per stage (``partition="parameters"``). The model's parameters dominate its
memory (wide blocks, a byte vocabulary, short rows): a stage keeps two weight versions, the gradients and AdamW's two
moments, about ``5 x`` its weights, which tensor parallelism divides by ``t``, as it divides the embedding, the head
and (sequence parallelism) the activations. Every process reports its peak memory (``VmHWM`` on CPU,
``max_memory_allocated`` on CUDA), the same before the model got memory (the interpreter, torch and Lightning: equal
in both runs, not the model's), and its median step time after the warm-up. On CPU the runs set glibc's
``MALLOC_MMAP_THRESHOLD_`` (128 KiB) so that the resident peak counts live memory, not blocks malloc kept after
they were freed.

    .venv/bin/python benchmarks/tensor_parallel_memory.py                  # CPU, gloo
    .venv/bin/python benchmarks/tensor_parallel_memory.py --accelerator cuda  # needs 4 GPUs (2 stages x 2 ranks)

On this CPU the step time says nothing of speed-ups: the 4 processes of ``t = 2`` share the same cores as the 2 of
``t = 1`` and add the tensor-parallel collectives over gloo. ``--json PATH`` keeps every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import (median_gap, one_thread_env, peak_rss_mib, resident_mib,  # noqa: E402
                                resident_peak_env, run_ranks, step_recorder, write_json)

one_thread_env()

import torch  # noqa: E402


def worker(cfg: dict, out_dir: str) -> None:
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.models import Llama

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    t, cuda = cfg["tensor_parallel"], cfg["accelerator"] == "cuda"
    # the final weights stay where they are in both runs (t > 1 requires it; at t = 1 rank 0 would gather the model)
    kwargs = dict(tensor_parallel_size=t, gather_final_weights=False)
    record = step_recorder()
    trainer = L.Trainer(
        strategy=AsyncPipelineStrategy("2bw", num_microbatches=cfg["microbatches"], partition="parameters", **kwargs),
        accelerator=cfg["accelerator"], devices=2 * t, max_steps=cfg["warmup"] + cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    model = Llama("tiny", vocab_size=256, hidden_size=cfg["hidden"], num_layers=cfg["layers"], num_heads=cfg["heads"],
                  num_kv_heads=cfg["heads"] // 2, intermediate_size=4 * cfg["hidden"], max_seq_len=cfg["seq"],
                  init_seed=0)  # parameters on the meta device until configure_model: no memory yet
    rows = torch.randint(0, 256, (cfg["batch"] * (cfg["warmup"] + cfg["steps"] + 1), cfg["seq"] + 1))
    loader = torch.utils.data.DataLoader(list(rows), batch_size=cfg["batch"], drop_last=True)
    before = resident_mib() * 2**20
    trainer.fit(model, loader)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_mib() * 2**20
    strategy = trainer.strategy
    out = {"rank": trainer.global_rank, "stage": strategy.engine.stage_views[0].index, "peak_bytes": peak,
           "before_bytes": 0 if cuda else before,
           "param_bytes": sum(q.numel() * q.element_size() for q in strategy.engine.stages[0].versions.slots[0]),
           "sec_per_step": median_gap(record.ends[cfg["warmup"]:]),
           "loss": float(trainer.callback_metrics["train_loss"])}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def run(cfg: dict) -> list[dict]:
    """One ``Trainer.fit`` over ``2 x t`` processes (this script's ``--worker``; Lightning starts the other ranks)."""
    return run_ranks([os.path.abspath(__file__), "--worker", json.dumps(cfg)], "rank*.json", f"run {cfg}",
                     timeout=3600, ranks=2 * cfg["tensor_parallel"],
                     env=resident_peak_env())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out_dir)
        return
    base = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "seq", "batch", "microbatches", "steps",
                                          "warmup", "accelerator")}
    runs = {t: run(dict(base, tensor_parallel=t)) for t in (1, 2)}
    mib = 2**20
    print(f"\n## Llama hidden {args.hidden}, {args.layers} layers, intermediate {4 * args.hidden}, vocab 256, "
          f"2 stages, 2bw + AdamW, batch {args.batch} x {args.seq} tokens, {args.microbatches} microbatches, "
          f"{args.accelerator}\n")
    print("| t | rank | stage | weights held MiB | peak MiB | before the model MiB | peak - before MiB | s/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t, rows in runs.items():
        for r in rows:
            print(f"| {t} | {r['rank']} | {r['stage']} | {r['param_bytes'] / mib:.0f} | {r['peak_bytes'] / mib:.0f} | "
                  f"{r['before_bytes'] / mib:.0f} | {(r['peak_bytes'] - r['before_bytes']) / mib:.0f} | "
                  f"{r['sec_per_step']:.2f} |")
    largest = {t: max(r["peak_bytes"] for r in rows) for t, rows in runs.items()}
    model = {t: max(r["peak_bytes"] - r["before_bytes"] for r in rows) for t, rows in runs.items()}
    step = {t: statistics.median(r["sec_per_step"] for r in rows) for t, rows in runs.items()}
    print(f"\nlargest process at t = 2 / t = 1: peak {largest[2] / largest[1]:.2f}x, "
          f"peak above the interpreter's {model[2] / model[1]:.2f}x; step {step[2]:.2f} s / {step[1]:.2f} s")
    write_json(args.json, {"config": base, "runs": runs})


if __name__ == "__main__":
    main()
