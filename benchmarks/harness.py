"""What every benchmark here shares, once: threads, launching processes, clocks, timing alternatives in turn,
medians, quiet-machine checks, JSON output and report lines.

- Threads: :func:`one_thread_env` (before torch is imported) and :func:`one_thread` give each CPU process one
  thread, as ``make bench`` measures.
- Launching: :func:`spawn_pair` and :func:`run_pairs` start ``target(rank, ...)`` in fresh spawned processes;
  :func:`run_ranks` starts a script (Lightning re-executes it for the other ranks) in a session of its own. Both
  collect the JSON file each rank writes and kill everything on a timeout.
- Clocks: :class:`StepClock` (step ends, CPU use of this process and of the machine over the timed window, peak
  memory), :func:`step_recorder` (the same ends, and the engine's ``StepTimes``, from a Lightning callback).
- In turn: :func:`in_turn` rotates the order of the alternatives from one step (or block) to the next;
  :func:`block_median` times a block of one alternative's steps.
- Medians: :func:`median_gap` (the median step from step ends), :func:`median_ratio` (the median of per-step
  ratios between alternatives taken in turn), :func:`median_round` (the round with the median value).
- Quiet machine: :func:`others_cpu` (the share of the CPUs others used in a timed window) and :class:`Quiet`
  (waits for an idle machine, measures again when others disturbed a measurement).
- Output: :func:`write_json`, :func:`wall_time_line`.

torch is imported only inside the functions that need it, so that :func:`one_thread_env` can run first.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

CHILD_TIMEOUT = 240.0  # seconds any child run may take before it is killed
DISTURBED = 0.05  # others used more than this fraction of all CPUs during a measurement
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: What a launcher (Lightning's, torchrun) leaves in the environment; a child run must start without it.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")

# ---------------------------------------------------------------------------------------------------------------
# Threads.
# ---------------------------------------------------------------------------------------------------------------


def requested_accelerator(argv: list[str]) -> str:
    """``--accelerator`` as given on the command line, read before torch is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--accelerator", default="cpu")
    return pre.parse_known_args(argv)[0].accelerator


def one_thread_env(argv: Optional[list[str]] = None) -> None:
    """On CPU (``--accelerator`` absent or ``cpu`` in ``argv``, default ``sys.argv[1:]``) one thread per process,
    for this process and every child it starts: set before torch is imported (intra-op pools are sized at
    import). On CUDA the CPU only launches kernels, so torch keeps its own thread defaults."""
    if requested_accelerator(sys.argv[1:] if argv is None else argv) == "cpu":
        for var in THREAD_VARS:
            os.environ[var] = "1"


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # may be set only once per process, before any inter-op work
        pass


# ---------------------------------------------------------------------------------------------------------------
# Clocks: steps, CPU time, memory.
# ---------------------------------------------------------------------------------------------------------------


def system_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used since boot (from /proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process (gloo's included)
    return usage.ru_utime + usage.ru_stime


def _status_mib(field: str) -> Optional[float]:
    """A memory field of this process's /proc/self/status (``VmHWM``, ``VmRSS``) in MiB; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """Peak resident memory of this process (VmHWM). Not ``getrusage``'s ``ru_maxrss``: that survives ``exec``,
    so a child started by fork and exec would report at least its parent's peak."""
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM to its resident memory now (Linux: ``5`` into ``/proc/self/clear_refs``), so that
    :func:`peak_rss_mib` after a fit is that fit's peak where one process runs several; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_mib() -> float:
    """Resident memory of this process now (VmRSS; nan where unavailable): where one process runs several fits,
    growth from one to the next shows here, which the peak hides."""
    now = _status_mib("VmRSS")
    return float("nan") if now is None else now


def total_steps(cfg: dict) -> int:
    """The steps a run takes: ``cfg["warmup"]``, the ``cfg["steps"]`` timed ones, and one untimed step at the end
    (2BW drains there)."""
    return cfg["warmup"] + cfg["steps"] + 1


class StepClock:
    """End times of every step; CPU use of this process and of the whole machine over the timed window.

    The timed window runs from the end of step ``warmup - 1`` to the end of step ``warmup + steps - 1``. The
    machine-wide CPU use minus what the measured processes used tells whether something else was running.
    On a GPU a step ends when its kernels have finished: each tick waits for the device first (CUDA kernels run
    asynchronously to the CPU that launched them), and the result adds the device's peak allocated memory.
    """

    def __init__(self, cfg: dict, device: Any = None) -> None:
        self.first, self.last = cfg["warmup"] - 1, cfg["warmup"] + cfg["steps"] - 1
        self.stamps: list[float] = []
        self._start = self._end = (0.0, 0.0)
        self.cuda = device if device is not None and device.type == "cuda" else None
        if self.cuda is not None:
            import torch

            # The allocator's statistics exist only once CUDA is initialized on that device; a process that has
            # not touched the GPU yet gets "Invalid device argument" from reset_peak_memory_stats.
            torch.cuda.init()
            torch.cuda.reset_peak_memory_stats(self.cuda)

    def in_window(self) -> bool:
        """Whether the step about to run is a timed one."""
        return self.first < len(self.stamps) <= self.last

    def tick(self) -> None:
        if self.cuda is not None:
            import torch

            torch.cuda.synchronize(self.cuda)
        self.stamps.append(time.perf_counter())
        i = len(self.stamps) - 1
        if i == self.first:
            self._start = (own_cpu_seconds(), system_busy_seconds())
        elif i == self.last:
            self._end = (own_cpu_seconds(), system_busy_seconds())

    def result(self) -> dict:
        window = self.stamps[self.first : self.last + 1]
        steps = step_gaps(window)
        result = {
            "sec_per_step": statistics.median(steps),  # robust to a step slowed by something else on the machine
            "mean_sec_per_step": (window[-1] - window[0]) / len(steps),
            "wall_s": window[-1] - window[0],
            "cpu_s": self._end[0] - self._start[0],
            "system_busy_s": self._end[1] - self._start[1],
            "rss_mib": peak_rss_mib(),
        }
        if self.cuda is not None:
            import torch

            result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(self.cuda) / 2**20
        return result


def step_recorder(fields: Sequence[str] = ()) -> Any:
    """A Lightning callback that records each training step's end (``ends``, ``time.perf_counter``) and, for each
    name in ``fields``, that step's figure from the engine's ``StepTimes`` (``steps``: one dict per step);
    ``median_step()`` is the median time between step ends (the first step, and the setup before it, not
    counted)."""
    import lightning as L

    class StepRecorder(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            if fields:
                t = trainer.strategy.engine.stats.last_times
                self.steps.append({f: getattr(t, f) for f in fields})

        def median_step(self) -> float:
            return median_gap(self.ends)

    return StepRecorder()


def transfer_seconds(rank: int, rows: int, width: int, rounds: int = 30) -> float:
    """One activation's (rows x width float32) transfer between two processes (ranks 0 and 1 of the default
    group): half the median round trip."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(rows, width)
    trips = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def span_costs(spans: list, rank: int, steps: int) -> dict:
    """This stage's mean forward, backward and optimizer span (seconds) and its waits per step, from an engine
    trace (``engine.start_trace()`` / ``stop_trace()``)."""
    own = [s for s in spans if s.stage == rank]

    def mean(name: str) -> float:
        durations = [s.end - s.start for s in own if s.name == name]
        return statistics.fmean(durations) if durations else 0.0

    return {"forward_s": mean("forward"), "backward_s": mean("backward"), "optimizer_s": mean("optimizer"),
            "spans": {name: sum(s.name == name for s in own) for name in ("forward", "backward", "optimizer")},
            "wait_per_step_s": sum(s.end - s.start for s in own if s.name in ("send", "recv")) / steps}


# ---------------------------------------------------------------------------------------------------------------
# Medians, and alternatives timed in turn.
# ---------------------------------------------------------------------------------------------------------------


def step_gaps(ends: Sequence[float]) -> list[float]:
    """The times between consecutive step ends."""
    return [b - a for a, b in zip(ends, ends[1:])]


def median_gap(ends: Sequence[float]) -> float:
    """The median step from step ends (the time before the first end is not a step)."""
    return statistics.median(step_gaps(ends))


def median_ratio(num: Iterable[float], den: Iterable[float]) -> float:
    """The median of the pairwise ratios ``num[i] / den[i]``: alternatives taken in turn see the same machine,
    so each pair's ratio is free of the drift between them, and their median is robust to a disturbed pair."""
    return statistics.median(a / b for a, b in zip(num, den))


def median_round(rounds: list[Any], value: Callable[[Any], float]) -> Any:
    """The round with the median ``value`` (the lower middle one of an even count)."""
    return sorted(rounds, key=value)[(len(rounds) - 1) // 2]


def in_turn(names: list[str], turn: int) -> list[str]:
    """``names`` rotated by ``turn``: systems taking steps (or blocks) in turn start with another one each time."""
    turn %= len(names)
    return names[turn:] + names[:turn]


def block_median(loop: Any, first: int, k: int) -> float:
    """Steps ``first .. first + k - 1`` of ``loop`` (``loop.step(i)``); the median step time, the block's first
    step not counted (in a process pair the other rank may still be finishing the previous system's step)."""
    ends = [time.perf_counter()]
    for i in range(first, first + k):
        loop.step(i)
        ends.append(time.perf_counter())
    return median_gap(ends[1:])


# ---------------------------------------------------------------------------------------------------------------
# Launching processes, each run bounded by a timeout; every rank writes its results as JSON into a folder.
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables (:data:`LAUNCH_VARS`), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    return env


def read_rank_files(out_dir: str, pattern: str) -> list[dict]:
    """The JSON files matching ``pattern`` in ``out_dir``, in the order of the rank number ending their names."""
    def rank(p: Path) -> tuple[int, str]:
        digits = re.search(r"(\d*)$", p.stem).group(1)  # type: ignore[union-attr]
        return (int(digits) if digits else -1, p.name)

    return [json.loads(f.read_text()) for f in sorted(Path(out_dir).glob(pattern), key=rank)]


def spawn_pair(target: Callable, args: tuple, timeout: float, ranks: int = 2) -> None:
    """Start ``target(rank, *args)`` in ``ranks`` fresh processes; kill all if any fails or time runs out."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.__name__} did not finish within {timeout:.0f}s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{target.__name__} failed: exit codes {codes}")


def run_pairs(target: Callable, cfgs: list[dict], name: str, profile: bool, timeout: float,
              ranks: int = 2) -> list[list[dict]]:
    """``target(rank, port, cfgs, out_dir, profile)`` in spawned processes (:func:`spawn_pair`), each rank writing
    the list of its results, one per config, to ``out_dir/<name><rank>.json``; one ``[rank 0, rank 1, ...]`` per
    config."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_pair(target, (free_port(), cfgs, out_dir, profile), timeout, ranks)
        per_rank = [json.loads(Path(out_dir, f"{name}{r}.json").read_text()) for r in range(ranks)]
    return [list(pair) for pair in zip(*per_rank)]


def resident_peak_env() -> dict[str, str]:
    """The environment of ranks whose resident peak is measured: one thread each unless set, and glibc's mmap
    threshold fixed (unless set): glibc otherwise raises it as large blocks are freed and keeps later ones of that size
    in its heap, so that the resident peak would count freed memory."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}


def run_ranks(argv: list[str], pattern: str, what: str, timeout: float, ranks: int = 2,
              env: Optional[dict[str, str]] = None, capture: bool = True) -> list[dict]:
    """``python argv --out-dir DIR`` in a subprocess of its own session (Lightning re-executes it for the other
    ranks; all are killed together on timeout); the JSON files matching ``pattern`` each rank wrote into DIR, in
    rank order. ``env`` adds to :func:`child_env` (warnings off); ``capture=False`` lets the run's output through
    instead of showing its end only on a failure."""
    with tempfile.TemporaryDirectory() as out_dir:
        proc = subprocess.Popen([sys.executable, *argv, "--out-dir", out_dir],
                                env=child_env(PYTHONWARNINGS="ignore", **(env or {})),
                                stdout=subprocess.PIPE if capture else None,
                                stderr=subprocess.STDOUT if capture else None, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TimeoutError(f"{what} did not finish within {timeout:.0f}s")
        results = read_rank_files(out_dir, pattern)
        if proc.returncode != 0 or len(results) != ranks:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{(output or '')[-4000:]}")
        return results


# ---------------------------------------------------------------------------------------------------------------
# Other processes on the machine: measured, waited out, and measured around.
# ---------------------------------------------------------------------------------------------------------------


def others_cpu(procs: list[dict]) -> float:
    """Fraction of the machine's CPU time used by processes other than ``procs`` during their timed window (each
    a :meth:`StepClock.result`)."""
    wall = max(r["wall_s"] for r in procs)
    busy = max(r["system_busy_s"] for r in procs)
    own = sum(r["cpu_s"] for r in procs)
    return max(0.0, busy - own) / ((os.cpu_count() or 1) * wall) if wall > 0 else 0.0


class Quiet:
    """Waits for an idle machine before each measurement and repeats measurements that others disturbed."""

    def __init__(self, wait_idle: float, retries: int, timeout: float = CHILD_TIMEOUT) -> None:
        self.wait_idle, self.retries, self.timeout = wait_idle, retries, timeout

    def wait(self) -> None:
        deadline = time.monotonic() + self.wait_idle
        while True:
            before = system_busy_seconds()
            time.sleep(0.5)
            busy = (system_busy_seconds() - before) / (0.5 * (os.cpu_count() or 1))
            if busy < 0.1 or time.monotonic() > deadline:
                return

    def measure(self, run: Callable[[], Any], disturbance: Callable[[Any], float] = others_cpu) -> Any:
        """``run()`` on a quiet machine, again (``retries`` times) while ``disturbance(result)`` (by default others'
        CPU share of a list of per-process results) exceeds 5%; the least disturbed result."""
        best: Any = None
        for _ in range(1 + self.retries):
            self.wait()
            res = run()
            if best is None or disturbance(res) < disturbance(best):
                best = res
            if disturbance(best) <= DISTURBED:
                break
        return best

    def measure_keyed(self, run: Callable[[], dict[str, list[dict]]]) -> dict[str, list[dict]]:
        """:meth:`measure` for a run that measures several systems in one window: ``{system: [result]}``."""
        return self.measure(run, lambda res: max(others_cpu(v) for v in res.values()))

    def measure_group(self, worker: Callable, name: str, cfgs: list[dict]) -> list[list[dict]]:
        """Several configurations in one process pair (:func:`run_pairs`); the disturbed ones are measured again."""
        self.wait()
        best = run_pairs(worker, cfgs, name, False, self.timeout)
        for _ in range(self.retries):
            again = [i for i, pair in enumerate(best) if others_cpu(pair) > DISTURBED]
            if not again:
                break
            self.wait()
            for i, pair in zip(again, run_pairs(worker, [cfgs[i] for i in again], name, False, self.timeout)):
                if others_cpu(pair) < others_cpu(best[i]):
                    best[i] = pair
        return best


# ---------------------------------------------------------------------------------------------------------------
# Output: JSON and report lines.
# ---------------------------------------------------------------------------------------------------------------


def write_json(path: Optional[str], obj: Any) -> None:
    """``obj`` as JSON (indented by one) into ``path``, if a path is given (``--json``)."""
    if path:
        Path(path).write_text(json.dumps(obj, indent=1))


def load_line() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def wall_time_line(started: float, label: str = "benchmark wall time") -> str:
    """The line a report ends with: the wall time since ``started`` (``time.perf_counter``) and the load now."""
    return f"\n({label} {time.perf_counter() - started:.0f}s; load average now {load_line()})"
