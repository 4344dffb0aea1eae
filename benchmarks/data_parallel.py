"""Data parallelism at p stages x r replicas: optimizer state per process with and without ``shard_optimizer``, and
the gradient reduction's exposed time with and without overlap, against the planner.

Each configuration is one ``Trainer.fit`` over ``p * r`` processes (Lightning launches them; gloo on CPU, NCCL on
CUDA) of ``--layers`` x ``Linear(--width, --width)`` under ``2bw`` with AdamW wrapped in ``ErrorFeedback``. Every
process reports the bytes of optimizer state it holds (``parallel.zero.state_nbytes``), its peak memory (RSS
on CPU, ``max_memory_allocated`` on CUDA) and, per step after the warm-up, the engine's ``StepTimes``
(``dp_comm``, ``dp_comm_exposed``, compute). The overlap is switched with ``GradientReducer.OVERLAP``.

    .venv/bin/python benchmarks/data_parallel.py                    # p=2 x r=2, CPU
    .venv/bin/python benchmarks/data_parallel.py --accelerator cuda --stages 2 --replicas 2

The planner's prediction takes the measured per-microbatch forward+backward time of each stage (backward = 2 x
forward) and the measured reduction time without overlap, and simulates ``2bw`` with ``dp_overlap="none"`` and
``"backward"``; ``--json PATH`` keeps every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
from benchmarks.harness import peak_rss_mib, run_ranks, step_recorder, write_json  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def worker(cfg: dict, out_dir: str) -> None:
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy, PipelineModule
    from lightning_async_pp.optim import ErrorFeedback
    from lightning_async_pp.parallel.data_parallel import GradientReducer
    from lightning_async_pp.parallel.zero import state_nbytes

    GradientReducer.OVERLAP = cfg["overlap"]
    GradientReducer.BUCKET_BYTES = int(cfg["bucket_mb"] * 2**20)

    class Wide(PipelineModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = None

        def configure_model(self) -> None:
            if self.blocks is None:
                self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(cfg["width"], cfg["width"], bias=False), nn.Tanh())
                                            for _ in range(cfg["layers"]))

        def pipeline_layers(self):
            return list(self.blocks)

        def pipeline_loss(self, output, batch):
            return output.pow(2).mean()

        def configure_optimizers(self):
            return ErrorFeedback(self.parameters(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), coefficient=1.0)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    p, r = cfg["stages"], cfg["replicas"]
    record = step_recorder(("total", "compute", "dp_comm", "dp_comm_exposed", "optimizer"))
    trainer = L.Trainer(
        strategy=AsyncPipelineStrategy("2bw", num_microbatches=cfg["microbatches"], data_parallel_size=r,
                                       shard_optimizer=cfg["shard"]),
        accelerator=cfg["accelerator"], devices=p * r, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    data = torch.utils.data.TensorDataset(torch.randn(cfg["batch"] * (cfg["steps"] + 1) * r, cfg["width"]))
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"], drop_last=True)
    with trainer.init_module():
        model = Wide()
    trainer.fit(model, loader)
    if cfg["accelerator"] == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_mib() * 2**20
    strategy = trainer.strategy
    out = {"rank": trainer.global_rank, "stage": strategy.topology.stage, "replica": strategy.topology.dp_rank,
           "optimizer_state_bytes": sum(state_nbytes(o) for o in strategy.optimizers), "peak_bytes": peak,
           "param_bytes": sum(q.numel() * q.element_size() for q in strategy.engine.params),
           "steps": record.steps[cfg["warmup"]:]}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def run(cfg: dict) -> list[dict]:
    """One ``Trainer.fit`` over p * r processes (this script's ``--worker``; Lightning starts the other ranks), its
    output shown as it runs; each rank's result."""
    return run_ranks([os.path.abspath(__file__), "--worker", json.dumps(cfg)], "rank*.json", f"run {cfg}",
                     timeout=3600, ranks=cfg["stages"] * cfg["replicas"],
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, capture=False)


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / max(1, len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="GradientReducer.BUCKET_BYTES in MiB (default 4)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out_dir)
        return
    base = {k: getattr(args, k) for k in ("stages", "replicas", "layers", "width", "batch", "microbatches", "steps",
                                          "warmup", "accelerator", "bucket_mb")}
    runs = {
        "unsharded, overlapped": run(dict(base, shard=False, overlap=True)),
        "sharded, overlapped": run(dict(base, shard=True, overlap=True)),
        "sharded, not overlapped": run(dict(base, shard=True, overlap=False)),
    }
    p, r, m = args.stages, args.replicas, args.microbatches
    print(f"\n## p={p} x r={r}, {args.layers} x Linear({args.width}, {args.width}), AdamW + ErrorFeedback, 2bw, "
          f"m={m}, batch {args.batch} per replica, {args.accelerator}; steps {args.warmup}..{args.steps - 1}\n")
    print("| run | rank | stage | optimizer state MiB | x unsharded | peak MiB | dp reduction ms | exposed ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    plain = {row["rank"]: row for row in runs["unsharded, overlapped"]}
    for name, rows in runs.items():
        for row in rows:
            ratio = row["optimizer_state_bytes"] / max(1, plain[row["rank"]]["optimizer_state_bytes"])
            print(f"| {name} | {row['rank']} | {row['stage']} | {row['optimizer_state_bytes'] / 2**20:.1f} | "
                  f"{ratio:.2f} | {row['peak_bytes'] / 2**20:.0f} | {1e3 * mean(s['dp_comm'] for s in row['steps']):.1f} | "
                  f"{1e3 * mean(s['dp_comm_exposed'] for s in row['steps']):.1f} |")
    # The planner with this run's costs: each stage's forward + backward per microbatch (backward = 2 forward) and the
    # reduction time measured where nothing hides it.
    from lightning_async_pp.pipeline.simulate import simulate

    exposed_run = runs["sharded, not overlapped"]
    per_stage = [[row for row in exposed_run if row["stage"] == s] for s in range(p)]
    work = [mean(st["compute"] for row in rows for st in row["steps"]) / m for rows in per_stage]
    reduce_s = [mean(st["dp_comm_exposed"] for row in rows for st in row["steps"]) for rows in per_stage]
    print("\n| stage | measured fwd+bwd per microbatch ms | reduction ms | exposed, not overlapped ms (measured / "
          "planner) | exposed, overlapped ms (measured / planner) |")
    print("|---:|---:|---:|---:|---:|")
    layer_mb = args.width * args.width * 4 / 2**20
    buckets = max(1, round(args.layers / p / max(1, int(args.bucket_mb // layer_mb))))
    predicted = {mode: simulate("2bw", p, m, [w / 3 for w in work], [2 * w / 3 for w in work], dp_reduce_s=reduce_s,
                                dp_overlap=mode, dp_buckets=buckets) for mode in ("none", "backward")}
    overlapped = runs["sharded, overlapped"]
    for s in range(p):
        measured_overlap = mean(st["dp_comm_exposed"] for row in overlapped if row["stage"] == s for st in row["steps"])
        print(f"| {s} | {1e3 * work[s]:.1f} | {1e3 * reduce_s[s]:.1f} | {1e3 * reduce_s[s]:.1f} / "
              f"{1e3 * predicted['none'].dp_exposed_s[s]:.1f} | {1e3 * measured_overlap:.1f} / "
              f"{1e3 * predicted['backward'].dp_exposed_s[s]:.1f} |")
    write_json(args.json, {"config": base, "runs": runs})


if __name__ == "__main__":
    main()
