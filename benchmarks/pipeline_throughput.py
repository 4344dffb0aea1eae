#!/usr/bin/env python
"""Pipeline throughput, CPU or CUDA: this package's schedules against ``torch.distributed.pipelining`` and one process.

The benchmark lives in the ``benchmarks.throughput`` package (its docstring says what is measured and how; the
shared harness is ``benchmarks/harness.py``); this file is its command line, run from the repository root:

    make bench        # = .venv/bin/python benchmarks/pipeline_throughput.py
    .venv/bin/python benchmarks/pipeline_throughput.py --quick --no-paired

It also re-exports the names other scripts use through ``import pipeline_throughput`` (``compare_checkouts.py``
runs this file's ``run_lightning`` inside each checkout, ``trace_gaps.py`` its engine workers).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package
# Importing benchmarks.throughput sets one thread per process on CPU, before torch is imported.
from benchmarks.harness import CHILD_TIMEOUT, Quiet, one_thread, others_cpu, run_pairs, span_costs  # noqa: E402,F401
from benchmarks.throughput.cli import main  # noqa: E402
from benchmarks.throughput.pairing import run_paired_blocks  # noqa: E402,F401
from benchmarks.throughput.systems import _engine_worker, _torchpp_worker, run_lightning  # noqa: E402,F401
from benchmarks.throughput.workload import CPU_STEPS, SCHEDULES, TORCH_SCHEDULES, WIDTH  # noqa: E402,F401

if __name__ == "__main__":
    main()
