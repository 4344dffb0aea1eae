"""models.Llama under AsyncPipelineStrategy on 2 processes (gloo on CPU) against the same run on one device.

The one-device run is the emulation of the same 2-stage pipeline in one process, whose update rule the one-device
tests check against written-out loops. Across processes a tied embedding/head is kept as one copy per stage whose
gradients are summed (docs/design/stages.md, "Tied weights"), so the final weights must agree with one device, where
the two stages share one Parameter; both add the stages' sums in stage order, so they agree bit for bit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import llama_fit  # noqa: E402
import tie_cases_fit  # noqa: E402
from pipeline_runs import max_difference, run_here_on_one_device, run_script, script_ranks  # noqa: E402

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


@pytest.mark.multiprocess
def test_the_default_balanced_split_on_two_processes_trains_exactly_as_one_device_with_that_split(tmp_path):
    # No partition given: both layouts cost the layers on Llama's default sample and pick the same split.
    cfg = {"tie": True, "steps": 3, "schedule": "2bw", "microbatches": 4, "vocab": 2048, "max_seq_len": 32}
    reference = one_device(cfg)
    ranks = run_two_processes(cfg, tmp_path)
    method, counts = reference["split"]
    assert method == "balanced" and [r["split"] for r in ranks] == [reference["split"]] * 2
    assert counts == [4, 2]  # the head over 2048 words costs 2.7 tiny blocks; "parameters" would cut at [3, 3]
    assert max_difference(ranks[0]["state_dict"], reference["state_dict"]) < TOL


# Every schedule (zb_h1's split backward too), clipping (the norm counts the tied matrix once), activation
# checkpointing, and the HF adapter, whose head is tied to its embedding; untied as the control. The monitors log
# every step of a delayed and a synchronous one (test_the_staleness_figures_...).
TIE_CASES = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b_clipped": {"schedule": "1f1b", "clip": 0.05, "monitors": True},
    "2bw_checkpointed": {"schedule": "2bw", "strategy_kwargs": {"activation_checkpointing": True}, "monitors": True},
    "zb_h1": {"schedule": "zb_h1"},
    "untied_2bw": {"schedule": "2bw", "tie": False},
    "hf_2bw": {"adapter": "hf", "schedule": "2bw", "partition": [2, 3]},
    "hf_1f1b": {"adapter": "hf", "schedule": "1f1b", "partition": [2, 3]},
}


@pytest.fixture(scope="module")
def tie_runs(tmp_path_factory) -> tuple[dict, list[dict], dict]:
    """``TIE_CASES`` on 2 processes (one launch) and on one device: (the cases, what each rank returned, what one
    device's runs returned)."""
    cases = {name: {"tie": True, "steps": 3, "microbatches": 4, "partition": [3, 3], **case}
             for name, case in TIE_CASES.items()}
    ranks = script_ranks(Path(tie_cases_fit.__file__), {"cases": cases}, tmp_path_factory.mktemp("tie_cases"),
                         timeout=400)
    return cases, ranks, run_here_on_one_device(tie_cases_fit.run, {"cases": cases})["cases"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tied_embedding_and_head_on_two_processes_train_bit_for_bit_as_on_one_device(tie_runs):
    # The tied matrix's gradient is each stage's own sum over its microbatches, then the stages' sums added in
    # stage order, on one device as across processes (docs/design/stages.md, "Tied weights"): equal, as untied
    # runs are. One device used to add both stages' uses into one leaf microbatch by microbatch: up to 5e-7 apart
    # here after 3 steps, and a tied HF Llama 16% of its weights apart after 300.
    cases, ranks, reference = tie_runs
    failures = []
    for name in cases:
        got, want = ranks[0]["cases"][name]["state_dict"], reference[name]["state_dict"]
        assert got.keys() == want.keys()
        differ = [k for k in want if not torch.equal(got[k], want[k])]
        if differ:
            failures.append(f"{name}: {len(differ)} tensors differ, up to {max_difference(got, want):.3g}")
    assert not failures, failures
    moved = run_here_on_one_device(tie_cases_fit.run, {"cases": {"gpipe": {**cases["gpipe"], "steps": 0}}})
    assert max_difference(reference["gpipe"]["state_dict"], moved["cases"]["gpipe"]["state_dict"]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_staleness_figures_of_a_tied_embedding_and_head_on_two_processes_are_one_devices(tie_runs):
    # The weights are one device's bit for bit (the test above), and the tied matrix counts once, on the stage that
    # owns it (stage 0, where one device's stage 1 borrows it): the figures differ only by the order of their float64
    # sums, whose relative error is below n eps for n non-negative terms (n: the model's elements), and twice that
    # for a ratio. Counted on both stages, stage 1's update norm was 9% larger here.
    cases, ranks, reference = tie_runs
    for name in (n for n, case in cases.items() if case.get("monitors")):
        logged, one = ranks[0]["cases"][name]["logged"], reference[name]["logged"]
        n = sum(t.numel() for t in reference[name]["state_dict"].values())
        staleness = sorted(tag for tag in one if tag.startswith("staleness/"))
        assert staleness == sorted(tag for tag in logged if tag.startswith("staleness/")), name
        for tag in staleness:
            assert [k for k, _ in logged[tag]] == [k for k, _ in one[tag]] == [0, 1, 2], (name, tag)
            for (k, value), (_, expected) in zip(logged[tag], one[tag]):
                assert abs(value - expected) <= 4 * n * torch.finfo(torch.float64).eps * abs(expected), (
                    name, tag, k, value, expected)
        assert dict(logged["staleness/stage1/update_norm"])[1] > 0.1, name  # not trivially zero


def _compare_calls(ranks: list[dict], reference: dict) -> None:
    calls = ranks[0]["calls"]
    assert len(calls) == len(reference["calls"])
    for i, (got, want) in enumerate(zip(calls, reference["calls"])):
        assert max_difference(got["state_dict"], want["state_dict"]) < TOL, f"weights after call {i}"
        for key, value in want.items():
            if key == "logits":
                assert torch.allclose(got["logits"], value, atol=TOL, rtol=0), f"predictions of call {i}"
            elif key != "state_dict":
                assert abs(got[key] - value) < TOL, (i, key, got[key], value)


@pytest.mark.parametrize("sequence", [["fit", "validate", "predict", "test", "fit"], ["predict", "validate", "fit"]],
                         ids=["fit-validate-predict-test-fit", "predict-validate-fit"])
def test_a_sequence_of_trainer_calls_with_a_tie_across_processes_equals_one_device(sequence, tmp_path):
    # Each call builds a new engine on the model the previous call left (split across the processes): every
    # process must derive the same ties and groups from it (a mismatch used to wait in new_group until the
    # timeout), and the numbers must still be the one-device ones. A smaller lr than the default: the second fit
    # starts a fresh AdamW, whose first steps scale any float32 rounding difference by lr / eps for gradients
    # near zero.
    cfg = {"tie": True, "steps": 2, "partition": [3, 3], "sequence": sequence, "timeout": 30.0, "lr": 3e-4}
    _compare_calls(run_two_processes(cfg, tmp_path), one_device(cfg))


def test_a_one_device_fit_then_a_two_process_fit_in_one_interpreter_equals_one_device(tmp_path):
    # Lightning's launcher re-runs the script for rank 1, so there the one-device Trainer runs with LOCAL_RANK=1 in
    # the environment (it must still use its one device); then both processes continue the one-device weights.
    cfg = {"tie": True, "steps": 2, "partition": [3, 3], "sequence": ["fit", "fit", "validate"], "timeout": 120.0,
           "lr": 3e-4}
    _compare_calls(run_two_processes({**cfg, "first_on_one_device": True}, tmp_path), one_device(cfg))


@pytest.mark.multiprocess
def test_a_second_fit_under_a_memory_cap_counts_the_same_optimizer_state_on_every_process(tmp_path):
    # After the first fit each process's model holds placeholders for the other stage's layers; the second fit's
    # split counted the optimizer state on that tree (the other stage's layers: 0 bytes), so the processes could
    # choose different splits under the cap. Every process, every call: the whole model's numbers.
    cfg = {"tie": True, "steps": 1, "stage_memory_gib": 1.0, "sequence": ["fit", "fit"], "timeout": 60.0,
           "record_state_bytes": True}
    counted = [call["optimizer_state_bytes"] for rank in run_two_processes(cfg, tmp_path) for call in rank["calls"]]
    assert len(counted) == 4 and counted[0] is not None and all(n > 0 for n in counted[0]), counted
    assert all(c == counted[0] for c in counted), counted


def test_processes_that_build_different_models_fail_fast_with_a_message(tmp_path):
    # Rank 1 builds the model untied: the processes would create different process groups. They must say so at
    # setup, well before the 300 s pipeline timeout (the subprocess is given 120 s).
    cfg = {"tie": True, "steps": 2, "partition": [3, 3], "untie_on_other_ranks": True, "timeout": 300.0}
    proc = run_script(SCRIPT, cfg, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "the processes see different pipelines" in proc.stderr and "rank 1:" in proc.stderr, proc.stderr[-3000:]


def test_parameter_groups_chosen_by_name_put_both_copies_of_a_tie_in_the_same_group(tmp_path):
    # The last stage lists the tied matrix as embed.weight (its one-device name), so a rule on names gives it the
    # embedding's group there too; under the head's name the copies took different learning rates and drifted.
    cfg = {"tie": True, "steps": 3, "partition": [3, 3], "groups_by_name": "by_name"}
    ranks = run_two_processes(cfg, tmp_path)
    weights = ranks[0]["state_dict"]
    assert max_difference(weights, one_device(cfg)["state_dict"]) < TOL
    assert torch.equal(weights["embed.weight"], weights["head.proj.weight"])


def test_tied_copies_with_different_optimizer_groups_are_refused_before_training(tmp_path):
    cfg = {"tie": True, "steps": 2, "partition": [3, 3], "groups_by_name": "rank_dependent", "timeout": 300.0}
    proc = run_script(SCRIPT, cfg, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "'embed.weight' is tied across pipeline stages, but its optimizer groups differ" in proc.stderr, proc.stderr[-3000:]
