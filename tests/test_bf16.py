"""bf16 under 2BW: ``precision="bf16-true"`` keeps the weight versions, the stash and the optimizer state
(ErrorFeedback's buffer included) in bf16; ``"bf16-mixed"`` keeps them in fp32 and computes under autocast. Both
run on one device and across processes (docs/design/stages.md, "bf16")."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import seam_fit  # noqa: E402
from test_lightning_seam import OWN_SAMPLER, seam_results  # noqa: E402

BASE = dict(model={"optimizer": "muon_ef"}, schedule="2bw", steps=6, data={"samples": 64, "batch": 8}, microbatches=4)


def one_device(cfg: dict) -> dict:
    return seam_fit.run(dict(cfg, strategy_kwargs={"num_stages": 2}), devices=1)[0]


def expected_dtypes(dtype: torch.dtype) -> dict[str, list[str]]:
    # Muon's momentum and its AdamW part's moments, and ErrorFeedback's u_{k-1} buffer: all in the parameter dtype.
    state = ["exp_avg", "exp_avg_sq", "momentum_buffer", "prev_update"]
    return {"params": [str(dtype)], "slots": [str(dtype)], "optimizer_state": [f"{k}:{dtype}" for k in state]}


def bf16_ulps_apart(a: dict, b: dict) -> float:
    """The largest difference of two state dicts in units of one bf16 rounding step at each weight's magnitude."""
    return max(((a[k].float() - b[k].float()).abs() / (b[k].float().abs() * 2.0**-8).clamp_min(2.0**-133)).max().item()
               for k in a)


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_versions_stash_and_error_feedback_buffer_are_kept_in_the_parameter_dtype(precision, dtype):
    result = one_device(dict(BASE, precision=precision))
    assert result["dtypes"] == expected_dtypes(dtype)
    assert {v.dtype for v in result["state_dict"].values()} == {dtype}


def test_bf16_mixed_loss_stays_close_to_fp32_and_autocast_is_active():
    fp32 = torch.tensor(one_device(dict(BASE, precision="32-true"))["losses"])
    mixed = torch.tensor(one_device(dict(BASE, precision="bf16-mixed"))["losses"])
    # autocast rounds each matmul's inputs to bf16 (8 significant bits, relative error <= 2^-9): over 6 steps of a
    # tiny MLP the losses stay within 2% of fp32's, yet they are not fp32's
    torch.testing.assert_close(mixed, fp32, rtol=2e-2, atol=0)
    assert (mixed - fp32).abs().max() > 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_bf16_2bw_on_two_processes_equals_the_one_device_run(tmp_path, precision, dtype):
    # Under bf16-mixed the activation crossing the boundary is bf16 (a Linear's output under autocast): the
    # layout header carries the dtype, so the receiver allocates bf16 and the gradient goes back in bf16.
    cfg = dict(BASE, precision=precision, **OWN_SAMPLER)
    ranks = seam_results(cfg, tmp_path)
    one = one_device(cfg)
    for r in ranks:
        assert r["dtypes"] == expected_dtypes(dtype), f"rank {r['rank']}"
    multi = ranks[0]["state_dict"]
    assert {v.dtype for v in multi.values()} == {dtype}
    # The stages run the same operations in the same order as on one device, and they agree exactly here. The
    # bound allows one bf16 rounding step per weight (2^-8 relative), what a different CPU thread count could
    # change in a matmul's summation order; fp32 weights (bf16-mixed) are held to the fp32 tests' 1e-5.
    if dtype == torch.bfloat16:
        assert bf16_ulps_apart(multi, one["state_dict"]) <= 1.0
    else:
        assert max((multi[k] - one["state_dict"][k]).abs().max().item() for k in multi) < 1e-5
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(one["losses"]), rtol=2.0**-8, atol=0)
