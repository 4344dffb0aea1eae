"""``lightning-async-pp-plan``: what a pipeline would do, predicted from the engine's own action lists.

For each number of stages ``p`` and microbatches ``m`` it simulates ``2bw`` beside every synchronous schedule
(``1f1b``, ``gpipe``, ``zb_h1``, ``interleaved_1f1b``, ``zbv``;
:func:`lightning_async_pp.pipeline.simulate.simulate`) and prints a Markdown table with one row per schedule:
steady-state step time, bubble, speedup over ``1f1b`` (and, for 2bw, over the fastest synchronous schedule),
peak activations and weight copies per device. The costs come from one of:

- ``--layers L --forward-s X [--backward-s Y]``: ``L`` identical layers, ``X`` seconds of forward per layer and
  microbatch (measured, e.g. from a ``PipelineMonitor`` trace); the layers are split as evenly as they go;
- ``--stage-forward-s a b ... [--stage-backward-s ...]``: seconds per microbatch of each stage (fixes ``p``);
- a model shape (``--model smollm-360m`` or ``llama-10b``, or ``--hidden --layers --heads --kv-heads
  --intermediate --vocab --seq-len``): FLOPs per layer, an accelerator rate (``--tflops`` x ``--mfu``) and a
  link bandwidth (``--link-gbps``) give the times; blocks are split as the engine's ``partition="balanced"`` splits
  them (``plan.balanced.balanced_split``: the slowest stage least, every stage's memory under
  ``--stage-memory-gib``), and a *Split* table sets that split against ``"parameters"`` and ``"uniform"``.

A shape also gives a table of each schedule's peak memory per device (:func:`device_memory`: the memory model,
``plan.memory.stage_memory``, fed the shape's per-layer parameters and activations, ``--param-bytes``,
``--optimizer``, ``--correction-buffers``, ``--bytes-per-value``).

``--data-parallel R`` adds a table of the data-parallel gradient reduction (each stage's gradient all-reduced
over its ``R`` replicas with a ring: ``2 (R-1)/R`` x its bytes over ``--dp-gbps``, plus ``2 (R-1)`` latencies)
with no overlap, overlapped from the last backward (what the engine does), and, for 2BW, deferred to batch
``k+2``'s first forward; a shape gives each stage's gradient bytes, other cost sources take ``--dp-reduce-s``.

``--trace PATH`` writes the simulated timelines as the Chrome trace ``PipelineMonitor`` writes (open it at
https://ui.perfetto.dev); ``--figure PATH`` draws them as a PNG, as ``PipelineMonitor`` draws an executed step.
See docs/guide/planning.md and BENCHMARKS.md "Predicted beyond this machine".

The package, one concern per module. The command's (every name importable from ``lightning_async_pp.plan``, as
when it was one module): ``shapes.py`` (:class:`Shape`, :data:`MODELS`), ``costs.py`` (:class:`CostModel`:
per-stage seconds, the balanced split, the data-parallel reduction; :func:`device_memory`), ``report.py``
(:func:`plan`: the Markdown tables; the timelines as a trace or a PNG), ``tensor.py`` (``--tensor-parallel``:
stages split over ``t`` devices, per-device costs and the layouts that fit), ``units.py`` (how the tables write
seconds and counts) and ``cli.py`` (:func:`parser`, :func:`main`). The split the engine runs with, shared with
the command: ``partition.py`` (layers -> stage ranges by method), ``balanced.py`` (each layer's FLOPs and bytes,
each stage's memory account, :func:`balanced_split`), ``timing.py`` (``layer_cost="measured"``: each layer timed
on the device) and ``memory.py`` (a device's peak walked over the simulated action order). The simulation itself
is the engine's (:mod:`lightning_async_pp.pipeline.simulate`), on the same action lists the runtime executes.
"""
from lightning_async_pp.plan.cli import (_fraction, _non_negative, _open_fraction, _positive, _positive_int, main,
                                         parser)
from lightning_async_pp.plan.costs import (DEFAULT_STAGES, CostModel, Costs, device_memory, optimizer_state_bytes,
                                           tied_kwargs)
from lightning_async_pp.plan.report import (dp_row, label, memory_row, optimizer_fraction, plan,
                                            simulated_spans, split_rows, trace_path, write_figure, write_trace)
from lightning_async_pp.plan.shapes import MODELS, Shape
from lightning_async_pp.plan.units import fmt_count, fmt_seconds

__all__ = [
    "MODELS", "Shape",
    "DEFAULT_STAGES", "CostModel", "Costs", "device_memory", "optimizer_state_bytes", "tied_kwargs",
    "dp_row", "label", "memory_row", "optimizer_fraction", "plan", "simulated_spans", "split_rows", "trace_path",
    "write_figure", "write_trace",
    "fmt_count", "fmt_seconds",
    "main", "parser",
]
