"""The pipeline's spans as Chrome-trace (Perfetto, ``chrome://tracing``) timelines and as pictures.

Each process records its spans with its own ``time.perf_counter()``; :class:`ProcessSpans` carries them with the
offset to the wall clock (``time.time() - time.perf_counter()``, read once per process), so the spans of all
processes land on one shared time axis. One track per stage (thread ``tid = stage``) inside one process track per
data-parallel replica (``pid = replica``); gaps between a stage's spans inside the traced window become ``idle``
spans. The planner (``lightning_async_pp.plan``) writes simulated timelines with the same functions: one
``ProcessSpans`` per stage, clock offset 0, facts about the simulation under ``otherData["simulated"]``.
:func:`schedule_figure` draws the same spans as a picture (``PipelineMonitor(schedule_image_every_n_steps=N)``
logs it to TensorBoard).

The runtime records its work as :class:`Span` objects and each step's wall time as :class:`StepTimes`, both
defined here, so that their readers need not import the engine.

This module imports no Lightning: the monitor (``callbacks/pipeline.py``) and the planner (``plan/report.py``) both use it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

#: Trace categories, so that Perfetto can colour and filter by kind of work.
CATEGORIES = {"forward": "compute", "backward": "compute", "recv": "communication", "send": "communication",
              "tied_sum": "communication", "optimizer": "optimizer", "idle": "idle"}


# ---- what the runtime records: spans of work and where a step's time went ----------------------------------------
@dataclass
class Span:
    """One timed piece of work on one stage, for the timeline trace."""

    stage: int
    name: str  # forward, backward, send, recv, tied_sum, optimizer, idle
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class StepTimes:
    """Where one process's wall time went during one training step, in seconds."""

    total: float = 0.0  # from the start of the step's pipeline work to the end of its optimizer update
    compute: float = 0.0  # forward and backward
    comm_wait: float = 0.0  # blocked waiting for a neighbour's activation, gradient or loss
    optimizer: float = 0.0  # the update (set by the caller that runs the optimizer)
    dp_comm: float = 0.0  # the data-parallel gradient reduction, from its first bucket's start to the end of its wait
    dp_comm_exposed: float = 0.0  # of that, the time blocked waiting for it (what the step's other work did not hide)
    # Summing the gradient of a weight tied across processes (an embedding tied to the head): it waits for every
    # stage of the tie to finish the step (docs/design/stages.md, "Tied weights").
    tied_sum: float = 0.0

    @property
    def idle(self) -> float:
        """Everything else: scheduling, Python overhead, data handling."""
        return max(0.0, self.total - self.compute - self.comm_wait - self.optimizer - self.dp_comm_exposed
                   - self.tied_sum)


def clock_offset() -> float:
    """Seconds to add to this process's ``time.perf_counter()`` to get the wall clock (``time.time()``)."""
    return time.time() - time.perf_counter()


@dataclass
class ProcessSpans:
    """One process's spans over the traced window, in its own ``perf_counter`` seconds."""

    rank: int
    replica: int
    stages: list[int]  # the stages this process runs (one across processes; all of them on one device)
    clock_offset: float
    window: tuple[float, float]  # perf_counter at the start and at the end of the traced steps
    spans: list[tuple[int, str, float, float, dict]] = field(default_factory=list)  # (stage, name, start, end, args)
    steps: tuple[int, int] = (0, 0)


def spans_of(executor_spans: Sequence[Any]) -> list[tuple[int, str, float, float, dict]]:
    """The runtime's :class:`Span` objects as plain tuples (picklable, whatever the spans' class)."""
    return [(s.stage, s.name, float(s.start), float(s.end), dict(s.args)) for s in executor_spans]


def idle_gaps(spans: Sequence[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The gaps inside ``window`` not covered by any of ``spans`` (``(start, end)`` pairs), in time order."""
    gaps, cursor = [], window[0]
    for start, end in sorted(spans):
        if start > cursor:
            gaps.append((cursor, min(start, window[1])))
        cursor = max(cursor, end)
    if cursor < window[1]:
        gaps.append((cursor, window[1]))
    return [(a, b) for a, b in gaps if b > a]


def chrome_trace(processes: Sequence[ProcessSpans], other_data: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object of ``processes`` (microseconds since the earliest window start).

    ``other_data``: more JSON-able facts for the trace's ``otherData`` (e.g. that a timeline is simulated).
    """
    origin = min(p.window[0] + p.clock_offset for p in processes)

    def us(t: float, p: ProcessSpans) -> float:
        return (t + p.clock_offset - origin) * 1e6

    events: list[dict[str, Any]] = []
    named_pids: set[int] = set()
    for p in sorted(processes, key=lambda q: (q.replica, q.stages)):
        pid = p.replica
        if pid not in named_pids:
            named_pids.add(pid)
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"pipeline replica {pid}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        tid = p.stages[0]
        label = (f"stage {tid} (rank {p.rank})" if len(p.stages) == 1
                 else f"stages {p.stages[0]}-{p.stages[-1]} (one process, rank {p.rank})")
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        # A process is one track: on one device every stage runs in it, one span at a time.
        work = [(start, end) for _, _, start, end, _ in p.spans]
        spans = [(name, start, end, args) for _, name, start, end, args in p.spans]
        spans += [("idle", start, end, {}) for start, end in idle_gaps(work, p.window)]
        for name, start, end, args in sorted(spans, key=lambda s: s[1]):
            events.append({
                "name": name, "cat": CATEGORIES.get(name, "other"), "ph": "X", "pid": pid, "tid": tid,
                "ts": us(start, p), "dur": max(0.0, us(end, p) - us(start, p)),
                "args": {k: _jsonable(v) for k, v in args.items()},
            })
    steps = sorted({p.steps for p in processes})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_time": origin, "steps": list(steps[0]) if steps else None,
                      "ranks": sorted(p.rank for p in processes), **(other_data or {})},
    }


def write_chrome_trace(path: str, processes: Sequence[ProcessSpans],
                       other_data: Optional[dict[str, Any]] = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(chrome_trace(processes, other_data), f)
    os.replace(tmp, path)
    return path


def _jsonable(value: Any) -> Optional[Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ---- the schedule as a picture ----------------------------------------------------------------------------------

#: What the picture of a schedule colours, in drawing order: the kind of each span and its colour. Gaps between a
#: stage's spans are idle and left blank.
SCHEDULE_KINDS = {"forward": "#1f77b4", "backward": "#ff7f0e", "weight gradient": "#2ca02c", "optimizer": "#d62728",
                  "wait": "#7f7f7f"}


def span_kind(name: str, args: dict) -> Optional[str]:
    """The kind :func:`schedule_figure` draws a span as (``None``: not drawn). A split backward's input part is
    ``backward``; its weight part is ``weight gradient``; blocked receives and sends, and the sum of a gradient tied
    across processes, are ``wait``."""
    if name == "backward":
        return "weight gradient" if args.get("part") == "weight" else "backward"
    if name in ("recv", "send", "tied_sum"):
        return "wait"
    return name if name in SCHEDULE_KINDS else None


def schedule_figure(processes: Sequence[ProcessSpans], title: str = "") -> Any:
    """A matplotlib figure of ``processes``' spans: one row per (replica, stage), stage 0 on top, time in ms from
    the earliest window start on the shared clock, one colour per :data:`SCHEDULE_KINDS` kind, idle left blank
    (a span shorter than two pixels is drawn two pixels wide, inside the window).

    Row ``i`` (from the top) is centred on ``y = i`` of the figure's only axes. Needs matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pixels, no display, pyplot's state untouched
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    origin = min(p.window[0] + p.clock_offset for p in processes)
    end = max(p.window[1] + p.clock_offset for p in processes)
    rows: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for p in processes:
        for stage in p.stages:
            rows.setdefault((p.replica, stage), [])
        for stage, name, start, stop, args in p.spans:
            kind = span_kind(name, args)
            if kind is not None:
                rows.setdefault((p.replica, stage), []).append(
                    (kind, (start + p.clock_offset - origin) * 1e3, (stop + p.clock_offset - origin) * 1e3))
    keys = sorted(rows)
    replicas = len({r for r, _ in keys})
    fig = Figure(figsize=(10, 0.6 * len(keys) + 1.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # A span shorter than two pixels (a stage's tiny weight gradient) is drawn two pixels wide, so that all work
    # shows; one ending the window (the update ending a step) is widened to the left, not past the window's edge.
    span_ms = (end - origin) * 1e3
    least = span_ms / 400
    for i, key in enumerate(keys):
        for kind in SCHEDULE_KINDS:  # waits drawn last: a wait inside a compute span stays visible
            bars = [(max(min(a, span_ms - least), 0.0), max(b - a, least)) for k, a, b in rows[key] if k == kind]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=SCHEDULE_KINDS[kind], edgecolors="none")
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlim(0.0, max((end - origin) * 1e3, 1e-6))
    ax.set_yticks(range(len(keys)),
                  [f"replica {r} stage {s}" if replicas > 1 else f"stage {s}" for r, s in keys])
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=c, label=k) for k, c in SCHEDULE_KINDS.items()] + [
        Patch(facecolor="white", edgecolor="black", label="idle")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(keys) < 3 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
