"""models.Llama under AsyncPipelineStrategy on 2 processes (gloo on CPU) against the same run on one device.

The one-device run is the emulation of the same 2-stage pipeline in one process, whose update rule the one-device
tests check against written-out loops. Across processes a tied embedding/head is kept as one copy per stage whose
gradients are summed (docs/design.md, "Tied weights"), so the final weights must agree with one device, where
the two stages share one leaf.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import llama_fit  # noqa: E402
from pipeline_runs import max_difference, run_here_on_one_device, script_ranks  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "llama_fit.py"
TOL = 1e-5


def run_two_processes(cfg: dict, tmp_path: Path) -> list[dict]:
    return script_ranks(SCRIPT, cfg, tmp_path, timeout=180)


def one_device(cfg: dict) -> dict:
    return run_here_on_one_device(llama_fit.run, cfg)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_two_processes_train_llama_exactly_as_one_device(tie, tmp_path):
    # Embedding + 2 blocks | 2 blocks + head: with tie=True the tied matrix is used on both stages.
    cfg = {"tie": tie, "steps": 4, "schedule": "2bw", "microbatches": 4, "partition": [3, 3]}
    reference = one_device(cfg)["state_dict"]
    ranks = run_two_processes(cfg, tmp_path)
    assert [r["global_step"] for r in ranks] == [4, 4]
    weights = ranks[0]["state_dict"]
    assert max_difference(weights, reference) < TOL
    initial = one_device({**cfg, "steps": 0})["state_dict"]
    assert max_difference(weights, initial) > 1e-3  # the steps did move the weights
    tied_gap = (weights["embed.weight"] - weights["head.proj.weight"]).abs().max().item()
    assert (tied_gap == 0.0) if tie else (tied_gap > 1e-3)
