"""The second-round study scripts (studies/delay/sweeps.py, studies/delay/spike.py): iso-loss arithmetic on
made-up curves, the delayed stability bound against closed forms, and every planned run parsing through the CLI."""
from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies" / "delay"))
import spike as spike  # noqa: E402
import sweeps as study2  # noqa: E402

from lightning_async_pp.cli import AsyncPipelineCLI  # noqa: E402


def test_crossing_step_interpolates_between_validation_points():
    curve = [(50, 3.0), (100, 2.6), (150, 2.4)]
    assert study2.crossing_step(curve, 2.5) == pytest.approx(125.0)
    assert study2.crossing_step(curve, 3.5) == 50.0
    assert math.isnan(study2.crossing_step(curve, 2.0))


def test_overhead_read_off_the_sync_curve():
    # sync reaches the async final loss (2.5) at update 125 of 150: async needs 150/125 - 1 = 20% more tokens
    assert study2.overhead_from_sync_curve([(50, 3.0), (100, 2.6), (150, 2.4)], 2.5, 150) == pytest.approx(0.2)


def test_overhead_from_longer_runs_interpolates_the_scale_that_meets_sync():
    assert study2.overhead_from_longer_runs({1.0: 2.8, 2.0: 2.4}, 2.5) == pytest.approx(0.75)
    assert study2.overhead_from_longer_runs({1.0: 2.4, 2.0: 2.3}, 2.5) == 0.0  # already there
    assert math.isnan(study2.overhead_from_longer_runs({1.0: 2.9, 2.0: 2.7}, 2.5))  # beyond the longest run


def test_net_speedup_and_tail_share():
    assert study2.net_speedup(1.5, 0.25) == pytest.approx(1.2)
    assert math.isnan(study2.net_speedup(1.5, math.nan))
    assert study2.tail_closed(0.4, 0.1) == pytest.approx(0.75)


@pytest.mark.parametrize("beta1", [0.0, 0.5, 0.9])
def test_stability_bound_without_delay_is_the_heavy_ball_bound(beta1):
    # EMA momentum without delay: stable for a < 2 (1 + beta1) / (1 - beta1) (38 for beta1 = 0.9)
    assert spike.stability_bound(beta1, 0) == pytest.approx(2 * (1 + beta1) / (1 - beta1), rel=1e-6)


def test_stability_bound_of_delayed_gradient_descent_is_one():
    # x_{k+1} = x_k - a x_{k-1}: roots of z^2 - z + a have |z|^2 = a for a > 1/4, so the bound is a = 1
    assert spike.stability_bound(0.0, 1) == pytest.approx(1.0, rel=1e-6)
    assert spike.spectral_radius(0.81, 0.0, 1) == pytest.approx(0.9, rel=1e-9)


def test_spike_window_finds_the_biggest_rise():
    rows = [{"loss": 3.0 - 0.001 * k} for k in range(300)]
    rows[150]["loss"] += 0.5
    k, rise = spike.spike_window(rows)
    assert k == 150 and rise == pytest.approx(0.5 - 0.0055, abs=1e-9)  # 3.35 - mean(2.860 .. 2.851)


@pytest.mark.parametrize("experiment", study2.EXPERIMENTS)
def test_every_planned_run_parses_through_the_cli(experiment, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    specs = study2.plan(experiment)
    assert len({s.name for s in specs}) == len(specs)  # one folder per run
    for spec in specs:
        args = spec.cli_args(tmp_path)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            AsyncPipelineCLI(args=[args[0], "--print_config", *args[1:]])
        config = yaml.safe_load(out.getvalue())
        strategy = config["trainer"]["strategy"]["init_args"]
        assert config["seed_everything"] == spec.seed
        if "sync_from_step" in " ".join(spec.extra):
            assert strategy["sync_from_step"] in (240, 270, 1700)
        if spec.long:
            assert config["trainer"]["max_steps"] == 2000 and config["model"]["init_args"]["n_embd"] == 144


@pytest.mark.parametrize("cell", ["adamw_sync", "adamw_2bw_ef", "muon_2bw"])
def test_the_gpu_study_config_parses_with_every_kind_of_cell(cell, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    configs = Path(__file__).resolve().parents[1] / "configs" / "study"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        AsyncPipelineCLI(args=["fit", "--print_config", "--config", str(configs / "gpu" / "base.yaml"),
                               "--config", str(configs / f"{cell}.yaml"), "--trainer.strategy.init_args.sync_from_step=8000"])
    config = yaml.safe_load(out.getvalue())
    assert config["trainer"]["precision"] == "bf16-true" and config["trainer"]["accelerator"] == "gpu"
    assert config["model"]["init_args"]["size"] == "smollm-135m"
    assert config["model"]["init_args"]["max_seq_len"] == config["data"]["block_size"]
    assert config["trainer"]["strategy"]["init_args"]["sync_from_step"] == 8000
    assert config["lr_scheduler"]["init_args"]["total_steps"] == config["trainer"]["max_steps"]


def test_horizon_tables_average_over_the_seeds_that_finished_a_whole_row():
    # made-up 2000-update curves: sync ends at 2.0, async at 2.4 (seed 0) / 2.6 (seed 1), corrected at 2.1 / 2.1;
    # seed 2 lacks its corrected run, so the row is over seeds 0 and 1 only
    sync = [(1000, 2.4), (2000, 2.0)]
    c = {"adamw_sync_lr0.001_s0": sync, "adamw_2bw_lr0.001_s0": [(2000, 2.4)], "adamw_2bw_ef_lr0.001_s0": [(2000, 2.1)],
         "adamw_sync_lr0.001_s1": sync, "adamw_2bw_lr0.001_s1": [(2000, 2.6)], "adamw_2bw_ef_lr0.001_s1": [(2000, 2.1)],
         "adamw_sync_lr0.001_s2": sync, "adamw_2bw_lr0.001_s2": [(2000, 2.5)]}
    loss, cost = study2.horizon_tables(c, (0, 1, 2), ratios={"m=4": 1.2}).split("\n\n")
    (row,) = [r for r in loss.splitlines() if r.startswith("| AdamW (0.001)")]
    cells = [x.strip() for x in row.strip("|").split("|")]
    assert cells[1] == "0, 1"
    assert cells[2] == "2.000 ± 0.000" and cells[3] == "2.500 ± 0.141" and cells[4] == "2.100 ± 0.000"
    # from the means: (2.5 - 2.1) / (2.5 - 2.0) = 80%; per seed 75% and 83%
    assert cells[7] == "80%" and cells[8] == "75%, 83%"
    # sync reaches 2.4 at update 1000: async seed 0 needs 2000/1000 - 1 = 100% more tokens; seed 1's 2.6 is never
    # above the curve's first point, so it crosses at 1000 too; corrected 2.1 at 1750 -> 14%
    (asyn,) = [r for r in cost.splitlines() if "| async |" in r]
    assert [x.strip() for x in asyn.strip("|").split("|")][3:] == ["100%, 100%", "100%", "0.60"]
    (corr,) = [r for r in cost.splitlines() if "| async + correction |" in r]
    assert [x.strip() for x in corr.strip("|").split("|")][3:] == ["14%, 14%", "14%", f"{1.2 / (1 + 2000 / 1750 - 1):.2f}"]
    assert not [r for r in loss.splitlines() if r.startswith("| Muon")]  # no Muon runs: no row
