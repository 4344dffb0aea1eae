"""Point-to-point transfers between neighbouring stages over ``torch.distributed`` (gloo or NCCL).

Activations go forward and gradients backward as non-blocking sends and receives. What crosses a boundary is a
tensor or a tuple of tensors; their shapes and dtypes travel once, in a small header before the first
microbatch, and are reused after that (training), or travel with every transfer (evaluation, whose batch
shapes may differ). Every wait is bounded by the process group's timeout and, when it breaks, reads a
shared failure board, so a stage that raised or died stops its neighbours (naming it) instead of hanging them.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_HEADER_LEN = 64
_MAX_DIMS = 8

# Tags keep independent message streams apart; gloo matches by (source, tag) in posting order.
TAG_HEADER, TAG_ACT, TAG_GRAD, TAG_LOSS, TAG_EVAL_HEADER, TAG_EVAL_ACT, TAG_EVAL_LOSS = range(0, 7 * 64, 64)


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


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _encode(metas: list[TensorMeta], is_tuple: bool) -> Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    values = [len(metas), int(is_tuple)]
    for m in metas:
        if len(m.shape) > _MAX_DIMS:
            raise ValueError(f"cannot send a tensor of {len(m.shape)} dims between stages (at most {_MAX_DIMS})")
        values += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(values) > _HEADER_LEN:
        raise ValueError(f"too many tensors cross this stage boundary ({len(metas)}); pack them into fewer")
    header[: len(values)] = torch.tensor(values)
    return header


def _decode(header: Tensor) -> tuple[list[TensorMeta], bool]:
    v = header.tolist()
    metas, i = [], 2
    for _ in range(v[0]):
        dtype, grad, ndim = _DTYPES[v[i]], bool(v[i + 1]), v[i + 2]
        metas.append(TensorMeta(tuple(v[i + 3 : i + 3 + ndim]), dtype, grad))
        i += 3 + ndim
    return metas, bool(v[1])


def unpack(tensors: tuple[Tensor, ...], is_tuple: bool) -> Any:
    """Give the receiving layer what the sending layer returned: a tensor or a tuple."""
    return tensors if is_tuple else tensors[0]


def as_tuple(x: Any) -> tuple[Tensor, ...]:
    if isinstance(x, Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, Tensor) for t in x):
        return tuple(x)
    raise TypeError(
        f"What crosses a pipeline stage boundary must be a tensor or a tuple of tensors, got {type(x).__name__}"
    )


def needs_grad(meta: TensorMeta) -> bool:
    return meta.requires_grad and meta.dtype.is_floating_point


class StageLink:
    """The links of one stage to its previous and next stage (global ranks)."""

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
        self.out_metas: Optional[list[TensorMeta]] = None  # what this stage sends forward
        self.in_metas: Optional[list[TensorMeta]] = None  # what this stage receives
        self.in_is_tuple = False
        # Sends whose receives are posted in the same step (or evaluation call) as the send, and sends of the
        # next batch's forwards (2BW lookahead) whose receives may be posted only in the next step.
        self._pending_sends: deque = deque()
        self._carried_sends: deque = deque()
        self._posted_act: deque = deque()  # pre-posted activation receives, oldest first
        self._posted_grad: deque = deque()
        self.wait_seconds = 0.0  # time spent blocked waiting for a neighbour (communication wait)
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

    def _irecv(self, meta: TensorMeta, src: int, tag: int) -> tuple[Any, Tensor]:
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return dist.irecv(buf, src=src, tag=tag), buf

    # ---- training: activations forward ----------------------------------------------------------------------
    def send_activations(self, outputs: Any, carried: bool = False) -> None:
        tensors = as_tuple(outputs)
        metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
        if self.out_metas is None:
            self.out_metas = metas
            self._isend(_encode(metas, not isinstance(outputs, Tensor)).to(self.device), self.next_rank, TAG_HEADER)
        elif [(m.shape, m.dtype) for m in metas] != [(m.shape, m.dtype) for m in self.out_metas]:
            raise ValueError(
                f"stage {self.stage} output shapes changed from {[m.shape for m in self.out_metas]} to "
                f"{[m.shape for m in metas]}; the pipeline needs equal microbatch shapes (use drop_last=True)"
            )
        for i, t in enumerate(tensors):
            self._isend(t.detach(), self.next_rank, TAG_ACT + i, carried=carried)

    def post_activation_recv(self) -> None:
        """Post the receive of the next activation in advance so it overlaps compute."""
        if self.in_metas is None:
            work, header = self._irecv(TensorMeta((_HEADER_LEN,), torch.int64, False), self.prev_rank, TAG_HEADER)
            self.wait(work, self.prev_rank, "the activation header")
            self.in_metas, self.in_is_tuple = _decode(header.cpu())
        self._posted_act.append([self._irecv(m, self.prev_rank, TAG_ACT + i) for i, m in enumerate(self.in_metas)])

    def recv_activations(self) -> tuple[Tensor, ...]:
        if not self._posted_act:
            self.post_activation_recv()
        received = self._posted_act.popleft()
        for work, _ in received:
            self.wait(work, self.prev_rank, "an activation")
        assert self.in_metas is not None
        return tuple(buf.requires_grad_(needs_grad(m)) for (_, buf), m in zip(received, self.in_metas))

    # ---- training: gradients backward -------------------------------------------------------------------------
    def send_gradients(self, inputs: tuple[Tensor, ...]) -> None:
        assert self.in_metas is not None
        for i, (t, m) in enumerate(zip(inputs, self.in_metas)):
            if needs_grad(m):
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._isend(grad, self.prev_rank, TAG_GRAD + i)

    def post_gradient_recv(self) -> None:
        assert self.out_metas is not None, "gradients are received only after activations were sent"
        self._posted_grad.append(
            [self._irecv(m, self.next_rank, TAG_GRAD + i) if needs_grad(m) else None for i, m in enumerate(self.out_metas)]
        )

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

    # ---- small scalars and evaluation ---------------------------------------------------------------------
    def send_scalar(self, value: Tensor, dst: int, tag: int) -> None:
        self._isend(value.detach().reshape(1).to(torch.float64), dst, tag)

    def recv_scalar(self, src: int, tag: int) -> Tensor:
        work, buf = self._irecv(TensorMeta((1,), torch.float64, False), src, tag)
        self.wait(work, src, "the loss")
        return buf[0]

    def post_scalar_recv(self, src: int, tag: int) -> tuple[Any, Tensor]:
        return self._irecv(TensorMeta((1,), torch.float64, False), src, tag)

    def send_eval(self, outputs: Any) -> None:
        tensors = as_tuple(outputs)
        metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in tensors]
        self._isend(_encode(metas, not isinstance(outputs, Tensor)).to(self.device), self.next_rank, TAG_EVAL_HEADER)
        for i, t in enumerate(tensors):
            self._isend(t.detach(), self.next_rank, TAG_EVAL_ACT + i)

    def recv_eval(self) -> Any:
        work, header = self._irecv(TensorMeta((_HEADER_LEN,), torch.int64, False), self.prev_rank, TAG_EVAL_HEADER)
        self.wait(work, self.prev_rank, "an evaluation header")
        metas, is_tuple = _decode(header.cpu())
        received = [self._irecv(m, self.prev_rank, TAG_EVAL_ACT + i) for i, m in enumerate(metas)]
        for work, _ in received:
            self.wait(work, self.prev_rank, "an evaluation activation")
        return unpack(tuple(buf for _, buf in received), is_tuple)
