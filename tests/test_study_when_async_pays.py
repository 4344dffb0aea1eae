"""studies/when_async_pays.py: the planner's 2bw speedup over the fastest synchronous schedule that fits in the
same memory, and the net speedup after the delay's token overhead."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("when_async_pays", ROOT / "studies" / "when_async_pays.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_few_microbatches_are_where_2bw_beats_every_synchronous_schedule_and_the_net_divides_by_the_overhead():
    wap = load()
    (few,) = wap.rows("smollm-360m", [4], per_stage=1, steps=3, weight_grad_fraction=0.5)
    (many,) = wap.rows("smollm-360m", [4], per_stage=4, steps=3, weight_grad_fraction=0.5)
    assert few["m"] == 4 and many["m"] == 16
    # m = p: the synchronous schedules' bubble is large, 2bw has none; at m = 4p ZBV's bubble is nearly closed.
    assert few["speedup"] > 1.2 and abs(many["speedup"] - 1.0) < 0.02
    # The fastest synchronous peer is a zero-bubble schedule: at m = p on the balanced split (the planner's default
    # since the split follows the layers' FLOPs) ZB-H1's or ZBV's; at m = 4p ZBV's.
    assert few["best"] in ("zb_h1", "zbv") and many["best"] == "zbv"
    # The stash makes 2bw the largest: every synchronous schedule fits in its memory.
    assert few["mem_best"] <= few["mem_2bw"]
    line = wap.table([few])[2].split("|")
    nets = [float(c) for c in line[-len(wap.OVERHEADS) - 1:-1]]
    assert nets == pytest.approx([round(few["speedup"] / (1 + o), 2) for o in wap.OVERHEADS.values()], abs=0.006)
