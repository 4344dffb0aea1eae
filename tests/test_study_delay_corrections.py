"""The third-round study script (studies/delay/corrections.py): the gap-closed and seed arithmetic on hand-written
numbers, picking the tuned setting, planning from (faked) tune results, and every kind of cell parsing through the
CLI with its overrides landing where they should."""
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
import corrections as study3  # noqa: E402

from lightning_async_pp.cli import AsyncPipelineCLI  # noqa: E402


def test_gap_closed_per_seed_and_from_the_means():
    finals = {"sync": {0: 2.0, 1: 2.2, 2: 2.1}, "2bw": {0: 2.4, 1: 2.6}, "ef": {0: 2.1, 1: 2.3, 2: 2.0}}
    s = study3.summarize(finals, (0, 1, 2))
    # seed 2 has no 2BW run: every row is over seeds 0 and 1
    assert s["ef"]["seeds"] == [0, 1]
    assert s["ef"]["mean"] == pytest.approx(2.2) and s["ef"]["std"] == pytest.approx(math.sqrt(0.02))
    # (2.5 - 2.2) / (2.5 - 2.1) = 75%; per seed (2.4 - 2.1) / 0.4 = 75%, (2.6 - 2.3) / 0.4 = 75%
    assert s["ef"]["closed"] == pytest.approx(0.75)
    assert s["ef"]["sync_mean"] == pytest.approx(2.1)  # sync over the row's own seeds, for its gap
    assert s["ef"]["closed_per_seed"] == pytest.approx([0.75, 0.75])
    assert s["2bw"]["closed"] == pytest.approx(0.0) and s["sync"]["closed"] == pytest.approx(1.0)
    assert math.isnan(study3.gap_closed(2.5, 2.4, 2.3))  # no gap to close


def test_token_overhead_is_zero_at_or_below_the_sync_final_loss():
    sync = [(100, 2.6), (300, 2.5)]
    assert study3.token_overhead(sync, 2.55, 300) == pytest.approx(0.5)  # sync reaches 2.55 at update 200
    assert study3.token_overhead(sync, 2.5, 300) == 0.0 and study3.token_overhead(sync, 2.4, 300) == 0.0


def test_pick_best_waits_for_the_whole_sweep_and_lets_a_diverged_run_lose():
    assert study3.pick_best({"c1": 2.5, "c2": None}) is None
    assert study3.pick_best({"c1": 2.5, "c2": 2.4, "c3": math.nan}) == "c2"
    assert study3.pick_best({"c1": math.nan}) is None


def test_extra_buffers_per_correction():
    assert [study3.extra_buffers(k) for k in ("sync", "2bw", "ef", "nesterov", "wp", "pipemare")] == [0, 0, 1, 0, 1, 0]
    assert study3.extra_buffers("dc", delay=4) == 4 and study3.extra_buffers("dc", delay=2, ema=True) == 3
    best = {("adamw", "ef"): ("c1", (("coefficient", 1.0),), 2.5),
            ("adamw", "dc"): ("c1e3_ema", (("coefficient", 1e3), ("ema", 0.95)), 2.6)}
    assert study3._buffers("ef+dc", "adamw", best) == 3  # EF 1 + DC's history 1 + its average 1


def _fake_tune(monkeypatch, tmp_path, losses):
    """Mark every tune run finished, with final loss ``losses.get(name, 3.0)``."""
    for spec in study3.tune_specs():
        spec.log_dir(tmp_path).mkdir(parents=True)
        (spec.log_dir(tmp_path) / study.DONE).write_text("")
    monkeypatch.setattr(study3, "final_loss", lambda spec, out: losses.get(spec.name, 3.0))
    monkeypatch.setattr(study3, "available", lambda key: key != "wp")


def test_plans_follow_the_tune_results(monkeypatch, tmp_path):
    _fake_tune(monkeypatch, tmp_path, {"adamw_ef_c2_s0": 2.6, "adamw_dc_c1e4_ema_s0": 2.7, "adamw_nesterov_m0.9_s0": 2.8,
                                       "muon_dc_c1e2_s0": 2.4, "muon_ef_c0.5_s0": 2.5})
    best = study3.tuned(tmp_path)
    assert best[("adamw", "ef")][0] == "c2" and best[("adamw", "dc")][0] == "c1e4_ema"
    assert ("muon", "nesterov") not in best and ("adamw", "wp") not in best
    compare = study3.plan("compare", tmp_path, seeds=(0, 1))
    names = {(s.experiment, s.name) for s in compare}
    # seed 0 is the tune run itself; EF around the best other correction (DC for both optimizers here)
    assert ("tune", "adamw_ef_c2_s0") in names and ("compare", "adamw_ef_s1") in names
    assert ("compare", "adamw_ef+dc_s1") in names and ("compare", "muon_ef+dc_s1") in names
    assert not any("nesterov" in n and n.startswith("muon") for _, n in names)
    (pair,) = [s for s in compare if s.name == "adamw_ef+dc_s1"]
    assert "--optimizer.init_args.coefficient=2.0" in pair.extra
    assert "--optimizer.init_args.optimizer.init_args.ema=0.95" in pair.extra
    delays = study3.plan("delays", tmp_path)
    assert not any("pipemare_d1" in s.name for s in delays)  # the identity at delay 1
    (dc4,) = [s for s in delays if s.name == "adamw_dc_d4_s0"]
    assert {"--trainer.strategy.init_args.delay=4", "--optimizer.init_args.delay=4"} <= set(dc4.extra)
    (pm2,) = [s for s in delays if s.name == "muon_pipemare_d2_s0"]
    assert "--lr_scheduler.init_args.delay=2" in pm2.extra
    long = [s.name for s in study3.plan("long", tmp_path)]
    assert long[:4] == ["adamw_sync_s0", "muon_sync_s0", "adamw_2bw_s0", "muon_2bw_s0"]
    assert set(long[4:]) == {"adamw_dc_s0", "muon_dc_s0", "adamw_ef_s0", "muon_ef_s0", "adamw_nesterov_s0"}


@pytest.mark.parametrize("cell,extra,check", [
    ("corrections/adamw_ef_dc", ("--optimizer.init_args.optimizer.init_args.ema=0.95",),
     lambda c: c["optimizer"]["init_args"]["optimizer"]["init_args"]["optimizer"]["init_args"]["lr"] == 0.5),
    ("corrections/muon_dc", ("--trainer.strategy.init_args.delay=2", "--optimizer.init_args.delay=2"),
     lambda c: c["optimizer"]["init_args"]["delay"] == c["trainer"]["strategy"]["init_args"]["delay"] == 2),
    ("corrections/adamw_nesterov", ("--optimizer.init_args.adaptive_momentum=[1, 2]",),
     lambda c: c["optimizer"]["init_args"]["adaptive_momentum"] == [1, 2] and c["optimizer"]["init_args"]["lr"] == 0.5),
    ("corrections/muon_ef_wp", ("--optimizer.init_args.optimizer.init_args.scale=2.0",),
     lambda c: c["optimizer"]["init_args"]["optimizer"]["init_args"]["scale"] == 2.0),
    ("corrections/muon_pipemare", ("--lr_scheduler.init_args.delay=4",),
     lambda c: c["lr_scheduler"]["init_args"]["delay"] == 4
     and c["lr_scheduler"]["init_args"]["scheduler"]["init_args"]["total_steps"] == 300),
])
def test_correction_cells_parse_with_their_overrides(cell, extra, check, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])
    args = study3.Spec("tune", "x", cell, 0.5, 3, extra).cli_args(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        AsyncPipelineCLI(args=[args[0], "--print_config", *args[1:]])
    config = yaml.safe_load(out.getvalue())
    assert config["seed_everything"] == 3 and check(config)
