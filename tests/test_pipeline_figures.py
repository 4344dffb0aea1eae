"""One bubble for the monitor, the planner and the docs, and the picture of the executed schedule.

The bubble of a stage is the share of the pipeline's step in which it neither computes (forward, backward) nor
updates its weights; the optimizer's share is reported beside it. ``PipelineMonitor`` and the planner
(``pipeline/simulate.py``, ``lightning-async-pp-plan``) are checked against a schedule worked out by hand.
"""
from __future__ import annotations


import lightning as L
import numpy as np
import pytest
from helpers import TinyLM, make_dataset
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.callbacks import PipelineMonitor
from lightning_async_pp.callbacks.figures import StageFigures
from lightning_async_pp.callbacks.pipeline import _MAX_FIELDS, _MEAN_FIELDS
from lightning_async_pp.pipeline.simulate import simulate
from lightning_async_pp.plan import optimizer_fraction
from lightning_async_pp.trace import SCHEDULE_KINDS, ProcessSpans, schedule_figure

# The pictures need matplotlib (the dev extra); the transformers-5 environment (make test-hf5) has none.
to_rgb = pytest.importorskip("matplotlib.colors").to_rgb


# ---- one definition of the bubble -----------------------------------------------------------------------------
# Two stages, two microbatches, forward 1 s, backward 2 s, optimizer 1 s, no transfer time.
# GPipe, by hand: stage 0 runs F0 F1 [0, 2], waits for stage 1's backwards (F0 [1, 2], F1 [2, 3], B1 [3, 5],
# B0 [5, 7]), runs B1 B0 [5, 9] and its update [9, 10]; the next step's first forward starts at 10: T = 10 s.
# Each stage computes 2 x 1 + 2 x 2 = 6 s and updates 1 s: bubble 1 - 7/10 = 0.3, optimizer 1/10.
# 2BW, by hand: no flush, each stage's 6 s of compute and 1 s of update back to back: T = 7 s, bubble 0,
# optimizer 1/7 (the old monitor counted the update as bubble: 1/7).
HAND = {"gpipe": (10.0, 0.3, 0.1), "2bw": (7.0, 0.0, 1 / 7)}


@pytest.mark.parametrize("schedule", sorted(HAND))
def test_monitor_and_planner_report_the_hand_computed_bubble_with_the_optimizer_apart(schedule):
    step, bubble, opt = HAND[schedule]
    sim = simulate(schedule, 2, 2, [1.0, 1.0], [2.0, 2.0], comm_s=0.0, optimizer_s=1.0, steps=6)
    assert sim.step_time_s == pytest.approx(step, abs=1e-12)
    assert sim.bubble_fraction == pytest.approx(bubble, abs=1e-12)
    assert sim.stage_bubble_fractions == pytest.approx([bubble, bubble], abs=1e-12)
    assert optimizer_fraction(sim) == pytest.approx(opt, abs=1e-12)
    # The monitor's figures from the same per-step seconds, as each stage's process measures them: compute 6 s,
    # optimizer 1 s, the rest of the pipeline's step waiting for the neighbour.
    figures = StageFigures(2, _MEAN_FIELDS, _MAX_FIELDS)
    for s in (0, 1):
        figures.update(s, {"compute_s": 6.0, "comm_wait_s": step - 7.0, "optimizer_s": 1.0, "dp_comm_exposed_s": 0.0,
                           "dp_comm_s": 0.0, "tied_sum_s": 0.0, "idle_s": 0.0, "overhead_s": 0.5, "step_time_s": step + 0.5,
                           "tokens_per_sec": 1.0, "samples_per_sec": 1.0}, {"peak_memory_mb": 1.0})
    metrics = PipelineMonitor._metrics(figures.reduce(), per_stage=True)
    assert metrics["pipeline/bubble_fraction"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert metrics["pipeline/optimizer_fraction"] == pytest.approx(optimizer_fraction(sim), abs=1e-12)
    for s in (0, 1):
        assert metrics[f"pipeline/stage{s}/bubble_fraction"] == pytest.approx(sim.stage_bubble_fractions[s], abs=1e-12)
        assert metrics[f"pipeline/stage{s}/optimizer_fraction"] == pytest.approx(opt, abs=1e-12)


def test_monitor_and_planner_agree_on_2bw_with_an_embedding_tied_to_the_head():
    """2BW as above with the first and last stage summing a tied gradient before each update. By hand: stage 1's
    last backward ends 2 s before stage 0's (which waits 2 s for its gradient after the lookahead's forward), and
    stage 1 waits those 2 s in the sum: T = 6 + 1 + 2 = 9 s, each stage busy 7 s, bubble 2/9. That is without
    ``last_ahead`` (as under data parallelism); with it stage 1 spends those 2 s on the next batch's first
    microbatch (F + B = 3 s), so the tie costs nothing here: T = 7 s, no bubble."""
    ahead = simulate("2bw", 2, 2, [1.0, 1.0], [2.0, 2.0], comm_s=0.0, optimizer_s=1.0, steps=6, tied_stages=(0, 1))
    assert ahead.step_time_s == pytest.approx(7.0, abs=1e-12)
    assert ahead.stage_bubble_fractions == pytest.approx([0.0, 0.0], abs=1e-12)
    sim = simulate("2bw", 2, 2, [1.0, 1.0], [2.0, 2.0], comm_s=0.0, optimizer_s=1.0, steps=6, tied_stages=(0, 1),
                   last_ahead=False)
    assert sim.step_time_s == pytest.approx(9.0, abs=1e-12)
    assert sim.stage_bubble_fractions == pytest.approx([2 / 9, 2 / 9], abs=1e-12)
    figures = StageFigures(2, _MEAN_FIELDS, _MAX_FIELDS)
    for s, (comm, tied) in enumerate([(2.0, 0.0), (0.0, 2.0)]):  # where each stage's 2 s of waiting are measured
        figures.update(s, {"compute_s": 6.0, "comm_wait_s": comm, "optimizer_s": 1.0, "dp_comm_exposed_s": 0.0,
                           "dp_comm_s": 0.0, "tied_sum_s": tied, "idle_s": 0.0, "overhead_s": 0.5,
                           "step_time_s": 9.5, "tokens_per_sec": 1.0, "samples_per_sec": 1.0}, {"peak_memory_mb": 1.0})
    metrics = PipelineMonitor._metrics(figures.reduce(), per_stage=True)
    assert metrics["pipeline/bubble_fraction"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert [metrics[f"pipeline/stage{s}/bubble_fraction"] for s in (0, 1)] == pytest.approx(sim.stage_bubble_fractions)
    assert metrics["pipeline/stage1/tied_sum_s"] == 2.0 and metrics["pipeline/tied_sum_s"] == pytest.approx(1.0)


def test_the_monitors_imbalance_is_the_slowest_stages_compute_over_the_mean_and_busy_is_one_minus_bubble():
    # Stage 0 computes 3 s per step, stage 1 6 s (then waits 3 s for nothing else); no optimizer time.
    figures = StageFigures(2, _MEAN_FIELDS, _MAX_FIELDS)
    for s, (compute, wait) in enumerate([(3.0, 3.0), (6.0, 0.0)]):
        figures.update(s, {"compute_s": compute, "comm_wait_s": wait, "optimizer_s": 0.0, "dp_comm_exposed_s": 0.0,
                           "dp_comm_s": 0.0, "tied_sum_s": 0.0, "idle_s": 0.0, "overhead_s": 0.0, "step_time_s": 6.0,
                           "tokens_per_sec": 1.0, "samples_per_sec": 1.0}, {"peak_memory_mb": 1.0})
    metrics = PipelineMonitor._metrics(figures.reduce(), per_stage=True, predicted_imbalance=1.25)
    assert metrics["pipeline/imbalance"] == pytest.approx(6.0 / 4.5)
    assert metrics["pipeline/predicted_imbalance"] == 1.25
    assert metrics["pipeline/stage0/busy_fraction"] == pytest.approx(0.5)
    assert metrics["pipeline/stage1/busy_fraction"] == pytest.approx(1.0)


# ---- the picture of the executed schedule ----------------------------------------------------------------------

def row_pixels(figure, row: int) -> np.ndarray:
    """The RGB pixels along the centre line of row ``row`` of a :func:`schedule_figure`, inside its axes."""
    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(float) / 255
    ax = figure.axes[0]
    (x0, y), (x1, _) = ax.transData.transform([(ax.get_xlim()[0], row), (ax.get_xlim()[1], row)])
    height = rgba.shape[0]
    return rgba[int(round(height - y)), int(np.ceil(x0)) + 1:int(np.floor(x1)) - 1]


def shows(pixels: np.ndarray, kind: str) -> bool:
    return bool((np.abs(pixels - np.array(to_rgb(SCHEDULE_KINDS[kind]))).max(axis=1) < 0.02).any())


def fit(tmp_path, monitor, logger, steps=4):
    model = TinyLM(width=64, depth=6)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=logger, log_every_n_steps=1,
                        strategy=AsyncPipelineStrategy("zb_h1", 4, num_stages=3), callbacks=[monitor],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(make_dataset(8 * (steps + 1)), batch_size=8, drop_last=True))
    return trainer


def test_monitor_logs_a_picture_of_every_stages_executed_schedule_to_tensorboard(tmp_path):
    monitor = PipelineMonitor(schedule_image_every_n_steps=2)
    trainer = fit(tmp_path, monitor, TensorBoardLogger(str(tmp_path)))
    assert monitor.schedule_steps == [1, 3]  # steps 1 and 3 ((k + 1) % 2 == 0), at the loggers' step of each
    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
    accumulator.Reload()
    images = accumulator.Images("pipeline/schedule")
    assert [e.step for e in images] == [1, 3] and all(e.width > 0 and e.height > 0 for e in images)
    # The last pictured step, redrawn from the spans it was drawn from: a row per stage, each showing its
    # forwards, its backwards and (zb_h1 splits the backward) its weight gradients; the update runs on the one
    # process, drawn on its first stage's row.
    figure = schedule_figure(monitor.schedule_spans)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    for stage in range(3):
        pixels = row_pixels(figure, stage)
        for kind in ("forward", "backward", "weight gradient"):
            assert shows(pixels, kind), (stage, kind)
    assert shows(row_pixels(figure, 0), "optimizer")


def test_picture_shows_a_span_far_shorter_than_a_pixel_that_ends_the_window():
    # The update ending a step, 10 µs of a 1 s window (slow steps on a busy machine beside a fast update), used to
    # be drawn mostly past the window's right edge and clipped to nothing.
    spans = [(0, "forward", 0.0, 0.5, {}), (0, "backward", 0.5, 0.99999, {}), (0, "optimizer", 0.99999, 1.0, {})]
    figure = schedule_figure([ProcessSpans(0, 0, [0], 0.0, (0.0, 1.0), spans)])
    assert shows(row_pixels(figure, 0), "optimizer")


def test_picture_shows_each_replicas_stages_on_their_own_rows_on_one_clock():
    # Two processes (stages 0 and 1) whose perf_counter clocks differ by 100 s: the offsets put them on one axis.
    spans0 = [(0, "forward", 100.0, 101.0, {}), (0, "backward", 103.0, 105.0, {}), (0, "optimizer", 105.0, 106.0, {})]
    spans1 = [(1, "recv", 0.0, 1.0, {}), (1, "forward", 1.0, 2.0, {}), (1, "backward", 2.0, 3.0, {"part": "input"}),
              (1, "backward", 3.0, 4.0, {"part": "weight"})]
    figure = schedule_figure([ProcessSpans(0, 0, [0], -100.0, (100.0, 106.0), spans0),
                              ProcessSpans(1, 0, [1], 0.0, (0.0, 6.0), spans1)])
    assert figure.axes[0].get_xlim() == pytest.approx((0.0, 6000.0))  # ms on the shared clock
    assert all(shows(row_pixels(figure, 0), k) for k in ("forward", "backward", "optimizer"))
    assert all(shows(row_pixels(figure, 1), k) for k in ("wait", "forward", "backward", "weight gradient"))
    assert not shows(row_pixels(figure, 1), "optimizer")


def test_picture_is_skipped_with_a_warning_without_tensorboard_and_bad_periods_are_refused(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"schedule_image_every_n_steps must be a positive number.*{bad!r}"):
            PipelineMonitor(schedule_image_every_n_steps=bad)
    monitor = PipelineMonitor(schedule_image_every_n_steps=1)
    with pytest.warns(UserWarning, match="this Trainer has none \\(CSVLogger\\), so no picture is logged"):
        fit(tmp_path, monitor, CSVLogger(str(tmp_path)), steps=2)
    assert monitor.schedule_steps == [] and monitor.schedule_spans is None
