"""Delay study, second round (docs/delay-study.md): delay sweeps, per-stage delays, a longer horizon, iso-loss
token overhead, net speedup, and a synchronous tail (``sync_from_step``).

Every run is one ``lightning-async-pp fit`` of ``configs/study/base.yaml`` (plus ``configs/study/long/base.yaml``
for the longer horizon) and one cell file, with command-line overrides, on one CPU device where every delay rule
is exact. One command per experiment:

    .venv/bin/python examples/delay_study2.py sweep     # d in {0,1,2,4,8} x {AdamW, Muon} x {plain, corrected}
    .venv/bin/python examples/delay_study2.py stages    # p=4: per-stage [3,2,1,0] vs uniform 1 vs uniform 3
    .venv/bin/python examples/delay_study2.py iso       # async runs 1.25x, 1.5x, 2x as long: iso-loss overhead
    .venv/bin/python examples/delay_study2.py tail      # sync_from_step for the last 20% / 10% of training
    .venv/bin/python examples/delay_study2.py long      # 1.05 M parameters, 2000 updates
    .venv/bin/python examples/delay_study2.py report    # read every finished run, write tables and the figure

Runs go to ``runs/study2/<experiment>/<name>/`` (TensorBoard), finished runs are skipped (an interrupted
experiment resumes), and ``report`` rewrites the marked block of docs/delay-study.md, ``runs/study2/results.md``
and ``docs/delay-study2.png``.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import delay_study as study  # noqa: E402

ROOT = study.ROOT
CONFIGS = study.CONFIGS
#: Each optimizer's best synchronous lr in the first round's sweep (docs/delay-study.md).
BEST_LR = {"adamw": 3e-3, "muon": 3e-2}
DELAYS = (0, 1, 2, 4, 8)
ISO_SCALES = (1.25, 1.5, 2.0)
TAIL_FRACTIONS = (0.2, 0.1)
BASE_STEPS, LONG_STEPS = 300, 2000
#: BENCHMARKS.md, "Across processes" (4 stages, 4 processes, GPT 4 layers x 256, 8 microbatches, 2 CPU cores):
#: 2bw 1.60x the 1f1b throughput. The only measured 2bw/1f1b ratio in the repository; see docs/delay-study.md.
THROUGHPUT_RATIO = 1.60


@dataclass(frozen=True)
class Spec:
    """One run: ``cell`` is a configs/study file (``adamw_2bw_ef``), ``extra`` more CLI overrides."""

    experiment: str
    name: str
    cell: str
    lr: float
    seed: int = 0
    extra: tuple[str, ...] = ()
    long: bool = False

    @property
    def optimizer(self) -> str:
        return self.cell.split("_", 1)[0]

    def log_dir(self, out: Path) -> Path:
        return out / self.experiment / self.name

    def cli_args(self, out: Path) -> list[str]:
        base = study.cli_args(study.Run(self.optimizer, self.cell.split("_", 1)[1], self.lr, self.seed), out)
        configs = ["--config", str(CONFIGS / "base.yaml")]
        if self.long:
            configs += ["--config", str(CONFIGS / "long" / "base.yaml")]
        configs += ["--config", str(CONFIGS / f"{self.cell}.yaml")]
        overrides = [a for a in base[5:] if "logger" not in a]  # lr and seed
        return ["fit", *configs, *overrides, *self.extra, f"--trainer.logger.init_args.save_dir={out}",
                f"--trainer.logger.init_args.name={self.experiment}", f"--trainer.logger.init_args.version={self.name}"]


def _steps(n: int, warmup: Optional[int] = None) -> tuple[str, ...]:
    out = (f"--trainer.max_steps={n}", f"--lr_scheduler.init_args.total_steps={n}")
    return out + ((f"--lr_scheduler.init_args.warmup_steps={warmup}",) if warmup is not None else ())


def _cell(opt: str, ef: bool, sync: bool = False) -> str:
    return f"{opt}_{'sync' if sync else '2bw_ef' if ef else '2bw'}"


def plan(experiment: str, seeds: Sequence[int] = (0,)) -> list[Spec]:
    specs: list[Spec] = []
    for seed in seeds:
        for opt, lr in BEST_LR.items():
            if experiment == "sweep":
                for d in DELAYS:
                    for ef in (False, True):
                        specs.append(Spec("sweep", f"{opt}_d{d}{'_ef' if ef else ''}_s{seed}", _cell(opt, ef), lr, seed,
                                          (f"--trainer.strategy.init_args.delay={d}",)))
            elif experiment == "stages":
                four = ("--trainer.strategy.init_args.num_stages=4", "--trainer.strategy.init_args.partition=[1,1,1,1]")
                for name, delay in (("perstage", "[3,2,1,0]"), ("uniform1", "1"), ("uniform3", "3")):
                    specs.append(Spec("stages", f"{opt}_{name}_s{seed}", _cell(opt, False), lr, seed,
                                      (*four, f"--trainer.strategy.init_args.delay={delay}")))
            elif experiment == "iso":
                for ef in (False, True):
                    for scale in ISO_SCALES:
                        n = round(BASE_STEPS * scale)
                        specs.append(Spec("iso", f"{opt}_2bw{'_ef' if ef else ''}_x{scale:g}_s{seed}", _cell(opt, ef),
                                          lr, seed, _steps(n)))
            elif experiment == "tail":
                for ef in (False, True):
                    for frac in TAIL_FRACTIONS:
                        k = round(BASE_STEPS * (1 - frac))
                        specs.append(Spec("tail", f"{opt}_2bw{'_ef' if ef else ''}_K{k}_s{seed}", _cell(opt, ef), lr,
                                          seed, (f"--trainer.strategy.init_args.sync_from_step={k}",)))
            elif experiment == "long":
                for variant in ("sync", "2bw", "2bw_ef"):
                    specs.append(Spec("long", f"{opt}_{variant}_s{seed}", f"{opt}_{variant}", lr, seed, long=True))
            elif experiment == "longtail":
                k = round(LONG_STEPS * 0.85)
                specs.append(Spec("long", f"{opt}_2bw_K{k}_s{seed}", f"{opt}_2bw", lr, seed,
                                  (f"--trainer.strategy.init_args.sync_from_step={k}",), long=True))
            else:
                raise ValueError(f"unknown experiment {experiment!r}; use one of {', '.join(EXPERIMENTS)}")
    return specs


EXPERIMENTS = ("sweep", "stages", "iso", "tail", "long", "longtail")


def execute(spec: Spec, out: Path) -> tuple[bool, float]:
    log = out / "logs" / f"{spec.experiment}_{spec.name}.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # torch.set_num_threads(1) in the child
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "lightning_async_pp.cli", *spec.cli_args(out)],
                             stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc == 0:
        (spec.log_dir(out) / study.DONE).write_text("")
    return rc == 0, time.perf_counter() - start


def run_all(specs: Sequence[Spec], out: Path) -> None:
    todo = [s for s in specs if not (s.log_dir(out) / study.DONE).exists()]
    print(f"{len(specs) - len(todo)} of {len(specs)} runs already done; running {len(todo)} one at a time", flush=True)
    if todo:
        study.build_data_cache()
    start = time.perf_counter()
    for spec in todo:
        ok, seconds = execute(spec, out)
        print(f"[{time.perf_counter() - start:7.0f}s] {spec.experiment:7s} {spec.name:24s} {seconds:5.0f}s "
              f"{'ok' if ok else 'FAILED'}", flush=True)


# ---- aggregation (pure functions on numbers; tests call these) ------------------------------------------------------
def crossing_step(curve: Sequence[tuple[int, float]], target: float) -> float:
    """First step at which ``curve`` (validation points) reaches ``target`` or below, linearly interpolated between
    points; NaN if it never does."""
    prev = None
    for step, value in curve:
        if value <= target:
            if prev is None:
                return float(step)
            (s0, v0) = prev
            return s0 + (step - s0) * (v0 - target) / (v0 - value)
        prev = (step, value)
    return math.nan


def overhead_from_sync_curve(sync_curve: Sequence[tuple[int, float]], async_final: float, total: int) -> float:
    """Token overhead read off the synchronous curve: sync reaches the async final loss at step s, so async needs
    ``total / s - 1`` more tokens. The sync run is mid-schedule at s (higher lr), so this overstates the overhead."""
    s = crossing_step(sync_curve, async_final)
    return total / s - 1 if s == s and s > 0 else math.nan


def overhead_from_longer_runs(finals: Mapping[float, float], sync_final: float) -> float:
    """Iso-loss token overhead from async runs of ``scale x`` the updates (each with its own full schedule):
    ``finals`` maps scale (1.0 = the base run) to final loss. The scale at which the async final loss meets the
    synchronous one, linearly interpolated, minus 1; NaN if even the longest run stays above it; 0 if the base
    run is already at or below it."""
    points = sorted(finals.items())
    for i, (scale, loss) in enumerate(points):
        if loss <= sync_final:
            if i == 0:
                return 0.0 if scale <= 1.0 else math.nan
            s0, l0 = points[i - 1]
            return s0 + (scale - s0) * (l0 - sync_final) / (l0 - loss) - 1
    return math.nan


def net_speedup(throughput_ratio: float, token_overhead: float) -> float:
    """Wall-clock speedup to the same loss: the throughput gain divided by the extra tokens needed."""
    return throughput_ratio / (1 + token_overhead) if token_overhead == token_overhead else math.nan


def tail_closed(gap_full_async: float, gap_with_tail: float) -> float:
    """Share of the async gap (to sync) that a synchronous tail closes."""
    return (gap_full_async - gap_with_tail) / gap_full_async if gap_full_async > 0 else math.nan


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=(*EXPERIMENTS, "report"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "study2", help="where the runs' logs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.experiment == "report":
        report_all(out, args.seeds)
        return
    specs = plan(args.experiment, args.seeds)
    if args.dry_run:
        for spec in specs:
            print("lightning-async-pp", " ".join(spec.cli_args(out)))
        return
    run_all(specs, out)


if __name__ == "__main__":
    main()
