"""Delay study, third round (docs/delay-study.md, "Third round"): the delay corrections side by side.

Error feedback (``optim.ErrorFeedback``), DC-ASGD (``optim.DelayCompensation``), AsyncPP's Nesterov rule
(``optim.AsyncNesterov``, replacing AdamW), PipeMare's lr rescheduling (``optim.PipeMareLR``, the identity at delay 1)
and weight prediction (``optim.WeightPrediction``, once the package has it), on the first round's 136 K model
(``configs/study/base.yaml``, 300 updates) at AdamW lr 1e-3 and Muon lr 3e-2, and at 2000 updates
(``configs/study/long/base.yaml``). The cells are ``configs/study/{adamw,muon}_{sync,2bw,2bw_ef}.yaml`` and
``configs/study/corrections/*.yaml``; coefficients are command-line overrides. One command per experiment:

    .venv/bin/python studies/delay/corrections.py tune     # seed 0: a small sweep of each correction's coefficient
    .venv/bin/python studies/delay/corrections.py compare --seeds 0 1 2   # each at its tuned setting + the best pair
    .venv/bin/python studies/delay/corrections.py long     # 2000 updates: sync, 2BW, EF, the two best new ones
    .venv/bin/python studies/delay/corrections.py delays   # d = 1, 2, 4: plain, PipeMareLR, the two best corrections
    .venv/bin/python studies/delay/corrections.py all --seeds 0 1 2 --jobs 2  # the four, in that priority order
    .venv/bin/python studies/delay/corrections.py report --seeds 0 1 2        # rewrites the block in the doc

"Tuned" is read off the finished ``tune`` runs (lowest final validation loss of a correction's sweep, once all of
its sweep finished), so ``compare``, ``long`` and ``delays`` plan only what ``tune`` has settled. ``all`` re-plans
whenever a run ends, so its later experiments start as soon as the tune results they need are in. Runs go to
``runs/study3/<experiment>/<name>/`` (finished ones are skipped); a seed-0, delay-1, 300-update cell is the ``tune``
run itself, not run twice.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grid as study  # noqa: E402
import sweeps as study2  # noqa: E402

ROOT, CONFIGS = study.ROOT, study.CONFIGS
#: The lrs of the baseline (docs/delay-study.md, "The longer horizon over three seeds"): EF recovered 97% of
#: AdamW's gap at 1e-3 and 92% of Muon's at 3e-2 at 2000 updates.
LR = {"adamw": 1e-3, "muon": 3e-2}
OPTIMIZERS = tuple(LR)
BASE_STEPS, LONG_STEPS = study2.BASE_STEPS, study2.LONG_STEPS
DELAYS = (1, 2, 4)
PIPEMARE_WARMUP = 100  # of the 300 updates (configs/study/corrections/*_pipemare.yaml)


@dataclass(frozen=True)
class Correction:
    """One correction: its cell per optimizer (None: not defined there), the sweep of ``tune`` as ``(tag,
    {init_arg: value})``, where its init_args sit, and the parameter-sized buffers it keeps per parameter."""

    key: str
    label: str
    cells: Mapping[str, Optional[str]]
    settings: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
    #: cell of ErrorFeedback around this correction (the combination), per optimizer
    with_ef: Mapping[str, Optional[str]] = None  # type: ignore[assignment]
    takes_delay: bool = False


def _s(tag: str, **values: object) -> tuple[str, tuple[tuple[str, object], ...]]:
    return tag, tuple(values.items())


CORRECTIONS = {
    "ef": Correction("ef", "ErrorFeedback", {"adamw": "adamw_2bw_ef", "muon": "muon_2bw_ef"},
                     (_s("c0.5", coefficient=0.5), _s("c1", coefficient=1.0), _s("c2", coefficient=2.0),
                      _s("c4", coefficient=4.0))),  # 4: AdamW's best was 2, the edge of {0.5, 1, 2}
    # the term is c * g * g * (W_k - W_b): with clipped gradients (|g| <= 1 over 136 K weights) and AdamW steps of
    # about lr per weight it is ~1e-6 c of g per weight, so c spans 1e2..1e5 to reach a term that matters
    "dc": Correction("dc", "DelayCompensation", {"adamw": "corrections/adamw_dc", "muon": "corrections/muon_dc"},
                     (_s("c1e2", coefficient=1e2), _s("c1e3", coefficient=1e3), _s("c1e4", coefficient=1e4),
                      _s("c1e5", coefficient=1e5), _s("c1e3_ema", coefficient=1e3, ema=0.95),
                      _s("c1e4_ema", coefficient=1e4, ema=0.95)),
                     {"adamw": "corrections/adamw_ef_dc", "muon": "corrections/muon_ef_dc"}, takes_delay=True),
    # AdamW's betas[1] 0.95 and weight decay 0.1 kept, beta1 -> NAdam's momentum; adaptive: AsyncPP's rule
    # momentum + delay * (0.99 - momentum) / num_stages from 0.9 at (delay 1, 2 stages) = 0.945 (at 1 stage it
    # would be 0.99, the m0.99 cell)
    "nesterov": Correction("nesterov", "AsyncNesterov", {"adamw": "corrections/adamw_nesterov", "muon": None},
                           (_s("m0.9", momentum=0.9), _s("m0.99", momentum=0.99),
                            _s("m0.9_adaptive", momentum=0.9, adaptive_momentum=[1, 2])),
                           {"adamw": "corrections/adamw_ef_nesterov", "muon": None}),
    "wp": Correction("wp", "WeightPrediction", {"adamw": "corrections/adamw_wp", "muon": "corrections/muon_wp"},
                     (_s("s0.5", scale=0.5), _s("s1", scale=1.0), _s("s2", scale=2.0),
                      _s("s4", scale=4.0)),  # 4: AdamW's best was 2, the edge of {0.5, 1, 2}
                     {"adamw": "corrections/adamw_ef_wp", "muon": "corrections/muon_ef_wp"}),
}
#: Parameter-sized buffers per parameter beyond the base optimizer's (docs: "extra memory").
def extra_buffers(key: str, delay: int = 1, ema: bool = False) -> int:
    return {"sync": 0, "2bw": 0, "ef": 1, "dc": delay + (1 if ema else 0), "nesterov": 0, "nesterov_sync": 0, "wp": 1,
            "pipemare": 0}[key]


def available(key: str) -> bool:
    """Whether the package in this checkout has the correction (WeightPrediction lands later); read from the source
    so that a long-running ``all`` sees a merge."""
    if key != "wp":
        return True
    return "WeightPrediction" in (ROOT / "lightning_async_pp" / "optim" / "__init__.py").read_text()


@dataclass(frozen=True)
class Spec(study2.Spec):
    """A study2 run whose cell may sit under ``configs/study/corrections/``; the lr goes to the innermost optimizer
    (through any wrappers), the correction's settings are ``extra`` overrides."""

    @property
    def optimizer(self) -> str:
        return Path(self.cell).name.split("_", 1)[0]

    def cli_args(self, out: Path) -> list[str]:
        configs = ["--config", str(CONFIGS / "base.yaml")]
        if self.long:
            configs += ["--config", str(CONFIGS / "long" / "base.yaml")]
        configs += ["--config", str(CONFIGS / f"{self.cell}.yaml")]
        return ["fit", *configs, f"--{lr_key(self.cell)}={self.lr}", f"--seed_everything={self.seed}", *self.extra,
                f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={self.experiment}",
                f"--trainer.logger.init_args.version={self.name}"]


def lr_key(cell: str) -> str:
    """``optimizer(.init_args.optimizer)*.init_args.lr``: the innermost optimizer's lr in the cell's YAML."""
    node, key = yaml.safe_load((CONFIGS / f"{cell}.yaml").read_text())["optimizer"], "optimizer"
    while "optimizer" in node.get("init_args", {}):
        node, key = node["init_args"]["optimizer"], key + ".init_args.optimizer"
    return key + ".init_args.lr"


def overrides(prefix: str, values: Sequence[tuple[str, object]]) -> tuple[str, ...]:
    return tuple(f"--{prefix}.init_args.{k}={v}" for k, v in values)


def _delay_args(corr: Optional[str], d: int, combo: bool = False) -> tuple[str, ...]:
    out = (f"--trainer.strategy.init_args.delay={d}",)
    if corr == "dc":
        out += (f"--optimizer{'.init_args.optimizer' if combo else ''}.init_args.delay={d}",)
    if corr == "pipemare":
        out += (f"--lr_scheduler.init_args.delay={d}",)
    return out


# ---- planning -----------------------------------------------------------------------------------------------------
def sweep_cells():
    """``(key, correction, optimizer, lr)`` for every correction the package has, with each optimizer it is
    defined for (AsyncNesterov has no Muon cell)."""
    for key, corr in CORRECTIONS.items():
        if not available(key):
            continue
        for opt, lr in LR.items():
            if corr.cells[opt] is not None:
                yield key, corr, opt, lr


def tune_specs(seed: int = 0) -> list[Spec]:
    specs = []
    for opt, lr in LR.items():
        specs += [Spec("tune", f"{opt}_sync_s{seed}", f"{opt}_sync", lr, seed),
                  Spec("tune", f"{opt}_2bw_s{seed}", f"{opt}_2bw", lr, seed)]
    for key, corr, opt, lr in sweep_cells():
        for tag, values in corr.settings:
            specs.append(Spec("tune", f"{opt}_{key}_{tag}_s{seed}", corr.cells[opt], lr, seed,
                              overrides("optimizer", values)))
    return specs


def final_loss(spec: Spec, out: Path) -> float:
    if not (spec.log_dir(out) / study.DONE).exists():
        return math.nan
    curve = study.read_curve(spec.log_dir(out))
    return curve[-1][1] if curve else math.nan


def token_overhead(sync_curve: Sequence[tuple[int, float]], final: float, total: int) -> float:
    """study2's overhead read off the synchronous curve, and 0 where the run ends at or below the synchronous final
    loss (it needs no extra tokens; how many it saves is not read here)."""
    if sync_curve and final <= sync_curve[-1][1]:
        return 0.0
    return study2.overhead_from_sync_curve(sync_curve, final, total)


def pick_best(losses: Mapping[str, float]) -> Optional[str]:
    """The key of the lowest loss, if every value is known (a diverged run, NaN, counts as known and loses);
    ``None`` while any is missing (``None`` values)."""
    if not losses or any(v is None for v in losses.values()):
        return None
    finite = {k: v for k, v in losses.items() if v == v}
    return min(finite, key=finite.__getitem__) if finite else None


def tuned(out: Path, seed: int = 0) -> dict[tuple[str, str], tuple[str, tuple[tuple[str, object], ...], float]]:
    """``(optimizer, correction) -> (tag, settings, final loss)`` for each correction whose whole sweep finished."""
    result = {}
    for key, corr, opt, lr in sweep_cells():
        losses = {}
        for tag, values in corr.settings:
            spec = Spec("tune", f"{opt}_{key}_{tag}_s{seed}", corr.cells[opt], lr, seed)
            done = (spec.log_dir(out) / study.DONE).exists()
            losses[tag] = final_loss(spec, out) if done else None
        best = pick_best(losses)
        if best is not None:
            result[(opt, key)] = (best, dict(corr.settings)[best], losses[best])
    return result


def ranking(best: Mapping, opt: str, exclude: Sequence[str] = ()) -> list[str]:
    """Corrections of ``opt`` by their tuned final loss, best first."""
    keys = [k for (o, k) in best if o == opt and k not in exclude]
    return sorted(keys, key=lambda k: best[(opt, k)][2])


def _tune_name(opt: str, key: str, tag: str, seed: int = 0) -> str:
    return f"{opt}_{key}_{tag}_s{seed}"


def cell_spec(experiment: str, opt: str, key: str, best: Mapping, seed: int, d: int = 1, long: bool = False,
              name: Optional[str] = None) -> Optional[Spec]:
    """The run of correction ``key`` ("sync", "2bw", "pipemare", a CORRECTIONS key or "ef+<key>") at its tuned
    setting; ``None`` if not defined or not tuned yet. At seed 0, delay 1, 300 updates it is the tune run."""
    lr = LR[opt]
    name = name or f"{opt}_{key}{f'_d{d}' if experiment == 'delays' else ''}_s{seed}"
    delay = _delay_args(key, d) if experiment == "delays" else ()
    if key == "nesterov_sync":  # the tuned AsyncNesterov without a delay: what the base optimizer alone is worth
        if (opt, "nesterov") not in best:
            return None
        return Spec(experiment, name, CORRECTIONS["nesterov"].cells[opt], lr, seed,
                    (*overrides("optimizer", best[(opt, "nesterov")][1]), "--trainer.strategy.init_args.schedule=1f1b"),
                    long)
    if key in ("sync", "2bw"):
        if seed == 0 and d == 1 and not long:
            return Spec("tune", f"{opt}_{key}_s0", f"{opt}_{key}", lr, 0)
        return Spec(experiment, name, f"{opt}_{key}", lr, seed, delay, long)
    if key == "pipemare":
        return Spec(experiment, name, f"corrections/{opt}_pipemare", lr, seed,
                    (*delay, f"--lr_scheduler.init_args.warmup_steps={PIPEMARE_WARMUP}"), long)
    if key.startswith("ef+"):
        other = key[3:]
        cell = CORRECTIONS[other].with_ef[opt]
        if cell is None or (opt, "ef") not in best or (opt, other) not in best:
            return None
        values = overrides("optimizer", best[(opt, "ef")][1]) + overrides("optimizer.init_args.optimizer",
                                                                          best[(opt, other)][1])
        delay = _delay_args(other, d, combo=True) if experiment == "delays" else ()
        return Spec(experiment, name, cell, lr, seed, (*values, *delay), long)
    if CORRECTIONS[key].cells[opt] is None or (opt, key) not in best:
        return None
    tag, values, _ = best[(opt, key)]
    if seed == 0 and d == 1 and not long:
        return Spec("tune", _tune_name(opt, key, tag), CORRECTIONS[key].cells[opt], lr, 0, overrides("optimizer", values))
    return Spec(experiment, name, CORRECTIONS[key].cells[opt], lr, seed, (*overrides("optimizer", values), *delay), long)


def combination(best: Mapping, opt: str) -> Optional[str]:
    """EF around the best other correction of ``opt`` that has a combined cell (DelayCompensation, AsyncNesterov,
    WeightPrediction), as ``"ef+<key>"``."""
    for key in ranking(best, opt, exclude=("ef",)):
        if CORRECTIONS[key].with_ef[opt] is not None:
            return f"ef+{key}"
    return None


def compare_cells(best: Mapping, opt: str) -> list[str]:
    """sync, 2BW, each tuned correction, EF + the best other, AsyncNesterov without a delay (its reference), then EF
    + each other correction where defined."""
    cells = ["sync", "2bw", *[k for k in CORRECTIONS if (opt, k) in best]]
    combo = combination(best, opt)
    cells += ([combo] if combo else []) + (["nesterov_sync"] if (opt, "nesterov") in best else [])
    return cells + [f"ef+{k}" for k in ranking(best, opt, exclude=("ef",))
                    if CORRECTIONS[k].with_ef[opt] is not None and f"ef+{k}" not in cells]


def long_cells(best: Mapping, opt: str) -> list[str]:
    """sync, 2BW, EF, then the two best new corrections (by the tune runs)."""
    return ["sync", "2bw", "ef", *ranking(best, opt, exclude=("ef",))[:2]]


def second_new(out: Path) -> tuple[str, ...]:
    """Run-name prefixes of the second-best new correction of each optimizer at 2000 updates (the last of
    ``long_cells``)."""
    best = tuned(out)
    return tuple(f"{opt}_{cells[4]}_" for opt in OPTIMIZERS if len(cells := long_cells(best, opt)) > 4)


def delay_cells(best: Mapping, opt: str) -> list[str]:
    """plain, PipeMareLR, and the two best corrections (by the tune runs)."""
    return ["2bw", "pipemare", *ranking(best, opt)[:2]]


def plan(experiment: str, out: Path, seeds: Sequence[int] = (0,), long_seeds: Sequence[int] = (0,)) -> list[Spec]:
    """The runs of ``experiment`` that can be planned now (what ``tune`` has settled), in priority order: ``seeds``
    for ``compare``, ``long_seeds`` for ``long``."""
    if experiment == "tune":
        return tune_specs(0)
    best = tuned(out)
    specs: list[Optional[Spec]] = []
    if experiment == "compare":
        for seed in seeds:  # seed-major: a cut leaves whole seeds
            for opt in OPTIMIZERS:
                specs += [cell_spec("compare", opt, k, best, seed) for k in compare_cells(best, opt)]
    elif experiment == "long":
        for seed in long_seeds:
            cells = {opt: long_cells(best, opt) for opt in OPTIMIZERS}
            # sync and 2BW first, then the best new correction, then EF (measured before), then the second new one
            for i in (0, 1, 3, 2, 4):
                for opt in OPTIMIZERS:
                    if i < len(cells[opt]):
                        specs.append(cell_spec("long", opt, cells[opt][i], best, seed, long=True))
    elif experiment == "delays":
        for d in DELAYS:
            for opt in OPTIMIZERS:
                for key in delay_cells(best, opt):
                    if key == "pipemare" and d == 1:
                        continue  # the identity at delay 1: that is the plain 2BW run
                    specs.append(cell_spec("delays", opt, key, best, 0, d))
    elif experiment == "all":
        # a 2000-update run costs 10-13 minutes here, the whole delay sweep about as much: the delays go before the
        # long runs of the second-best new correction, the long runs' extra seeds last
        first = plan("long", out, long_seeds=long_seeds[:1])
        core = [s for s in first if not s.name.startswith(second_new(out))]
        return (plan("tune", out) + plan("compare", out, seeds) + core + plan("delays", out)
                + [s for s in first if s not in core] + plan("long", out, long_seeds=long_seeds[1:]))
    else:
        raise ValueError(f"unknown experiment {experiment!r}; use one of {', '.join(EXPERIMENTS)}")
    seen, result = set(), []
    for s in specs:
        if s is not None and s.log_dir(out) not in seen:
            seen.add(s.log_dir(out))
            result.append(s)
    return result


EXPERIMENTS = ("tune", "compare", "long", "delays", "all")


# ---- aggregation (pure functions on numbers; tests call these) ------------------------------------------------------
def gap_closed(sync: float, plain: float, corrected: float) -> float:
    """Share of the sync gap a correction closes, ``(async - corrected) / (async - sync)``; NaN without a gap."""
    return study.recovered_share(sync, plain, corrected)


def summarize(finals: Mapping[str, Mapping[int, float]], seeds: Sequence[int]) -> dict[str, dict]:
    """Per cell: mean and sample std of the final losses over ``seeds`` where sync, 2BW and the cell all finished,
    the share of the sync gap closed from the means and per seed. ``finals``: cell -> seed -> final loss, with the
    references under "sync" and "2bw"."""
    result = {}
    for cell, by_seed in finals.items():
        done = [k for k in seeds if k in by_seed and k in finals.get("sync", {}) and k in finals.get("2bw", {})]
        if not done:
            continue
        s, a, c = ([finals[x][k] for k in done] for x in ("sync", "2bw", cell))
        (sm, _), (am, _), (cm, cs) = study.mean_std(s), study.mean_std(a), study.mean_std(c)
        result[cell] = {"seeds": done, "mean": cm, "std": cs, "sync_mean": sm, "closed": gap_closed(sm, am, cm),
                        "closed_per_seed": [gap_closed(*v) for v in zip(s, a, c)]}
    return result


# ---- the report ---------------------------------------------------------------------------------------------------
def _run_figures(spec: Spec, out: Path) -> Optional[dict]:
    """Final loss, validation curve, median step and optimizer seconds, wall seconds of a finished run."""
    d = spec.log_dir(out)
    if not (d / study.DONE).exists():
        return None
    curve = study.read_curve(d)
    if not curve:
        return None
    med = lambda tag: (sorted(v for _, v in c)[len(c) // 2] if (c := study.read_curve(d, tag)) else math.nan)  # noqa: E731
    wall = float((d / WALL).read_text()) if (d / WALL).exists() else math.nan
    return {"final": curve[-1][1], "curve": curve, "step_s": med("pipeline/step_time_s"),
            "opt_s": med("pipeline/optimizer_s"), "ratio": med("staleness/compensation_ratio"), "wall": wall}


def _setting_text(opt: str, key: str, best: Mapping) -> str:
    if key in ("sync", "2bw"):
        return "-"
    if key == "nesterov_sync":
        key = "nesterov"
    if key.startswith("ef+"):
        return f"EF {best[(opt, 'ef')][0]}, {CORRECTIONS[key[3:]].label} {best[(opt, key[3:])][0]}"
    return best[(opt, key)][0] if (opt, key) in best else "-"


def _label(key: str) -> str:
    names = {"sync": "sync (1F1B)", "2bw": "async (2BW)", "pipemare": "PipeMareLR",
             "nesterov_sync": "AsyncNesterov, sync (1F1B): no delay"}
    if key.startswith("ef+"):
        return f"ErrorFeedback + {CORRECTIONS[key[3:]].label}"
    return names.get(key) or CORRECTIONS[key].label


def _buffers(key: str, opt: str, best: Mapping, d: int = 1) -> int:
    parts = key[3:].split("+") + ["ef"] if key.startswith("ef+") else [key]
    total = 0
    for part in parts:
        ema = part == "dc" and (opt, "dc") in best and dict(best[(opt, "dc")][1]).get("ema") is not None
        total += extra_buffers(part, d, ema)
    return total


def tune_table(out: Path, best: Mapping) -> str:
    lines = ["| optimizer (lr) | correction | setting | final val loss (seed 0) | gap closed | median compensation ratio | tuned |",
             "|---|---|---|---|---|---|---|"]
    for opt, lr in LR.items():
        refs = {k: _run_figures(Spec("tune", f"{opt}_{k}_s0", f"{opt}_{k}", lr), out) for k in ("sync", "2bw")}
        for k, f in refs.items():
            if f:
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {_label(k)} | - | {study2._f(f['final'])} | - | - | |")
        for key, corr in CORRECTIONS.items():
            if corr.cells[opt] is None:
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {corr.label} | not defined (replaces AdamW) | | | | |")
                continue
            if not available(key):
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {corr.label} | not in this checkout | | | | |")
                continue
            for tag, values in corr.settings:
                f = _run_figures(Spec("tune", _tune_name(opt, key, tag), corr.cells[opt], lr), out)
                if not f:
                    continue
                closed = (gap_closed(refs["sync"]["final"], refs["2bw"]["final"], f["final"])
                          if refs["sync"] and refs["2bw"] else math.nan)
                mark = "**tuned**" if best.get((opt, key), ("",))[0] == tag else ""
                setting = ", ".join(f"{k}={v}" for k, v in values)
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {corr.label} | {setting} | {study2._f(f['final'])} "
                             f"| {study._pct(closed)} | {study2._f(f['ratio'], 4) if key == 'dc' else '-'} | {mark} |")
    return "\n".join(lines)


def compare_tables(out: Path, best: Mapping, seeds: Sequence[int],
                   ratios: Mapping[str, float] = study2.FASTEST_SYNC_RATIOS) -> str:
    loss = ["| optimizer (lr) | cell | setting | seeds | final val loss | gap to sync | gap closed (means) "
            "| gap closed, per seed | token overhead (read off sync), per seed | extra buffers / param "
            "| step (ms) | optimizer part (ms) | wall s / update "
            + "".join(f"| net speedup ({m}, x{r:.2f}) " for m, r in ratios.items()) + "|",
            "|---" * (13 + len(ratios)) + "|"]
    for opt, lr in LR.items():
        cells = compare_cells(best, opt)
        cells += [f"ef+{k}" for k in CORRECTIONS if k != "ef" and f"ef+{k}" not in cells]  # other finished pairs
        figures = {k: {seed: f for seed in seeds if (sp := cell_spec("compare", opt, k, best, seed))
                       and (f := _run_figures(sp, out))} for k in cells}
        figures = {k: v for k, v in figures.items() if v}
        stats = summarize({k: {s: f["final"] for s, f in v.items()} for k, v in figures.items()}, seeds)
        for k in [c for c in cells if c in stats]:
            st, fs = stats[k], figures[k]
            synchronous = k in ("sync", "nesterov_sync")
            overheads = ([token_overhead(figures["sync"][s]["curve"], fs[s]["final"], BASE_STEPS)
                          for s in st["seeds"]] if not synchronous else [])
            mean_over = study.mean_std(overheads)[0] if overheads else math.nan
            speed = "".join(f"| {study2._f(study2.net_speedup(r, mean_over), 2) if not synchronous else '-'} "
                            for r in ratios.values())
            step = study.mean_std([fs[s]["step_s"] for s in st["seeds"]])[0]
            opt_s = study.mean_std([fs[s]["opt_s"] for s in st["seeds"]])[0]
            wall = study.mean_std([fs[s]["wall"] / BASE_STEPS for s in st["seeds"]])[0]
            closed = "-" if k in ("sync", "2bw", "nesterov_sync") else study._pct(st["closed"])
            per_seed = "-" if k in ("sync", "2bw", "nesterov_sync") else ", ".join(study._pct(x) for x in st["closed_per_seed"])
            loss.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {_label(k)} | {_setting_text(opt, k, best)} "
                        f"| {', '.join(map(str, st['seeds']))} | {study2._f(st['mean'])} ± {study2._f(st['std'])} "
                        f"| {study2._f(st['mean'] - st['sync_mean'])} | {closed} | {per_seed} "
                        f"| {', '.join(study._pct(o) for o in overheads) or '-'} | {_buffers(k, opt, best)} "
                        f"| {study2._f(1e3 * step, 0)} | {study2._f(1e3 * opt_s, 1)} | {study2._f(wall, 3)} {speed}|")
        if CORRECTIONS["nesterov"].cells[opt] is None:
            loss.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | AsyncNesterov | not defined (it replaces AdamW) "
                        + "| " * (11 + len(ratios)) + "|")
        loss.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | PipeMareLR | not run: the identity at delay 1 "
                    + "| " * (11 + len(ratios)) + "|")
    return "\n".join(loss)


def long_table(out: Path, best: Mapping, seeds: Sequence[int],
               ratios: Mapping[str, float] = study2.FASTEST_SYNC_RATIOS) -> str:
    lines = ["| optimizer (lr) | cell | setting | seeds | final val loss | gap to sync | gap closed (means) "
             "| token overhead (read off sync) | wall min / run "
             + "".join(f"| net speedup ({m}, x{r:.2f}) " for m, r in ratios.items()) + "|",
             "|---" * (9 + len(ratios)) + "|"]
    for opt, lr in LR.items():
        cells = ["sync", "2bw", "ef", *[k for k in CORRECTIONS if k != "ef"]]
        figures = {k: {seed: f for seed in seeds if (sp := cell_spec("long", opt, k, best, seed, long=True))
                       and (f := _run_figures(sp, out))} for k in cells}
        figures = {k: v for k, v in figures.items() if v}
        stats = summarize({k: {s: f["final"] for s, f in v.items()} for k, v in figures.items()}, seeds)
        for k in [c for c in cells if c in stats]:
            st, fs = stats[k], figures[k]
            over = [token_overhead(figures["sync"][s]["curve"], fs[s]["final"], LONG_STEPS)
                    for s in st["seeds"]] if k != "sync" else []
            mean_over = study.mean_std(over)[0] if over else math.nan
            speed = "".join(f"| {study2._f(study2.net_speedup(r, mean_over), 2) if k != 'sync' else '-'} "
                            for r in ratios.values())
            wall = study.mean_std([fs[s]["wall"] / 60 for s in st["seeds"]])[0]
            lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {_label(k)} | {_setting_text(opt, k, best)} "
                         f"| {', '.join(map(str, st['seeds']))} | {study2._f(st['mean'])} ± {study2._f(st['std'])} "
                         f"| {study2._f(st['mean'] - st['sync_mean'])} "
                         f"| {'-' if k in ('sync', '2bw') else study._pct(st['closed'])} "
                         f"| {', '.join(study._pct(o) for o in over) or '-'} | {study2._f(wall, 1)} {speed}|")
    return "\n".join(lines)


def delays_table(out: Path, best: Mapping) -> str:
    lines = ["| optimizer (lr) | delay d | cell | setting | final val loss | gap to sync | gap closed | extra buffers / param |",
             "|---|---|---|---|---|---|---|---|"]
    for opt, lr in LR.items():
        sync = _run_figures(Spec("tune", f"{opt}_sync_s0", f"{opt}_sync", lr), out)
        keys = delay_cells(best, opt)
        for d in DELAYS:
            plain = (_run_figures(sp, out) if (sp := cell_spec("delays", opt, "2bw", best, 0, d)) else None)
            for k in keys:
                if k == "pipemare" and d == 1:
                    continue
                sp = cell_spec("delays", opt, k, best, 0, d)
                f = _run_figures(sp, out) if sp else None
                if not f or not sync:
                    continue
                closed = "-" if k == "2bw" or not plain else study._pct(gap_closed(sync["final"], plain["final"], f["final"]))
                setting = "warmup_steps=100" if k == "pipemare" else _setting_text(opt, k, best)
                lines.append(f"| {study.OPTIMIZER_LABELS[opt]} ({lr:g}) | {d} | {_label(k)} | {setting} "
                             f"| {study2._f(f['final'])} | {study2._f(f['final'] - sync['final'])} | {closed} "
                             f"| {_buffers(k, opt, best, d)} |")
    return "\n".join(lines)


BEGIN, END = "<!-- corrections.py results: begin -->", "<!-- corrections.py results: end -->"


def report(out: Path, seeds: Sequence[int], long_seeds: Sequence[int] = (0, 1, 2),
           doc: Path = ROOT / "docs" / "delay-study.md") -> str:
    """Every finished run of the four experiments: rewrites the marked block of ``doc`` and ``<out>/results.md``."""
    best = tuned(out)
    text = (f"Tune (seed 0, 136 K parameters, {BASE_STEPS} updates; the tuned setting, lowest final loss of its "
            f"sweep, is used below):\n\n{tune_table(out, best)}\n\n"
            f"Comparison at the tuned settings ({BASE_STEPS} updates; final loss mean ± sample std over seeds, gaps "
            f"from the means; step and optimizer times: medians of the logged `pipeline/` times, averaged over seeds, "
            f"one thread, 2 shared CPU cores):\n\n{compare_tables(out, best, seeds)}\n\n"
            f"Longer horizon (1.05 M parameters, {LONG_STEPS} updates):\n\n{long_table(out, best, long_seeds)}\n\n"
            f"Delay sweep (seed 0, {BASE_STEPS} updates; gap closed against plain 2BW at the same d, sync is d = 0):"
            f"\n\n{delays_table(out, best)}\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    study2.replace_block(doc, BEGIN, END, text)
    print(text)
    return text


# ---- running ------------------------------------------------------------------------------------------------------
WALL = "WALL_S"  # written into a run's folder beside DONE: the run's wall seconds


def _execute(spec: Spec, out: Path) -> tuple[bool, float]:
    if spec.log_dir(out).exists():  # an interrupted run: its events would mix with the new run's
        shutil.rmtree(spec.log_dir(out))
    ok, seconds = study2.execute(spec, out)
    if ok:
        (spec.log_dir(out) / WALL).write_text(f"{seconds:.1f}\n")
    return ok, seconds


def run_planned(experiment: str, out: Path, seeds: Sequence[int], long_seeds: Sequence[int], jobs: int,
                names: Optional[Sequence[str]] = None) -> None:
    """Run ``plan(experiment)`` ``jobs`` at a time, re-planning whenever a run ends (so runs that tune results
    unlock, or a correction the checkout gains, join the queue in priority order). A failed run is not retried."""
    start, running, failed = time.perf_counter(), {}, set()
    study.build_data_cache()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while True:
            todo = [s for s in plan(experiment, out, seeds, long_seeds) if not (s.log_dir(out) / study.DONE).exists()
                    and s.log_dir(out) not in running and s.log_dir(out) not in failed
                    and (not names or s.name in names)]
            for spec in todo[:jobs - len(running)]:
                running[spec.log_dir(out)] = (spec, pool.submit(_execute, spec, out))
            if not running:
                break
            finished, _ = wait([f for _, f in running.values()], return_when=FIRST_COMPLETED)
            for key, (spec, future) in list(running.items()):
                if future in finished:
                    del running[key]
                    ok, seconds = future.result()
                    if not ok:
                        failed.add(key)
                    print(f"[{time.perf_counter() - start:7.0f}s] {spec.experiment:8s} {spec.name:28s} {seconds:5.0f}s "
                          f"{'ok' if ok else 'FAILED (see ' + str(out / 'logs') + ')'}", flush=True)
    print(f"nothing left to run for {experiment} ({len(failed)} failed)", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=(*EXPERIMENTS, "report"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "study3", help="where the runs' logs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of compare and long")
    parser.add_argument("--long-seeds", type=int, nargs="+", default=[0], help="seeds of long")
    parser.add_argument("--names", nargs="+", help="run only these runs (by folder name)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.experiment == "report":
        report(out, args.seeds, args.long_seeds)
        return
    if args.dry_run:
        for spec in plan(args.experiment, out, args.seeds, args.long_seeds):
            done = (spec.log_dir(out) / study.DONE).exists()
            print(f"{'done ' if done else ''}lightning-async-pp", " ".join(spec.cli_args(out)))
        return
    run_planned(args.experiment, out, args.seeds, args.long_seeds, args.jobs, args.names)


if __name__ == "__main__":
    main()
