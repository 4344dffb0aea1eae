"""Pipeline throughput, CPU or CUDA: this package's schedules against ``torch.distributed.pipelining`` and one process.

One run on CPU (the default, ``--accelerator cpu``) measures, on the same model (8 x [Linear(512, 512) + GELU],
``--width`` changes 512; mean-squared-error regression), the same batches and the same optimizer, with one thread
per process:

- ``2bw``, ``1f1b``, ``gpipe`` through ``lightning.Trainer(strategy=AsyncPipelineStrategy(...), devices=2)``, which
  is what users run (each run is this script started again as a subprocess: Lightning's launcher re-executes
  ``sys.argv`` for rank 1);
- the same three schedules on the bare engine (``PipelineEngine`` driven by a plain loop, no Lightning), to
  separate Lightning's per-step cost from the engine's;
- ``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleGPipe`` with ``PipelineStage`` (gloo), and its
  multi-stage schedules with two stages per rank (each a quarter of the layers): ``ScheduleInterleaved1F1B``
  (rank r holds stages r and r+2), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (the V: rank r holds
  stages r and 3-r, so rank 0 computes the loss);
- the whole model in one process (plain loop, whole batch at once): the baseline; and the same with the batch
  split into the pipeline's microbatches (gradients accumulated), which has the pipeline's matrix shapes: twice
  its rate is what two stages could reach without any overhead;
- every schedule of the bare engine with both stages in this one process, against that microbatched loop and
  against the same loop cut where the stages meet (a detached input and two backward calls per microbatch, as in
  any pipeline): what a stage's compute costs over a plain loop's, without transfers or a second process on the
  cores. These run in one process taking steps in turn (step ``i`` of each system, then step ``i + 1``), and the
  ratio is the median of the per-step ratios: a shared VM's speed drifts by 10-90% within minutes, which a ratio
  between two runs made one after the other would also measure;
- two independent one-process runs side by side: what two processes can reach on this machine (the ceiling).

Throughput is samples (rows) per second over the steady state: ``--warmup`` steps are skipped, the next
``--steps`` are timed between the ends of consecutive steps on rank 0, and one more step runs untimed after them
(2BW drains there). For ``2bw`` under Lightning it also prints where each stage's wall time went
(``strategy.engine.stats.last_times``) and every process's peak RSS.

Last (not with ``--quick`` or ``--no-paired``), per m, 2bw under Lightning and torch's five schedules in one
process pair, taking blocks of 6 steps in turn (torch's schedules run from a callback between Lightning's
blocks, each on a process group of its own): each schedule's step over 2bw's a second apart, the median over 12
block rounds (``run_paired_blocks``; ``benchmarks/paired_rounds.py --blocks`` prints the rounds).

``--rounds N`` measures everything N times in turn; the tables show each system's median round, and a table of
the targets gives each round's ratios (both sides from the same round) and their median.

Other processes on the machine distort such numbers, so before each measurement the benchmark waits (up to
``--wait-idle`` seconds) for an idle machine, records which share of the CPUs others used during the timed window
(the *others' CPU* column), and measures again (``--retries``) when that share exceeds 5%.

``--profile`` (or ``--profile-only``) additionally profiles both stages of torch's ``Schedule1F1B``, of this
engine's ``1f1b`` and ``2bw`` and of ``2bw`` under Lightning: main-thread CPU per step by kind (cProfile timed with
``thread_time``, so waits and other processes do not count) and a wall-clock split, to show where per-microbatch
and per-step overhead comes from. ``--only-engines`` measures one process, the bare engine and torch's schedules
only (a quick check of engine changes).

``--predict`` runs only the bare engine's three schedules, traced (``engine.start_trace()``), and reports the
planner's prediction against the measurement: each stage's mean forward, backward and optimizer span and the
measured activation transfer time are fed to ``pipeline.simulate.simulate()``, whose steady-state step time is
compared with the measured one (see BENCHMARKS.md, "Predicted vs measured").

``--compile`` runs only the bare engine's schedules (``2bw``, ``1f1b``, ``gpipe``; ``zb_h1`` cannot split a
compiled layer's backward), each with eager layers and with compiled ones (``PipelineConfig(compile=True)``:
torch.compile's default backend, inductor), in the same process pair, and reports the step times side by side.
Compilation happens in the warm-up steps, which are not timed. With ``--accelerator cuda`` it runs both stages on
``cuda:0`` in this process (the engine overhead setting below) and, with two or more GPUs, the 2-process pairs too.

``--accelerator cuda`` (width 4096 unless ``--width`` is given, 10 warm-up + 50 timed steps unless given, torch's
own thread settings) measures on ``cuda:0`` in this process the whole model (whole batch, and microbatched) and the
bare engine with both stages on that one GPU (``num_stages=2``, one process: the stages cannot overlap, so its
ratio to the whole model is the engine's overhead); with two or more GPUs also the ceiling, the bare engine's three
schedules and torch's two over NCCL, one GPU per process. Lightning is not measured there, nor ``--predict`` or
``--profile``. Each step's end is taken after ``torch.cuda.synchronize()``. Without a CUDA device it stops at once.

Run: ``make bench`` (= ``.venv/bin/python benchmarks/pipeline_throughput.py``); see BENCHMARKS.md.

The modules: ``workload`` (the model, the data, the optimizer, shared by every system), ``systems`` (each system
measured and the processes it runs in), ``pairing`` (systems taking steps or blocks of steps in turn),
``profiling`` (profiles of torch's schedule and of the engine), ``measure`` (a round of every system, and the
``--predict`` and ``--compile`` runs), ``report`` (the tables) and ``cli`` (the command line). Launching, clocks,
medians, quiet-machine checks and JSON are ``benchmarks/harness.py``'s.
"""
from __future__ import annotations

from benchmarks.harness import one_thread_env

# On CPU one thread per process, set before torch is imported (intra-op pools are sized at import); spawned
# workers and Lightning's re-executed ranks see the parent's argv.
one_thread_env()
