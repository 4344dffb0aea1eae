"""The benchmarks, as a package: ``harness`` is what they share (launching processes, clocks, timing alternatives
in turn, medians, quiet-machine checks, JSON, report lines); ``throughput`` is ``pipeline_throughput.py``'s
systems, measurement, pairing, profiling and reports. Each benchmark's script (``benchmarks/<name>.py``) is run
as a file from the repository root and puts the root on ``sys.path`` first, so ``benchmarks.harness`` imports."""
