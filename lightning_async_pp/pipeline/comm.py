"""Point-to-point transfers between neighbouring stages over ``torch.distributed`` (gloo or NCCL).

Activations go forward and gradients backward as non-blocking sends and receives. What crosses a boundary is
any nesting of tuples, lists and dicts of tensors (:mod:`.structure`); its layout (nesting, shapes, dtypes)
travels once, in a header before the first microbatch, and is reused after that (training), or travels with
every transfer (evaluation and prediction, whose batch shapes may differ). Every wait is bounded by the process group's timeout and, when it breaks, reads a
shared failure board, so a stage that raised or died stops its neighbours (naming it) instead of hanging them.
"""
from __future__ import annotations

import os
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.pipeline.structure import Layout, flatten, input_gradient, unflatten

_MAX_LEAVES = 1000
# Tags keep independent message streams apart; gloo matches by (source, tag) in posting order. A stream's leaves
# use consecutive tags from its base.
_STREAMS = ("header", "act", "grad", "loss", "eval", "predict", "check")
TAG_HEADER, TAG_ACT, TAG_GRAD, TAG_LOSS, TAG_EVAL, TAG_PREDICT, TAG_CHECK = (i * 1024 for i in range(len(_STREAMS)))


class PipelineFailure(RuntimeError):
    """Another stage failed or stopped answering; the message names it."""


class FailureBoard:
    """A key in the process group's store where the first failing stage writes what went wrong."""

    KEY = "lightning_async_pp/failure"

    def __init__(self, store: Optional[dist.Store]) -> None:
        self.store = store

    def report(self, message: str) -> None:
        if self.store is None:
            return
        try:
            if not self.store.check([self.KEY]):
                self.store.set(self.KEY, message)
        except Exception:  # the store may be gone already (its host died); nothing more to tell
            pass

    def check(self) -> None:
        if self.store is None:
            return
        try:
            failed = self.store.check([self.KEY])
        except Exception:
            return
        if failed:
            raise PipelineFailure(self.store.get(self.KEY).decode())

    @classmethod
    def from_default_group(cls) -> "FailureBoard":
        try:
            return cls(dist.distributed_c10d._get_default_store())
        except Exception:
            return cls(None)


def elastic_attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, a client of the agent's store whose keys belong to this restart attempt only; else ``None``.

    torchrun's agent keeps one store, on one port, across restarts (``TORCHELASTIC_USE_AGENT_STORE``), and the
    ``env://`` rendezvous does not prefix its keys per attempt: a restarted rank could read the gloo address a
    killed rank of the previous attempt published and fail to connect ("Connection refused"), depending on which
    rank gets there first. See docs/design.md, "Faults"."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lightning_async_pp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


class StepAgreement:
    """One decision every process acts on at the same training step, without a collective per step.

    The first process that wants it (:meth:`request`, at a step boundary) writes into the process group's store the
    step ``now + margin``; every process reads the store at each step boundary (:meth:`due`) and acts when it
    reaches that step. Processes of a job are never more than a few steps apart (a stage at boundary ``b`` has
    taken batch ``b-1``'s gradient, which needs every later stage past ``b-1`` and every earlier one past ``b-2``
    under 2BW's one-batch lookahead; data-parallel replicas meet in each step's all-reduce), so ``margin`` steps
    ahead no process has passed yet. Without a store (one process) the decision is due at once.
    See docs/design.md, "Faults"."""

    KEY = "lightning_async_pp/agreed_step"

    def __init__(self, store: Optional[dist.Store], margin: int) -> None:
        self.store, self.margin = store, margin
        self.wanted = False  # set by a signal handler: only a flag, the store is written at the next boundary
        self._requested = False
        self._step: Optional[int] = None

    def request(self) -> None:
        self.wanted = True

    def due(self, step: int) -> bool:
        """Called at every step boundary (``step`` updates done) on every process: whether to act now."""
        if self.wanted and not self._requested:
            self._requested = True
            if self.store is None:
                self._step = step
            elif self.store.add(self.KEY + "/requests", 1) == 1:  # the first request sets the step
                self.store.set(self.KEY, str(step + self.margin))
        if self._step is None and self.store is not None and self.store.check([self.KEY]):
            self._step = int(self.store.get(self.KEY).decode())
        if self._step is None:
            return False
        if step > self._step:
            raise RuntimeError(f"the agreed step {self._step} was passed before it was read (now at step {step})")
        return step == self._step

    def clear(self, coordinator: bool) -> None:
        """After acting, on every process; the coordinator deletes the keys (every process has read them by then)."""
        self._step, self.wanted, self._requested = None, False, False
        if coordinator and self.store is not None:
            for key in (self.KEY, self.KEY + "/requests"):
                try:
                    self.store.delete_key(key)
                except Exception:  # a store without delete_key: the next job starts with a new store anyway
                    pass


class StageLink:
    """The links of one stage to its previous and next stage (global ranks).

    On CUDA (NCCL) two things differ, both behind ``device.type == "cuda"`` (docs/design.md, "The runtime"):

    - **Waits do not block the host.** NCCL runs each transfer on its own CUDA stream; ``work.wait()`` without a
      timeout only makes the compute stream wait for it, so the host keeps queueing kernels and transfers overlap
      compute. (A wait *with* a timeout blocks the host thread until the transfer is done.) NCCL's watchdog
      bounds a hang by the process group's timeout, which is ``pipeline_timeout``.
    - **Receive buffers are reused** (``reuse_buffers``): a training activation's buffers go back to a pool once
      its microbatch's backward has sent the input gradients, a gradient's once the backward that took it ran,
      so steady-state training allocates none. Buffers still shared with something in flight (a stage that
      passes its input through as its output, a gradient autograd kept as an input's ``.grad``) are not reused.
      On CUDA "the backward ran" means its kernels are queued; NCCL starts each transfer after the work already
      queued on the compute stream, so a new receive writes a pooled buffer only after its last reader ran.
    """

    REUSE_BUFFERS_ON_CPU = False  # tests turn this on to check the pools with gloo on CPU

    def __init__(
        self,
        *,
        stage: int,
        rank: int,
        prev_rank: Optional[int],
        next_rank: Optional[int],
        device: torch.device,
        timeout: float,
        board: FailureBoard,
        rank_to_stage: dict[int, int],
    ) -> None:
        self.stage, self.rank = stage, rank
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.device = device
        self.timeout = timeout
        self.board = board
        self.rank_to_stage = rank_to_stage
        self.out_layout: Optional[Layout] = None  # what this stage sends forward in training
        self.in_layout: Optional[Layout] = None  # what this stage receives in training
        # Sends whose receives are posted in the same step (or evaluation call) as the send, and sends of the
        # next batch's forwards (2BW lookahead) whose receives may be posted only in the next step.
        self._pending_sends: deque = deque()
        self._carried_sends: deque = deque()
        self._posted_act: deque = deque()  # pre-posted activation receives, oldest first
        self._posted_grad: deque = deque()
        self.wait_seconds = 0.0  # time spent blocked waiting for a neighbour (communication wait)
        self.on_cuda = device.type == "cuda"
        self.reuse_buffers = self.on_cuda or self.REUSE_BUFFERS_ON_CPU
        self._act_pool: list[list[Tensor]] = []  # free receive buffers, one list of leaves per activation
        self._grad_pool: list[list[Optional[Tensor]]] = []
        self.buffers_reused = 0  # receives posted into a pooled buffer
        # Called with (name, start, end, args) for every wait, when a trace is being recorded.
        self.recorder: Optional[Callable[[str, float, float, dict], None]] = None

    # ---- waiting ------------------------------------------------------------------------------------------
    def _describe(self, rank: Optional[int]) -> str:
        return f"stage {self.rank_to_stage.get(rank, '?')} (rank {rank})"

    def wait(self, work: Any, peer: Optional[int], what: str) -> None:
        """Block until ``work`` completes (gloo marks completion only inside ``wait``, so there is no polling).

        ``timeout`` bounds the wait. When a peer fails its process exits, the connection closes and the wait
        raises at once; the failure board then tells which stage failed first and why.
        """
        start = time.perf_counter()
        try:
            if self.on_cuda:
                work.wait()  # a stream wait: the host goes on queueing (see the class docstring)
            else:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as err:
            waited = time.perf_counter() - start
            time.sleep(0.2)  # give the failing stage a moment to post its report
            self.board.check()
            if waited >= 0.9 * self.timeout:
                raise PipelineFailure(
                    f"stage {self.stage} (rank {self.rank}) waited {waited:.0f}s for {what} from "
                    f"{self._describe(peer)}, which did not answer: it failed, died or hangs"
                ) from err
            raise PipelineFailure(
                f"stage {self.stage} (rank {self.rank}) lost {self._describe(peer)} while waiting for {what}: {err}"
            ) from err
        finally:
            end = time.perf_counter()
            self.wait_seconds += end - start
            if self.recorder is not None:
                self.recorder("send" if what.startswith("a send") else "recv", start, end, {"what": what, "peer": peer})

    def _isend(self, tensor: Tensor, dst: int, tag: int, carried: bool = False) -> None:
        # A gloo send completes only once the receiver has posted its receive. Waiting on a send is therefore
        # safe only where that receive is sure to come without this stage doing anything more: in the same
        # step for ordinary sends, in the next step for the lookahead's (which stay in ``_carried_sends``).
        tensor = tensor.contiguous()
        queue = self._carried_sends if carried else self._pending_sends
        queue.append((dist.isend(tensor, dst=dst, tag=tag), tensor, dst))
        while len(self._pending_sends) > 64:  # the receiver takes them in order: the oldest completes first
            self._complete_oldest(self._pending_sends)

    def _complete_oldest(self, queue: deque) -> None:
        work, _, dst = queue.popleft()
        self.wait(work, dst, "a send to be taken")

    def begin_step(self) -> None:
        """The lookahead's sends of the previous step are received during this one: wait for them with it."""
        self._carried_sends.extend(self._pending_sends)
        self._pending_sends, self._carried_sends = self._carried_sends, deque()

    def flush_sends(self) -> None:
        """Complete the sends whose receives are posted in this step or evaluation call."""
        while self._pending_sends:
            self._complete_oldest(self._pending_sends)

    def _irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
               buf: Optional[Tensor] = None) -> tuple[Any, Tensor]:
        if buf is None:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, src=src, tag=tag), buf

    # ---- layouts (what a value looks like) travel as a length, then JSON bytes -----------------------------------
    def _send_layout(self, layout: Layout, dst: int, tag: int, carried: bool = False) -> None:
        if len(layout.metas) > _MAX_LEAVES:
            raise ValueError(f"{len(layout.metas)} tensors cross one stage boundary; at most {_MAX_LEAVES} can")
        data = layout.encode().to(self.device)
        self._isend(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), dst, tag, carried)
        self._isend(data, dst, tag + 1, carried)

    def _recv_layout(self, src: int, tag: int, what: str) -> Layout:
        work, length = self._irecv((1,), torch.int64, src, tag)
        self.wait(work, src, what)
        work, data = self._irecv((int(length.item()),), torch.uint8, src, tag + 1)
        self.wait(work, src, what)
        return Layout.decode(data)

    def _send_leaves(self, leaves: list[Tensor], dst: int, tag: int, carried: bool = False) -> None:
        for i, t in enumerate(leaves):
            self._isend(t.detach(), dst, tag + 2 + i, carried)

    def _recv_leaves(self, layout: Layout, src: int, tag: int,
                     bufs: Optional[list[Tensor]] = None) -> list[tuple[Any, Tensor]]:
        return [self._irecv(m.shape, m.dtype, src, tag + 2 + i, bufs[i] if bufs else None)
                for i, m in enumerate(layout.metas)]

    # ---- training: activations forward ----------------------------------------------------------------------
    def send_activations(self, outputs: Any, carried: bool = False, check: Optional[Tensor] = None) -> None:
        """Send a forward's output; ``check`` (a batch fingerprint) goes along with a batch's first microbatch."""
        leaves, spec = flatten(outputs, f"stage {self.stage}'s output")
        layout = Layout.of(leaves, spec)
        if self.out_layout is None:
            self.out_layout = layout
            self._send_layout(layout, self.next_rank, TAG_HEADER)
        elif not layout.same_shapes(self.out_layout):
            raise ValueError(
                f"stage {self.stage} output shapes changed from {self.out_layout.describe()} to {layout.describe()}; "
                f"training needs equal microbatch shapes (use drop_last=True)"
            )
        if check is not None:
            self._isend(check.reshape(1).to(torch.float64), self.next_rank, TAG_CHECK, carried)
        self._send_leaves(leaves, self.next_rank, TAG_ACT, carried)

    def post_activation_recv(self, with_check: bool = False) -> None:
        """Post the receive of the next activation in advance so it overlaps compute."""
        if self.in_layout is None:
            self.in_layout = self._recv_layout(self.prev_rank, TAG_HEADER, "the activation header")
        check = self._irecv((1,), torch.float64, self.prev_rank, TAG_CHECK) if with_check else None
        bufs = self._take(self._act_pool)
        self._posted_act.append((check, self._recv_leaves(self.in_layout, self.prev_rank, TAG_ACT, bufs)))

    def recv_activations(self, with_check: bool = False) -> tuple[list[Tensor], Optional[Tensor]]:
        """The next activation's leaves (as autograd leaves where a gradient flows back) and its fingerprint."""
        if not self._posted_act:
            self.post_activation_recv(with_check)
        check, received = self._posted_act.popleft()
        if check is not None:
            self.wait(check[0], self.prev_rank, "a batch fingerprint")
        for work, _ in received:
            self.wait(work, self.prev_rank, "an activation")
        assert self.in_layout is not None
        leaves = [buf.requires_grad_(m.needs_grad) for (_, buf), m in zip(received, self.in_layout.metas)]
        return leaves, (check[1][0] if check is not None else None)

    # ---- training: gradients backward -------------------------------------------------------------------------
    def send_gradients(self, inputs: list[Tensor]) -> None:
        assert self.in_layout is not None
        for i, (t, m) in enumerate(zip(inputs, self.in_layout.metas)):
            if m.needs_grad:
                self._isend(input_gradient(t), self.prev_rank, TAG_GRAD + i)

    def post_gradient_recv(self) -> None:
        assert self.out_layout is not None, "gradients are received only after activations were sent"
        bufs = self._take(self._grad_pool) or [None] * len(self.out_layout.metas)
        self._posted_grad.append(
            [self._irecv(m.shape, m.dtype, self.next_rank, TAG_GRAD + i, buf) if m.needs_grad else None
             for i, (m, buf) in enumerate(zip(self.out_layout.metas, bufs))]
        )

    # ---- reusing receive buffers --------------------------------------------------------------------------------
    def _take(self, pool: list) -> Optional[list]:
        if not pool:
            return None
        self.buffers_reused += 1
        return pool.pop()

    def release_microbatch(self, inputs: list[Tensor], outputs: list[Tensor],
                           gradients: Optional[list[Optional[Tensor]]]) -> None:
        """A training microbatch's backward ran and its input gradients were sent: its received ``inputs``
        (activation buffers) and received output ``gradients`` may take the next transfers.

        Not a buffer whose memory may still be in use: an output that is the input itself (its send to the next
        stage has completed by now, since that stage sent back the gradient computed from it), or a gradient that
        autograd kept as an input's ``.grad`` (it copies one the caller still holds). Neither happens today;
        ruling them out costs a set per microbatch."""
        if not self.reuse_buffers:
            return
        in_use = {t.untyped_storage().data_ptr() for t in outputs}
        in_use.update(t.grad.untyped_storage().data_ptr() for t in inputs if t.grad is not None)
        if inputs and not any(t.untyped_storage().data_ptr() in in_use for t in inputs):
            for t in inputs:
                t.grad = None
                t.requires_grad_(False)
            self._act_pool.append(inputs)
        if gradients is not None and not any(g is not None and g.untyped_storage().data_ptr() in in_use
                                             for g in gradients):
            self._grad_pool.append(list(gradients))

    def recv_gradients(self) -> list[Optional[Tensor]]:
        if not self._posted_grad:
            self.post_gradient_recv()
        received = self._posted_grad.popleft()
        grads = []
        for item in received:
            if item is None:
                grads.append(None)
            else:
                self.wait(item[0], self.next_rank, "a gradient")
                grads.append(item[1])
        return grads

    # ---- small scalars, evaluation and prediction (layout sent with every value: shapes may vary) ---------------
    def send_scalar(self, value: Tensor, dst: int, tag: int) -> None:
        """A scalar, or a 1-D vector of them (the loss and the module's metrics)."""
        self._isend(value.detach().reshape(-1).to(torch.float64), dst, tag)

    def recv_scalar(self, src: int, tag: int) -> Tensor:
        work, buf = self._irecv((1,), torch.float64, src, tag)
        self.wait(work, src, "the loss")
        return buf[0]

    def post_scalar_recv(self, src: int, tag: int, size: int = 1) -> tuple[Any, Tensor]:
        return self._irecv((size,), torch.float64, src, tag)

    def send_value(self, value: Any, dst: int, tag: int = TAG_EVAL) -> None:
        leaves, spec = flatten(value, f"stage {self.stage}'s output")
        self._send_layout(Layout.of(leaves, spec, with_grad=False), dst, tag)
        self._send_leaves(leaves, dst, tag)

    def recv_value(self, src: int, tag: int = TAG_EVAL, what: str = "an evaluation activation") -> Any:
        layout = self._recv_layout(src, tag, what)
        received = self._recv_leaves(layout, src, tag)
        for work, _ in received:
            self.wait(work, src, what)
        return unflatten([buf for _, buf in received], layout.spec)
