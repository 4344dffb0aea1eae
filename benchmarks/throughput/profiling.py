"""Profiles for ``pipeline_throughput.py --profile``: the pieces of torch's schedule on one stage, main-thread CPU
per step by kind (cProfile timed with ``thread_time``), and the engine's step breakdown averaged over steps."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time
from typing import Any

from torch import nn


class _TorchSplit:
    """Times the pieces of torch's schedule on one stage: pure forward, pure backward, their wrappers, p2p waits."""

    def __init__(self, stage: Any) -> None:
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage_mod

        self.active = False
        self.totals = {"fwd_pure": 0.0, "bwd_pure": 0.0, "fwd_chunk": 0.0, "bwd_chunk": 0.0, "p2p_wait": 0.0,
                       "p2p_post": 0.0}
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrap(stage, "forward_one_chunk", "fwd_chunk")
        self._wrap(stage, "backward_one_chunk", "bwd_chunk")
        self._wrap(stage.submod, "forward", "fwd_pure")
        self._wrap(stage_mod, "stage_backward", "bwd_pure")
        self._wrap(schedules, "_wait_batch_p2p", "p2p_wait")
        self._wrap(schedules, "_batch_p2p", "p2p_post")

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def remove(self) -> None:
        for owner, name, original in reversed(self._restore):
            if isinstance(owner, nn.Module):
                delattr(owner, name)  # the instance attribute shadowed the class method
            else:
                setattr(owner, name, original)



def _times_dict(t: Any) -> dict:
    return {"total": t.total, "compute": t.compute, "comm_wait": t.comm_wait, "optimizer": t.optimizer, "idle": t.idle}


def _mean_times(times: list[dict]) -> dict:
    return {k: statistics.fmean(t[k] for t in times) for k in times[0]} if times else {}



def _profile_text(prof: cProfile.Profile, sort: str = "tottime", limit: int = 18) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(limit)
    return buf.getvalue()


def _profile_summary(prof: cProfile.Profile, steps: int) -> dict:
    """Main-thread CPU milliseconds per step by kind, from a profile timed with ``time.thread_time``.

    CPU time, not wall time: blocking in a wait costs none, and other processes on the machine do not inflate
    it, so this attributes overhead even on a busy machine. *kernels* are torch's C++ calls (forward kernels,
    the whole autograd backward, optimizer math); *p2p calls* are torch.distributed's isend/irecv/wait calls;
    *python* is everything else: the schedule, the runtime's bookkeeping, Lightning's loop.
    """
    kernels = comm = python = optimizer = 0.0
    for (file, _line, name), (_cc, _nc, tottime, cumtime, _callers) in pstats.Stats(prof).stats.items():
        if file == "~" and "_distributed_c10d" in name:
            comm += tottime
        elif file == "~" and "torch" in name:
            kernels += tottime
        else:
            python += tottime
        if name == "step" and "torch/optim/" in file.replace(os.sep, "/") and not file.endswith("optimizer.py"):
            optimizer = max(optimizer, cumtime)
    per = 1e3 / steps
    return {"kernels": kernels * per, "p2p_calls": comm * per, "python": python * per, "optimizer": optimizer * per}


def _trim_profile(text: str) -> str:
    keep = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced"))]
    return "\n".join(keep)
