"""Delay study, second round (docs/delay-study.md): delay sweeps, per-stage delays, a longer horizon, iso-loss
token overhead, net speedup, and a synchronous tail (``sync_from_step``).

Every run is one ``lightning-async-pp fit`` of ``configs/study/base.yaml`` (plus ``configs/study/long/base.yaml``
for the longer horizon) and one cell file, with command-line overrides, on one CPU device where every delay rule
is exact. One command per experiment:

    .venv/bin/python studies/delay/sweeps.py sweep     # d in {0,1,2,4,8} x {AdamW, Muon} x {plain, corrected}
    .venv/bin/python studies/delay/sweeps.py stages    # p=4: per-stage [3,2,1,0] vs uniform 1 vs uniform 3
    .venv/bin/python studies/delay/sweeps.py iso       # async runs 1.5x and 2x as long: iso-loss overhead
    .venv/bin/python studies/delay/sweeps.py tail      # sync_from_step for the last 20% / 10% of training
    .venv/bin/python studies/delay/sweeps.py long      # 1.05 M parameters, 2000 updates
    .venv/bin/python studies/delay/sweeps.py lowlr     # AdamW at lr 1e-3: sync, 2BW, 2BW + correction, 300 updates
    .venv/bin/python studies/delay/sweeps.py longlowlr # the same at the longer horizon
    .venv/bin/python studies/delay/sweeps.py report    # read every finished run, write tables and the figure
    .venv/bin/python studies/delay/sweeps.py horizon --seeds 0 1 2 --jobs 2         # long + longlowlr, 3 seeds
    .venv/bin/python studies/delay/sweeps.py report-horizon --seeds 0 1 2           # their mean +- std block

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grid as study  # noqa: E402

ROOT = study.ROOT
CONFIGS = study.CONFIGS
#: Each optimizer's best synchronous lr in the first round's sweep (docs/delay-study.md).
BEST_LR = {"adamw": 3e-3, "muon": 3e-2}
#: A second lr for the horizon question (AdamW's recovered share was 74% at 1e-3 in the first round).
LOW_LR = {"adamw": 1e-3}
DELAYS = (0, 1, 2, 4, 8)
ISO_OPTIMIZERS = ("adamw", "muon")
ISO_SCALES = (1.5, 2.0)
TAIL_FRACTIONS = (0.2, 0.1)
BASE_STEPS, LONG_STEPS = 300, 2000
#: docs/benchmarks-archive.md, "Run A (full table)": 2bw (Lightning) / 1f1b (Lightning) samples/s, p=2 stages on 2 CPU cores.
THROUGHPUT_RATIOS = {"m=4": 9579 / 7513, "m=8": 9090 / 7721}
#: docs/benchmarks-archive.md, "Against torch's zero-bubble and interleaved schedules", quiet medians of 3 ``make bench`` runs:
#: 2bw (Lightning) / torch's fastest synchronous schedule of each run, p=2 stages on 2 CPU cores.
FASTEST_SYNC_RATIOS = {"m=4": 1.15, "m=8": 1.19}


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
    if experiment == "horizon":  # the 2000-update cells the seeds question is about; the 88% cell first
        return plan("longlowlr", seeds) + plan("long", seeds)
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
                # uniform 1 and sync are the sweep's d=1 and d=0 runs: one uniform delay is the same rule however
                # many stages share it
                for name, delay in (("perstage", "[3,2,1,0]"), ("uniform3", "3")):
                    specs.append(Spec("stages", f"{opt}_{name}_s{seed}", _cell(opt, False), lr, seed,
                                      (*four, f"--trainer.strategy.init_args.delay={delay}")))
            elif experiment == "iso":
                if opt not in ISO_OPTIMIZERS:
                    continue
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
            elif experiment in ("lowlr", "longlowlr"):
                # the horizon question again at a lower lr, where the first round's correction recovered 74%
                if opt not in LOW_LR:
                    continue
                for variant in ("sync", "2bw", "2bw_ef"):
                    specs.append(Spec("long" if experiment == "longlowlr" else "sweep",
                                      f"{opt}_{variant}_lr{LOW_LR[opt]:g}_s{seed}", f"{opt}_{variant}", LOW_LR[opt], seed,
                                      long=experiment == "longlowlr"))
            elif experiment == "longtail":
                k = round(LONG_STEPS * 0.85)
                specs.append(Spec("long", f"{opt}_2bw_K{k}_s{seed}", f"{opt}_2bw", lr, seed,
                                  (f"--trainer.strategy.init_args.sync_from_step={k}",), long=True))
            else:
                raise ValueError(f"unknown experiment {experiment!r}; use one of {', '.join(EXPERIMENTS)}")
    return specs


EXPERIMENTS = ("sweep", "stages", "iso", "tail", "long", "longtail", "lowlr", "longlowlr", "horizon")


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


def run_all(specs: Sequence[Spec], out: Path, jobs: int = 1) -> None:
    todo = [s for s in specs if not (s.log_dir(out) / study.DONE).exists()]
    print(f"{len(specs) - len(todo)} of {len(specs)} runs already done; running {len(todo)}, {jobs} at a time",
          flush=True)
    if not todo:
        return
    study.build_data_cache()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each run is its own one-thread process
        for spec, (ok, seconds) in zip(todo, pool.map(lambda s: execute(s, out), todo)):
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


# ---- the report ---------------------------------------------------------------------------------------------------
def curves(specs: Sequence[Spec], out: Path) -> dict[str, list[tuple[int, float]]]:
    """Validation curves of the finished runs, by name."""
    return {s.name: c for s in specs if (s.log_dir(out) / study.DONE).exists() and (c := study.read_curve(s.log_dir(out)))}


def _f(x: float, digits: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def sweep_table(c: Mapping[str, Sequence[tuple[int, float]]], seed: int = 0) -> str:
    lines = ["| optimizer (lr) | delay d | plain | corrected | gap plain - sync | gap corrected - sync | recovered |",
             "|---|---|---|---|---|---|---|"]
    for opt, lr in BEST_LR.items():
        sync = c.get(f"{opt}_d0_s{seed}")
        for d in DELAYS:
            plain, corr = c.get(f"{opt}_d{d}_s{seed}"), c.get(f"{opt}_d{d}_ef_s{seed}")
            if not (sync and plain and corr):
                continue
            s0, p, e = sync[-1][1], plain[-1][1], corr[-1][1]
            lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {d} | {_f(p)} | {_f(e)} | {_f(p - s0)} | {_f(e - s0)} "
                         f"| {study._pct(study.recovered_share(s0, p, e))} |")
    return "\n".join(lines)


def stages_table(sweep: Mapping[str, Sequence[tuple[int, float]]], stages: Mapping[str, Sequence[tuple[int, float]]],
                 seed: int = 0) -> str:
    lines = ["| optimizer (lr) | sync | uniform 1 (2BW) | per-stage [3,2,1,0] | uniform 3 | gap per-stage | gap uniform 3 "
             "| uniform 3 / per-stage |", "|---|---|---|---|---|---|---|---|"]
    for opt, lr in BEST_LR.items():
        runs = [sweep.get(f"{opt}_d0_s{seed}"), sweep.get(f"{opt}_d1_s{seed}"), stages.get(f"{opt}_perstage_s{seed}"),
                stages.get(f"{opt}_uniform3_s{seed}")]
        if not all(runs):
            continue
        sync, one, per, three = (r[-1][1] for r in runs)
        ratio = (three - sync) / (per - sync) if per > sync else math.nan
        lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {_f(sync)} | {_f(one)} | {_f(per)} | {_f(three)} "
                     f"| {_f(per - sync)} | {_f(three - sync)} | {_f(ratio, 2)} |")
    return "\n".join(lines)


def _long_rows() -> list[tuple[str, float, str]]:
    """``(optimizer, lr, name tag)`` of the longer horizon's rows: each optimizer's best lr, then ``LOW_LR``."""
    return [(opt, lr, "") for opt, lr in BEST_LR.items()] + [(opt, lr, f"_lr{lr:g}") for opt, lr in LOW_LR.items()]


def long_table(c: Mapping[str, Sequence[tuple[int, float]]], seed: int = 0) -> str:
    k = round(LONG_STEPS * 0.85)
    lines = ["| optimizer (lr) | sync | async (2BW) | async + correction | async, sync from 1700 | gap async - sync "
             "| gap corrected - sync | recovered | tail closes |", "|---|---|---|---|---|---|---|---|---|"]
    rows = _long_rows()
    for opt, lr, tag in rows:
        sync, asyn, corr = (c.get(f"{opt}_{v}{tag}_s{seed}") for v in ("sync", "2bw", "2bw_ef"))
        if not (sync and asyn and corr):
            continue
        tail = c.get(f"{opt}_2bw_K{k}_s{seed}") if not tag else None
        s0, a, e = sync[-1][1], asyn[-1][1], corr[-1][1]
        t = tail[-1][1] if tail else math.nan
        lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {_f(s0)} | {_f(a)} | {_f(e)} | {_f(t)} | {_f(a - s0)} "
                     f"| {_f(e - s0)} | {study._pct(study.recovered_share(s0, a, e))} | {study._pct(tail_closed(a - s0, t - s0))} |")
    return "\n".join(lines)


def horizon_tables(c: Mapping[str, Sequence[tuple[int, float]]], seeds: Sequence[int],
                   ratios: Mapping[str, float] = FASTEST_SYNC_RATIOS) -> str:
    """The 2000-update cells over ``seeds``: final losses (mean +- sample std over the seeds that finished all three
    runs of a row), gaps and the recovered share from the means, each seed's share; then the token overhead read off
    each seed's own synchronous curve and the net speedup against the fastest synchronous schedule (``ratios``)."""
    rows = _long_rows()
    loss = ["| optimizer (lr) | seeds | sync | async (2BW) | async + correction | gap async - sync | gap corrected - sync "
            "| recovered (means) | recovered, per seed |", "|---|---|---|---|---|---|---|---|---|"]
    cost = ["| optimizer (lr) | variant | seeds | token overhead (read off sync), per seed | mean "
            + "".join(f"| net speedup ({m}, x{r:.2f}) " for m, r in ratios.items()) + "|",
            "|---|---|---|---|---" + "|---" * len(ratios) + "|"]
    for opt, lr, tag in rows:
        runs = {seed: [c.get(f"{opt}_{v}{tag}_s{seed}") for v in ("sync", "2bw", "2bw_ef")] for seed in seeds}
        done = [seed for seed, r in runs.items() if all(r)]
        if not done:
            continue
        finals = {seed: [r[-1][1] for r in runs[seed]] for seed in done}
        (s0, ss), (a, sa), (e, se) = (study.mean_std([finals[k][i] for k in done]) for i in range(3))
        per_seed = ", ".join(study._pct(study.recovered_share(*finals[k])) for k in done)
        label = f"{study.OPTIMIZER_LABELS[opt]} ({lr:g})"
        loss.append(f"| {label} | {', '.join(map(str, done))} | {_f(s0)} ± {_f(ss)} | {_f(a)} ± {_f(sa)} "
                    f"| {_f(e)} ± {_f(se)} | {_f(a - s0)} | {_f(e - s0)} | {study._pct(study.recovered_share(s0, a, e))} "
                    f"| {per_seed} |")
        for i, variant in ((1, "async"), (2, "async + correction")):
            overheads = [overhead_from_sync_curve(runs[k][0], finals[k][i], LONG_STEPS) for k in done]
            mean = study.mean_std(overheads)[0]
            speed = "".join(f"| {_f(net_speedup(r, mean), 2)} " for r in ratios.values())
            cost.append(f"| {label} | {variant} | {', '.join(map(str, done))} "
                        f"| {', '.join(study._pct(o) for o in overheads)} | {study._pct(mean)} {speed}|")
    return "\n".join(loss) + "\n\n" + "\n".join(cost)


def _as_cells(sweep: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, Sequence[tuple[int, float]]]:
    """The sweep's d=0 / d=1 / d=1 corrected runs under the long experiment's names (sync, 2bw, 2bw_ef)."""
    out = dict(sweep)
    for name, run in sweep.items():
        for d, variant in (("_d0_", "_sync_"), ("_d1_ef_", "_2bw_ef_"), ("_d1_", "_2bw_")):
            if d in name:
                out.setdefault(name.replace(d, variant), run)
    return out


def recovered_along(sync: Sequence[tuple[int, float]], asyn: Sequence[tuple[int, float]],
                    corr: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The recovered share at every validation step the three curves share."""
    s, a, e = dict(sync), dict(asyn), dict(corr)
    return [(k, study.recovered_share(s[k], a[k], e[k])) for k in sorted(set(s) & set(a) & set(e))]


def iso_table(sweep: Mapping[str, Sequence[tuple[int, float]]], iso: Mapping[str, Sequence[tuple[int, float]]],
              long: Mapping[str, Sequence[tuple[int, float]]], seed: int = 0) -> str:
    lines = ["| run | sync final | async final | overhead, longer async runs | overhead, read off the sync curve "
             + "".join(f"| net speedup ({m}, x{r:.2f}) " for m, r in THROUGHPUT_RATIOS.items()) + "|",
             "|---|---|---|---|---" + "|---" * len(THROUGHPUT_RATIOS) + "|"]
    for opt in BEST_LR:
        sync = sweep.get(f"{opt}_d0_s{seed}")
        for ef in (False, True):
            base = sweep.get(f"{opt}_d1{'_ef' if ef else ''}_s{seed}")
            if not (sync and base):
                continue
            finals = {1.0: base[-1][1]}
            for scale in ISO_SCALES:
                run = iso.get(f"{opt}_2bw{'_ef' if ef else ''}_x{scale:g}_s{seed}")
                if run:
                    finals[scale] = run[-1][1]
            direct = overhead_from_longer_runs(finals, sync[-1][1]) if len(finals) > 1 else math.nan
            if direct != direct and len(finals) == 1 + len(ISO_SCALES):
                direct_text = f"> {max(ISO_SCALES) - 1:.0%}"
            else:
                direct_text = study._pct(direct) if direct == direct else "n/a"
            read = overhead_from_sync_curve(sync, base[-1][1], BASE_STEPS)
            best = direct if direct == direct else read
            speed = "".join(f"| {_f(net_speedup(r, best), 2)} " for r in THROUGHPUT_RATIOS.values())
            lines.append(f"| {study.OPTIMIZER_LABELS[opt]} {'async + correction' if ef else 'async'}, 300 updates "
                         f"| {_f(sync[-1][1])} | {_f(base[-1][1])} | {direct_text} | {study._pct(read)} {speed}|")
        sync_l = long.get(f"{opt}_sync_s{seed}")
        for ef in (False, True):
            run = long.get(f"{opt}_2bw{'_ef' if ef else ''}_s{seed}")
            if not (sync_l and run):
                continue
            read = overhead_from_sync_curve(sync_l, run[-1][1], LONG_STEPS)
            speed = "".join(f"| {_f(net_speedup(r, read), 2)} " for r in THROUGHPUT_RATIOS.values())
            lines.append(f"| {study.OPTIMIZER_LABELS[opt]} {'async + correction' if ef else 'async'}, {LONG_STEPS} updates "
                         f"(1.05 M) | {_f(sync_l[-1][1])} | {_f(run[-1][1])} | not run | {study._pct(read)} {speed}|")
    return "\n".join(lines)


def tail_table(sweep: Mapping[str, Sequence[tuple[int, float]]], tail: Mapping[str, Sequence[tuple[int, float]]],
               seed: int = 0) -> str:
    lines = ["| optimizer (lr) | variant | sync from | final | gap to sync | full-async gap | tail closes |",
             "|---|---|---|---|---|---|---|"]
    for opt, lr in BEST_LR.items():
        sync = sweep.get(f"{opt}_d0_s{seed}")
        for ef in (False, True):
            full = sweep.get(f"{opt}_d1{'_ef' if ef else ''}_s{seed}")
            if not (sync and full):
                continue
            for frac in TAIL_FRACTIONS:
                k = round(BASE_STEPS * (1 - frac))
                run = tail.get(f"{opt}_2bw{'_ef' if ef else ''}_K{k}_s{seed}")
                if not run:
                    continue
                gap, full_gap = run[-1][1] - sync[-1][1], full[-1][1] - sync[-1][1]
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {'async + correction' if ef else 'async'} "
                             f"| {k} (last {frac:.0%}) | {_f(run[-1][1])} | {_f(gap)} | {_f(full_gap)} "
                             f"| {study._pct(tail_closed(full_gap, gap))} |")
    return "\n".join(lines)


def plot_all(c: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], path: Path, seed: int = 0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.3))
    ax = axes[0]
    for opt, ls in (("adamw", "-"), ("muon", "--")):
        sync = c["sweep"].get(f"{opt}_d0_s{seed}")
        for ef, color in ((False, "tab:red"), (True, "tab:green")):
            pts = [(d, r[-1][1] - sync[-1][1]) for d in DELAYS
                   if sync and (r := c["sweep"].get(f"{opt}_d{d}{'_ef' if ef else ''}_s{seed}"))]
            if pts:
                ax.plot(*zip(*pts), ls=ls, marker="o", color=color,
                        label=f"{study.OPTIMIZER_LABELS[opt]}{' + correction' if ef else ''}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(title="final loss minus sync vs uniform delay d (300 updates)", xlabel="delay d (updates)", ylabel="gap",
           xticks=list(DELAYS))
    ax.legend(fontsize=8)
    ax = axes[1]
    colors = {"sync": "tab:blue", "2bw": "tab:red", "2bw_ef": "tab:green", f"2bw_K{round(LONG_STEPS * 0.85)}": "tab:purple"}
    lines = [("adamw", "", "-"), ("muon", "", "--")] + [(o, f"_lr{lr:g}", ":") for o, lr in LOW_LR.items()]
    for opt, tag, ls in lines:
        for v, color in colors.items():
            run = c["long"].get(f"{opt}_{v}{tag}_s{seed}")
            if run:
                lr = LOW_LR[opt] if tag else BEST_LR[opt]
                ax.plot(*zip(*run), ls=ls, color=color, label=f"{study.OPTIMIZER_LABELS[opt]} lr {lr:g} {v}")
    ax.set(title=f"longer horizon: 1.05 M parameters, {LONG_STEPS} updates", xlabel="update", ylabel="validation loss")
    ax.set_ylim(bottom=2.0)
    ax.set_ylim(top=3.0)
    ax.legend(fontsize=7)
    ax = axes[2]
    for opt, tag, ls in lines:
        for exp, marker, n in (("long", "o", LONG_STEPS), ("sweep", "s", BASE_STEPS)):
            suffix = ("sync", "2bw", "2bw_ef") if exp == "long" or tag else ("d0", "d1", "d1_ef")
            runs = [c[exp].get(f"{opt}_{x}{tag}_s{seed}") for x in suffix]
            if all(runs):
                pts = recovered_along(*runs)
                lr = LOW_LR[opt] if tag else BEST_LR[opt]
                ax.plot([k / n for k, _ in pts], [r for _, r in pts], ls=ls, marker=marker,
                        label=f"{study.OPTIMIZER_LABELS[opt]} lr {lr:g}, {n} updates")
    ax.set(title="share of the gap the correction recovers, along training", xlabel="fraction of training",
           ylabel="recovered share", ylim=(-0.5, 1.5))
    ax.axhline(1, color="k", lw=0.5)
    ax.legend(fontsize=8)
    ax = axes[3]
    for opt, ls in (("adamw", "-"), ("muon", "--")):
        sync = c["sweep"].get(f"{opt}_d0_s{seed}")
        if sync:
            ax.axhline(sync[-1][1], ls=ls, color="tab:blue", lw=0.8, label=f"{study.OPTIMIZER_LABELS[opt]} sync, 1x")
        for ef, color in ((False, "tab:red"), (True, "tab:green")):
            base = c["sweep"].get(f"{opt}_d1{'_ef' if ef else ''}_s{seed}")
            pts = [(1.0, base[-1][1])] if base else []
            pts += [(sc, r[-1][1]) for sc in ISO_SCALES if (r := c["iso"].get(f"{opt}_2bw{'_ef' if ef else ''}_x{sc:g}_s{seed}"))]
            if pts:
                ax.plot(*zip(*pts), ls=ls, marker="o", color=color,
                        label=f"{study.OPTIMIZER_LABELS[opt]} async{' + corr' if ef else ''}")
    ax.set(title="iso-loss: async runs trained longer (own schedule)", xlabel="updates / 300", ylabel="final validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


BEGIN, END = "<!-- sweeps.py results: begin -->", "<!-- sweeps.py results: end -->"
HORIZON_BEGIN, HORIZON_END = "<!-- sweeps.py horizon seeds: begin -->", "<!-- sweeps.py horizon seeds: end -->"


def replace_block(doc: Path, begin: str, end: str, text: str) -> None:
    """Rewrite what lies between the two markers of ``doc``, if it has both."""
    if doc.exists():
        body = doc.read_text()
        start, stop = body.find(begin), body.find(end)
        if 0 <= start < stop:
            doc.write_text(f"{body[:start + len(begin)]}\n{text}{body[stop:]}")


def report_horizon(out: Path, seeds: Sequence[int], doc: Path = ROOT / "docs" / "delay-study.md") -> str:
    """The seeds block of docs/delay-study.md from every finished run of ``horizon`` over ``seeds``; ``report``'s
    block is left alone."""
    text = (f"Longer horizon over seeds (1.05 M parameters, {LONG_STEPS} updates; losses mean ± sample std):\n\n"
            f"{horizon_tables(curves(plan('horizon', seeds), out), seeds)}\n")
    (out / "horizon.md").write_text(text)
    replace_block(doc, HORIZON_BEGIN, HORIZON_END, text)
    print(text)
    return text


def report_all(out: Path, seeds: Sequence[int] = (0,), doc: Path = ROOT / "docs" / "delay-study.md",
               figure: Path = ROOT / "docs" / "delay-study2.png") -> str:
    seed = seeds[0]
    extra = {"long": plan("longtail", seeds) + plan("longlowlr", seeds), "sweep": plan("lowlr", seeds)}
    c = {e: curves(plan(e, seeds) + extra.get(e, []), out) for e in ("sweep", "stages", "iso", "tail", "long")}
    text = (f"Delay sweep (uniform delay d, final validation loss, seed {seed}):\n\n{sweep_table(c['sweep'], seed)}\n\n"
            f"Per-stage delays at p = 4 (seed {seed}):\n\n{stages_table(c['sweep'], c['stages'], seed)}\n\n"
            f"Longer horizon (seed {seed}; 1.05 M parameters, 2000 updates):\n\n{long_table(c['long'], seed)}\n\n"
            f"The same three cells at 300 updates (136 K parameters; the lr {', '.join(f'{v:g}' for v in LOW_LR.values())} "
            f"row from `lowlr`):\n\n{long_table(_as_cells(c['sweep']), seed)}\n\n"
            f"Iso-loss token overhead and net speedup (seed {seed}):\n\n{iso_table(c['sweep'], c['iso'], c['long'], seed)}\n\n"
            f"Synchronous tail (`sync_from_step`, seed {seed}):\n\n{tail_table(c['sweep'], c['tail'], seed)}\n")
    (out / "results.md").write_text(text)
    plot_all(c, figure, seed)
    replace_block(doc, BEGIN, END, text)
    print(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=(*EXPERIMENTS, "report", "report-horizon"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "study2", help="where the runs' logs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--optimizers", nargs="+", choices=sorted(BEST_LR), default=sorted(BEST_LR))
    parser.add_argument("--names", nargs="+", help="run only these runs of the experiment (by folder name)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.experiment == "report":
        report_all(out, args.seeds)
        return
    if args.experiment == "report-horizon":
        report_horizon(out, args.seeds)
        return
    specs = [s for s in plan(args.experiment, args.seeds)
             if s.optimizer in args.optimizers and (not args.names or s.name in args.names)]
    if args.dry_run:
        for spec in specs:
            print("lightning-async-pp", " ".join(spec.cli_args(out)))
        return
    run_all(specs, out, args.jobs)


if __name__ == "__main__":
    main()
