"""The monitors across processes (2 stages, gloo): figures gathered to rank 0 and logged once, the bubble of
GPipe against 2BW, and the timeline trace with one track per stage."""
from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
from helpers import TinyLM, make_dataset
from lightning.pytorch.loggers import TensorBoardLogger
from pipeline_runs import run_multiprocess
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.callbacks import StalenessMonitor

pytestmark = pytest.mark.multiprocess

# Wide layers so that forward/backward time dominates the per-step overhead of Lightning and of the transport,
# and the schedules' bubbles are told apart by the clock.
STEPS, EVERY, TRACE = 20, 4, (6, 7)
# One batch more than steps, so that the run ends by max_steps inside the epoch.
BASE = dict(stages=2, microbatches=2, steps=STEPS, batch=1024, samples=1024 * (STEPS + 1), optimizer="adamw",
            model={"width": 1024, "depth": 4}, log_every_n_steps=EVERY)
PICTURE_EVERY = 5  # pictures of steps 4, 9, 14, 19, none inside the traced steps
MONITORS = {"staleness": {}, "pipeline": {"trace_steps": list(TRACE), "schedule_image_every_n_steps": PICTURE_EVERY}}
# 2BW runs under every correction with two parameter groups (tests/helpers.py), for the per-group figures.
OPTIMIZERS = {"2bw": "grouped_corrections", "gpipe": "adamw"}
GROUP_TAGS = {f"staleness/opt0/{group}/{metric}" for group in ("group1", "group2")
              for metric in ("correction_norm", "compensation_ratio", "nesterov_momentum")}
GROUP_TAGS.add("staleness/opt0/matrices/nesterov_momentum")  # coefficient 0: no correction to log


def scalars(log_dir: str) -> dict[str, dict[int, float]]:
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def pictures(log_dir: str) -> list:
    accumulator = EventAccumulator(log_dir, size_guidance={"images": 0})
    accumulator.Reload()
    return accumulator.Images("pipeline/schedule") if "pipeline/schedule" in accumulator.Tags()["images"] else []


def printed(stdout: str, key: str) -> str:
    lines = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith(key + " ")]
    assert lines, f"{key} not printed:\n{stdout[-2000:]}"
    return lines[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for schedule in ("2bw", "gpipe"):
        tmp = tmp_path_factory.mktemp(schedule)
        proc = run_multiprocess(dict(BASE, schedule=schedule, monitors=MONITORS, optimizer=OPTIMIZERS[schedule]), tmp)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        out[schedule] = {"scalars": scalars(printed(proc.stdout, "LOG_DIR")), "pictures": pictures(printed(proc.stdout, "LOG_DIR")),
                         "trace": json.loads(Path(printed(proc.stdout, "TRACE_FILE")).read_text())}
    return out


LOGGED_STEPS = [k for k in range(STEPS) if (k + 1) % EVERY == 0]


def test_two_stages_log_per_stage_and_whole_model_figures_once_all_finite(runs):
    logged = runs["2bw"]["scalars"]
    stage_tags = {f"staleness/stage{s}/{n}" for s in (0, 1) for n in ("drift", "delay", "update_norm")}
    stage_tags |= {f"pipeline/stage{s}/{n}" for s in (0, 1)
                   for n in ("compute_s", "comm_wait_s", "optimizer_s", "idle_s", "overhead_s", "step_time_s",
                             "bubble_fraction", "optimizer_fraction", "peak_memory_mb")}
    model_tags = {f"staleness/{n}" for n in ("drift", "delay", "update_norm")}
    model_tags |= {f"pipeline/{n}" for n in ("compute_s", "comm_wait_s", "optimizer_s", "idle_s", "overhead_s", "step_time_s",
                                             "bubble_fraction", "optimizer_fraction", "tokens_per_sec", "samples_per_sec",
                                             "peak_memory_mb")}
    assert stage_tags | model_tags <= set(logged), (stage_tags | model_tags) - set(logged)
    for tag in stage_tags | model_tags:
        assert sorted(logged[tag]) == LOGGED_STEPS, (tag, logged[tag])  # once per logging step, no more
        assert all(math.isfinite(v) for v in logged[tag].values()), (tag, logged[tag])
    for k in LOGGED_STEPS:
        # Both stages' figures reached rank 0: stage 1's compute was measured in its own process.
        assert logged["pipeline/stage0/compute_s"][k] > 0 and logged["pipeline/stage1/compute_s"][k] > 0
        # Every process of the pipeline sees the same 1024-sample batch: global samples/s is one batch per step.
        assert abs(logged["pipeline/samples_per_sec"][k] * logged["pipeline/step_time_s"][k] - 1024) < 1024 * 0.05
        assert logged["pipeline/peak_memory_mb"][k] == max(logged[f"pipeline/stage{s}/peak_memory_mb"][k] for s in (0, 1))


def test_two_stage_staleness_equals_the_one_device_run_and_is_zero_under_gpipe(runs, tmp_path):
    multi = runs["2bw"]["scalars"]
    # The same training on one device (both stages in this process, same partition): the same weights, so the
    # same per-stage figures, computed there without any cross-process reduction.
    model = TinyLM(**BASE["model"], optimizer=OPTIMIZERS["2bw"])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, strategy=AsyncPipelineStrategy("2bw", 2, num_stages=2),
        callbacks=[StalenessMonitor()], logger=TensorBoardLogger(str(tmp_path)), log_every_n_steps=EVERY,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(BASE["samples"]), batch_size=BASE["batch"], shuffle=False, drop_last=True))
    local = scalars(trainer.logger.log_dir)
    for tag in [f"staleness/stage{s}/{n}" for s in (0, 1) for n in ("drift", "update_norm", "correction_norm",
                                                                    "compensation_ratio")] + ["staleness/drift"]:
        for k in LOGGED_STEPS:
            assert abs(multi[tag][k] - local[tag][k]) <= 1e-4 * abs(local[tag][k]), (tag, k, multi[tag][k], local[tag][k])
            assert multi[tag][k] > 0
    # Per parameter group (each group has parameters on both stages): the squared norms summed over the two
    # processes before the square root, the momentum the largest reported, equal to the one-device figures.
    assert {tag for tag in multi if tag.startswith("staleness/opt")} == GROUP_TAGS
    for tag in GROUP_TAGS:
        for k in LOGGED_STEPS:
            assert abs(multi[tag][k] - local[tag][k]) <= 1e-4 * abs(local[tag][k]), (tag, k, multi[tag][k],
                                                                                      local[tag][k])
            assert multi[tag][k] > 0
    assert all(multi[f"staleness/stage{s}/delay"][k] == 1 for s in (0, 1) for k in LOGGED_STEPS)
    gpipe = runs["gpipe"]["scalars"]
    for tag in ("staleness/drift", "staleness/stage0/drift", "staleness/stage1/drift", "staleness/delay"):
        assert all(v == 0.0 for v in gpipe[tag].values()), (tag, gpipe[tag])


def test_gpipe_bubble_exceeds_2bw_bubble_with_two_microbatches(runs):
    # Steady windows only: the first holds the warm-up step, the last 2BW's drain (no next batch to start).
    # Theory for 2 stages, 2 microbatches, backward ~2x forward: GPipe's step is 3 microbatch slots for 2 of
    # compute (bubble >= 1/3); 2BW's is shorter, since stage 1 starts on the activation sent during the previous
    # step (with Lightning's per-step broadcast aligning the ranks, about 0.25 instead of 0).
    def steady(schedule):
        values = runs[schedule]["scalars"]["pipeline/bubble_fraction"]
        return [values[k] for k in LOGGED_STEPS[1:-1]]

    gpipe, twobw = steady("gpipe"), steady("2bw")
    assert all(0 < v < 1 for v in gpipe + twobw)
    assert sum(gpipe) / len(gpipe) > sum(twobw) / len(twobw), (gpipe, twobw)


@pytest.mark.parametrize("schedule", ["2bw", "gpipe"])
def test_trace_has_one_track_per_stage_with_non_overlapping_spans_of_the_traced_steps(runs, schedule):
    trace = runs[schedule]["trace"]
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {(e["pid"], e["tid"]) for e in spans}
    assert tracks == {(0, 0), (0, 1)}
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"stage 0 (rank 0)", "stage 1 (rank 1)"}
    for track in tracks:
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == track), key=lambda e: e["ts"])
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)  # microseconds
        kinds = [e["name"] for e in mine]
        # 2 traced steps x 2 microbatches (2BW's lookahead may add the next batch's first forward on stage 0)
        assert kinds.count("backward") == 4 and kinds.count("optimizer") == 2
        assert 4 <= kinds.count("forward") <= 5 and "recv" in kinds and "idle" in kinds
        # Under 2BW the last stage also runs the next batch's first microbatch before each update (last_ahead).
        ahead = {TRACE[1] + 1} if schedule == "2bw" and track == (0, 1) else set()
        assert {e["args"]["batch"] for e in mine if e["name"] == "backward"} == set(range(TRACE[0], TRACE[1] + 1)) | ahead
    # One shared clock: stage 1's first forward of a batch cannot start before stage 0's forward of it ended.
    first = lambda tid, name: min(  # noqa: E731
        e["ts"] + (e["dur"] if tid == 0 else 0) for e in spans
        if e["tid"] == tid and e["name"] == name and e["args"].get("batch") == TRACE[1] and e["args"].get("microbatch") == 0
    )
    assert first(1, "forward") >= first(0, "forward") - 1e3  # within 1 ms of clock conversion error


def test_schedule_picture_of_both_stages_is_logged_every_n_steps_from_rank_0(runs):
    import io

    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    from lightning_async_pp.trace import SCHEDULE_KINDS

    for schedule in ("2bw", "gpipe"):
        images = runs[schedule]["pictures"]
        # Once per picture step, written by rank 0 only.
        assert [e.step for e in images] == [k for k in range(STEPS) if (k + 1) % PICTURE_EVERY == 0], schedule
        for event in images:
            rgb = imread(io.BytesIO(event.encoded_image_string), format="png")[..., :3]
            # Two rows, one per stage (each in its own process), both showing backwards (every step runs its batch's
            # backwards on every stage; 2BW's last step has no next batch to run forwards of): two horizontal bands
            # of pixel rows holding the backward colour, taller than the legend's swatch of it (under 20 pixels).
            backward = (np.abs(rgb - np.array(to_rgb(SCHEDULE_KINDS["backward"]))).max(axis=2) < 0.02).any(axis=1)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], backward.astype(int), [0]])))
            heights = edges[1::2] - edges[0::2]
            assert sum(h > 20 for h in heights) == 2, (schedule, event.step, heights)
