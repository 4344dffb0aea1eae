"""StalenessMonitor and PipelineMonitor on one device: figures read back from TensorBoard's own event files and
checked against references recomputed here from the weights saved at every step."""
from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import TinyLM, make_dataset
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.callbacks import PipelineMonitor, StalenessMonitor

STEPS = 6
BATCH = 8
MICROBATCHES = 4


def loader() -> DataLoader:
    return DataLoader(make_dataset(64), batch_size=BATCH, shuffle=False, drop_last=True)


class WeightRecorder(Callback):
    """Saves every stage's weights at the start of every batch (W_k) and at the end of training (W_N)."""

    def __init__(self) -> None:
        self.weights: dict[int, list[list[torch.Tensor]]] = {}

    def _save(self, trainer) -> None:
        stats = trainer.strategy.engine.stats
        self.weights[stats.batch_index] = [[p.detach().clone() for p in stage.params] for stage in stats.stages]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer)


def fit(tmp_path: Path, strategy: AsyncPipelineStrategy, callbacks=(), model=None, optimizer="sgd", steps=STEPS,
        log_every_n_steps=1) -> tuple[TinyLM, L.Trainer]:
    model = model if model is not None else TinyLM(optimizer=optimizer)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, strategy=strategy, callbacks=list(callbacks),
        logger=TensorBoardLogger(str(tmp_path), name="lightning_logs"), log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, loader())
    return model, trainer


def scalars(trainer: L.Trainer) -> dict[str, dict[int, float]]:
    """Every scalar of the run, read back with TensorBoard's own reader: ``{tag: {step: value}}``."""
    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def sq_dist(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b))


def sq_norm(a: list[torch.Tensor]) -> float:
    return sum(float((x.double() ** 2).sum()) for x in a)


def close(value: float, reference: float, rel: float = 1e-5, abs_: float = 1e-9) -> bool:
    return abs(value - reference) <= rel * abs(reference) + abs_


# ---- StalenessMonitor ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "schedule, options, delays",
    [
        ("2bw", {}, lambda k, s: min(1, k)),
        ("2bw", {"delay": 2}, lambda k, s: min(2, k)),
        ("2bw", {"sync_steps": 2}, lambda k, s: 0 if k < 2 else 1),
        ("2bw", {"delay": [1, 0]}, lambda k, s: min(1, k) if s == 0 else 0),
        ("1f1b", {}, lambda k, s: 0),
    ],
    ids=["2bw", "delay2", "sync_steps2", "per_stage_delays", "1f1b"],
)
def test_drift_delay_and_update_norm_match_norms_recomputed_from_the_saved_weights(tmp_path, schedule, options, delays):
    recorder = WeightRecorder()
    strategy = AsyncPipelineStrategy(schedule, MICROBATCHES, num_stages=2, **options)
    _, trainer = fit(tmp_path, strategy, [recorder, StalenessMonitor()])
    logged = scalars(trainer)
    W = recorder.weights  # W[k][stage] = the stage's tensors of W_k
    for k in range(STEPS):
        drift_sq, weight_sq, update_sq = 0.0, 0.0, 0.0
        for s in range(2):
            d = delays(k, s)
            assert logged[f"staleness/stage{s}/delay"][k] == d
            stage_drift_sq, stage_weight_sq = sq_dist(W[k][s], W[k - d][s]), sq_norm(W[k][s])
            stage_update_sq = sq_dist(W[k][s], W[k + 1][s])  # plain SGD: u_k = W_k - W_{k+1}
            assert close(logged[f"staleness/stage{s}/drift"][k], math.sqrt(stage_drift_sq / stage_weight_sq))
            assert close(logged[f"staleness/stage{s}/update_norm"][k], math.sqrt(stage_update_sq))
            if d == 0:
                assert logged[f"staleness/stage{s}/drift"][k] == 0.0  # exactly: the same version
            else:
                assert logged[f"staleness/stage{s}/drift"][k] > 0.0
            drift_sq, weight_sq, update_sq = drift_sq + stage_drift_sq, weight_sq + stage_weight_sq, update_sq + stage_update_sq
        assert logged["staleness/delay"][k] == max(delays(k, s) for s in range(2))
        assert close(logged["staleness/drift"][k], math.sqrt(drift_sq / weight_sq))
        assert close(logged["staleness/update_norm"][k], math.sqrt(update_sq))
    assert "staleness/correction_norm" not in logged  # no ErrorFeedback here
    if schedule == "1f1b":
        assert all(v == 0.0 for v in logged["staleness/drift"].values())


def test_update_and_correction_norms_match_the_inverted_error_feedback_recurrence(tmp_path):
    # Muon wrapped in ErrorFeedback(c=1): W_k - W_{k+1} = u_k + c (u_k - u_{k-1}), no correction at the first
    # update. From the saved weights alone: u_0 = D_0, u_k = (D_k + c u_{k-1}) / (1 + c), correction = D_k - u_k.
    recorder = WeightRecorder()
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES), [recorder, StalenessMonitor()],
                     optimizer="muon_ef")
    logged = scalars(trainer)
    W = {k: [t.double() for t in w[0]] for k, w in recorder.weights.items()}
    c, u_prev = 1.0, None
    for k in range(STEPS):
        D = [a - b for a, b in zip(W[k], W[k + 1])]
        u = D if u_prev is None else [(d + c * p) / (1 + c) for d, p in zip(D, u_prev)]
        correction = [d - x for d, x in zip(D, u)]
        assert close(logged["staleness/update_norm"][k], math.sqrt(sq_norm(u)), rel=1e-4)
        assert close(logged["staleness/correction_norm"][k], math.sqrt(sq_norm(correction)), rel=1e-3, abs_=1e-7)
        u_prev = u
    assert logged["staleness/correction_norm"][0] < 1e-7  # no correction at the first update
    assert min(logged["staleness/correction_norm"][k] for k in range(2, STEPS)) > 1e-4  # and a real one later


def test_probe_cosine_and_loss_delta_match_gradients_recomputed_from_the_saved_weights(tmp_path):
    recorder = WeightRecorder()
    model = TinyLM()
    initial = copy.deepcopy(model)
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES), [recorder, StalenessMonitor(probe_every=2)],
                     model=model, log_every_n_steps=50)
    logged = scalars(trainer)
    batches = list(loader())
    probed = sorted(logged["staleness/grad_cosine"])
    assert probed == [1, 3, 5]  # every 2nd step: k = 1, 3, 5, written whatever log_every_n_steps is
    for k in probed:
        mb = [t[: BATCH // MICROBATCHES] for t in batches[k]]  # the first microbatch of batch k
        losses, grads = [], []
        for version in (k, k - 1):  # fresh W_k, stale W_{k-1}
            reference = copy.deepcopy(initial)
            with torch.no_grad():
                for p, w in zip(reference.parameters(), recorder.weights[version][0]):
                    p.copy_(w)
            loss = reference.pipeline_loss(reference.pipeline_forward(mb), mb)
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(reference.parameters()))]))
            losses.append(loss.item())
        cosine = torch.nn.functional.cosine_similarity(grads[0].double(), grads[1].double(), dim=0).item()
        assert abs(logged["staleness/grad_cosine"][k] - cosine) < 1e-5
        assert abs(logged["staleness/stage0/grad_cosine"][k] - cosine) < 1e-5
        assert cosine < 1 - 1e-6  # stale and fresh gradients really differ under 2bw
        assert close(logged["staleness/loss_delta"][k], losses[1] - losses[0], rel=1e-4, abs_=1e-7)


def test_probe_cosine_is_one_and_loss_delta_zero_under_a_synchronous_schedule(tmp_path):
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("1f1b", MICROBATCHES, num_stages=2),
                     [StalenessMonitor(probe_every=1)])
    logged = scalars(trainer)
    assert sorted(logged["staleness/grad_cosine"]) == list(range(STEPS))
    for tag in ("staleness/grad_cosine", "staleness/stage0/grad_cosine", "staleness/stage1/grad_cosine"):
        assert all(abs(v - 1.0) < 1e-6 for v in logged[tag].values()), logged[tag]
    assert all(v == 0.0 for v in logged["staleness/loss_delta"].values())


class DropoutTinyLM(TinyLM):
    """TinyLM with dropout between layers: training draws random numbers (``p=0`` keeps the modules, draws none)."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(layer, nn.Dropout(p)) for layer in self.layers[:-1]]
                                    + [self.layers[-1]])


class ConsumesRandomNumbers(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.rand(1)


def test_probe_leaves_the_final_weights_bit_identical(tmp_path):
    def final(callbacks, name, p=0.2):
        torch.manual_seed(0)
        model, _ = fit(tmp_path / name, AsyncPipelineStrategy("2bw", MICROBATCHES), callbacks, model=DropoutTinyLM(p))
        return model.state_dict()

    without = final([], "without")
    with_probe = final([StalenessMonitor(probe_every=1), PipelineMonitor()], "with")
    assert without.keys() == with_probe.keys()
    assert all(torch.equal(without[k], with_probe[k]) for k in without)
    # Each forward draws from its own seeded stream (docs/design/stages.md, "Randomness"): random numbers drawn outside
    # the pipeline, as an unguarded probe would, leave the run as it was ...
    disturbed = final([ConsumesRandomNumbers()], "disturbed")
    assert all(torch.equal(without[k], disturbed[k]) for k in without)
    # ... while the masks do matter: the same run without dropout ends elsewhere.
    no_dropout = final([], "no_dropout", p=0.0)
    assert not all(torch.equal(without[k], no_dropout[k]) for k in without)


def test_probe_across_processes_is_refused_at_setup_naming_the_limitation():
    strategy = AsyncPipelineStrategy("2bw", 2, parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.is_multiprocess
    trainer = SimpleNamespace(strategy=strategy, loggers=[object()])
    with pytest.raises(ValueError, match="whole model in one process.*devices=1"):
        StalenessMonitor(probe_every=5).setup(trainer, None, "fit")
    StalenessMonitor().setup(trainer, None, "fit")  # without the probe it is fine


def test_monitors_need_the_pipeline_strategy_and_a_logger(tmp_path):
    for monitor in (StalenessMonitor(), PipelineMonitor()):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[monitor],
                            logger=TensorBoardLogger(str(tmp_path)), enable_progress_bar=False)
        with pytest.raises(TypeError, match="AsyncPipelineStrategy"):
            trainer.fit(TinyLM(), loader())
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[monitor], logger=False,
                            strategy=AsyncPipelineStrategy("2bw", 4), enable_progress_bar=False)
        with pytest.raises(MisconfigurationException, match="no logger"):
            trainer.fit(TinyLM(), loader())
    with pytest.raises(ValueError, match="probe_every"):
        StalenessMonitor(probe_every=0)
    with pytest.raises(ValueError, match="trace_steps"):
        PipelineMonitor(trace_steps=(3, 1))


# ---- PipelineMonitor ------------------------------------------------------------------------------------------

def test_both_monitors_write_every_documented_tag_to_tensorboard_and_all_values_are_finite(tmp_path):
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES),
                     [StalenessMonitor(probe_every=2), PipelineMonitor()], optimizer="muon_ef", log_every_n_steps=2)
    logged = scalars(trainer)
    expected = {f"staleness/{n}" for n in ("drift", "delay", "update_norm", "correction_norm", "grad_cosine",
                                            "loss_delta")}
    expected |= {f"staleness/stage0/{n}" for n in ("drift", "delay", "update_norm", "correction_norm", "grad_cosine")}
    timing = ("compute_s", "comm_wait_s", "optimizer_s", "idle_s", "overhead_s", "step_time_s", "bubble_fraction",
              "optimizer_fraction", "dp_comm_s", "dp_comm_exposed_s")
    expected |= {f"pipeline/{n}" for n in timing + ("tokens_per_sec", "samples_per_sec", "peak_memory_mb")}
    expected |= {f"pipeline/stage0/{n}" for n in timing + ("peak_memory_mb",)}
    assert expected <= set(logged), expected - set(logged)
    for tag in expected:
        assert logged[tag] and all(math.isfinite(v) for v in logged[tag].values()), (tag, logged[tag])
    assert sorted(logged["pipeline/bubble_fraction"]) == [1, 3, 5]  # logging steps: (k + 1) % 2 == 0
    assert sorted(logged["staleness/drift"]) == [1, 3, 5]


def test_throughput_and_timing_add_up_against_the_wall_clock(tmp_path):
    monitor = PipelineMonitor()
    start = time.perf_counter()
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES), [monitor], steps=8, log_every_n_steps=4)
    elapsed = time.perf_counter() - start
    logged = scalars(trainer)
    assert sorted(logged["pipeline/step_time_s"]) == [3, 7]
    # The windows (4 steps each) lie inside the fit, so their wall time cannot exceed it.
    assert 0 < sum(4 * v for v in logged["pipeline/step_time_s"].values()) <= elapsed
    for k in (3, 7):
        step = logged["pipeline/step_time_s"][k]
        assert 0 < logged["pipeline/compute_s"][k] <= step
        assert close(logged["pipeline/samples_per_sec"][k] * step, BATCH, rel=1e-4)  # 8 samples per step
        # a TinyLM sample is 4 input features: tokens = numel(pipeline_input(batch))
        assert close(logged["pipeline/tokens_per_sec"][k], 4 * logged["pipeline/samples_per_sec"][k], rel=1e-5)
        parts = [logged[f"pipeline/{n}"][k] for n in ("compute_s", "comm_wait_s", "optimizer_s", "idle_s")]
        assert all(p >= 0 for p in parts) and logged["pipeline/overhead_s"][k] > 0
        assert close(sum(parts) + logged["pipeline/overhead_s"][k], step, rel=1e-4)
        # one process: the bubble is the share of the pipeline's step spent neither in forward and backward nor
        # in the optimizer; the optimizer's share is logged apart
        assert close(logged["pipeline/bubble_fraction"][k], 1 - (parts[0] + parts[2]) / sum(parts), rel=1e-4, abs_=1e-5)
        assert close(logged["pipeline/optimizer_fraction"][k], parts[2] / sum(parts), rel=1e-4, abs_=1e-5)
        assert 0 < logged["pipeline/bubble_fraction"][k] < 1 and 0 < logged["pipeline/optimizer_fraction"][k] < 1
        assert logged["pipeline/peak_memory_mb"][k] > 10  # the RSS of a Python process with torch loaded


def test_one_device_trace_is_a_chrome_trace_of_the_traced_steps(tmp_path):
    monitor = PipelineMonitor(trace_steps=(1, 2))
    fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES, num_stages=2), [monitor])
    assert monitor.trace_file == str(Path(tmp_path) / "lightning_logs" / "version_0" / "pipeline_trace.json")
    events = json.loads(Path(monitor.trace_file).read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0)}  # all stages run in this one process: one track
    names = [e["name"] for e in spans]
    # 2 steps x 4 microbatches x 2 stages, each stage's actions timed on their own
    assert names.count("forward") == names.count("backward") == 2 * MICROBATCHES * 2
    assert names.count("optimizer") == 2 and "idle" in names
    assert {e["args"]["batch"] for e in spans if e["name"] == "forward"} == {1, 2}
    spans.sort(key=lambda e: e["ts"])
    for a, b in zip(spans, spans[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3  # microseconds: no overlap within the track


# ---- StalenessMonitor per parameter group ---------------------------------------------------------------------

class GroupedCorrectionsTinyLM(TinyLM):
    """Two parameter groups with their own correction coefficient, learning rate and NAdam momentum, under every
    correction at once: ErrorFeedback(DelayCompensation(AsyncNesterov)) and PipeMareLR (delay 2)."""

    SETTINGS = [  # per group: the first is named, the second is not
        {"name": "matrices", "coefficient": 0.5, "lr": 0.01, "betas": (0.9, 0.999), "momentum_decay": 0.004},
        {"coefficient": 2.0, "lr": 0.02, "betas": (0.95, 0.999), "momentum_decay": 0.3},
    ]
    DELAY, WARMUP = 2, 4

    def configure_optimizers(self):
        from functools import partial

        from lightning_async_pp.optim import AsyncNesterov, DelayCompensation, ErrorFeedback, PipeMareLR

        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [dict(settings, params=params) for settings, params in zip(self.SETTINGS, (matrices, vectors))]
        opt = ErrorFeedback(groups, optimizer=partial(DelayCompensation, optimizer=partial(AsyncNesterov, lr=0.01),
                                                      delay=self.DELAY))
        schedule = PipeMareLR(opt, delay=self.DELAY, warmup_steps=self.WARMUP)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


GROUP_TAGS = {f"staleness/opt0/{group}/{metric}" for group in ("matrices", "group1")
              for metric in ("correction_norm", "compensation_ratio", "lr_factor", "nesterov_momentum")}


class OptimizerRecorder(Callback):
    """Per update k: each parameter's weights W_k (batch start), gradient and group learning rate as the optimizer
    receives them, and ErrorFeedback's u_k from the optimizer's state after the update."""

    def __init__(self) -> None:
        self.weights, self.grads, self.lrs, self.updates = {}, {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.k = k = trainer.strategy.engine.stats.batch_index
        self.weights[k] = {p: p.detach().clone() for p in pl_module.parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        k = self.k
        self.grads[k] = {p: p.grad.detach().clone() for p in pl_module.parameters()}
        self.lrs[k] = [group["lr"] for group in optimizer.param_groups]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_async_pp.optim import PREV_UPDATE

        opt = trainer.optimizers[0]
        self.updates[self.k] = {p: opt.state[p][PREV_UPDATE].clone() for p in pl_module.parameters()}


def test_each_correction_per_group_matches_its_formula_on_the_optimizers_state_and_gradients(tmp_path):
    """Per group G with coefficient c_G (ErrorFeedback and DelayCompensation), learning rate lr_G, NAdam beta1_G and
    momentum_decay psi_G, at update k (delay 2):
      correction_norm    = c_G ||u_k - u_{k-1}||_G                    (0 at k = 0), u from ErrorFeedback's state
      compensation_ratio = ||c_G g g (W_k - W_{max(k-2,0)})||_G / ||g||_G, g the gradient the optimizer received
      lr_factor          = the group's learning rate in update k / lr_G
      nesterov_momentum  = beta1_G (1 - 0.5 * 0.96 ** ((k + 2) psi_G))  (NAdam's mu_{t+1} with t = k + 1 updates)
    and the groups' squared norms add up to the whole model's."""
    recorder = OptimizerRecorder()
    model = GroupedCorrectionsTinyLM()
    _, trainer = fit(tmp_path, AsyncPipelineStrategy("2bw", MICROBATCHES, num_stages=2, delay=2),
                     [recorder, StalenessMonitor()], model=model)
    logged = scalars(trainer)
    groups = [[p for p in model.parameters() if p.dim() >= 2], [p for p in model.parameters() if p.dim() < 2]]
    sq = lambda ts: sum(float((t.double() ** 2).sum()) for t in ts)  # noqa: E731
    correction_sq_total = 0.0
    for k in range(STEPS):
        correction_sq_total = 0.0
        for settings, params, label in zip(GroupedCorrectionsTinyLM.SETTINGS, groups, ("matrices", "group1")):
            c, tag = settings["coefficient"], f"staleness/opt0/{label}/"
            correction = [c * (recorder.updates[k][p] - recorder.updates[k - 1][p]) for p in params] if k else []
            assert close(logged[tag + "correction_norm"][k], math.sqrt(sq(correction)), rel=1e-4, abs_=1e-7)
            correction_sq_total += sq(correction)
            g = [recorder.grads[k][p].double() for p in params]
            drift = [recorder.weights[k][p].double() - recorder.weights[max(k - 2, 0)][p].double() for p in params]
            terms = [c * x * x * d for x, d in zip(g, drift)]
            assert close(logged[tag + "compensation_ratio"][k], math.sqrt(sq(terms) / sq(g)), rel=1e-4, abs_=1e-9)
            assert close(logged[tag + "lr_factor"][k], recorder.lrs[k][label != "matrices"] / settings["lr"], rel=1e-6)
            beta1, psi = settings["betas"][0], settings["momentum_decay"]
            assert close(logged[tag + "nesterov_momentum"][k], beta1 * (1 - 0.5 * 0.96 ** ((k + 2) * psi)), rel=1e-6)
        assert close(logged["staleness/correction_norm"][k], math.sqrt(correction_sq_total), rel=1e-4, abs_=1e-7)
    # The groups really differ, and every correction acted.
    for metric in ("correction_norm", "compensation_ratio", "nesterov_momentum"):
        a, b = logged[f"staleness/opt0/matrices/{metric}"], logged[f"staleness/opt0/group1/{metric}"]
        assert all(a[k] > 0 and b[k] > 0 and not close(a[k], b[k], rel=1e-2) for k in range(1, STEPS)), metric
    assert logged["staleness/opt0/group1/lr_factor"][0] < 0.6  # 2 ** -(1 - 1/4) = 0.59: PipeMare acting


def test_per_group_tags_are_the_documented_names_at_every_logging_step_and_leave_the_other_figures_unchanged(tmp_path):
    def run(path, **options):
        _, trainer = fit(path, AsyncPipelineStrategy("2bw", MICROBATCHES, num_stages=2, delay=2),
                         [StalenessMonitor(**options)], model=GroupedCorrectionsTinyLM(), log_every_n_steps=2)
        return scalars(trainer)

    with_groups, without = run(tmp_path / "groups"), run(tmp_path / "no_groups", per_group=False)
    assert {tag for tag in with_groups if tag.startswith("staleness/opt")} == GROUP_TAGS
    assert all(sorted(with_groups[tag]) == [1, 3, 5] for tag in GROUP_TAGS)
    assert not any(tag.startswith("staleness/opt") for tag in without)
    assert set(without) == set(with_groups) - GROUP_TAGS
    for tag in without:  # the whole-model and per-stage figures (and training) are the same with or without
        if tag.startswith("staleness/") or tag == "train_loss":
            assert with_groups[tag] == without[tag], tag


def test_a_position_labelled_group_that_differs_between_processes_is_left_out_and_named_groups_are_kept():
    """Each stage's optimizer is built over its own parameters: optim.Muon holds a given group as its Muon and AdamW
    halves on a stage with both, as the AdamW half alone on a stage without matrices, so ``group0`` is not the same
    group on both processes. The agreed layout (taken once, from every rank's groups) drops it, and keeps the union
    of the rest."""
    from lightning_async_pp.callbacks.staleness import _agreed_layout, _group_corrections, _group_settings
    from lightning_async_pp.optim import ErrorFeedback, Muon

    def muon_ef(params):
        groups = [{"params": params, "coefficient": 1.0}, {"params": [nn.Parameter(torch.zeros(3))], "name": "gains"}]
        return [ErrorFeedback(groups, optimizer=lambda g: Muon(g, lr=0.02))]

    stage0 = muon_ef([nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))])  # Muon half, AdamW half
    stage1 = muon_ef([nn.Parameter(torch.zeros(4))])  # the AdamW half only
    ranks = [(_group_corrections(opts, []), _group_settings(opts)) for opts in (stage0, stage1)]
    assert ranks[0][0] == {"opt0/group0": {"correction_norm"}, "opt0/group1": {"correction_norm"},
                           "opt0/gains": {"correction_norm"}}
    layout, mixed = _agreed_layout(ranks)
    assert mixed == ["opt0/group0"]  # the Muon half on stage 0, the AdamW half on stage 1
    assert layout == {"opt0/group1": {"correction_norm"}, "opt0/gains": {"correction_norm"}}
    assert _agreed_layout([ranks[0], ranks[0]]) == (ranks[0][0], [])  # the same groups everywhere: all kept
