"""The one runtime that executes schedules: the action lists of however many stages this process holds.

Across processes a process holds one stage and its neighbours are reached through a :class:`StageLink`; on one
device it holds every stage and the boundaries are in-process hand-overs that follow the same rules (what may
cross, which tensors carry gradients back). In both cases each stage runs its own action list in order; a
stage whose next action waits for a neighbour in this process yields to the others (see docs/design/runtime.md,
"The runtime"). There is no second code path per schedule: a new schedule is a new action list.

``train_batch(batch, next_batch)`` returns the batch's mean loss on every rank and leaves the batch gradient of
``params`` in ``gradients`` (with data-parallel replicas, their mean once ``finish_reduction()`` has waited for the
reduction that the batch's last backward started); ``prepare_update()`` moves the parameters
onto the slot that will hold ``W_{k+1}`` before the optimizer writes them (weight stashing).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.parallel.data_parallel import GradientReducer
from lightning_async_pp.parallel.tensor_parallel import loss_context, whole_value
from lightning_async_pp.pipeline.backward import PendingWeightGradient, backward_input, backward_weight
from lightning_async_pp.pipeline.comm import StageLink
from lightning_async_pp.pipeline.messages import Message, evaluation_programs, step_programs
from lightning_async_pp.pipeline.microbatch import (batch_size_of, concatenate, fingerprint, loss_shares, scalar_loss,
                                                    shape_signature, split_microbatches, split_ragged, weight_shares)
from lightning_async_pp.pipeline.randomness import EVAL, ForwardRandomness
from lightning_async_pp.pipeline.schedule import Action, step_actions
from lightning_async_pp.pipeline.stage import Stage
from lightning_async_pp.pipeline.structure import as_received, flatten, input_gradient, unflatten
from lightning_async_pp.trace import Span, StepTimes

InputFn = Callable[[Any], Any]
LossFn = Callable[[Any, Any], Tensor]
WeightFn = Callable[[Any], Any]  # a microbatch -> its weight in the batch's mean loss (a number or a scalar tensor)


class BatchMismatch(RuntimeError):
    """Two stages of one pipeline were given different batches."""



class PipelineRuntime:
    """Runs the action lists of ``stages`` (this process's) for one training step, an evaluation or a prediction.

    ``link`` connects the first/last local stage to stages in other processes (``None`` when every stage is here).
    """

    # Batch fingerprints are compared on the host. On CUDA that is a device synchronization, so there they are
    # compared every this many steps (a mismatch is still found, a few steps later); on CPU at every step.
    CHECK_EVERY_ON_CUDA = 16
    DEFER_CHECKS_ON_CPU = False  # tests turn this on to count host reads as on CUDA

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        schedule: str,
        num_microbatches: int,
        input_fn: InputFn,
        loss_fn: LossFn,
        weight_fn: Optional[WeightFn] = None,
        link: Optional[StageLink] = None,
        pipeline_ranks: Sequence[int] = (0,),
        dp_group: Any = None,
        dp_size: int = 1,
        check_batches: bool = True,
        loss_group: Any = None,
        metric_names: Sequence[str] = (),
        metrics_fn: Optional[Callable[[], dict[str, Tensor]]] = None,
        randomness: Optional[ForwardRandomness] = None,
        last_ahead: bool = True,
        tensor_parallel: bool = False,
        expert_gradients: Any = None,
    ) -> None:
        self.stages = list(stages)
        # The last stage's loss and its backward run under loss_parallel() (logits split over the vocabulary)
        self.tensor_parallel = tensor_parallel
        self.num_stages = self.stages[0].num_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.input_fn, self.loss_fn = input_fn, loss_fn
        # A microbatch's weight in its batch's mean loss (the module's pipeline_loss_weight; default its rows): the
        # last stage, which holds the whole batch, weighs each microbatch loss by it (docs/design/update-rule.md).
        self.weight_fn: WeightFn = weight_fn if weight_fn is not None else batch_size_of
        self._shares: dict[int, Optional[Tensor]] = {}  # batch -> its microbatches' shares of the loss (last stage)
        # Scalars the loss computation of a batch produced besides the loss (the module's pipeline_metrics(), read on
        # the last stage after the batch's last loss): they travel with the loss, so every rank can log them.
        self.metric_names, self.metrics_fn = tuple(metric_names), metrics_fn
        self.last_metrics: dict[str, Tensor] = {}
        self.link = link
        self.pipeline_ranks = list(pipeline_ranks)
        self.dp_group, self.dp_size = dp_group, dp_size
        self.loss_group = loss_group if loss_group is not None else dp_group
        # Data parallel: one stage per process; its gradient accumulates in the reducer's buckets.
        # Expert parallelism: the experts' gradients have their own rule (parallel/expert.py), not the buckets'.
        self.experts, skip = expert_gradients, expert_gradients.indices if expert_gradients is not None else ()
        self.reducer = GradientReducer(self.params, dp_group, dp_size, skip=skip) if dp_size > 1 else None
        # Under the lookahead the last stage also runs the next batch's first forward and backward before its
        # update (schedule.step_actions, ``last_ahead``), so a weight tied to the first stage does not keep it
        # idle. Not with data parallelism: the reducer's buckets hold one batch's gradient at a time.
        # Switched off by PipelineConfig.last_stage_run_ahead, or by the balanced split where memory is short.
        self.last_ahead = self.reducer is None and last_ahead
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
        # What this process sends, from the computation that produced it to its place in the program.
        self._outbox: dict[tuple[str, int, int], Any] = {}
        self._loss_vectors: dict[int, Tensor] = {}  # batch -> [loss, metrics...] (last stage)
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

    def record_tied_sum(self, start: float, end: float) -> None:
        """The engine summed the gradients of weights tied across processes from ``start`` to ``end`` (after the
        step's pipeline work, before its update): part of the step, as the data-parallel wait is, since it holds
        the update back (PipelineMonitor's ``tied_sum_s``; on CUDA the host does not wait for NCCL, so there it is
        mostly the launch)."""
        self.last_times.tied_sum = end - start
        self.last_times.total += end - start
        if self.trace is not None:
            self.trace.append(Span(self.stages[0].index, "tied_sum", start, end, {}))

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
        for stage in self.stages:  # requires_grad as Lightning's hooks for this batch left it
            stage.settle_batch(k)
        lists = {s.index: step_actions(self.schedule, s.index, self.num_stages, m, carried_in=self._carried_in,
                                       lookahead=lookahead, last_ahead=self.last_ahead) for s in self.stages}
        first, last = self.stages[0], self.stages[-1]
        if self.reducer is not None:
            # The actions that add to this batch's weight gradients: whole backwards, and a split one's weight pass.
            self._backwards_left = sum(a.op in ("B", "W") and a.batch == 0 for a in lists[first.index])
            self.reducer.attach(first.versions.leaves_for_batch(k))
        acts: dict[tuple[int, int, int], tuple[list[Tensor], Any]] = {}  # in-process hand-overs, by receiver
        grads: dict[tuple[int, int, int], list[Optional[Tensor]]] = {}
        compute = 0.0
        wait_before = link.wait_seconds if link is not None else 0.0
        step_start = time.perf_counter()
        if link is None:
            # Every stage is here: each runs its list in order, yielding to the others while it waits for them.
            queues = {index: deque(actions) for index, actions in lists.items()}
            while any(queues.values()):
                progressed = False
                for stage in self.stages:
                    queue = queues[stage.index]
                    while queue and self._ready(stage, queue[0], k, acts, grads):
                        compute += self._run(stage, queue.popleft(), k, microbatches, checks, acts, grads)
                        progressed = True
                if not progressed:
                    waiting = {s: str(q[0]) for s, q in queues.items() if q}
                    raise RuntimeError(f"the schedule cannot make progress: stages wait on each other at {waiting}")
        else:
            # One stage here: its program (pipeline/messages.py) puts every send and receive at its place in the
            # order all stages agree on; operations are issued in one batch before each computation.
            program = step_programs(self.schedule, self.num_stages, m, carried_in=self._carried_in,
                                    lookahead=lookahead, checks=self.check_batches,
                                    last_ahead=self.last_ahead)[first.index]
            for entry in program:
                if entry.op == "compute":
                    link.flush()
                    assert entry.action is not None
                    compute += self._run(first, entry.action, k, microbatches, checks, acts, grads)
                elif entry.op == "recv":
                    self._post(entry.message, k)
                else:
                    self._send(entry.message, k)
            link.flush()
        self._carried_in = lookahead
        self._compare_checks()

        if last.is_last:
            self._shares.pop(k, None)
            loss = self._loss_vectors.pop(k) if k in self._loss_vectors else self._loss_vector(k)
        else:
            assert link is not None
            loss = link.take_scalar(("loss", k, 0), "the batch loss")
        if link is not None:
            link.complete_sends()  # every receive of this step's sends was posted in this step
        self.gradients = self._take_gradients(k)
        if self.reducer is not None:
            self.reducer.launch_rest()
            if self.experts is not None:
                self.experts.launch(self.gradients)
            dist.all_reduce(loss, group=self.loss_group)  # its own group: not queued behind the gradient buckets
            loss /= self.dp_size
            if not self.reducer.OVERLAP:
                self.finish_reduction()
        self.last_metrics = {name: value.to(torch.float32) for name, value in zip(self.metric_names, loss[1:])}
        loss = loss[0]
        self.last_times = StepTimes(
            total=time.perf_counter() - step_start, compute=compute,
            comm_wait=(link.wait_seconds - wait_before) if link is not None else 0.0,
        )
        if self.reducer is not None and not self.reducer.OVERLAP:
            self.last_times.dp_comm = self.last_times.dp_comm_exposed = self.reducer.exposed_s
        return loss.to(torch.float32)

    def _take_gradients(self, k: int) -> list[Optional[Tensor]]:
        """Batch ``k``'s gradient of ``params``. A parameter that later stages here borrow (a tied one) gets its
        owner's sum over the microbatches plus each borrowing stage's own sum, in stage order: the sum the
        processes form when each stage holds a copy (PipelineEngine's tied sum), so one device gives their
        bits. One leaf for all uses would add them microbatch by microbatch, in another order."""
        gradients = [g for stage in self.stages for g in stage.take_gradients(k)]
        first, offset = {}, 0
        for stage in self.stages:
            first[stage.index], offset = offset, offset + len(stage.params)
        for stage in self.stages:  # in stage order
            for owner, i, g in stage.take_borrowed_gradients(k):
                j = first[owner.index] + i
                if g is not None:
                    gradients[j] = g if gradients[j] is None else gradients[j].add_(g)  # the owner's, taken
        return gradients

    def _loss_vector(self, b: int) -> Tensor:
        """Batch ``b``'s loss and the module's declared metrics, one float64 vector (last stage, once the batch's
        last loss is computed)."""
        total = self._losses.pop(b)
        if not self.metric_names:
            return total.reshape(1)
        return torch.cat([total.reshape(1), self._batch_metrics(total.device)])

    # ---- the program's sends and receives (one stage in this process) ----------------------------------------
    def _post(self, message: Optional[Message], k: int) -> None:
        link = self.link
        assert message is not None and link is not None
        key = (message.kind, k + message.batch, message.microbatch)
        if message.kind == "act":
            link.post_activations(key)
        elif message.kind == "check":
            link.post_check(key)
        elif message.kind == "grad":
            link.post_gradients(key)
        elif message.kind == "loss":
            link.post_scalar(key, self.pipeline_ranks[message.src], size=1 + len(self.metric_names))
        else:
            raise AssertionError(f"a training step has no {message.kind} message")

    def _send(self, message: Optional[Message], k: int) -> None:
        link = self.link
        assert message is not None and link is not None
        if message.kind == "loss":  # one vector to every other stage
            link.send_scalar(self._loss_vectors[k + message.batch], self.pipeline_ranks[message.dst])
            return
        payload = self._outbox.pop((message.kind, k + message.batch, message.microbatch))
        if message.kind == "act":
            link.send_activations(payload)
        elif message.kind == "check":
            link.send_check(payload)
        elif message.kind == "grad":
            link.send_gradients(payload)
        else:
            raise AssertionError(f"a training step has no {message.kind} message")

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
        return self.reducer is not None and (self.reducer.pending or self.experts is not None and self.experts.pending)

    def finish_reduction(self) -> None:
        """Wait for the data-parallel reduction of the last step's gradient (launched during its last backward)."""
        if not self.reduction_pending:
            return
        assert self.reducer is not None
        self.gradients = self.reducer.finish(self.gradients)
        if self.experts is not None:
            self.gradients = self.experts.finish(self.gradients)
        self.last_times.dp_comm, self.last_times.dp_comm_exposed = self.reducer.total_s, self.reducer.exposed_s
        self.last_times.total += self.reducer.exposed_s

    def _ready(self, stage: Stage, action: Action, k: int, acts: dict, grads: dict) -> bool:
        key = (stage.index, k + action.batch, action.microbatch)
        if action.op == "F":
            return stage.is_first or stage is self.stages[0] and self.link is not None or key in acts
        if action.op == "W":  # after its I on this stage (schedule.validate_actions)
            return True
        return stage.is_last or stage is self.stages[-1] and self.link is not None or key in grads

    def _run(self, stage: Stage, action: Action, k: int, microbatches: dict, checks: dict,
             acts: dict, grads: dict) -> float:
        b, j = k + action.batch, action.microbatch
        mb = microbatches[action.batch][j]
        remote_in = self.link is not None and stage is self.stages[0] and not stage.is_first
        remote_out = self.link is not None and stage is self.stages[-1] and not stage.is_last
        if action.op == "F":
            inputs: list[Tensor] = []
            x = None  # the first stage's input is computed in the forward's seeded stream, below
            if remote_in:
                check_key = ("check", b, j) if self.check_batches and j == 0 else None
                inputs, check = self.link.take_activations(("act", b, j), check_key)
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
                    with loss_context(self.tensor_parallel):
                        out = scalar_loss(self.loss_fn(out, mb))  # first: it refuses a batch it does not take
                    if b not in self._shares:  # the last stage holds the whole batch: every microbatch's weight
                        self._shares[b] = loss_shares([self.weight_fn(piece) for piece in microbatches[action.batch]])
                    shares = self._shares[b]
                    out = out / self.num_microbatches if shares is None else out * shares[j].to(out.dtype)
            if stage.is_last:
                self._losses[b] = self._losses.get(b, 0.0) + out.detach().to(torch.float64)
                out_leaves: Any = out
                if self.link is not None and action.batch == 0 and j == self.num_microbatches - 1:
                    self._loss_vectors[b] = self._loss_vector(b)  # sent to the other stages next
            else:
                out_leaves, spec = flatten(out, f"stage {stage.index}'s output")
            elapsed = self._span(stage.index, "forward", start, batch=b, microbatch=j)
            if not stage.is_last:
                if remote_out:
                    self._outbox[("act", b, j)] = out
                    if self.check_batches and j == 0:
                        self._outbox[("check", b, 0)] = checks[action.batch]
                else:
                    acts[(stage.index + 1, b, j)] = (as_received(out_leaves), spec)
            self._inflight[(stage.index, b, j)] = (inputs, out_leaves)
            return elapsed
        if action.op == "W":
            pending, inputs, out_leaves, received = self._weight_due.pop((stage.index, b, j))
            self._count_gradient_action(action)
            start = time.perf_counter()
            backward_weight(pending)  # from the nodes the input pass reached: no loss backward left
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
                received = self.link.take_gradients(("grad", b, j))
            else:
                received = grads.pop((stage.index, b, j))
            pairs = [(o, g) for o, g in zip(out_leaves, received) if g is not None and o.requires_grad]
            outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        start = time.perf_counter()
        if action.op == "B":
            if stage.is_last:
                with loss_context(self.tensor_parallel):
                    out_leaves.backward()
            elif outputs:
                torch.autograd.backward(outputs, seeds)
            elapsed = self._span(stage.index, "backward", start, batch=b, microbatch=j)
        else:  # I: the input gradient now, the weight gradient at this microbatch's W
            # The last stage's input pass runs the loss's backward: under loss_parallel(), as B's does (outside it
            # DTensor refuses the backward of the cross-entropy on vocabulary-split logits).
            with loss_context(self.tensor_parallel and stage.is_last):
                pending = backward_input(outputs, seeds, inputs, stage.grad_leaves(b))
            elapsed = self._span(stage.index, "backward", start, batch=b, microbatch=j, part="input")
        if not stage.is_first:
            if remote_in:
                # Taken now: releasing the microbatch below clears the inputs' .grad before the send is issued.
                self._outbox[("grad", b, j)] = [input_gradient(t) for t in inputs if t.requires_grad]
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

    def _compare_checks(self, now: bool = False) -> None:
        """Compare the fingerprints received with this process's own (once the step's work is queued). On CUDA
        reading the comparison waits for the device, so it is read every ``CHECK_EVERY_ON_CUDA`` steps."""
        due = [(r, own, stage, b) for r, own, stage, b in self._checks_due if own is not None]
        if not due:
            self._checks_due = []
            return
        deferred = self.link is not None and (self.link.on_cuda or self.DEFER_CHECKS_ON_CPU)
        if deferred and not now and self.batch_index % self.CHECK_EVERY_ON_CUDA:
            return
        self._checks_due = []
        received = torch.stack([r.reshape(()).to(own.device) for r, own, _, _ in due])
        own = torch.stack([o.reshape(()) for _, o, _, _ in due])
        same = torch.isclose(received, own, rtol=1e-9, atol=0.0)
        if bool(same.all()):
            return
        n = int((~same).nonzero()[0, 0])
        _, _, stage, b = due[n]
        raise BatchMismatch(
            f"stage {stage.index} was given another batch than stage {stage.index - 1} for training batch {b} "
            f"(fingerprints {own[n].item():.6g} and {received[n].item():.6g}). Every stage of a pipeline must see "
            f"the same batches: use the same loader, sampler and seed on every process (with one pipeline the "
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
        """Drop the next batch's forwards that already ran (and the last stage's backward of its first microbatch):
        Lightning will not train that batch (an epoch was cut short, or training stopped). Each stage drops the
        activations and gradients it received for them (in the step that sent them: nothing crosses into the
        next step)."""
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
        self._shares.pop(k, None)
        if self._losses.pop(k, None) is not None and self.metric_names and self.metrics_fn is not None:
            # The last stage's share of it (``last_ahead``): what the module recorded for that microbatch's loss
            # (an MoE router's statistics, say) is taken and dropped, or it would count in the next batch.
            self.metrics_fn()
        for stage in self.stages:
            stage.forget_batch(k)
        link = self.link
        if link is None:
            return
        # The lookahead's activations were received in the step that sent them: drop them.
        link.drop_posted()

    # ---- evaluation and prediction (newest weights, forward only, batches of any size) -------------------------
    @torch.no_grad()
    def _forward_all(self, batch: Any, kind: str, on_last: Callable[[Any, Any], None]) -> int:
        """Every microbatch of ``batch`` forward through this process's stages; ``on_last(output, microbatch)``.
        Returns the call's number (evaluations are counted: each keys its random streams and its messages)."""
        with self.buffers_as_trained():
            return self._forward_microbatches(batch, kind, on_last)

    def _forward_microbatches(self, batch: Any, kind: str, on_last: Callable[[Any, Any], None]) -> int:
        link = self.link
        call, self._evaluations = self._evaluations, self._evaluations + 1
        microbatches = split_ragged(batch, self.num_microbatches)
        if link is None:
            for j, mb in enumerate(microbatches):
                x = None
                for stage in self.stages:
                    x = self._forward_newest(stage, call, j, mb, x, on_last)
            return call
        # One stage here: its part of the evaluation's plan (pipeline/messages.py); the result messages that end
        # it are the caller's. Each microbatch's shape keys its layout, agreed once per shape.
        stage = self.stages[0]
        keys = [(kind, shape_signature(mb)) for mb in microbatches]
        what = f"an {kind} activation"
        outputs: dict[int, Any] = {}
        for entry in evaluation_programs(self.num_stages, len(microbatches), "result_to_all")[stage.index]:
            m = entry.message
            if entry.op == "compute":
                assert entry.action is not None
                j = entry.action.microbatch
                x = None if stage.is_first else link.take_value(("value", call, j), what)
                outputs[j] = self._forward_newest(stage, call, j, microbatches[j], x, on_last)
            elif m is not None and m.kind == "value" and entry.op == "recv":
                assert link.prev_rank is not None
                link.post_value(("value", call, m.microbatch), link.prev_rank, keys[m.microbatch], what)
            elif m is not None and m.kind == "value":
                assert link.next_rank is not None
                link.send_value(outputs.pop(m.microbatch), link.next_rank, keys[m.microbatch])
        return call

    def _forward_newest(self, stage: Stage, call: int, j: int, mb: Any, x: Any, on_last: Callable[[Any, Any], None]) -> Any:
        """Microbatch ``j`` of evaluation ``call`` through ``stage`` with the newest weights, in its seeded stream
        (the first stage's input is computed inside it)."""
        with self.randomness.forward(stage.index, call, j, phase=EVAL):
            x = stage.forward_newest(self.input_fn(mb) if stage.is_first else x)
            if stage.is_last:
                on_last(x, mb)
        if not stage.is_last:
            flatten(x, f"stage {stage.index}'s output")  # the same rules as across processes
        return x

    @torch.no_grad()
    def eval_loss(self, batch: Any) -> Tensor:
        """The batch's mean loss: microbatch losses weighted by their weights (default their rows, so a ragged batch
        is exact; kept targets for a packed model that skips some, as the batch in one piece)."""
        link = self.link
        losses: list[Tensor] = []
        weights: list[Any] = []

        def accumulate(output: Any, mb: Any) -> None:
            with loss_context(self.tensor_parallel):
                losses.append(scalar_loss(self.loss_fn(output, mb)).to(torch.float64))  # first: it refuses bad batches
            weights.append(self.weight_fn(mb))

        call = self._forward_all(batch, "evaluation", accumulate)
        if self.stages[-1].is_last:
            shares = weight_shares(weights)
            total = (torch.stack(losses) * shares.to(losses[0].device)).sum()
            if link is not None:
                for rank in self.pipeline_ranks[:-1]:
                    link.send_scalar(total, rank)
        else:
            assert link is not None
            link.post_scalar(("result", call, 0), self.pipeline_ranks[-1])
            total = link.take_scalar(("result", call, 0), "the evaluation loss")[0]
        if link is not None:
            link.complete_sends()
        return total.to(torch.float32)

    @torch.no_grad()
    def predict(self, batch: Any) -> Any:
        """The last layer's output for ``batch`` on the pipeline's first stage (``None`` on the others)."""
        outputs: list[Any] = []

        def keep(output: Any, mb: Any) -> None:
            # A tensor-parallel head's logits may stay split over the vocabulary (DTensors, ``use_local_output=False``):
            # the prediction is the whole logits, gathered on every tensor-parallel rank of the last stage alike.
            if self.tensor_parallel:
                leaves, spec = flatten(output, "the last layer's output")
                output = unflatten([whole_value(t) for t in leaves], spec)
            outputs.append(output)

        call = self._forward_all(batch, "prediction", keep)
        link = self.link
        result = None
        shape_key = ("result", shape_signature(batch))
        if self.stages[-1].is_last:
            result = concatenate(outputs)
            if link is not None and not self.stages[0].is_first:
                link.send_value(result, self.pipeline_ranks[0], shape_key)
                result = None
        elif self.stages[0].is_first:
            assert link is not None
            link.post_value(("result", call, 0), self.pipeline_ranks[-1], shape_key, "the prediction")
            result = link.take_value(("result", call, 0), "the prediction")
        if link is not None:
            link.complete_sends()
        return result

