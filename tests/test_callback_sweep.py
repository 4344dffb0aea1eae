"""Every public callback of ``lightning.pytorch.callbacks`` is exact under the strategy or refused at setup, on 1
and on 2 processes, and the table in docs/callbacks.md says which.

The callbacks are enumerated from the module, so a new Lightning release's callback fails
``test_every_public_lightning_callback_is_classified`` (naming it) until it is entered in ``SWEEP`` and so runs
through the same checks. Each case (tests/scripts/callback_fit.py) trains the same small model with one callback:

- 1 process: the strategy with 2 stages in one process under ``gpipe`` (synchronous, so the numbers are plain
  Lightning's) against plain Lightning (no strategy): final weights, and what the callback decided or logged.
- 2 processes: 2 stages under ``2bw`` against the same run on one process (``num_stages=2``), which is the
  reference docs/design/update-rule.md's rule makes exact; all cases in one launch. The data-parallel case (2 replicas of 1
  stage) is compared with one process trained on the replicas' batches concatenated.

Refused means ``fit`` raises ``ValueError`` from ``AsyncPipelineStrategy.setup_environment`` naming the callback,
before the callbacks' own setup and before any process group. ``python tests/test_callback_sweep.py`` rewrites
docs/callbacks.md.
"""
from __future__ import annotations

import inspect
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch.callbacks as lightning_callbacks
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import callback_fit  # noqa: E402
from pipeline_runs import script_ranks  # noqa: E402

from lightning_async_pp.lightning_callbacks import refusal  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "callbacks.md"
SCRIPT = Path(__file__).parent / "scripts" / "callback_fit.py"
# Weights: float32 sums of a handful of products per step, 24 steps of SGD with lr <= 0.1 on O(1) weights: the
# pipeline and the reference add the same terms in another order (microbatches, stages), each rounding ~6e-8
# relative; 1e-5 leaves two orders of magnitude over that growth and is far below one update (~1e-2).
TOL = 1e-5


@dataclass(frozen=True)
class Row:
    """How one public callback is swept: its cases (callback_fit.CASES), whether it is exact on 1 and on 2
    processes (else refused), and what is compared besides the final weights (for the docs)."""

    cases: tuple[str, ...]
    one: bool
    two: bool
    compared: str


SWEEP: dict[str, Row] = {
    "BaseFinetuning": Row(("BaseFinetuning",), True, True,
                          "a layer frozen in setup, unfrozen into a new parameter group at epoch 1; also on 2 "
                          "data-parallel replicas, and on 2 processes with the whole first stage frozen (beside a "
                          "plain callback freezing layers mid-epoch)"),
    "BackboneFinetuning": Row(("BackboneFinetuning",), True, True, "the backbone unfrozen at epoch 1, its lr schedule"),
    "ModelPruning": Row(("ModelPruning",), False, False, ""),
    "StochasticWeightAveraging": Row(("StochasticWeightAveraging",), True, False, "the averaged weights at the end"),
    "EMAWeightAveraging": Row(("EMAWeightAveraging",), True, False,
                              "the averaged weights at the end; resuming a fit with it is refused"),
    "WeightAveraging": Row(("WeightAveraging",), True, False,
                           "the averaged weights at the end; resuming a fit with it is refused"),
    "GradientAccumulationScheduler": Row(("GradientAccumulationScheduler", "GradientAccumulationScheduler(factor 2)"),
                                         True, True, "factor 1 at every epoch (the weights)"),
    "LearningRateMonitor": Row(("LearningRateMonitor",), True, True, "the learning rate logged at every step"),
    "EarlyStopping": Row(("EarlyStopping",), True, True, "the step and epoch it stops at, its best score"),
    "ModelCheckpoint": Row(("ModelCheckpoint",), True, True, "the best score, the best and kept checkpoints' names"),
    "OnExceptionCheckpoint": Row(("OnExceptionCheckpoint",), True, False,
                                 "the step of the failure, then the weights after resuming from its checkpoint"),
    "Timer": Row(("Timer",), True, True, "the step it stops at (a clock of one second per step)"),
    "ThroughputMonitor": Row(("ThroughputMonitor",), True, False, "the sample and batch counts it logs"),
    "DeviceStatsMonitor": Row(("DeviceStatsMonitor",), True, True, "the weights (its figures are the machine's)"),
    "BatchSizeFinder": Row(("BatchSizeFinder",), False, False, ""),
    "LearningRateFinder": Row(("LearningRateFinder",), True, True, "the losses of its learning-rate sweep"),
    "ModelSummary": Row(("ModelSummary",), True, True, "the total and trainable parameters it prints"),
    "RichModelSummary": Row(("RichModelSummary",), True, True, "the total and trainable parameters it prints"),
    "TQDMProgressBar": Row(("TQDMProgressBar",), True, True, "the weights"),
    "RichProgressBar": Row(("RichProgressBar",), True, True, "the weights"),
    "LambdaCallback": Row(("LambdaCallback",), True, True, "every on_train_batch_end call: step, batch index, loss"),
    "BasePredictionWriter": Row(("BasePredictionWriter",), True, True, "what it is given to write after fit"),
    "SpikeDetection": Row(("SpikeDetection",), True, True, "the batch where it stops training, the batches it excludes"),
}
#: Base classes with no behaviour of their own; each is exercised through the rows of its subclasses.
BASES = {"Callback": "every row", "Checkpoint": "ModelCheckpoint, OnExceptionCheckpoint",
         "ProgressBar": "TQDMProgressBar, RichProgressBar"}
#: The data-parallel case of the finding "a layer unfrozen mid-run never trains under data parallelism".
DATA_PARALLEL = {"BaseFinetuning, 2 replicas": dict(callback="BaseFinetuning", dp=2, stages=1)}


def public_callbacks() -> list[str]:
    return sorted(name for name, obj in vars(lightning_callbacks).items()
                  if not name.startswith("_") and inspect.isclass(obj) and issubclass(obj, lightning_callbacks.Callback))


def refused_by_design(case: str, processes: int) -> bool:
    """Whether the strategy refuses this case (GradientAccumulationScheduler: only its factor-2 case)."""
    callbacks, _, _ = callback_fit.CASES[case](Path("unused"))
    return any(refusal(c, processes=processes, num_stages=2) for c in callbacks)


def expected_exact(row: Row, case: str, processes: int) -> bool:
    return (row.one if processes == 1 else row.two) and not refused_by_design(case, processes)


# ---- comparing two runs -----------------------------------------------------------------------------------------
def differences(got: dict, want: dict, path: str = "") -> list[str]:
    """Where two observations differ: numbers beyond TOL (relative to their size), anything else not equal."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got} vs {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path}: {got} vs {want}"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(want, torch.Tensor):
        gap = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else math.inf
        return [] if gap <= TOL * max(1.0, want.double().abs().max().item()) else [f"{path}: {gap:.3g} apart"]
    if isinstance(want, float) and isinstance(got, float):
        return [] if abs(got - want) <= TOL * max(1.0, abs(want)) else [f"{path}: {got} vs {want}"]
    return [] if got == want else [f"{path}: {got!r} vs {want!r}"]


def compare(name: str, got: dict, want: dict) -> list[str]:
    if got.get("error") != want.get("error"):  # SpikeDetection stops both with the same error
        return [f"{name}: error {got.get('error')!r} vs {want.get('error')!r}"]
    keys = [k for k in ("observed", "observed_at_failure") if k in want]
    found = [f"{name}: {d}" for k in keys for d in differences(got.get(k), want[k], k)]
    if "state_dict" in want:
        found += [f"{name}: {d}" for d in differences(got.get("state_dict"), want["state_dict"], "weights")]
    return found


def check_refused(name: str, result: dict) -> list[str]:
    callback = SWEEP_CASE_CLASS[name]
    error = result.get("error", "")
    if error.startswith("ValueError: AsyncPipelineStrategy cannot run these callbacks exactly") and callback in error:
        return []
    return [f"{name}: expected a refusal naming {callback}, got {error or 'a run'!r}"]


SWEEP_CASE_CLASS = {case: name for name, row in SWEEP.items() for case in row.cases}


def one_process(case: dict, tmp_path: Path, label: str) -> dict:
    saved = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        return callback_fit.run(case, devices=1, tmp=tmp_path / label)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- the tests -------------------------------------------------------------------------------------------------
def test_every_public_lightning_callback_is_classified():
    unknown = [n for n in public_callbacks() if n not in SWEEP and n not in BASES]
    assert not unknown, (f"Lightning callbacks not in the sweep: {unknown}; add each to SWEEP (with a case in "
                         f"tests/scripts/callback_fit.py) so it is checked exact or refused")
    assert not [n for n in [*SWEEP, *BASES] if n not in public_callbacks()], "rows for callbacks Lightning lacks"
    assert {c for row in SWEEP.values() for c in row.cases} == set(callback_fit.CASES)


@pytest.mark.slow
def test_every_callback_on_one_process_gives_plain_lightnings_numbers_or_is_refused_at_setup(tmp_path):
    failures = []
    for name, row in SWEEP.items():
        for case in row.cases:
            got = one_process(dict(callback=case, schedule="gpipe"), tmp_path, f"{case}-pipeline")
            if not expected_exact(row, case, 1):
                failures += check_refused(case, got)
                continue
            want = one_process(dict(callback=case, strategy=False), tmp_path, f"{case}-plain")
            failures += compare(case, got, want)
    assert not failures, "\n".join(failures)


def test_a_refusal_surfaces_as_itself_when_an_on_exception_checkpoint_would_save_on_it(tmp_path):
    """OnExceptionCheckpoint saves on any exception in fit, the refusal's included, when no engine exists yet: the
    save is skipped (with a warning) and the refusal is the error raised, before any training."""
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, strategy=AsyncPipelineStrategy("2bw", num_microbatches=2),
                        callbacks=[lightning_callbacks.OnExceptionCheckpoint(tmp_path),
                                   lightning_callbacks.GradientAccumulationScheduler({2: 4})])
    model = callback_fit.SweepLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="no checkpoint written"), \
            pytest.raises(ValueError, match=r"GradientAccumulationScheduler .*factors \{2: 4\}.*raise num_microbatches"):
        trainer.fit(model, torch.utils.data.DataLoader(callback_fit.make_dataset(8), batch_size=4))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not list(tmp_path.iterdir())


def test_resuming_with_a_weight_averaging_callback_is_refused_before_loading_naming_it(tmp_path):
    """EMAWeightAveraging restores its average from the checkpoint's state_dict, which the strategy's checkpoints
    keep with the weight versions: the resume stopped with a KeyError after loading the averaged weights."""
    import lightning as L

    from lightning_async_pp import AsyncPipelineStrategy

    def trainer(callbacks):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks,
                         strategy=AsyncPipelineStrategy("2bw", num_microbatches=2, num_stages=2, partition=[2, 2]))

    loader = torch.utils.data.DataLoader(callback_fit.make_dataset(16), batch_size=4)
    trainer([lightning_callbacks.EMAWeightAveraging(),
             lightning_callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=4)]).fit(callback_fit.SweepLM(), loader)
    (saved,) = tmp_path.glob("*.ckpt")
    with pytest.raises(ValueError, match="cannot resume a fit with EMAWeightAveraging"):
        trainer([lightning_callbacks.EMAWeightAveraging()]).fit(callback_fit.SweepLM(), loader, ckpt_path=str(saved))


def launch_two_processes(cfg: dict, tmp_path: Path, timeout: float = 900) -> list[dict]:
    """Both ranks started here, as torchrun would (``run_ranks``: LOCAL_RANK set): Lightning then kills no process
    when a fit raises, so a refused case leaves both processes ready for the next one."""
    return script_ranks(SCRIPT, dict(cfg, root=str(tmp_path)), tmp_path, ranks=2, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_callback_on_two_processes_gives_one_devices_numbers_or_is_refused_at_setup(tmp_path):
    cases = {case: dict(callback=case) for row in SWEEP.values() for case in row.cases}
    ranks = launch_two_processes({"cases": {**cases, **DATA_PARALLEL}}, tmp_path)
    results = ranks[0]["cases"]
    failures = []
    for name, row in SWEEP.items():
        for case in row.cases:
            if not expected_exact(row, case, 2):
                failures += check_refused(case, results[case])
                failures += check_refused(case, ranks[1]["cases"][case])
                continue
            got = results[case]
            if "error" in got:  # stopped by the callback (SpikeDetection): the weights are each stage's own
                got = dict(got, state_dict={**ranks[1]["cases"][case]["state_dict"], **got["state_dict"]})
            failures += compare(case, got, one_process(dict(callback=case), tmp_path, f"{case}-one"))
    for name, case in DATA_PARALLEL.items():
        failures += compare(name, results[name], one_process(case, tmp_path, "data-parallel-one"))
    assert not failures, "\n".join(failures)


#: Freezing and unfreezing (callback_fit.FREEZING_CASES) on 2 stages: partition [1, 3] makes the first stage the
#: frozen layer alone.
FREEZING = {"BaseFinetuning(whole first stage)": dict(callback="BaseFinetuning(whole first stage)", partition=[1, 3]),
            "requires_grad toggled mid-epoch": dict(callback="requires_grad toggled mid-epoch")}


@pytest.mark.multiprocess
def test_freezing_and_unfreezing_layers_at_any_step_on_two_processes_gives_one_devices_weights(tmp_path):
    """Whether a received activation needs a gradient changes whenever a layer is frozen or unfrozen: the second
    stage must send back the gradient of every activation that needs one, however the first one was (a stage
    frozen at setup never trained on 2 processes); a stage with nothing to train at setup must still run; and a
    change made by a batch's hooks acts on the whole batch, the microbatches 2BW ran ahead of them included."""
    results = launch_two_processes({"cases": FREEZING}, tmp_path)[0]["cases"]
    failures = []
    for name, case in FREEZING.items():
        one = one_process(case, tmp_path, f"{name}-one")
        failures += compare(name, results[name], one)
        initial = callback_fit.SweepLM().state_dict()["layers.0.weight"]
        assert not torch.equal(one["state_dict"]["layers.0.weight"], initial), f"{name}: layer 0 never trained"
    assert not failures, "\n".join(failures)


# ---- the table in the docs -------------------------------------------------------------------------------------
HEADER = """# Lightning's callbacks under AsyncPipelineStrategy

Every public callback of `lightning.pytorch.callbacks` (Lightning {version}) either gives the numbers it gives
without the strategy, or is refused when `fit` starts (`ValueError` from the strategy's `setup_environment`, before
the callbacks' own setup and any process group) with the reason below. `tests/test_callback_sweep.py` checks every
row and generates this page (`python tests/test_callback_sweep.py` rewrites it); a callback a new Lightning
release adds fails that test until it has a row.

- **1 process**: 2 stages in one process under `gpipe` against plain Lightning (no strategy): the final weights and
  what the callback decided or logged (last column), float32 within 1e-5.
- **2 processes**: 2 stages under `2bw` against the same run on one process (`num_stages=2`), which docs/design/update-rule.md's
  update rule makes exact.

| callback | 1 process | 2 processes | compared / why refused |
|---|---|---|---|
"""


def render() -> str:
    import lightning

    lines = [HEADER.format(version=lightning.__version__)]
    for name in sorted(SWEEP):
        row = SWEEP[name]
        reasons: list[str] = []
        for case in row.cases:
            for processes in (1, 2):
                callbacks, _, _ = callback_fit.CASES[case](Path("unused"))
                found = [r for c in callbacks if (r := refusal(c, processes=processes, num_stages=2))]
                reasons += [r for r in found if r not in reasons]
        text = "; ".join([row.compared] * bool(row.compared) + [f"refused: {r}" for r in reasons])
        lines.append(f"| `{name}` | {'exact' if row.one else 'refused'} | {'exact' if row.two else 'refused'} | "
                     f"{text} |\n")
    lines.append("\nBase classes with no behaviour of their own, exercised through their subclasses: "
                 + ", ".join(f"`{b}` ({s})" for b, s in sorted(BASES.items())) + ".\n")
    lines.append(FINETUNING_ON_THE_MODELS)
    return "".join(lines)


#: The fine-tuning rows on the package's own models (their tests are elsewhere).
FINETUNING_ON_THE_MODELS = (
    "\nThe fine-tuning callbacks work on the package's models too (`Llama`, `HuggingFaceCausalLM`, `LitGPT`): their "
    "modules exist from `__init__` (parameters on the meta device until `configure_model`), so a layer frozen in "
    "`setup` is there to freeze. `BaseFinetuning` freezing the embedding in setup and unfreezing it at epoch 1 gives "
    "plain Lightning's weights (`tests/test_adapters.py`, `tests/test_llama.py`) and, for `HuggingFaceCausalLM` on 2 "
    "processes, the one-device run's. A recipe starting from pretrained weights: [the models guide](guide/models.md), "
    "'Fine-tuning'.\n")


def test_the_callback_table_in_the_docs_is_current():
    assert DOC.exists() and DOC.read_text() == render(), "docs/callbacks.md is out of date: python tests/test_callback_sweep.py rewrites it"


if __name__ == "__main__":
    DOC.write_text(render())
    print(f"wrote {DOC}")
