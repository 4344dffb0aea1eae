"""Peak memory per process of a model built in ``configure_model``, on 1, 2 and 4 pipeline stages.

Each configuration runs as its own ``Trainer.fit`` (Lightning launches the processes) with a model of
``--layers`` x ``Linear(--width, --width)`` (8 x 8192^2 = 2 GiB of fp32 parameters by default) under ``2bw``, and
again with a tiny model of the same shape of run (width 64): the difference of the peak resident memory of each
process between the two, divided by the whole model's parameter bytes, is what the model costs a stage.
For SGD without momentum a stage holds its parameters, its stash and its gradients: 3/p of the parameters is the
floor (0.75 at p=4).

    .venv/bin/python benchmarks/memory.py                       # SGD, 1/2/4 processes
    .venv/bin/python benchmarks/memory.py --optimizer adamw --procs 2 4
    .venv/bin/python benchmarks/memory.py --optimizer adamw-loop --procs 4   # AdamW(foreach=False)

On a CUDA machine, ``--accelerator cuda`` reports ``torch.cuda.max_memory_allocated`` instead of the resident size.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn


def worker(cfg: dict) -> None:
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy, PipelineModule

    class Wide(PipelineModule):
        def __init__(self, layers: int, width: int, optimizer: str) -> None:
            super().__init__()
            self.shape, self.optimizer_name, self.blocks = (layers, width), optimizer, None

        def configure_model(self) -> None:
            if self.blocks is None:
                layers, width = self.shape
                self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh()) for _ in range(layers))

        def pipeline_layers(self):
            return list(self.blocks)

        def pipeline_loss(self, output, batch):
            return output.pow(2).mean()

        def configure_optimizers(self):
            if self.optimizer_name.startswith("adamw"):
                # torch's default (foreach) AdamW allocates a stage-sized temporary in each step; the loop does not.
                return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=self.optimizer_name == "adamw")
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    procs, width = cfg["procs"], cfg["width"]
    strategy_kwargs = dict(num_microbatches=4, gather_final_weights=False)
    if cfg.get("activation_checkpointing"):
        strategy_kwargs["activation_checkpointing"] = True
    if procs == 1:
        strategy_kwargs["num_stages"] = 1
    trainer = L.Trainer(
        accelerator=cfg["accelerator"], devices=procs, max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=AsyncPipelineStrategy(**strategy_kwargs),
    )
    data = torch.utils.data.DataLoader(torch.randn(cfg["rows"] * cfg["steps"], width), batch_size=cfg["rows"])
    trainer.fit(Wide(cfg["layers"], width, cfg["optimizer"]), data)
    if cfg["accelerator"] == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(Path(cfg["out"]) / f"rank{trainer.global_rank}.json", "w") as f:
        json.dump({"peak": peak}, f)


def measure(cfg: dict) -> list[int]:
    """Peak bytes of each process of one run."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps({**cfg, "out": out})], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"run {cfg} failed:\n{proc.stderr[-4000:]}")
        return [json.load(open(Path(out) / f"rank{r}.json"))["peak"] for r in range(cfg["procs"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8, help="rows per batch (activations are negligible)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["sgd", "adamw", "adamw-loop"], default="sgd")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    base = dict(layers=args.layers, rows=args.rows, steps=args.steps, optimizer=args.optimizer,
                activation_checkpointing=args.activation_checkpointing, accelerator=args.accelerator)
    param_bytes = args.layers * args.width * args.width * 4
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {param_bytes / 2**30:.2f} GiB fp32, "
          f"optimizer {args.optimizer}, 2bw, activation checkpointing {'on' if args.activation_checkpointing else 'off'}")
    print("| processes | peak per process above the tiny model (GiB) | / parameter bytes | floor: (params + stash + grads + optimizer state) / p |")
    print("|---|---|---|---|")
    for procs in args.procs:
        tiny = measure({**base, "procs": procs, "width": 64})
        big = measure({**base, "procs": procs, "width": args.width})
        above = [b - t for b, t in zip(big, tiny)]
        ratios = ", ".join(f"{a / param_bytes:.3f}" for a in above)
        gib = ", ".join(f"{a / 2**30:.2f}" for a in above)
        floor = 3 / procs + (2 / procs if args.optimizer.startswith("adamw") else 0)
        print(f"| {procs} | {gib} | {ratios} | {floor:.3f} |", flush=True)


if __name__ == "__main__":
    main()
