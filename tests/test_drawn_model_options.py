"""The model's and the wire's options combined: a seeded generator draws combinations of schedule, microbatch count,
tied embeddings, packed rows, activation checkpointing, a memory cap on the balanced split and pooled receive
buffers (what CUDA does, switched on here for gloo), and each combination's 2-process run of ``models.Llama`` must
give the one-device run's weights bit for bit, and its split. A failure prints the combination (``COMBO=...``) so
that it can be rerun alone.

Why bitwise: the one-device run executes the same action lists in one process; every stage computes the same
operations on the same values, and a tied weight's gradient is summed in one order on both (docs/design/stages.md).
The silent bugs of round 7 (a stale document mask from a pooled buffer, tied weights apart by float rounding) each
passed the tests that covered their options one at a time (tests/test_seam_combinations.py draws Lightning's).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import llama_fit  # noqa: E402
from pipeline_runs import run_here_on_one_device, script_ranks  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "llama_fit.py"


def combinations(seed: int, count: int) -> list[dict]:
    """``count`` llama_fit configurations drawn with ``random.Random(seed)``, 2 stages, 3 steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        capped = rng.random() < 0.5
        combo = {
            "schedule": rng.choice(["2bw", "1f1b", "gpipe", "zb_h1"]),
            "microbatches": rng.choice([2, 4]),
            "tie": rng.choice([False, True]),
            "packed": rng.choice([False, True]),
            "activation_checkpointing": rng.choice([False, True, [1, 4]]),
            "pool_buffers": rng.choice([False, True]),
            # capped: the balanced split under a cap every stage fits; else the layers halved
            "stage_memory_gib": 0.5 if capped else None,
            "partition": None if capped else [3, 3],
        }
        out.append(dict(combo, steps=3, timeout=60.0, lr=3e-3))
    return out


def test_the_drawn_sample_covers_every_new_option():
    combos = combinations(seed=17, count=4)
    for key in ("tie", "packed", "pool_buffers"):
        assert {bool(c[key]) for c in combos} == {False, True}, key
    assert any(c["pool_buffers"] and c["packed"] for c in combos)
    assert any(c["stage_memory_gib"] for c in combos) and any(c["activation_checkpointing"] for c in combos)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_drawn_model_options_on_two_processes_give_the_one_device_weights_bitwise(tmp_path):
    combos = combinations(seed=17, count=4)
    cases = {f"combo{i}": c for i, c in enumerate(combos)}
    ranks = script_ranks(SCRIPT, {"cases": cases}, tmp_path, timeout=420)
    failures = []
    for name, combo in cases.items():
        one = run_here_on_one_device(llama_fit.run, combo)
        got = ranks[0]["cases"][name]
        apart = {k: float((got["state_dict"][k] - v).abs().max()) for k, v in one["state_dict"].items()
                 if not torch.equal(got["state_dict"][k], v)}
        if apart or got["split"] != one["split"]:
            failures.append(f"COMBO={json.dumps(combo)}: split {got['split']} vs {one['split']}; weights apart "
                            f"(largest first): {sorted(apart.items(), key=lambda kv: -kv[1])[:3]}")
    assert not failures, "\n".join(failures)
