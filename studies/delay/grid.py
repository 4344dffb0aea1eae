"""Delay study: {AdamW, Muon} x {sync, 2BW, 2BW + error feedback} on the example byte-level GPT.

Runs the grid in ``configs/study/`` (several learning rates and seeds, ``--jobs`` runs at a time, each single-threaded),
or only reads finished runs (``--no-run``), then writes a markdown table of final validation losses and a PNG of
validation-loss curves and of the delay gap against the learning rate. The tables go to ``<out>/results.md`` and
into the marked results block of docs/delay-study.md; the figure to docs/delay-study.png.

    .venv/bin/python studies/delay/grid.py --out runs/study

Finished runs are skipped, so an interrupted study resumes where it stopped.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "study"
OPTIMIZERS = ("adamw", "muon")
VARIANTS = ("sync", "2bw", "2bw_ef")
VARIANT_LABELS = {"sync": "sync (1F1B)", "2bw": "async (2BW)", "2bw_ef": "async + correction"}
OPTIMIZER_LABELS = {"adamw": "AdamW", "muon": "Muon"}
#: Zmushko et al. (2026), 360M model, final validation loss: sync / async / async + correction.
PAPER_360M = {"adamw": {"sync": 2.612, "2bw": 2.890, "2bw_ef": 2.640},
              "muon": {"sync": 2.578, "2bw": 2.590, "2bw_ef": 2.583}}
DONE = "DONE"  # written into a run's log folder when the run finished


@dataclass(frozen=True)
class Run:
    optimizer: str
    variant: str
    lr: float
    seed: int

    @property
    def cell(self) -> str:
        return f"{self.optimizer}_{self.variant}"

    @property
    def version(self) -> str:
        return f"lr{self.lr:g}_s{self.seed}"

    def log_dir(self, out: Path) -> Path:
        return out / self.cell / self.version


# ---- running ------------------------------------------------------------------------------------------------------
def plan(lrs: Sequence[float], headline_lr: float, seeds: Sequence[int], sweep_seeds: Sequence[int]) -> list[Run]:
    """Headline learning rate with every seed first, then the sweep; every cell at every point."""
    runs = [Run(o, v, headline_lr, s) for s in seeds for o in OPTIMIZERS for v in VARIANTS]
    runs += [Run(o, v, lr, s) for lr in lrs if lr != headline_lr for s in sweep_seeds
             for o in OPTIMIZERS for v in VARIANTS]
    return runs


def cli_args(run: Run, out: Path) -> list[str]:
    """``lightning-async-pp fit`` arguments for one run: base config, the cell's config, lr, seed, log folder."""
    config = yaml.safe_load((CONFIGS / f"{run.cell}.yaml").read_text())
    lr_key = "optimizer.init_args.lr"
    if "optimizer" in config["optimizer"]["init_args"]:  # ErrorFeedback: the lr is the wrapped optimizer's
        lr_key = "optimizer.init_args.optimizer.init_args.lr"
    return ["fit", "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / f"{run.cell}.yaml"),
            f"--{lr_key}={run.lr}", f"--seed_everything={run.seed}",
            f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={run.cell}",
            f"--trainer.logger.init_args.version={run.version}"]


def execute(run: Run, out: Path) -> tuple[Run, bool, float]:
    """One run in its own single-threaded process; its console output goes to ``<out>/logs/``."""
    log = out / "logs" / f"{run.cell}_{run.version}.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # torch.set_num_threads(1) in the child
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "lightning_async_pp.cli", *cli_args(run, out)],
                             stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc == 0:
        (run.log_dir(out) / DONE).write_text("")
    return run, rc == 0, time.perf_counter() - start


def build_data_cache() -> None:
    """Tokenize the corpus once, before parallel runs would all try to."""
    from lightning_async_pp.data import TextDataModule
    data = yaml.safe_load((CONFIGS / "base.yaml").read_text())["data"]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the default cache_dir is relative, as in the runs (which start in ROOT)
    try:
        TextDataModule(**data).prepare_data()
    finally:
        os.chdir(cwd)


def run_grid(runs: Sequence[Run], out: Path, jobs: int) -> None:
    todo = [r for r in runs if not (r.log_dir(out) / DONE).exists()]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already done; running {len(todo)}, {jobs} at a time", flush=True)
    if not todo:
        return
    build_data_cache()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for run, ok, seconds in pool.map(lambda r: execute(r, out), todo):
            status = "ok" if ok else f"FAILED (see {out}/logs/{run.cell}_{run.version}.txt)"
            print(f"[{time.perf_counter() - start:7.0f}s] {run.cell:12s} {run.version:14s} {seconds:5.0f}s {status}",
                  flush=True)


# ---- reading ------------------------------------------------------------------------------------------------------
def read_curve(log_dir: Path, tag: str = "val_loss") -> list[tuple[int, float]]:
    """``(step, value)`` of one scalar from a run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def read_runs(runs: Iterable[Run], out: Path) -> dict[Run, list[tuple[int, float]]]:
    """Validation curves of the finished runs among ``runs``."""
    return {r: curve for r in runs if (r.log_dir(out) / DONE).exists() and (curve := read_curve(r.log_dir(out)))}


# ---- aggregation (pure functions on numbers; tests call these) ------------------------------------------------------
def final_losses(curves: Mapping[Run, Sequence[tuple[int, float]]]) -> dict[tuple[str, str, float], list[float]]:
    """``(optimizer, variant, lr) -> [final validation loss of each seed]``, seeds in order."""
    finals: dict[tuple[str, str, float], list[float]] = {}
    for run in sorted(curves, key=lambda r: r.seed):
        if curves[run]:
            finals.setdefault((run.optimizer, run.variant, run.lr), []).append(curves[run][-1][1])
    return finals


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); NaN in, NaN out (a diverged run stays visible)."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def recovered_share(sync: float, asynchronous: float, corrected: float) -> float:
    """Share of the delay gap the correction recovers: (async - async+corr) / (async - sync). NaN without a gap."""
    gap = asynchronous - sync
    return (asynchronous - corrected) / gap if gap > 0 else math.nan


def cell_summary(finals: Mapping[tuple[str, str, float], Sequence[float]], optimizer: str, lr: float) -> Optional[dict]:
    """Means, spreads, gaps and recovered share for one optimizer at one lr; ``None`` if a variant is missing."""
    if any((optimizer, v, lr) not in finals for v in VARIANTS):
        return None
    stats = {v: mean_std(finals[(optimizer, v, lr)]) for v in VARIANTS}
    sync, asyn, corr = (stats[v][0] for v in VARIANTS)
    return {"stats": stats, "n": {v: len(finals[(optimizer, v, lr)]) for v in VARIANTS},
            "gap": asyn - sync, "gap_corrected": corr - sync, "recovered": recovered_share(sync, asyn, corr)}


def _fmt(x: float, digits: int = 3) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


def best_sync_lr(finals: Mapping[tuple[str, str, float], Sequence[float]], optimizer: str) -> Optional[float]:
    """The lr with the lowest mean synchronous loss among the lrs where all three variants finished."""
    lrs = [k[2] for k in finals if k[:2] == (optimizer, "sync") and cell_summary(finals, optimizer, k[2])]
    return min(lrs, key=lambda lr: mean_std(finals[(optimizer, "sync", lr)])[0]) if lrs else None


def headline_table(finals: Mapping[tuple[str, str, float], Sequence[float]], lr: float | Mapping[str, float]) -> str:
    """Markdown: final validation loss per cell (mean ± std over seeds), gap to sync, recovered share, paper's 360M.
    ``lr``: one for both optimizers, or one per optimizer (then shown in the first column)."""
    lines = ["| optimizer | sync | async (2BW) | async + correction | gap async - sync | gap corrected - sync "
             "| recovered | paper 360M sync / async / corr (recovered) |",
             "|---|---|---|---|---|---|---|---|"]
    for opt in OPTIMIZERS:
        opt_lr = lr.get(opt) if isinstance(lr, Mapping) else lr
        s = None if opt_lr is None else cell_summary(finals, opt, opt_lr)
        if s is None:
            continue
        cells = [f"{_fmt(m)} ± {_fmt(sd)} (n={s['n'][v]})" for v, (m, sd) in s["stats"].items()]
        p = PAPER_360M[opt]
        paper = (f"{p['sync']:.3f} / {p['2bw']:.3f} / {p['2bw_ef']:.3f} "
                 f"({_pct(recovered_share(p['sync'], p['2bw'], p['2bw_ef']))})")
        name = OPTIMIZER_LABELS[opt] + (f" (lr {opt_lr:g})" if isinstance(lr, Mapping) else "")
        lines.append(f"| {name} | {' | '.join(cells)} | {_fmt(s['gap'])} | {_fmt(s['gap_corrected'])} "
                     f"| {_pct(s['recovered'])} | {paper} |")
    return "\n".join(lines)


def lr_table(finals: Mapping[tuple[str, str, float], Sequence[float]]) -> str:
    """Markdown: per optimizer and lr, the final losses (mean ± std), the gap to sync and the recovered share."""
    lines = ["| optimizer | lr | seeds | sync | async | async + corr | gap async - sync | gap corrected - sync "
             "| recovered |", "|---|---|---|---|---|---|---|---|---|"]
    for opt in OPTIMIZERS:
        for lr in sorted({k[2] for k in finals if k[0] == opt}):
            s = cell_summary(finals, opt, lr)
            if s is None:
                continue
            means = " | ".join(f"{_fmt(m)} ± {_fmt(sd)}" for m, sd in (s["stats"][v] for v in VARIANTS))
            lines.append(f"| {OPTIMIZER_LABELS[opt]} | {lr:g} | {min(s['n'].values())} | {means} | {_fmt(s['gap'])} "
                         f"| {_fmt(s['gap_corrected'])} | {_pct(s['recovered'])} |")
    return "\n".join(lines)


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps common to all curves, with the mean, min and max over them."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
    by_step = [dict(c) for c in curves]
    vals = [[d[s] for d in by_step] for s in steps]
    return steps, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


# ---- figure -------------------------------------------------------------------------------------------------------
def plot(curves: Mapping[Run, Sequence[tuple[int, float]]], headline_lr: float, path: Path) -> None:
    """Validation-loss curves at the headline lr (mean over seeds, min-max band) per optimizer, and gap vs lr."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"sync": "tab:blue", "2bw": "tab:red", "2bw_ef": "tab:green"}
    for ax, opt in zip(axes, OPTIMIZERS):
        for v in VARIANTS:
            group = [c for r, c in curves.items() if (r.optimizer, r.variant, r.lr) == (opt, v, headline_lr) and c]
            if not group:
                continue
            steps, mean, lo, hi = mean_curve(group)
            ax.plot(steps, mean, color=colors[v], marker="o", ms=3, label=f"{VARIANT_LABELS[v]} (n={len(group)})")
            ax.fill_between(steps, lo, hi, color=colors[v], alpha=0.2)
        ax.set_title(f"{OPTIMIZER_LABELS[opt]}, lr {headline_lr:g}")
        ax.set_xlabel("update")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
    finals = final_losses(curves)
    ax = axes[2]
    for opt, marker in zip(OPTIMIZERS, ("o", "s")):
        points = [(lr, cell_summary(finals, opt, lr)) for lr in sorted({k[2] for k in finals if k[0] == opt})]
        points = [(lr, s) for lr, s in points if s is not None]
        if not points:
            continue
        lrs = [lr for lr, _ in points]
        ax.plot(lrs, [s["gap"] for _, s in points], marker=marker, color="tab:red",
                ls="-" if opt == "adamw" else "--", label=f"{OPTIMIZER_LABELS[opt]}: async - sync")
        ax.plot(lrs, [s["gap_corrected"] for _, s in points], marker=marker, color="tab:green",
                ls="-" if opt == "adamw" else "--", label=f"{OPTIMIZER_LABELS[opt]}: async + corr - sync")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_title("delay gap in final validation loss vs lr")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("loss minus sync loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(curves: Mapping[Run, Sequence[tuple[int, float]]], headline_lr: float) -> str:
    finals = final_losses(curves)
    return (f"Final validation loss at lr {headline_lr:g} (mean ± sample std over seeds):\n\n"
            f"{headline_table(finals, headline_lr)}\n\nAt each optimizer's best synchronous lr in the sweep:\n\n"
            f"{headline_table(finals, {o: best_sync_lr(finals, o) for o in OPTIMIZERS})}\n\n"
            f"Gap against the learning rate (losses: mean ± sample std over seeds; gaps and shares from the means):\n\n"
            f"{lr_table(finals)}\n")


BEGIN, END = "<!-- grid.py results: begin -->", "<!-- grid.py results: end -->"


def replace_results(doc: str, results: str) -> str:
    """``doc`` with the text between the BEGIN and END markers replaced by ``results`` (unchanged without markers)."""
    start, stop = doc.find(BEGIN), doc.find(END)
    if start < 0 or stop < start:
        return doc
    return f"{doc[:start + len(BEGIN)]}\n{results}{doc[stop:]}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="where the runs' logs go")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 1e-3, 3e-2, 3e-4], help="learning-rate sweep (run in this order)")
    parser.add_argument("--headline-lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds at the headline lr")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=[0, 1], help="seeds at the other lrs")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="runs at a time")
    parser.add_argument("--no-run", action="store_true", help="only read finished runs and write the report")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "delay-study.png")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "delay-study.md",
                        help="markdown file whose results block (between the markers) is rewritten")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    runs = plan(args.lrs, args.headline_lr, args.seeds, args.sweep_seeds)
    if not args.no_run:
        run_grid(runs, out, args.jobs)
    curves = read_runs(runs, out)
    text = report(curves, args.headline_lr)
    (out / "results.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    plot(curves, args.headline_lr, args.plot)
    if args.doc.exists():
        args.doc.write_text(replace_results(args.doc.read_text(), text))
    print(text)
    print(f"{len(curves)} of {len(runs)} runs read; tables in {out / 'results.md'} (and {args.doc}), "
          f"figure in {args.plot}")


if __name__ == "__main__":
    main()
