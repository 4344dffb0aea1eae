#!/usr/bin/env python
"""In-flight activation memory per pipeline stage, with and without activation checkpointing.

Two processes (one stage each, gloo on CPU) run the tiny GPT (``models.GPT``: 4 blocks, width 128, 4 heads,
sequences of 128 bytes) under ``2bw`` with 8 microbatches, through the engine's facade (``PipelineEngine.build``,
``train_step``, ``prepare_update``) and a plain SGD loop: what ``AsyncPipelineStrategy`` does, without Lightning.

Method: each process's resident memory (Linux ``/proc/self/status``), with glibc told to serve every allocation
of 64 KiB or more by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so that freed activations leave the process at once
and its resident size follows the live tensors. After a warm-up run (two steps, drained: nothing in flight, every
lazily created buffer exists) the baseline is taken and the peak (``VmHWM``) is reset; the measured steps' peak
above that baseline is everything a step adds: the activations held for backward by the microbatches in flight
(received inputs included), the current batch's gradient (one parameter-sized buffer: the loop drops the
previous step's gradient after the update) and short-lived temporaries. The table's "activations" column is
that peak minus the gradient bytes. The memory left after the measured run, which ends drained, is printed as a
check (about zero). (``torch.profiler``'s memory events were tried first: they miss frees that happen on the
gloo threads, and with profile_all_threads they record nothing.)

Run: ``.venv/bin/python benchmarks/activation_memory.py`` (about a minute; prints a Markdown table and writes
``--out`` as JSON). See BENCHMARKS.md.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # one thread per process, before torch is imported

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

STAGES = 2
VARIANTS: dict[str, Any] = {"off": False, "blocks (layers 1-4)": [1, 2, 3, 4], "all layers (True)": True}


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def resident() -> dict[str, int]:
    """This process's resident set now and its peak since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def worker(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES,
                            timeout=timedelta(seconds=120))
    from lightning_async_pp.models import GPT
    from lightning_async_pp.pipeline.config import PipelineConfig
    from lightning_async_pp.pipeline.engine import PipelineEngine

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, args.block_size + 1), generator=g) for _ in range(args.steps)]
    results = []
    for name, checkpointing in VARIANTS.items():
        torch.manual_seed(0)
        model = GPT(block_size=args.block_size, n_layer=4, n_head=4, n_embd=128)
        config = PipelineConfig(schedule="2bw", num_microbatches=args.microbatches, partition="uniform",
                                activation_checkpointing=checkpointing, pipeline_timeout=120.0)
        engine = PipelineEngine.build(model, model.pipeline_layers(), config, input_fn=model.pipeline_input,
                                      loss_fn=model.pipeline_loss, device=torch.device("cpu"), world_size=STAGES,
                                      rank=rank)
        engine.start()
        optimizer = torch.optim.SGD(engine.params, lr=1e-3)

        def train(steps: list) -> list[float]:
            losses = []
            for i, batch in enumerate(steps):
                last = i + 1 == len(steps)  # the last step takes no lookahead: the run ends drained
                losses.append(float(engine.train_step(batch, None if last else steps[i + 1])))
                for p, grad in zip(engine.params, engine.gradients):
                    p.grad = grad
                engine.prepare_update()
                optimizer.step()
                for p in engine.params:
                    p.grad = None
                engine.gradients.clear()  # hold one step's gradient at a time
            return losses

        losses = train(batches[:2])  # warm-up
        gc.collect()
        baseline = resident()["VmRSS"]
        reset_peak()
        start = time.perf_counter()
        losses += train(batches[2:])
        wall = time.perf_counter() - start
        gc.collect()
        after = resident()
        gradient = tensor_bytes(engine.params)
        peak = after["VmHWM"] - baseline
        results.append({"variant": name, "stage": engine.stage_views[0].index, "peak_bytes": peak,
                        "gradient_bytes": gradient, "activation_bytes": peak - gradient, "losses": losses,
                        "left_after_bytes": after["VmRSS"] - baseline, "parameter_bytes": tensor_bytes(engine.params),
                        "stash_bytes": engine.stats.stash_nbytes, "seconds_per_step": wall / (len(batches) - 2)})
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch (split into the microbatches)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="training steps, the first two a warm-up")
    parser.add_argument("--out", default="activation_memory.json")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each worker process starts
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(free_port(), args, out_dir), nprocs=STAGES, start_method="spawn", join=True)
        rows = [row for r in range(STAGES) for row in json.loads(Path(out_dir, f"rank{r}.json").read_text())]
    Path(args.out).write_text(json.dumps(rows, indent=1))
    mib = 2.0**20
    off = {row["stage"]: row for row in rows if row["variant"] == "off"}
    print(f"p={STAGES}, m={args.microbatches}, batch {args.batch} x {args.block_size} tokens, 2bw, "
          f"{args.steps - 2} measured steps after 2 warm-up steps")
    print("| checkpointed | stage | activations in flight, peak (MiB) | vs off | peak above weights (MiB) "
          "| of it gradient (MiB) | left after the run (MiB) | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["stage"])):
        ratio = row["activation_bytes"] / off[row["stage"]]["activation_bytes"]
        print(f"| {row['variant']} | {row['stage']} | {row['activation_bytes'] / mib:.1f} | {ratio:.2f}x | "
              f"{row['peak_bytes'] / mib:.1f} | {row['gradient_bytes'] / mib:.1f} | "
              f"{row['left_after_bytes'] / mib:.1f} | {row['seconds_per_step']:.2f} |")
    same = all(r["losses"] == off[r["stage"]]["losses"] for r in rows)
    print(f"losses identical with and without checkpointing on every stage: {same}")


if __name__ == "__main__":
    main()
