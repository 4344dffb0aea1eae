"""The one runtime that executes schedules: the action lists of however many stages this process holds.

Across processes a process holds one stage and its neighbours are reached through a :class:`StageLink`; on one
device it holds every stage and the boundaries are in-process hand-overs that follow the same rules (what may
cross, which tensors carry gradients back). In both cases each stage runs its own action list in order; a
stage whose next action waits for a neighbour in this process yields to the others (see docs/design.md,
"The runtime"). There is no second code path per schedule: a new schedule is a new action list.

``train_batch(batch, next_batch)`` returns the batch's mean loss on every rank and leaves the batch gradient of
``params`` in ``gradients`` (with data-parallel replicas, their mean once ``finish_reduction()`` has waited for the
reduction that the batch's last backward started); ``prepare_update()`` moves the parameters
onto the slot that will hold ``W_{k+1}`` before the optimizer writes them (weight stashing).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.pipeline.backward import PendingWeightGradient, backward_input, backward_weight
from lightning_async_pp.pipeline.comm import TAG_EVAL, TAG_LOSS, TAG_PREDICT, StageLink
from lightning_async_pp.pipeline.data_parallel import GradientReducer
from lightning_async_pp.pipeline.microbatch import batch_size_of, fingerprint, split_microbatches, split_ragged
from lightning_async_pp.pipeline.randomness import EVAL, ForwardRandomness
from lightning_async_pp.pipeline.schedule import Action, lookahead_forwards, step_actions
from lightning_async_pp.pipeline.stage import Stage
from lightning_async_pp.pipeline.structure import as_received, flatten, input_gradient, unflatten

TAG_EVAL_LOSS = TAG_LOSS + 1  # the evaluation loss, last stage -> the others
TAG_PREDICT_RESULT = TAG_PREDICT + 512  # the prediction, last stage -> first stage

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
    """Where one process's wall time went during one training step, in seconds."""

    total: float = 0.0  # from the start of the step's pipeline work to the end of its optimizer update
    compute: float = 0.0  # forward and backward
    comm_wait: float = 0.0  # blocked waiting for a neighbour's activation, gradient or loss
    optimizer: float = 0.0  # the update (set by the caller that runs the optimizer)
    dp_comm: float = 0.0  # the data-parallel gradient reduction, from its first bucket's start to the end of its wait
    dp_comm_exposed: float = 0.0  # of that, the time blocked waiting for it (what the step's other work did not hide)

    @property
    def idle(self) -> float:
        """Everything else: scheduling, Python overhead, data handling."""
        return max(0.0, self.total - self.compute - self.comm_wait - self.optimizer - self.dp_comm_exposed)


@dataclass
class _Receives:
    """One step's receives from other processes: how many to expect, and how many were posted and used."""

    checked: list[bool]  # per forward to receive: whether it carries a batch fingerprint
    gradients: int  # gradients to receive
    posted_f: int = 0
    used_f: int = 0
    posted_b: int = 0
    used_b: int = 0


class BatchMismatch(RuntimeError):
    """Two stages of one pipeline were given different batches."""


def scalar_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"pipeline_loss must return a scalar tensor (the mean loss of the microbatch), got shape {shape}; "
            f"reduce it, e.g. with .mean()"
        )
    return loss.reshape(())


class PipelineRuntime:
    """Runs the action lists of ``stages`` (this process's) for one training step, an evaluation or a prediction.

    ``link`` connects the first/last local stage to stages in other processes (``None`` when every stage is here).
    """

    RECV_DEPTH = 2  # receives posted ahead of the action that consumes them

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        schedule: str,
        num_microbatches: int,
        input_fn: InputFn,
        loss_fn: LossFn,
        link: Optional[StageLink] = None,
        pipeline_ranks: Sequence[int] = (0,),
        dp_group: Any = None,
        dp_size: int = 1,
        check_batches: bool = True,
        loss_group: Any = None,
        metric_names: Sequence[str] = (),
        metrics_fn: Optional[Callable[[], dict[str, Tensor]]] = None,
        randomness: Optional[ForwardRandomness] = None,
    ) -> None:
        self.stages = list(stages)
        self.num_stages = self.stages[0].num_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.input_fn, self.loss_fn = input_fn, loss_fn
        # Scalars the loss computation of a batch produced besides the loss (the module's pipeline_metrics(), read on
        # the last stage after the batch's last loss): they travel with the loss, so every rank can log them.
        self.metric_names, self.metrics_fn = tuple(metric_names), metrics_fn
        self.last_metrics: dict[str, Tensor] = {}
        self.link = link
        self.pipeline_ranks = list(pipeline_ranks)
        self.dp_group, self.dp_size = dp_group, dp_size
        self.loss_group = loss_group if loss_group is not None else dp_group
        # Data parallel: one stage per process; its gradient accumulates in the reducer's buckets.
        self.reducer = GradientReducer(self.params, dp_group, dp_size) if dp_size > 1 else None
        self._backwards_left = 0  # this step's backwards of the current batch still to run (data parallel)
        self.check_batches = check_batches and link is not None
        self.gradients: list[Optional[Tensor]] = []
        self.last_times = StepTimes()
        self.trace: Optional[list[Span]] = None  # a list while a trace window is open
        self._carried_in = False  # this step's first forwards ran as the previous step's lookahead
        self._next_check: Optional[Tensor] = None  # fingerprint of the lookahead batch
        self._inflight: dict[tuple[int, int, int], tuple[list[Tensor], Any]] = {}  # (stage, batch, mb)
        # A split backward's input pass ran, its weight pass is due: (stage, batch, mb) -> what W needs, and the
        # buffers it still reads (released to the link after W).
        self._weight_due: dict[tuple[int, int, int], tuple[PendingWeightGradient, list[Tensor], Any, Any]] = {}
        self._losses: dict[int, Tensor] = {}  # running loss sum of batches in flight (last stage)
        self._checks_due: list[tuple] = []  # (received fingerprint, own, stage, batch) to compare after the step
        # Per stage, its persistent buffers and their values before the lookahead's first forward of the next
        # batch (BatchNorm statistics, say): what they are for the batches trained so far.
        self._trained_buffers: dict[int, list[tuple[torch.nn.Module, str, Tensor]]] = {}
        # Every forward draws from its own seeded stream (pipeline/randomness.py); evaluations are counted to key
        # theirs.
        self.randomness = randomness or ForwardRandomness(torch.initial_seed(), torch.device("cpu"))
        self._evaluations = 0
        if link is not None:
            link.recorder = self._record_wait

    # ---- facts ------------------------------------------------------------------------------------------
    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for stage in self.stages for p in stage.params]

    @property
    def batch_index(self) -> int:
        """k: the number of updates applied so far, which is also the index of the next batch."""
        return self.stages[0].versions.num_updates

    @property
    def has_lookahead(self) -> bool:
        """The next batch's first forwards already ran (2BW), so the next step must be given that batch."""
        return self._carried_in

    def uses_lookahead(self, next_batch_exists: bool) -> bool:
        """2BW starts the next batch during this step when there is one and it is itself asynchronous.

        On one device the order of independent microbatches does not change the result, so no lookahead is used.
        """
        return (self.link is not None and self.schedule == "2bw" and next_batch_exists
                and self.stages[0].versions.delay_for_batch(self.batch_index + 1) > 0)

    def prepare_update(self) -> None:
        for stage in self.stages:
            stage.versions.prepare_update()

    # ---- tracing ----------------------------------------------------------------------------------------
    def _span(self, stage: int, name: str, start: float, **args: Any) -> float:
        end = time.perf_counter()
        if self.trace is not None:
            self.trace.append(Span(stage, name, start, end, args))
        return end - start

    def _record_wait(self, name: str, start: float, end: float, args: dict) -> None:
        if self.trace is not None:
            self.trace.append(Span(self.stages[0].index, name, start, end, args))

    def record_optimizer(self, start: float, end: float) -> None:
        """The caller ran the optimizer update of the last step from ``start`` to ``end``."""
        self.last_times.optimizer = end - start
        self.last_times.total += end - start
        if self.trace is not None:
            self.trace.append(Span(self.stages[0].index, "optimizer", start, end, {}))

    # ---- training -----------------------------------------------------------------------------------------
    def train_batch(self, batch: Any, next_batch: Any = None) -> Tensor:
        k = self.batch_index
        self._trained_buffers = {}  # the batch whose forwards ran ahead is trained now
        link = self.link
        lookahead = self.uses_lookahead(next_batch is not None)
        m = self.num_microbatches
        microbatches = {0: split_microbatches(batch, m)}
        checks: dict[int, Optional[Tensor]] = {0: None, 1: None}
        if lookahead:
            microbatches[1] = split_microbatches(next_batch, m)
        if self.check_batches:
            # The lookahead batch's fingerprint was taken last step: each batch is read once per stage.
            checks[0] = self._next_check if self._carried_in and self._next_check is not None else fingerprint(batch)
            checks[1] = fingerprint(next_batch) if lookahead else None
            self._next_check = checks[1]
        queues = {
            s.index: deque(step_actions(self.schedule, s.index, self.num_stages, m,
                                        carried_in=self._carried_in, lookahead=lookahead))
            for s in self.stages
        }
        first, last = self.stages[0], self.stages[-1]
        loss_recv = None
        wait_before = 0.0
        if link is not None:
            link.begin_step()
            wait_before = link.wait_seconds
            if not last.is_last:
                loss_recv = link.post_scalar_recv(self.pipeline_ranks[-1], TAG_LOSS, size=1 + len(self.metric_names))
        # Receives from other processes are posted a little ahead of the actions that consume them. Of the
        # forwards received, a batch's first microbatch carries the batch fingerprint.
        self._receives = _Receives(
            checked=[] if first.is_first else [a.microbatch == 0 for a in queues[first.index] if a.op == "F"],
            gradients=0 if last.is_last else sum(a.op in ("B", "I") for a in queues[last.index]),
        )
        if self.reducer is not None:
            # The actions that add to this batch's weight gradients: whole backwards, and a split one's weight pass.
            self._backwards_left = sum(a.op in ("B", "W") and a.batch == 0 for a in queues[first.index])
            self.reducer.attach(first.versions.leaves_for_batch(k))
        acts: dict[tuple[int, int, int], tuple[list[Tensor], Any]] = {}  # in-process hand-overs, by receiver
        grads: dict[tuple[int, int, int], list[Optional[Tensor]]] = {}
        compute = 0.0
        step_start = time.perf_counter()
        while any(queues.values()):
            progressed = False
            for stage in self.stages:
                queue = queues[stage.index]
                while queue and self._ready(stage, queue[0], k, acts, grads):
                    action = queue.popleft()
                    compute += self._run(stage, action, k, microbatches, checks, acts, grads)
                    progressed = True
            if not progressed:
                waiting = {s: str(q[0]) for s, q in queues.items() if q}
                raise RuntimeError(f"the schedule cannot make progress: stages wait on each other at {waiting}")
        self._carried_in = lookahead
        # Compared once the step's work is queued: on CUDA a comparison waits for the device.
        while self._checks_due:
            self._compare(*self._checks_due.pop(0))

        if last.is_last:
            total = self._losses.pop(k)
            loss = torch.cat([total.reshape(1), self._batch_metrics(total.device)]) if self.metric_names else total.reshape(1)
            if link is not None:
                for rank in self.pipeline_ranks[:-1]:
                    link.send_scalar(loss, rank, TAG_LOSS)
        else:
            assert link is not None and loss_recv is not None
            link.wait(loss_recv[0], self.pipeline_ranks[-1], "the batch loss")
            loss = loss_recv[1]
        if link is not None:
            link.flush_sends()  # all but the lookahead's sends: their receives were posted during this step
        self.gradients = [g for stage in self.stages for g in stage.take_gradients(k)]
        if self.reducer is not None:
            self.reducer.launch_rest()
            dist.all_reduce(loss, group=self.loss_group)  # its own group: not queued behind the gradient buckets
            loss /= self.dp_size
            if not self.reducer.OVERLAP:
                self.gradients = self.reducer.finish(self.gradients)
        self.last_metrics = {name: value.to(torch.float32) for name, value in zip(self.metric_names, loss[1:])}
        loss = loss[0]
        self.last_times = StepTimes(
            total=time.perf_counter() - step_start, compute=compute,
            comm_wait=(link.wait_seconds - wait_before) if link is not None else 0.0,
        )
        if self.reducer is not None and not self.reducer.OVERLAP:
            self.last_times.dp_comm = self.last_times.dp_comm_exposed = self.reducer.exposed_s
        return loss.to(torch.float32)

    def _batch_metrics(self, device: torch.device) -> Tensor:
        """The module's declared metrics of this batch, on ``device`` (where the loss is: no host sync per step)."""
        values = self.metrics_fn() if self.metrics_fn is not None else {}
        if sorted(values) != sorted(self.metric_names):
            raise ValueError(f"pipeline_metrics() returned {sorted(values)}; pipeline_metric_names() declared "
                             f"{sorted(self.metric_names)}: they must name the same scalars")
        return torch.stack([torch.as_tensor(values[n]).detach().reshape(()).to(device=device, dtype=torch.float64)
                            for n in self.metric_names])

    @property
    def reduction_pending(self) -> bool:
        return self.reducer is not None and self.reducer.pending

    def finish_reduction(self) -> None:
        """Wait for the data-parallel reduction of the last step's gradient (launched during its last backward)."""
        if not self.reduction_pending:
            return
        assert self.reducer is not None
        self.gradients = self.reducer.finish(self.gradients)
        self.last_times.dp_comm, self.last_times.dp_comm_exposed = self.reducer.total_s, self.reducer.exposed_s
        self.last_times.total += self.reducer.exposed_s

    def _ready(self, stage: Stage, action: Action, k: int, acts: dict, grads: dict) -> bool:
        key = (stage.index, k + action.batch, action.microbatch)
        if action.op == "F":
            return stage.is_first or stage is self.stages[0] and self.link is not None or key in acts
        if action.op == "W":  # after its I on this stage (schedule.validate_actions)
            return True
        return stage.is_last or stage is self.stages[-1] and self.link is not None or key in grads

    def _post_receives(self) -> None:
        link, r = self.link, self._receives
        assert link is not None
        while r.posted_f < min(len(r.checked), r.used_f + self.RECV_DEPTH):
            link.post_activation_recv(with_check=self.check_batches and r.checked[r.posted_f])
            r.posted_f += 1
        while r.posted_b < min(r.gradients, r.used_b + self.RECV_DEPTH) and link.out_layout is not None:
            link.post_gradient_recv()
            r.posted_b += 1

    def _run(self, stage: Stage, action: Action, k: int, microbatches: dict, checks: dict,
             acts: dict, grads: dict) -> float:
        b, j = k + action.batch, action.microbatch
        mb = microbatches[action.batch][j]
        remote_in = self.link is not None and stage is self.stages[0] and not stage.is_first
        remote_out = self.link is not None and stage is self.stages[-1] and not stage.is_last
        if self.link is not None:
            self._post_receives()
        if action.op == "F":
            inputs: list[Tensor] = []
            x = None  # the first stage's input is computed in the forward's seeded stream, below
            if remote_in:
                inputs, check = self.link.recv_activations(with_check=self.check_batches and j == 0)
                self._receives.used_f += 1
                if check is not None:
                    self._checks_due.append((check, checks[action.batch], stage, b))
                x = unflatten(inputs, self.link.in_layout.spec)
            elif not stage.is_first:
                inputs, spec = acts.pop((stage.index, b, j))
                x = unflatten(inputs, spec)
            if action.batch == 1 and stage.index not in self._trained_buffers:
                self._trained_buffers[stage.index] = [(m, n, m._buffers[n].clone()) for m, n in stage.persistent_buffers()]
            start = time.perf_counter()
            with self.randomness.forward(stage.index, b, j):
                out = stage.forward(b, self.input_fn(mb) if stage.is_first else x)
                if stage.is_last:
                    out = scalar_loss(self.loss_fn(out, mb)) / self.num_microbatches
            if stage.is_last:
                self._losses[b] = self._losses.get(b, 0.0) + out.detach().to(torch.float64)
                out_leaves: Any = out
            else:
                out_leaves, spec = flatten(out, f"stage {stage.index}'s output")
            elapsed = self._span(stage.index, "forward", start, batch=b, microbatch=j)
            if not stage.is_last:
                if remote_out:
                    self.link.send_activations(out, carried=action.batch == 1,
                                               check=checks[action.batch] if j == 0 else None)
                else:
                    acts[(stage.index + 1, b, j)] = (as_received(out_leaves), spec)
            self._inflight[(stage.index, b, j)] = (inputs, out_leaves)
            return elapsed
        if action.op == "W":
            pending, inputs, out_leaves, received = self._weight_due.pop((stage.index, b, j))
            self._count_gradient_action(action)
            start = time.perf_counter()
            backward_weight(pending)
            if self.reducer is not None and action.batch == 0:
                self.reducer.accumulated_outside_autograd(pending.weights)
            elapsed = self._span(stage.index, "backward", start, batch=b, microbatch=j, part="weight")
            self._release(stage, inputs, out_leaves, received, remote_in, remote_out)
            return elapsed
        inputs, out_leaves = self._inflight.pop((stage.index, b, j))
        received: Optional[list[Optional[Tensor]]] = None
        if action.op == "B":
            self._count_gradient_action(action)
        if stage.is_last:
            outputs, seeds = [out_leaves], [None]
        else:
            if remote_out:
                received = self.link.recv_gradients()
                self._receives.used_b += 1
            else:
                received = grads.pop((stage.index, b, j))
            pairs = [(o, g) for o, g in zip(out_leaves, received) if g is not None and o.requires_grad]
            outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        start = time.perf_counter()
        if action.op == "B":
            if stage.is_last:
                out_leaves.backward()
            elif outputs:
                torch.autograd.backward(outputs, seeds)
            elapsed = self._span(stage.index, "backward", start, batch=b, microbatch=j)
        else:  # I: the input gradient now, the weight gradient at this microbatch's W
            pending = backward_input(outputs, seeds, inputs, stage.grad_leaves(b))
            elapsed = self._span(stage.index, "backward", start, batch=b, microbatch=j, part="input")
        if not stage.is_first:
            if remote_in:
                self.link.send_gradients(inputs)
            else:
                grads[(stage.index - 1, b, j)] = [input_gradient(t) if t.requires_grad else None for t in inputs]
        if action.op == "B":
            self._release(stage, inputs, out_leaves, received, remote_in, remote_out)
        else:
            self._weight_due[(stage.index, b, j)] = (pending, inputs, out_leaves, received)
        return elapsed

    def _count_gradient_action(self, action: Action) -> None:
        """Before a B or W of this step's batch: arm the reducer for the last one, in which the gradients become
        final (its buckets then start as their gradients are accumulated)."""
        if self.reducer is not None and action.batch == 0:
            self._backwards_left -= 1
            if self._backwards_left == 0:
                self.reducer.arm()

    def _release(self, stage: Stage, inputs: list[Tensor], out_leaves: Any, received: Any, remote_in: bool,
                 remote_out: bool) -> None:
        """The microbatch's backward is complete: its receive buffers may take the next transfers (not before
        its weight gradient, which reads the received activation and gradient)."""
        if remote_in or remote_out:
            self.link.release_microbatch(inputs if remote_in else [], [] if stage.is_last else out_leaves,
                                         received if remote_out else None)

    def _compare(self, received: Tensor, own: Optional[Tensor], stage: Stage, b: int) -> None:
        if own is None:
            return
        if not math.isclose(received.item(), own.item(), rel_tol=1e-9, abs_tol=0.0):
            raise BatchMismatch(
                f"stage {stage.index} was given another batch than stage {stage.index - 1} for training batch {b} "
                f"(fingerprints {own.item():.6g} and {received.item():.6g}). Every stage of a pipeline must see the "
                f"same batches: use the same loader, sampler and seed on every process (with one pipeline the "
                f"strategy keeps your sampler and seeds a shuffling one identically on every stage)"
            )

    def trained_buffers(self) -> dict[int, Tensor]:
        """``id(buffer) -> value`` for each buffer the lookahead's forwards changed, as the trained batches left
        it: what a checkpoint saves and evaluation reads (the next batch is not trained yet)."""
        return {id(m._buffers[n]): saved for held in self._trained_buffers.values() for m, n, saved in held}

    @contextmanager
    def buffers_as_trained(self) -> Iterator[None]:
        """The modules hold the trained values inside (evaluation between two steps), the lookahead's after.

        The tensors are swapped, not copied into: the lookahead's graphs in flight saved the live buffers (CPU
        BatchNorm's backward keeps the running statistics), and an in-place write would invalidate them."""
        held = [entry for entries in self._trained_buffers.values() for entry in entries]
        live = [m._buffers[n] for m, n, _ in held]
        for m, n, saved in held:
            m._buffers[n] = saved
        try:
            yield
        finally:
            for (m, n, _), tensor in zip(held, live):
                m._buffers[n] = tensor

    def cancel_lookahead(self) -> None:
        """Drop the next batch's forwards that already ran: Lightning will not train that batch (an epoch was cut
        short, or training stopped). Each stage takes the activations still in transit from its predecessor
        and drops them, so nothing crosses into the next step."""
        if not self._carried_in:
            return
        k = self.batch_index
        self._carried_in = False
        with torch.no_grad():  # the dropped forwards' changes to buffers are undone too
            for entries in self._trained_buffers.values():
                for m, n, saved in entries:
                    m._buffers[n].copy_(saved)
        self._trained_buffers = {}
        for key in [key for key in self._inflight if key[1] == k]:
            del self._inflight[key]
        for stage in self.stages:
            stage.versions.forget_batch(k)
        link = self.link
        if link is None:
            return
        link.begin_step()
        stage = self.stages[0]
        if not stage.is_first:
            sent = lookahead_forwards(self.schedule, stage.index - 1, self.num_stages, self.num_microbatches)
            received = lookahead_forwards(self.schedule, stage.index, self.num_stages, self.num_microbatches)
            for nth in range(received, sent):
                link.recv_activations(with_check=self.check_batches and nth == 0)
        link.flush_sends()

    # ---- evaluation and prediction (newest weights, forward only, batches of any size) -------------------------
    @torch.no_grad()
    def _forward_all(self, batch: Any, tag: int, on_last: Callable[[Any, Any], None]) -> None:
        """Every microbatch of ``batch`` forward through this process's stages; ``on_last(output, microbatch)``."""
        with self.buffers_as_trained():
            self._forward_microbatches(batch, tag, on_last)

    def _forward_microbatches(self, batch: Any, tag: int, on_last: Callable[[Any, Any], None]) -> None:
        link = self.link
        call, self._evaluations = self._evaluations, self._evaluations + 1
        for j, mb in enumerate(split_ragged(batch, self.num_microbatches)):
            x = None  # the first stage's input is computed in the forward's seeded stream, below
            if not self.stages[0].is_first:
                assert link is not None
                x = link.recv_value(link.prev_rank, tag)
            for stage in self.stages:
                with self.randomness.forward(stage.index, call, j, phase=EVAL):
                    x = stage.forward_newest(self.input_fn(mb) if stage.is_first else x)
                    if stage.is_last:
                        on_last(x, mb)
                if not stage.is_last:
                    flatten(x, f"stage {stage.index}'s output")  # the same rules as across processes
            if not self.stages[-1].is_last:
                assert link is not None
                link.send_value(x, link.next_rank, tag)

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> Tensor:
        """The batch's mean loss (microbatch losses weighted by their sizes, so a ragged batch is exact)."""
        link = self.link
        weighted: list[Tensor] = []
        rows: list[int] = []

        def accumulate(output: Any, mb: Any) -> None:
            rows.append(batch_size_of(mb))
            weighted.append(scalar_loss(self.loss_fn(output, mb)).to(torch.float64) * rows[-1])

        self._forward_all(batch, TAG_EVAL, accumulate)
        if self.stages[-1].is_last:
            total = torch.stack(weighted).sum() / sum(rows)
            if link is not None:
                for rank in self.pipeline_ranks[:-1]:
                    link.send_scalar(total, rank, TAG_EVAL_LOSS)
        else:
            assert link is not None
            total = link.recv_scalar(self.pipeline_ranks[-1], TAG_EVAL_LOSS)
        if link is not None:
            link.flush_sends()
        return total.to(torch.float32)

    @torch.no_grad()
    def predict(self, batch: Any) -> Any:
        """The last layer's output for ``batch`` on the pipeline's first stage (``None`` on the others)."""
        outputs: list[Any] = []
        self._forward_all(batch, TAG_PREDICT, lambda output, mb: outputs.append(output))
        link = self.link
        result = None
        if self.stages[-1].is_last:
            result = concatenate(outputs)
            if link is not None and not self.stages[0].is_first:
                link.send_value(result, self.pipeline_ranks[0], TAG_PREDICT_RESULT)
                result = None
        elif self.stages[0].is_first:
            assert link is not None
            result = link.recv_value(self.pipeline_ranks[-1], TAG_PREDICT_RESULT, "the prediction")
        if link is not None:
            link.flush_sends()
        return result


def concatenate(outputs: list[Any]) -> Any:
    """Microbatch outputs joined along dim 0, leaf by leaf (any nesting)."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [flatten(o, "the last layer's output") for o in outputs]
    spec = flat[0][1]
    leaves = [torch.cat([f[0][i] for f in flat]) if flat[0][0][i].dim() > 0 else flat[0][0][i]
              for i in range(len(flat[0][0]))]
    return unflatten(leaves, spec)
