"""``PipelineMonitor``: throughput, per-stage timing, bubble, memory, an optional timeline trace and a picture of the
executed schedule in TensorBoard."""
from __future__ import annotations

import logging
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_async_pp.callbacks.figures import (StageFigures, log_to_loggers, logged_pipeline_strategy, logger_step,
                                                   logging_step_due, pipeline_strategy)
from lightning_async_pp.pipeline.microbatch import batch_size_of
from lightning_async_pp.trace import ProcessSpans, clock_offset, schedule_figure, spans_of, write_chrome_trace

log = logging.getLogger(__name__)

_TIMES = ("compute_s", "comm_wait_s", "optimizer_s", "dp_comm_exposed_s", "dp_comm_s", "tied_sum_s", "idle_s",
          "overhead_s", "step_time_s")
# A stage's step, summed.
_STEP_PARTS = ("compute_s", "comm_wait_s", "optimizer_s", "dp_comm_exposed_s", "tied_sum_s", "idle_s")
_MEAN_FIELDS = _TIMES + ("tokens_per_sec", "samples_per_sec")
_MAX_FIELDS = ("peak_memory_mb",)
_STAGE_FIELDS = _TIMES + ("bubble_fraction", "busy_fraction", "optimizer_fraction", "peak_memory_mb")


class PipelineMonitor(Callback):
    """Log how the pipeline spends its time under ``pipeline/``, and optionally write a timeline trace.

    Figures are measured over the window of steps since the previous logging step (Lightning's
    ``log_every_n_steps``). Each process splits its own wall time of the window (from the end of one logged step
    to the end of the next, validation excluded) into, per step:

    - ``compute_s``: forward and backward;
    - ``comm_wait_s``: blocked waiting for a neighbour's activation, gradient or loss, or for a send to be taken;
    - ``optimizer_s``: the optimizer update;
    - ``dp_comm_exposed_s``: with data-parallel replicas, blocked waiting for the gradient reduction (the part of
      it the rest of the step did not hide); ``dp_comm_s`` beside it is the reduction's whole time, from its
      first bucket's start (in the batch's last backward) to the end of that wait, not a part of the step;
    - ``tied_sum_s``: summing the gradient of a weight tied across processes (an embedding tied to the head) with
      the other stages that hold it, which waits for them to finish the step: under 2BW the last stage's wait for
      the first stage's last backward;
    - ``idle_s``: the rest of the pipeline's step (its step time, from the start of the step's pipeline work to
      the end of its update, minus the five above): scheduling and Python work between actions;
    - ``overhead_s``: wall time outside the pipeline's steps: Lightning's loop and hooks (including its
      per-step broadcast across ranks), data loading, logging;
    - ``step_time_s``: wall time per step, the sum of the seven.

    These are logged per stage (``pipeline/stage{s}/...``, the mean over the stage's processes: data-parallel
    replicas and tensor-parallel ranks) and for the whole model (``pipeline/...``, the mean over processes). On one
    device all stages run in one process and are timed together: per-stage figures are then only logged when there
    is one stage.

    - ``pipeline/bubble_fraction``: the share of the stages' time within the pipeline's step that is neither
      computing nor updating weights, ``1 - sum_s (C_s + O_s) / (S x T)``, with ``S`` the number of stages,
      ``C_s`` the forward+backward seconds per step of stage ``s``, ``O_s`` its optimizer seconds and
      ``T = max_s T_s`` the pipeline's step time, where ``T_s = compute_s + comm_wait_s + optimizer_s +
      dp_comm_exposed_s + tied_sum_s + idle_s`` is stage ``s``'s step from the start of its pipeline work to the end of its
      update (the pipeline steps at the pace of its slowest stage). This is the planner's definition
      (``lightning-async-pp-plan``'s *bubble*; ``docs/guide/monitoring.md``, "The bubble"): fill and drain,
      waiting for neighbours, imbalance between stages. Per stage, ``pipeline/stage{s}/bubble_fraction`` is
      ``1 - (C_s + O_s) / T`` (the whole-model figure is their mean). Lightning's work between steps is left out
      (it is ``overhead_s``), so the figure describes the schedule. 0 is a pipeline that always computes or
      updates; GPipe with ``S`` stages and ``m`` equal microbatches has at least ``(S-1)/(m+S-1)``; 2BW
      approaches 0 in steady state. Data-parallel replicas: the per-stage figures are their means.
    - ``pipeline/stage{s}/busy_fraction``: ``1 - bubble_fraction`` of the stage, ``(C_s + O_s) / T``: the share of
      the step it computes or updates. The slowest stage is near 1; a stage far below it waits for the others.
    - ``pipeline/imbalance`` (across processes): the slowest stage's ``compute_s`` over the mean of the stages'
      (1.0: balanced; 1.5: the slowest stage computes half as long again as the average, and the others wait for
      it every step). ``pipeline/predicted_imbalance``: the same figure predicted at setup by the split's cost
      model (``engine.stats.split``; docs/design/planner.md, "Balanced split"), on one device too. A measured figure far
      above the predicted one means the FLOP counts miss what the stages spend (memory-bound kernels, the loss).
    - ``pipeline/optimizer_fraction`` (and ``pipeline/stage{s}/optimizer_fraction``): the optimizer's share,
      ``O_s / T``, apart from the bubble (mean over stages).
    - ``pipeline/tokens_per_sec`` and ``pipeline/samples_per_sec``: global throughput, summed over data-parallel
      replicas. Tokens of a batch are the elements of ``pl_module.pipeline_input(batch)``; samples are its
      batch size (dim 0). Every process of a pipeline (each stage, and under tensor parallelism each of a stage's
      ranks) sees the same rows: they are counted once per replica.
    - ``pipeline/peak_memory_mb`` and ``pipeline/stage{s}/peak_memory_mb``: peak memory since the start, the
      largest over processes, measured, in MiB: on GPU the CUDA caching allocator's peak of allocated tensors
      (``torch.cuda.max_memory_allocated``), the quantity the setup report's "predicted peak of allocated
      tensors" predicts; on CPU the process's peak resident set size (``resource.getrusage``), the whole
      process's memory (Python, PyTorch and its libraries, the allocator's cache), which that prediction does not
      count and is not comparable with.

    Across processes the figures are reduced with torchmetrics at logging steps only (one ``all_gather`` per
    state on every rank) and logged once from rank 0; the time of that collective is not counted in the window.

    Timeline: ``trace_steps=(a, b)`` records a span for every forward, backward, blocked receive, blocked send
    (the engine posts sends asynchronously; a send span is the wait for one to be taken) and optimizer update
    of steps ``a..b`` (0-based batch indices, inclusive), plus ``idle`` spans for the gaps between them, and
    writes a Chrome trace (open it at https://ui.perfetto.dev or ``chrome://tracing``): one track per stage,
    grouped by data-parallel replica. Each process's clock is converted to the shared wall clock. The spans are
    gathered to rank 0 once, at the end of step ``b`` (or of training, if it ends first).

    Picture: ``schedule_image_every_n_steps=N`` traces every ``N``-th step (steps ``k`` with ``(k + 1) % N == 0``,
    0-based) and logs a picture of the schedule that step executed to TensorBoard as ``pipeline/schedule``: a
    timeline per stage (per data-parallel replica and stage) of its forwards, backwards, weight gradients (a split
    backward's weight part), optimizer update and blocked waits, idle time left blank. The spans are gathered to
    rank 0 at the end of that step (one collective every ``N`` steps). It is drawn by
    :func:`lightning_async_pp.trace.schedule_figure` with matplotlib and written with ``add_figure`` of each
    ``TensorBoardLogger``; without one it is skipped (with a warning). A step inside ``trace_steps`` is not
    pictured. On one device all stages share one process, so a stage's blank time is the others' work.

    Args:
        trace_steps: ``(a, b)``: trace steps ``a`` to ``b`` inclusive; ``None``: no trace.
        trace_path: where to write the trace; default ``<logger's log_dir>/pipeline_trace.json``.
        per_stage: also log the per-stage figures.
        schedule_image_every_n_steps: log a picture of the executed schedule every this many steps; ``None``: never.
    """

    def __init__(self, trace_steps: Optional[Sequence[int]] = None, trace_path: Optional[str] = None,
                 per_stage: bool = True, schedule_image_every_n_steps: Optional[int] = None) -> None:
        if trace_steps is not None:
            if (len(tuple(trace_steps)) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in trace_steps)
                    or not 0 <= trace_steps[0] <= trace_steps[1]):
                raise ValueError(f"trace_steps must be two step indices (a, b) with 0 <= a <= b, got {trace_steps!r}")
            trace_steps = (int(trace_steps[0]), int(trace_steps[1]))
        self.trace_steps: Optional[tuple[int, int]] = trace_steps
        n = schedule_image_every_n_steps
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"schedule_image_every_n_steps must be a positive number of steps or None, got {n!r}")
            try:
                import matplotlib  # noqa: F401
            except ImportError as err:
                raise ImportError("PipelineMonitor(schedule_image_every_n_steps=...) draws with matplotlib: "
                                  "pip install matplotlib") from err
        self.schedule_image_every_n_steps = n
        self.schedule_spans: Optional[list[ProcessSpans]] = None  # rank 0: the spans of the last pictured step
        self.schedule_steps: list[int] = []  # rank 0: the logger steps a picture was logged at
        self._pictures = False  # this fit logs pictures (a TensorBoardLogger is there)
        self._picture_start: Optional[tuple[float, float]] = None  # (perf_counter, clock offset) while tracing one
        self.trace_path = trace_path
        self.per_stage = per_stage
        self.metrics: dict[str, float] = {}  # the figures of the last logging step, as logged
        self.trace_file: Optional[str] = None  # set on rank 0 once the trace is written
        self._figures: Optional[StageFigures] = None
        self._due = False
        self._reset_window(None)
        self._validation_started: Optional[float] = None
        self._trace_start: Optional[tuple[float, float]] = None  # (perf_counter, clock offset) while tracing
        self._traced = False

    # ---- setup ------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        logged_pipeline_strategy(trainer, type(self).__name__)
        self._pictures = self.schedule_image_every_n_steps is not None and bool(_tensorboards(trainer))
        if self.schedule_image_every_n_steps is not None and not self._pictures:
            rank_zero_warn(f"{type(self).__name__}(schedule_image_every_n_steps=...) logs its picture to a "
                           f"TensorBoardLogger; this Trainer has none "
                           f"({', '.join(type(lg).__name__ for lg in trainer.loggers)}), so no picture is logged")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = pipeline_strategy(trainer, type(self).__name__)
        self._figures = StageFigures(self._rows(strategy), _MEAN_FIELDS, _MAX_FIELDS).to(strategy.root_device)
        self._reset_window(None)

    @staticmethod
    def _rows(strategy: Any) -> int:
        """Rows of the table: one per stage across processes, one for all stages on one device."""
        return strategy.topology.num_stages if strategy.is_multiprocess else 1

    @staticmethod
    def _per_pipeline(strategy: Any) -> int:
        """Processes per pipeline, which all see the same rows: each stage's ``t`` tensor-parallel ranks across
        processes, one for all stages on one device."""
        if not strategy.is_multiprocess:
            return 1
        return strategy.topology.num_stages * strategy.engine.stats.tensor_parallel_size

    def _reset_window(self, start: Optional[float]) -> None:
        self._window_start = start
        self._excluded = 0.0
        self._steps = 0
        self._compute = self._comm_wait = self._optimizer = self._pipeline = self._dp = self._dp_exposed = 0.0
        self._tied = 0.0
        self._tokens = self._samples = 0

    # ---- per batch ----------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._due = logging_step_due(trainer)
        if self._window_start is None:
            self._window_start = time.perf_counter()
        k = trainer.strategy.engine.stats.batch_index
        if self.trace_steps is not None and not self._traced and self._trace_start is None:
            if self.trace_steps[0] <= k <= self.trace_steps[1]:
                trainer.strategy.engine.start_trace()
                self._trace_start = (time.perf_counter(), clock_offset())
        # The same decision on every rank (the picture's gather is a collective): the step index and the options.
        if self._pictures and self._trace_start is None and (k + 1) % self.schedule_image_every_n_steps == 0:
            trainer.strategy.engine.start_trace()
            self._picture_start = (time.perf_counter(), clock_offset())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats = trainer.strategy.engine.stats
        times = stats.last_times
        self._steps += 1
        self._compute += times.compute
        self._comm_wait += times.comm_wait
        self._optimizer += times.optimizer
        self._dp += times.dp_comm
        self._dp_exposed += times.dp_comm_exposed
        self._tied += times.tied_sum
        self._pipeline += times.total
        inputs = pl_module.pipeline_input(batch)
        self._tokens += token_count(inputs)
        self._samples += batch_size_of(inputs)
        if self._trace_start is not None and stats.batch_index - 1 >= self.trace_steps[1]:
            self._finish_trace(trainer)
        if self._picture_start is not None:
            self._log_picture(trainer)
        if self._due:
            self._due = False
            self._log_window(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._window_start is not None:
            self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_started is not None:
            self._excluded += time.perf_counter() - self._validation_started
            self._validation_started = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._trace_start is not None:  # training ended inside the traced window: write what was traced
            self._finish_trace(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._trace_start is not None or self._picture_start is not None:
            trainer.strategy.engine.stop_trace()  # no gather: the other processes may be gone
            self._trace_start = self._picture_start = None

    # ---- figures --------------------------------------------------------------------------------------------
    def _log_window(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        assert self._figures is not None and self._window_start is not None
        wall = max(time.perf_counter() - self._window_start - self._excluded, 1e-12)
        n = max(self._steps, 1)
        per_pipeline = self._per_pipeline(strategy)  # every process of a pipeline sees the same batches
        compute, comm, opt, pipeline = self._compute / n, self._comm_wait / n, self._optimizer / n, self._pipeline / n
        dp, dp_exposed, tied = self._dp / n, self._dp_exposed / n, self._tied / n
        step = wall / n
        row = strategy.topology.stage if strategy.is_multiprocess else 0
        self._figures.update(row, {
            "compute_s": compute, "comm_wait_s": comm, "optimizer_s": opt,
            "dp_comm_exposed_s": dp_exposed, "dp_comm_s": dp, "tied_sum_s": tied,
            "idle_s": max(0.0, pipeline - compute - comm - opt - dp_exposed - tied),
            "overhead_s": max(0.0, step - pipeline),
            "step_time_s": step,
            "tokens_per_sec": self._tokens / wall / per_pipeline,
            "samples_per_sec": self._samples / wall / per_pipeline,
        }, {"peak_memory_mb": peak_memory_mb(strategy.root_device)})
        table = self._figures.reduce()  # across processes: every rank calls this at the same step
        metrics = self._metrics(table, per_stage=self.per_stage and (strategy.is_multiprocess or strategy.num_stages == 1),
                                predicted_imbalance=strategy.engine.stats.split.imbalance)
        self.metrics = metrics
        log_to_loggers(trainer, metrics)
        self._reset_window(time.perf_counter())

    @staticmethod
    def _metrics(table: dict[int, dict[str, float]], per_stage: bool,
                 predicted_imbalance: Optional[float] = None) -> dict[str, float]:
        out: dict[str, float] = {}
        rows = list(table.values())
        # The pipeline's step time: the slowest stage's, from the start of its pipeline work to its update's end.
        step = max(sum(r[f] for f in _STEP_PARTS) for r in rows)
        # One definition with the planner (pipeline/simulate.py): the optimizer is work, reported beside the bubble.
        share = lambda seconds: seconds / step if step > 0 else 0.0  # noqa: E731
        bubbles = {s: max(0.0, 1.0 - share(r["compute_s"] + r["optimizer_s"])) for s, r in table.items()}
        optimizer = {s: share(r["optimizer_s"]) for s, r in table.items()}
        if per_stage:
            for s, row in sorted(table.items()):
                row = dict(row, bubble_fraction=bubbles[s], optimizer_fraction=optimizer[s],
                           busy_fraction=1.0 - bubbles[s])
                out.update({f"pipeline/stage{s}/{f}": row[f] for f in _STAGE_FIELDS})
        if len(rows) > 1:  # one row per stage (across processes): the measured compute of each
            computes = [r["compute_s"] for r in rows]
            mean_compute = sum(computes) / len(computes)
            out["pipeline/imbalance"] = max(computes) / mean_compute if mean_compute > 0 else 1.0
        if predicted_imbalance is not None:
            out["pipeline/predicted_imbalance"] = predicted_imbalance
        mean = lambda f: sum(r[f] for r in rows) / len(rows)  # noqa: E731 - every row has the same replica count
        out.update({f"pipeline/{f}": mean(f) for f in _TIMES})
        out["pipeline/bubble_fraction"] = sum(bubbles.values()) / len(bubbles)
        out["pipeline/optimizer_fraction"] = sum(optimizer.values()) / len(optimizer)
        out["pipeline/tokens_per_sec"] = sum(r["tokens_per_sec:sum"] for r in rows)
        out["pipeline/samples_per_sec"] = sum(r["samples_per_sec:sum"] for r in rows)
        out["pipeline/peak_memory_mb"] = max(r["peak_memory_mb"] for r in rows)
        return out

    # ---- the trace and the picture ---------------------------------------------------------------------------
    def _finish_trace(self, trainer: Trainer) -> None:
        assert self._trace_start is not None and self.trace_steps is not None
        last = trainer.strategy.engine.stats.batch_index - 1
        gathered = _gather_spans(trainer, self._trace_start, (self.trace_steps[0], min(last, self.trace_steps[1])))
        self._trace_start, self._traced = None, True
        if gathered is not None:
            path = self.trace_path or os.path.join(_log_dir(trainer), "pipeline_trace.json")
            self.trace_file = write_chrome_trace(path, gathered)
            steps = gathered[0].steps
            log.info("Pipeline trace of steps %d-%d written to %s", steps[0], steps[1], self.trace_file)

    def _log_picture(self, trainer: Trainer) -> None:
        assert self._picture_start is not None
        k = trainer.strategy.engine.stats.batch_index - 1
        gathered = _gather_spans(trainer, self._picture_start, (k, k))
        self._picture_start = None
        if gathered is None:
            return
        strategy = trainer.strategy
        split = strategy.engine.stats.split
        # across processes the layout in words ("2 stages x 2 tensor-parallel ranks")
        layout = split.layout or f"{strategy.num_stages} stages"
        title = f"step {k}: {strategy.schedule}, {layout}, {strategy.num_microbatches} microbatches"
        title += f", layers per stage {list(split.counts)}"
        measured = self.metrics.get("pipeline/imbalance") if self.metrics else None
        if measured is not None:
            title += f", imbalance {measured:.2f}"
        if split.imbalance is not None:
            title += f" (predicted {split.imbalance:.2f})"
        figure = schedule_figure(gathered, title=title)
        step = logger_step(trainer)
        for logger in _tensorboards(trainer):
            logger.experiment.add_figure("pipeline/schedule", figure, global_step=step, close=False)
        self.schedule_spans = gathered
        self.schedule_steps.append(step)


def _gather_spans(trainer: Trainer, started: tuple[float, float], steps: tuple[int, int]) -> Optional[list[ProcessSpans]]:
    """Stop the engine's trace and gather every process's spans since ``started`` to rank 0 (``None`` elsewhere)."""
    strategy = trainer.strategy
    engine = strategy.engine
    spans = engine.stop_trace()
    start, offset = started
    record = ProcessSpans(
        rank=strategy.global_rank,
        replica=strategy.topology.dp_rank if strategy.is_multiprocess else 0,
        stages=[stage.index for stage in engine.stats.stages],
        clock_offset=offset,
        window=(start, time.perf_counter()),
        spans=spans_of(spans),
        steps=steps,
    )
    if strategy.is_multiprocess:
        gathered: Optional[list[Any]] = [None] * dist.get_world_size() if strategy.is_global_zero else None
        dist.gather_object(record, gathered, dst=0)
    else:
        gathered = [record]
    if not strategy.is_global_zero:
        return None
    assert gathered is not None
    return [r for r in gathered if r is not None]


def _tensorboards(trainer: Trainer) -> list[TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: on GPU the CUDA allocator's peak of allocated tensors (what the
    setup report's predicted peak predicts); on CPU the process's peak resident set size, all of its memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def token_count(inputs: Any) -> int:
    """The tokens in a model input: its ``input_ids`` where it is a mapping that has them (a packed batch's
    ``position_ids`` are not more tokens), else the elements of every tensor in it."""
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), Tensor):
        return inputs["input_ids"].numel()
    return sum(t.numel() for t in _tensors(inputs))


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _log_dir(trainer: Trainer) -> str:
    logger = trainer.logger
    directory = getattr(logger, "log_dir", None) if logger is not None else None
    return directory or trainer.default_root_dir
