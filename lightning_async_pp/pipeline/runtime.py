"""The runtime that executes schedules: one stage per process, or every stage in one process.

Both executors expose the same small interface to the strategy:

- ``train_batch(batch, next_batch)``: run this step's actions; returns the batch's mean loss (every rank);
  afterwards ``gradients`` holds the batch gradient for ``params`` (all-reduced across data-parallel replicas).
- ``prepare_update()``: move the parameters onto the slot that will hold ``W_{k+1}`` (weight stashing); the
  optimizer then writes them in place.
- ``eval_loss(batch)``: forward only on the newest weights.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.pipeline.comm import TAG_EVAL_LOSS, TAG_LOSS, StageLink, as_tuple, unpack
from lightning_async_pp.pipeline.microbatch import split_microbatches
from lightning_async_pp.pipeline.schedule import step_actions
from lightning_async_pp.pipeline.stage import Stage

InputFn = Callable[[Any], Any]
LossFn = Callable[[Any, Any], Tensor]


@dataclass
class Span:
    """One timed piece of work on one stage, for the timeline trace."""

    stage: int
    name: str  # forward, backward, send, recv, optimizer, idle
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class StepTimes:
    """Where one stage's wall time went during one training step, in seconds."""

    total: float = 0.0  # from the start of the step's pipeline work to the end of its optimizer update
    compute: float = 0.0  # forward and backward
    comm_wait: float = 0.0  # blocked waiting for a neighbour's activation, gradient or loss
    optimizer: float = 0.0  # the update (set by the caller that runs the optimizer)

    @property
    def idle(self) -> float:
        """Everything else: scheduling, Python overhead, data handling."""
        return max(0.0, self.total - self.compute - self.comm_wait - self.optimizer)


class _Executor:
    stages: list[Stage]
    num_microbatches: int

    def __init__(self) -> None:
        self.gradients: list[Optional[Tensor]] = []
        self.last_times = StepTimes()
        self.trace: Optional[list[Span]] = None  # a list while a trace window is open

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for stage in self.stages for p in stage.params]

    @property
    def batch_index(self) -> int:
        """k: the number of updates applied so far, which is also the index of the next batch."""
        return self.stages[0].versions.num_updates

    def prepare_update(self) -> None:
        for stage in self.stages:
            stage.versions.prepare_update()

    def stash_nbytes(self) -> int:
        return sum(stage.versions.stash_nbytes() for stage in self.stages)

    def state_dict(self) -> dict[str, Any]:
        return {"stages": {stage.index: stage.versions.state_dict() for stage in self.stages}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stage in self.stages:
            stage.versions.load_state_dict(state["stages"][stage.index])

    def _span(self, stage: int, name: str, start: float, **args: Any) -> float:
        end = time.perf_counter()
        if self.trace is not None:
            self.trace.append(Span(stage, name, start, end, args))
        return end - start

    def start_trace(self) -> None:
        """Record a :class:`Span` for every forward, backward and wait from now on (see ``trace``)."""
        self.trace = []

    def stop_trace(self) -> list[Span]:
        spans, self.trace = self.trace or [], None
        return spans

    def record_optimizer(self, start: float, end: float) -> None:
        """The caller ran the optimizer update of the last step from ``start`` to ``end``."""
        self.last_times.optimizer = end - start
        self.last_times.total += end - start
        if self.trace is not None:
            self.trace.append(Span(self.stages[0].index if len(self.stages) == 1 else 0, "optimizer", start, end, {}))


class LocalPipeline(_Executor):
    """Every stage in this process: each microbatch runs forward through all stages, then backward.

    The numbers equal the multi-process schedules' (same versions, same microbatch gradients); only the order in
    which independent microbatches run differs, and that order does not change the result.
    """

    def __init__(self, stages: Sequence[Stage], num_microbatches: int, input_fn: InputFn, loss_fn: LossFn) -> None:
        super().__init__()
        self.stages = list(stages)
        self.num_microbatches = num_microbatches
        self.input_fn, self.loss_fn = input_fn, loss_fn

    def train_batch(self, batch: Any, next_batch: Any = None) -> Tensor:
        k = self.batch_index
        step_start = time.perf_counter()
        total = None
        for j, mb in enumerate(split_microbatches(batch, self.num_microbatches)):
            start = time.perf_counter()
            x = self.input_fn(mb)
            for stage in self.stages:
                x = stage.forward(k, x)
            loss = self.loss_fn(x, mb) / self.num_microbatches
            self._span(0, "forward", start, batch=k, microbatch=j)
            start = time.perf_counter()
            loss.backward()
            self._span(0, "backward", start, batch=k, microbatch=j)
            total = loss.detach() if total is None else total + loss.detach()
        self.gradients = [g for stage in self.stages for g in stage.take_gradients(k)]
        elapsed = time.perf_counter() - step_start
        self.last_times = StepTimes(total=elapsed, compute=elapsed)
        return total

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> Tensor:
        losses = []
        for mb in split_microbatches(batch, self.num_microbatches):
            x = self.input_fn(mb)
            for stage in self.stages:
                x = stage.forward_newest(x)
            losses.append(self.loss_fn(x, mb))
        return torch.stack(losses).mean()


class DistributedPipeline(_Executor):
    """One stage in this process; neighbours are other processes reached through a :class:`StageLink`."""

    RECV_DEPTH = 2  # receives posted ahead of the action that consumes them

    def __init__(
        self,
        stage: Stage,
        link: StageLink,
        *,
        schedule: str,
        num_microbatches: int,
        input_fn: InputFn,
        loss_fn: LossFn,
        pipeline_ranks: Sequence[int],
        dp_group: Any = None,
        dp_size: int = 1,
    ) -> None:
        super().__init__()
        self.stages = [stage]
        self.stage, self.link = stage, link
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.pipeline_ranks = list(pipeline_ranks)
        self.dp_group, self.dp_size = dp_group, dp_size
        self._carried_in = False  # this step's first forwards ran as the previous step's lookahead
        self._inflight: dict[tuple[int, int], tuple[Optional[tuple[Tensor, ...]], Any]] = {}
        self._losses: dict[int, Tensor] = {}  # last stage: running loss sum of batches in flight
        link.recorder = self._record_wait

    def _record_wait(self, name: str, start: float, end: float, args: dict) -> None:
        if self.trace is not None:
            self.trace.append(Span(self.stage.index, name, start, end, args))

    def uses_lookahead(self, next_batch_exists: bool) -> bool:
        """2BW starts the next batch during this step when there is one and it is itself asynchronous."""
        versions = self.stage.versions
        return self.schedule == "2bw" and next_batch_exists and versions.delay_for_batch(self.batch_index + 1) > 0

    def train_batch(self, batch: Any, next_batch: Any = None) -> Tensor:
        k = self.batch_index
        stage, link = self.stage, self.link
        lookahead = self.uses_lookahead(next_batch is not None)
        actions = step_actions(
            self.schedule, stage.index, stage.num_stages, self.num_microbatches,
            carried_in=self._carried_in, lookahead=lookahead,
        )
        microbatches = {0: split_microbatches(batch, self.num_microbatches)}
        if lookahead:
            microbatches[1] = split_microbatches(next_batch, self.num_microbatches)
        last_rank = self.pipeline_ranks[-1]
        link.begin_step()
        loss_recv = None if stage.is_last else link.post_scalar_recv(last_rank, TAG_LOSS)

        forwards_needing_recv = 0 if stage.is_first else sum(a.op == "F" for a in actions)
        backwards_needing_recv = 0 if stage.is_last else sum(a.op == "B" for a in actions)
        posted_f = posted_b = used_f = used_b = 0
        wait_before = link.wait_seconds
        compute = 0.0
        step_start = time.perf_counter()
        for action in actions:
            # Keep a couple of receives posted ahead so transfers overlap compute.
            while posted_f < min(forwards_needing_recv, used_f + self.RECV_DEPTH):
                link.post_activation_recv()
                posted_f += 1
            while posted_b < min(backwards_needing_recv, used_b + self.RECV_DEPTH) and link.out_metas is not None:
                link.post_gradient_recv()
                posted_b += 1
            b = k + action.batch
            mb = microbatches[action.batch][action.microbatch]
            if action.op == "F":
                inputs = None
                if stage.is_first:
                    x = self.input_fn(mb)
                else:
                    inputs = link.recv_activations()
                    used_f += 1
                    x = unpack(inputs, link.in_is_tuple)
                start = time.perf_counter()
                out = stage.forward(b, x)
                if stage.is_last:
                    out = self.loss_fn(out, mb) / self.num_microbatches
                    self._losses[b] = self._losses.get(b, 0.0) + out.detach().to(torch.float64)
                compute += self._span(stage.index, "forward", start, batch=b, microbatch=action.microbatch)
                if not stage.is_last:
                    link.send_activations(out, carried=action.batch == 1)
                self._inflight[(b, action.microbatch)] = (inputs, out)
            else:
                inputs, out = self._inflight.pop((b, action.microbatch))
                if stage.is_last:
                    start = time.perf_counter()
                    out.backward()
                else:
                    grads = link.recv_gradients()
                    used_b += 1
                    start = time.perf_counter()
                    pairs = [(o, g) for o, g in zip(as_tuple(out), grads) if g is not None]
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                compute += self._span(stage.index, "backward", start, batch=b, microbatch=action.microbatch)
                if not stage.is_first:
                    link.send_gradients(inputs)
        self._carried_in = lookahead

        if stage.is_last:
            loss = self._losses.pop(k)
            for rank in self.pipeline_ranks[:-1]:
                link.send_scalar(loss, rank, TAG_LOSS)
        else:
            link.wait(loss_recv[0], last_rank, "the batch loss")
            loss = loss_recv[1][0]
        link.flush_sends()  # all but the lookahead's sends: their receives were posted during this step
        self.gradients = stage.take_gradients(k)
        if self.dp_size > 1:
            self._all_reduce_mean(self.gradients, loss)
        self.last_times = StepTimes(
            total=time.perf_counter() - step_start, compute=compute, comm_wait=link.wait_seconds - wait_before
        )
        return loss.to(torch.float32)

    def _all_reduce_mean(self, grads: list[Optional[Tensor]], loss: Tensor) -> None:
        present = [g for g in grads if g is not None]
        flat = torch.cat([g.reshape(-1).to(torch.float64 if g.dtype == torch.float64 else torch.float32) for g in present]
                         + [loss.reshape(1).to(torch.float32)])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        offset = 0
        for g in present:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        loss.copy_(flat[-1])

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> Tensor:
        stage, link = self.stage, self.link
        last_rank = self.pipeline_ranks[-1]
        total = torch.zeros((), dtype=torch.float64, device=link.device)
        for mb in split_microbatches(batch, self.num_microbatches):
            x = self.input_fn(mb) if stage.is_first else link.recv_eval()
            out = stage.forward_newest(x)
            if stage.is_last:
                total += self.loss_fn(out, mb).to(torch.float64)
            else:
                link.send_eval(out)
        if stage.is_last:
            total /= self.num_microbatches
            for rank in self.pipeline_ranks[:-1]:
                link.send_scalar(total, rank, TAG_EVAL_LOSS)
        else:
            total = link.recv_scalar(last_rank, TAG_EVAL_LOSS)
        link.flush_sends()
        return total.to(torch.float32)
