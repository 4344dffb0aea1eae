"""The delay study's script (studies/delay/grid.py): its aggregation on made-up numbers, its log reading, and
every study config parsing through the CLI with the overrides the script passes."""
from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies" / "delay"))
import grid as study  # noqa: E402

from lightning_async_pp.cli import AsyncPipelineCLI  # noqa: E402


def fake_curves() -> dict:
    """Two seeds at lr 0.01, one at 0.001; final losses chosen so gaps and shares are easy to check."""
    finals = {("adamw", "sync", 0.01): [2.0, 2.2], ("adamw", "2bw", 0.01): [3.0, 3.2], ("adamw", "2bw_ef", 0.01): [2.2, 2.4],
              ("muon", "sync", 0.01): [2.0, 2.0], ("muon", "2bw", 0.01): [2.1, 2.1], ("muon", "2bw_ef", 0.01): [2.05, 2.05],
              ("adamw", "sync", 0.001): [2.5], ("adamw", "2bw", 0.001): [2.4], ("adamw", "2bw_ef", 0.001): [2.45]}
    curves = {}
    for (opt, variant, lr), values in finals.items():
        for seed, final in enumerate(values):
            curves[study.Run(opt, variant, lr, seed)] = [(49, 4.0 + seed), (99, final)]
    return curves


def test_final_losses_take_the_last_point_of_each_seed():
    finals = study.final_losses(fake_curves())
    assert finals[("adamw", "2bw", 0.01)] == [3.0, 3.2]
    assert finals[("adamw", "sync", 0.001)] == [2.5]


def test_cell_summary_gap_and_recovered_share():
    finals = study.final_losses(fake_curves())
    s = study.cell_summary(finals, "adamw", 0.01)
    assert s["stats"]["sync"][0] == pytest.approx(2.1) and s["stats"]["sync"][1] == pytest.approx(math.sqrt(0.02))
    assert s["gap"] == pytest.approx(1.0) and s["gap_corrected"] == pytest.approx(0.2)
    assert s["recovered"] == pytest.approx(0.8)  # (3.1 - 2.3) / (3.1 - 2.1)
    assert study.cell_summary(finals, "muon", 0.001) is None  # missing cells are left out, not guessed


def test_recovered_share_is_undefined_without_a_gap_and_paper_numbers_match_the_paper():
    assert math.isnan(study.recovered_share(2.5, 2.4, 2.45))  # async better than sync: nothing to recover
    assert study.recovered_share(2.612, 2.890, 2.640) == pytest.approx(0.899, abs=1e-3)  # paper, AdamW 360M


def test_tables_list_every_complete_cell_and_the_paper():
    finals = study.final_losses(fake_curves())
    head = study.headline_table(finals, 0.01)
    assert "| AdamW | 2.100 ± 0.141 (n=2) | 3.100 ± 0.141 (n=2) | 2.300 ± 0.141 (n=2) | 1.000 | 0.200 | 80% |" in head
    assert "2.612 / 2.890 / 2.640 (90%)" in head and "| Muon |" in head
    by_lr = study.lr_table(finals)
    assert "| AdamW | 0.001 | 1 | 2.500 ± 0.000 | 2.400 ± 0.000 | 2.450 ± 0.000 | -0.100 | -0.050 | n/a |" in by_lr
    assert "| Muon | 0.01 | 2 |" in by_lr and "| Muon | 0.001 |" not in by_lr


def test_mean_curve_uses_common_steps():
    steps, mean, lo, hi = study.mean_curve([[(1, 1.0), (2, 3.0)], [(1, 3.0), (2, 5.0), (3, 9.0)]])
    assert steps == [1, 2] and mean == [2.0, 4.0] and lo == [1.0, 3.0] and hi == [3.0, 5.0]


def test_plan_runs_the_headline_seeds_first():
    runs = study.plan([0.003, 0.01], 0.003, seeds=[0, 1], sweep_seeds=[0])
    assert len(runs) == 6 * 2 + 6
    assert {(r.lr, r.seed) for r in runs[:12]} == {(0.003, 0), (0.003, 1)} and runs[-1].lr == 0.01


def test_read_runs_reads_val_loss_from_tensorboard_events_of_finished_runs_only(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    done, unfinished = study.Run("muon", "2bw", 0.01, 0), study.Run("muon", "sync", 0.01, 0)
    for run in (done, unfinished):
        writer = SummaryWriter(str(run.log_dir(tmp_path)))
        for step, value in [(49, 3.5), (99, 2.5)]:
            writer.add_scalar("val_loss", value, step)
        writer.close()
    (done.log_dir(tmp_path) / study.DONE).write_text("")
    curves = study.read_runs([done, unfinished], tmp_path)
    assert list(curves) == [done] and curves[done] == [(49, 3.5), (99, 2.5)]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "fig.png"
    study.plot(fake_curves(), 0.01, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("cell", [f"{o}_{v}" for o in study.OPTIMIZERS for v in study.VARIANTS])
def test_each_study_config_parses_through_the_cli_with_the_scripts_overrides(cell, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    optimizer, variant = cell.split("_", 1)
    args = study.cli_args(study.Run(optimizer, variant, 0.0123, 7), tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        AsyncPipelineCLI(args=[args[0], "--print_config", *args[1:]])
    config = yaml.safe_load(out.getvalue())
    assert config["trainer"]["strategy"]["init_args"]["schedule"] == ("1f1b" if variant == "sync" else "2bw")
    assert config["trainer"]["gradient_clip_val"] == 1.0 and config["seed_everything"] == 7
    assert config["lr_scheduler"]["class_path"] == "lightning_async_pp.optim.WarmupCosine"
    assert config["trainer"]["logger"]["init_args"]["version"] == "lr0.0123_s7"
    opt = config["optimizer"]
    if variant == "2bw_ef":
        assert opt["class_path"] == "lightning_async_pp.optim.ErrorFeedback" and opt["init_args"]["coefficient"] == 1.0
        opt = opt["init_args"]["optimizer"]
    assert opt["class_path"] == {"adamw": "torch.optim.AdamW", "muon": "lightning_async_pp.optim.Muon"}[optimizer]
    assert opt["init_args"]["lr"] == 0.0123 and opt["init_args"]["weight_decay"] == 0.1


def test_best_sync_lr_picks_the_lowest_sync_loss_among_complete_lrs():
    finals = study.final_losses(fake_curves())
    assert study.best_sync_lr(finals, "adamw") == 0.01  # 2.1 < 2.5
    assert study.best_sync_lr(finals, "muon") == 0.01
    table = study.headline_table(finals, {"adamw": 0.001, "muon": 0.01})
    assert "| AdamW (lr 0.001) | 2.500 ± 0.000 (n=1) |" in table and "| Muon (lr 0.01) |" in table


def test_replace_results_rewrites_only_the_marked_block():
    doc = f"intro\n{study.BEGIN}\nold table\n{study.END}\noutro\n"
    assert study.replace_results(doc, "new table\n") == f"intro\n{study.BEGIN}\nnew table\n{study.END}\noutro\n"
    assert study.replace_results("no markers", "x") == "no markers"
