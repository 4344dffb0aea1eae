"""Point-to-point transfers between the stages of a pipeline over ``torch.distributed`` (gloo or NCCL).

Activations go forward and gradients backward as non-blocking sends and receives, issued in the order of each
stage's program (:mod:`.messages`), so that they pair up by position as NCCL pairs them. What crosses a boundary
is any nesting of tuples, lists and dicts of tensors (:mod:`.structure`); its layout (nesting, shapes, dtypes) is
agreed once per layout. Every wait is bounded by the process group's timeout and, when it breaks, reads a shared
failure board, so a stage that raised or died stops its neighbours (naming it) instead of hanging them.

Which leaves need a gradient is not part of a layout: freezing or unfreezing a layer changes that at any step, and a
receiver could learn it per message only by reading a flag on the host (a wait for the device on CUDA). So every
floating leaf of a training activation carries a gradient back, every time: the receiver builds its graph from all
of them and answers each with its gradient (zeros where unused), and the sender backpropagates those of its outputs
that needed one. The weights are those of the one-device run, where each hand-over keeps the sender's
``requires_grad``; the price is the input gradients of leaves that needed none (a frozen stage's output, a floating
table computed without autograd) and their transfer.
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

from lightning_async_pp.pipeline.structure import Layout, flatten, unflatten

_MAX_LEAVES = 1000


class PipelineFailure(RuntimeError):
    """Another stage failed or stopped answering; the message names it. ``summary``: who failed and how, in a few
    words, where the failing process prints its error itself (the others then say only that they stopped)."""

    def __init__(self, message: str, summary: Optional[str] = None) -> None:
        super().__init__(message)
        self.summary = summary


# What gloo and NCCL say when the process at the other end is gone: a survivor sees these, not its own failure.
_LOST_CONNECTION = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                    "communicator was aborted", "NCCL communicator", "remote process exited")


def is_lost_connection(err: BaseException) -> bool:
    """Whether ``err`` says that another process went away (so it is not this process's own failure)."""
    return isinstance(err, PipelineFailure) or any(s in str(err) for s in _LOST_CONNECTION)


class FailureBoard:
    """A key in the process group's store where the first failing stage writes what went wrong."""

    KEY = "lightning_async_pp/failure"
    SUMMARY = KEY + "/summary"

    def __init__(self, store: Optional[dist.Store]) -> None:
        self.store = store

    def report(self, message: str, summary: Optional[str] = None) -> None:
        """Post ``message`` unless a failure was posted already; ``summary``: see :class:`PipelineFailure`."""
        if self.store is None:
            return
        try:
            if not self.store.check([self.KEY]):
                if summary is not None:  # first: a reader that finds the message finds its summary
                    self.store.set(self.SUMMARY, summary)
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
            summary = self.store.get(self.SUMMARY).decode() if self.store.check([self.SUMMARY]) else None
            raise PipelineFailure(self.store.get(self.KEY).decode(), summary)

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
    rank gets there first. See docs/design/checkpoints.md, "Faults"."""
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
    See docs/design/checkpoints.md, "Faults"."""

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


class _Posted:
    """A receive issued in a batch of point-to-point operations: its buffers, and the works to wait for (its own
    where the backend returns one per operation, the whole batch's where it coalesces them, as NCCL does)."""

    __slots__ = ("tensors", "works", "peer", "positions", "layout")

    def __init__(self, tensors: list[Optional[Tensor]], peer: int, positions: list[int]) -> None:
        self.tensors, self.peer = tensors, peer
        self.positions = positions  # of its operations in the batch they are issued in
        self.works: list[Any] = []
        self.layout: Optional[Layout] = None  # an evaluation value's


class StageLink:
    """The point-to-point operations of one stage with the other stages of its pipeline (global ranks).

    The runtime calls it in the order of the stage's program (:mod:`.messages`): every message is sent and
    received by both sides at the same place of one global order, so the k-th send of a pair of ranks meets its
    k-th receive whatever the tags (NCCL ignores them; every message here has tag 0, which makes gloo match by
    position too). Operations are queued and issued together, as one ``batch_isend_irecv``, before the next
    computation or wait (``flush``): NCCL then runs a stage's send forward and receive backward at once.

    Layouts (nesting, shapes, dtypes of what crosses) are agreed once: in training the first activation of the
    run is preceded by its layout, which fixes it; in evaluation each distinct microbatch shape's layout travels
    once (both sides see the same batch, so both know when a shape is new). Reading a layout is the only host
    read of a received tensor; a step's steady state has none.

    On CUDA two things differ, both behind ``device.type == "cuda"`` (docs/design/runtime.md, "The runtime"):

    - **Waits do not block the host.** ``work.wait()`` without a timeout makes the compute stream wait for the
      transfer, so the host keeps queueing kernels and transfers overlap compute. (A wait *with* a timeout blocks
      the host thread until the transfer is done.) NCCL's watchdog bounds a hang by the process group's timeout,
      which is ``pipeline_timeout``.
    - **Receive buffers are reused** (``reuse_buffers``): a training activation's buffers go back to a pool once
      its microbatch's backward has sent the input gradients, a gradient's once the backward that took it ran,
      so steady-state training allocates none. Buffers still shared with something in flight (a stage that
      passes its input through as its output, a gradient autograd kept as an input's ``.grad``) are not reused.
      On CUDA "the backward ran" means its kernels are queued; NCCL starts each transfer after the work already
      queued on the compute stream, so a new receive writes a pooled buffer only after its last reader ran. A
      pooled buffer's version is bumped as a receive takes it (:meth:`_take_buffers`). Training only: evaluation
      receives into new buffers.
    """

    REUSE_BUFFERS_ON_CPU = False  # tests turn this on to check the pools with gloo on CPU
    TAG = 0  # one tag for every message: matching is by position, as under NCCL

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
        # Evaluation layouts agreed so far, by (peer, key): the key names the microbatch's shape on both sides.
        self._sent_layouts: dict[tuple[int, Any], Layout] = {}
        self._received_layouts: dict[tuple[int, Any], Layout] = {}
        self._queued: list[dist.P2POp] = []  # operations not issued yet, in program order
        self._queued_recvs: list[_Posted] = []
        self._sends: deque = deque()  # (works, tensor, peer) of sends issued and not yet waited for
        self._posted: dict[tuple, _Posted] = {}  # receives issued, by message key, until the runtime takes them
        self.wait_seconds = 0.0  # time spent blocked waiting for a neighbour (communication wait)
        self.on_cuda = device.type == "cuda"
        self.reuse_buffers = self.on_cuda or self.REUSE_BUFFERS_ON_CPU
        self._act_pool: list[list[Tensor]] = []  # free receive buffers, one list of leaves per activation
        self._grad_pool: list[list[Optional[Tensor]]] = []
        self.buffers_reused = 0  # receives posted into a pooled buffer
        # Called with (name, start, end, args) for every wait, when a trace is being recorded.
        self.recorder: Optional[Callable[[str, float, float, dict], None]] = None

    # ---- failures -------------------------------------------------------------------------------------------
    def _describe(self, rank: Optional[int]) -> str:
        return f"stage {self.rank_to_stage.get(rank, '?')} (rank {rank})"

    def _lost(self, err: BaseException, waited: float, peer: Optional[int], what: str) -> PipelineFailure:
        """What a failed issue or wait means: the board names the stage that failed first, if it said so; else
        the peer this stage was talking to is the one that failed, died or hangs (never this stage itself)."""
        time.sleep(0.2)  # give the failing stage a moment to post its report
        self.board.check()
        if waited >= 0.9 * self.timeout:
            return PipelineFailure(
                f"stage {self.stage} (rank {self.rank}) waited {waited:.0f}s for {what} from "
                f"{self._describe(peer)}, which did not answer: it failed, died or hangs"
            )
        return PipelineFailure(
            f"{self._describe(peer)} failed or died: stage {self.stage} (rank {self.rank}) lost it while "
            f"{what}: {err}"
        )

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
            raise self._lost(err, time.perf_counter() - start, peer, f"waiting for {what}") from err
        finally:
            end = time.perf_counter()
            self.wait_seconds += end - start
            if self.recorder is not None:
                self.recorder("send" if what.startswith("a send") else "recv", start, end, {"what": what, "peer": peer})

    def _wait_posted(self, posted: _Posted, what: str) -> None:
        if not posted.works:
            self.flush()  # still queued: issue it first
        for work in posted.works:
            self.wait(work, posted.peer, what)
        posted.works = []

    # ---- queueing and issuing -------------------------------------------------------------------------------
    def _send(self, tensor: Tensor, dst: int) -> None:
        self._queued.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), dst, tag=self.TAG))

    def _recv(self, metas: list, src: int, bufs: Optional[list[Optional[Tensor]]] = None) -> _Posted:
        """Queue the receive of one tensor per meta (``None`` metas: nothing to receive in that place)."""
        tensors: list[Optional[Tensor]] = []
        positions: list[int] = []
        for i, m in enumerate(metas):
            if m is None:
                tensors.append(None)
                continue
            buf = bufs[i] if bufs is not None and bufs[i] is not None else torch.empty(m.shape, dtype=m.dtype, device=self.device)
            tensors.append(buf)
            positions.append(len(self._queued))
            self._queued.append(dist.P2POp(dist.irecv, buf, src, tag=self.TAG))
        posted = _Posted(tensors, src, positions)
        self._queued_recvs.append(posted)
        return posted

    def flush(self) -> None:
        """Issue the queued operations as one batch (before a computation, a wait or the end of a step)."""
        if not self._queued:
            return
        ops, recvs = self._queued, self._queued_recvs
        self._queued, self._queued_recvs = [], []
        peer = ops[0].peer
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as err:
            raise self._lost(err, 0.0, peer, "exchanging tensors") from err
        if len(works) == len(ops):  # one work per operation (gloo): a receive waits for its own only
            for posted in recvs:
                posted.works = [works[i] for i in posted.positions]
            sent = [(w, op) for w, op in zip(works, ops) if op.op is dist.isend]
            self._sends.extend(([w], op.tensor, op.peer) for w, op in sent)
        else:  # coalesced (NCCL): the batch completes as one
            for posted in recvs:
                posted.works = list(works)
            self._sends.append((list(works), [op.tensor for op in ops], peer))

    def complete_sends(self) -> None:
        """Wait for every send issued so far (each step's receives are all posted in the same step)."""
        self.flush()
        while self._sends:
            works, _, dst = self._sends.popleft()
            for work in works:
                self.wait(work, dst, "a send to be taken")

    def take(self, key: tuple) -> _Posted:
        return self._posted.pop(key)

    def drop_posted(self) -> None:
        """Wait for the receives posted and not taken (the lookahead's, when it is cancelled) and forget them."""
        self.flush()
        for key in list(self._posted):
            self._wait_posted(self._posted.pop(key), "an activation that will not be used")

    # ---- layouts (what a value looks like) travel as a length, then JSON bytes ----------------------------------
    def _send_layout(self, layout: Layout, dst: int) -> None:
        if len(layout.metas) > _MAX_LEAVES:
            raise ValueError(f"{len(layout.metas)} tensors cross one stage boundary; at most {_MAX_LEAVES} can")
        data = layout.encode().to(self.device)
        self._send(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), dst)
        self._send(data, dst)

    def _recv_layout(self, src: int, what: str) -> Layout:
        """Issued at once and read on the host: the only host read of a received tensor (once per layout)."""
        self.flush()
        length = self._recv([_Meta((1,), torch.int64)], src)
        self.flush()
        self._wait_posted(length, what)
        assert length.tensors[0] is not None
        data = self._recv([_Meta((int(length.tensors[0].item()),), torch.uint8)], src)
        self.flush()
        self._wait_posted(data, what)
        assert data.tensors[0] is not None
        return Layout.decode(data.tensors[0])

    # ---- training: activations forward, gradients backward ---------------------------------------------------
    def send_activations(self, outputs: Any, check: Optional[Tensor] = None) -> None:
        """Send a forward's output; ``check`` (a batch fingerprint) goes before a batch's first microbatch."""
        leaves, spec = flatten(outputs, f"stage {self.stage}'s output")
        layout = Layout.of(leaves, spec, with_grad=False)  # which need a gradient: every floating leaf (see above)
        assert self.next_rank is not None
        if self.out_layout is None:
            self.out_layout = layout
            self._send_layout(layout, self.next_rank)
        elif not layout.same_shapes(self.out_layout):
            raise ValueError(
                f"stage {self.stage} output shapes changed from {self.out_layout.describe()} to {layout.describe()}; "
                f"training needs equal microbatch shapes (use drop_last=True)"
            )
        for t in leaves:
            self._send(t, self.next_rank)

    def send_check(self, check: Tensor) -> None:
        assert self.next_rank is not None
        self._send(check.reshape(1).to(torch.float64), self.next_rank)

    def post_check(self, key: tuple) -> None:
        assert self.prev_rank is not None
        self._posted[key] = self._recv([_Meta((1,), torch.float64)], self.prev_rank)

    def post_activations(self, key: tuple) -> None:
        """Post the receive of an activation, to be taken by :meth:`take_activations`."""
        assert self.prev_rank is not None
        if self.in_layout is None:
            self.in_layout = self._recv_layout(self.prev_rank, "the activation layout")
        bufs = self._take_buffers(self._act_pool)
        self._posted[key] = self._recv(list(self.in_layout.metas), self.prev_rank, bufs)

    def take_activations(self, key: tuple, check_key: Optional[tuple]) -> tuple[list[Tensor], Optional[Tensor]]:
        """The activation's leaves (as autograd leaves where a gradient flows back) and its fingerprint."""
        check = None
        if check_key is not None:
            posted_check = self.take(check_key)
            self._wait_posted(posted_check, "a batch fingerprint")
            check = posted_check.tensors[0]
        posted = self.take(key)
        self._wait_posted(posted, "an activation")
        assert self.in_layout is not None
        leaves = [buf.requires_grad_(carries_grad_back(m)) for buf, m in zip(posted.tensors, self.in_layout.metas)]
        return leaves, (check[0] if check is not None else None)

    def send_gradients(self, gradients: list[Tensor]) -> None:
        """The input gradients of a microbatch, one per floating received leaf, in order."""
        assert self.prev_rank is not None
        for g in gradients:
            self._send(g, self.prev_rank)

    def post_gradients(self, key: tuple) -> None:
        assert self.out_layout is not None and self.next_rank is not None, "gradients come after activations"
        bufs = self._take_buffers(self._grad_pool)
        metas = [m if carries_grad_back(m) else None for m in self.out_layout.metas]
        self._posted[key] = self._recv(metas, self.next_rank, bufs)

    def take_gradients(self, key: tuple) -> list[Optional[Tensor]]:
        posted = self.take(key)
        self._wait_posted(posted, "a gradient")
        return list(posted.tensors)

    # ---- reusing receive buffers --------------------------------------------------------------------------------
    def _take_buffers(self, pool: list) -> Optional[list]:
        """Pooled buffers for the next receive, their versions bumped: the transfer writes them as an in-place op
        would, but outside autograd, which would leave the version of the earlier microbatch's content. A cache
        keyed on tensor and version (``models/packing.py``, ``per_positions``) then knows the new content without
        reading it (a host wait on CUDA)."""
        if not pool:
            return None
        self.buffers_reused += 1
        buffers = pool.pop()
        torch.autograd.graph.increment_version([b for b in buffers if b is not None])
        return buffers

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

    # ---- the loss and metrics (a float64 vector), evaluation values (any layout, agreed once per shape) ---------
    def send_scalar(self, value: Tensor, dst: int) -> None:
        """A scalar, or a 1-D vector of them (the loss and the module's metrics)."""
        self._send(value.detach().reshape(-1).to(torch.float64), dst)

    def post_scalar(self, key: tuple, src: int, size: int = 1) -> None:
        self._posted[key] = self._recv([_Meta((size,), torch.float64)], src)

    def take_scalar(self, key: tuple, what: str = "the loss") -> Tensor:
        posted = self.take(key)
        self._wait_posted(posted, what)
        assert posted.tensors[0] is not None
        return posted.tensors[0]

    def send_value(self, value: Any, dst: int, shape_key: Any) -> None:
        """An evaluation activation or result; its layout travels the first time ``shape_key`` is seen."""
        leaves, spec = flatten(value, f"stage {self.stage}'s output")
        layout = Layout.of(leaves, spec, with_grad=False)
        agreed = self._sent_layouts.get((dst, shape_key))
        if agreed is None:
            self._sent_layouts[(dst, shape_key)] = layout
            self._send_layout(layout, dst)
        elif layout != agreed:
            raise ValueError(
                f"stage {self.stage}'s evaluation output for microbatches of shape {shape_key} changed from "
                f"{agreed.describe()} to {layout.describe()}; a stage's output must depend only on its input's shapes"
            )
        for t in leaves:
            self._send(t, dst)

    def post_value(self, key: tuple, src: int, shape_key: Any, what: str) -> None:
        layout = self._received_layouts.get((src, shape_key))
        if layout is None:
            layout = self._received_layouts[(src, shape_key)] = self._recv_layout(src, what)
        posted = self._recv(list(layout.metas), src)
        posted.layout = layout
        self._posted[key] = posted

    def take_value(self, key: tuple, what: str) -> Any:
        posted = self.take(key)
        self._wait_posted(posted, what)
        assert posted.layout is not None
        return unflatten(list(posted.tensors), posted.layout.spec)


def carries_grad_back(meta: Any) -> bool:
    """Whether a leaf of a training activation carries a gradient back across processes: every floating one, in
    every message, whatever its ``requires_grad`` (see the module docstring)."""
    return meta.dtype.is_floating_point


class _Meta:
    """The shape and dtype of a receive buffer."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
