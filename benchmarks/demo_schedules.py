"""Steps per second of the demo job (configs/demo.yaml) under each schedule, measured in one run.

    .venv/bin/python benchmarks/demo_schedules.py [--devices 1] [--steps 60] [--warmup 10]

Each schedule trains the demo's GPT on the embedded corpus through the CLI for `--steps` steps; the rate is
taken over the steps after `--warmup` (compile, cache and allocator warm-up excluded), on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


class StepTimer(L.Callback):
    """Records the wall time at the end of every training step on rank 0 and prints the rate at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times = warmup, []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            timed = self.times[self.warmup:]
            print("STEPS_PER_SEC", json.dumps((len(timed) - 1) / (timed[-1] - timed[0])), flush=True)


def run_one(schedule: str, devices: int, steps: int, warmup: int, workdir: Path) -> float:
    args = [
        sys.executable, __file__, "--child", "fit", "--config", str(ROOT / "configs" / "demo.yaml"),
        f"--trainer.devices={devices}", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
        f"--trainer.logger.init_args.save_dir={workdir / 'logs'}",
        f"--trainer.strategy.init_args.schedule={schedule}",
        "--trainer.callbacks+=benchmarks.demo_schedules.StepTimer", f"--trainer.callbacks.warmup={warmup}",
        f"--data.cache_dir={workdir / 'cache'}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // devices)))
    out = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return float(out.stdout.split("STEPS_PER_SEC")[1].split()[0])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        # sys.argv stays as it is: Lightning's launcher re-executes it for the other ranks.
        from lightning_async_pp.cli import main as cli_main

        cli_main(args=sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--schedules", nargs="+", default=["2bw", "1f1b", "gpipe"])
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="demo_schedules_"))
    rates = {s: run_one(s, args.devices, args.steps, args.warmup, workdir) for s in args.schedules}
    print(f"\ndemo job, devices={args.devices}, {args.steps} steps ({args.warmup} warm-up steps not timed)\n")
    print("| schedule | steps/s | vs 1f1b |\n|---|---|---|")
    for s, r in rates.items():
        print(f"| {s} | {r:.3f} | {r / rates['1f1b']:.2f}x |" if "1f1b" in rates else f"| {s} | {r:.3f} | |")


if __name__ == "__main__":
    main()
