"""The data-parallel gradient reduction of one stage: bucketed, in place, and overlapped with the step's work.

A stage's replicas average their batch gradients. The gradients accumulate, microbatch by microbatch, directly in
a few flat bucket buffers (each leaf's ``.grad`` is a view into its bucket before the batch's first backward, and
autograd adds into it in place), so the reduction needs no second copy of the gradient. A
bucket is all-reduced asynchronously as soon as its gradients are final: during the batch's last backward on
this stage, once each of its leaves has taken its last microbatch's gradient (a post-accumulate hook), else
right after that backward. The buffers are allocated once, and again when the set of parameters that take
gradients changes (a layer unfrozen mid-run). Buckets are launched in one fixed order on every replica (as DDP: a bucket waits for the
ones before it), since collectives on a group are matched by their order: a parameter that one replica's data
used and another's did not (an MoE expert, any data-dependent branch) must not reorder them. With the buckets
goes one small all-reduce of which parameters each replica used, so that the decision "no gradient" is global:
a parameter some replica used gets the mean (zero from the replicas that did not use it) on every replica, one
that no replica used gets ``None`` everywhere (DDP with ``find_unused_parameters=True`` does the same).
:meth:`GradientReducer.finish` waits for them; the engine calls it only when the
gradient is first needed, in Lightning's ``backward``, so the reduction runs behind the rest of the backward,
the step's remaining sends and receives, and Lightning's work between ``training_step`` and ``backward``. See
docs/design/data-parallel.md, "Data parallelism".

With ``OVERLAP = False`` every bucket is reduced after the step's last action and waited for at once (the
reduction on the critical path, for comparison). No Lightning import here.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.parallel.tensor_parallel import local_tensor


@dataclass
class _Bucket:
    indices: list[int]  # positions in the stage's parameter list, in the order they sit in ``buffer``
    buffer: Tensor
    views: list[Tensor] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # leaves not yet final in this step's last backward
    ready: bool = False  # every leaf final: launched once the buckets before it are
    work: Any = None


class GradientReducer:
    """Averages one stage's batch gradient over its data-parallel ``group`` of ``size`` replicas.

    Per step: :meth:`attach` (before the batch's first backward), :meth:`arm` (before its last backward on this
    stage), :meth:`launch_rest` (after it), :meth:`finish` (before the gradient is used).
    """

    BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default bucket_cap_mb
    OVERLAP = True

    def __init__(self, params: Sequence[Tensor], group: Any, size: int, skip: Sequence[int] = ()) -> None:
        self.group, self.size = group, size
        # Parameters whose gradients another rule reduces (experts split over replicas: parallel/expert.py):
        # never bucketed, their gradients passed through as they are.
        self.skip = frozenset(skip)
        self._build(params)
        self._used_work: Any = None
        self._leaves: list[Tensor] = []
        self._hooks: list[Any] = []
        self._touched: set[int] = set()
        self._armed = False
        self.started: Optional[float] = None  # when the first bucket of this step was launched
        self.total_s = 0.0  # last step: first launch to the end of the wait
        self.exposed_s = 0.0  # last step: time blocked waiting for it

    def _build(self, params: Sequence[Tensor]) -> None:
        """Buckets for the parameters that take gradients now (``requires_grad``)."""
        self.trainable = tuple(p.requires_grad for p in params)
        # A DTensor parameter's gradient is its local shard's (docs/design/tensor-parallel.md): bucket those shapes.
        # Which take gradients is the parameters' say: a DTensor parameter's local tensor never requires grad.
        params = [local_tensor(p) for p in params]
        self.buckets: list[_Bucket] = []
        # Buckets in reverse parameter order, as DDP: a stage's last layers get their gradients first in backward.
        order = [i for i in reversed(range(len(params))) if self.trainable[i] and i not in self.skip]
        current: list[int] = []
        for i in order:
            if current and (params[i].dtype != params[current[0]].dtype or params[i].device != params[current[0]].device
                            or sum(params[j].numel() * params[j].element_size() for j in current + [i]) > self.BUCKET_BYTES):
                self._add_bucket(params, current)
                current = []
            current.append(i)
        if current:
            self._add_bucket(params, current)
        self._bucket_of = {i: b for b in self.buckets for i in b.indices}
        self._next = 0  # the first bucket of this step not launched yet (they are launched in order)
        # Which parameters each replica used this step, summed over the replicas (1 where this one did). On the
        # parameters' device even when none is trainable now (a later unfreeze must not move it).
        device = params[0].device if len(params) else torch.device("cpu")
        self._used = torch.zeros(len(params), dtype=torch.int32, device=device)

    def _add_bucket(self, params: Sequence[Tensor], indices: list[int]) -> None:
        numel = sum(params[i].numel() for i in indices)
        buffer = torch.zeros(numel, dtype=params[indices[0]].dtype, device=params[indices[0]].device)
        bucket = _Bucket(list(indices), buffer)
        offset = 0
        for i in indices:
            bucket.views.append(buffer[offset : offset + params[i].numel()].view_as(params[i]))
            offset += params[i].numel()
        self.buckets.append(bucket)

    @property
    def pending(self) -> bool:
        return self._used_work is not None or any(b.work is not None for b in self.buckets)

    # ---- one step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def attach(self, leaves: Sequence[Tensor]) -> None:
        """Make each leaf's ``.grad`` a zeroed view into its bucket, so that the batch's microbatch gradients
        accumulate there in place (the previous batch's gradient has been applied by now)."""
        self._leaves = list(leaves)
        if tuple(leaf.requires_grad for leaf in self._leaves) != self.trainable:
            # A layer was frozen or unfrozen since the buckets were made (Lightning's BaseFinetuning unfreezes at an
            # epoch start): rebuild them here, at a step boundary, from the leaves' requires_grad (that of the
            # parameters when the leaves were made). Every replica's callbacks change the same parameters, so
            # every replica rebuilds at the same step and the buckets still pair up.
            self._build(self._leaves)
        self._touched = set()
        self._armed = False
        self.started = None
        self._next = 0
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = set(bucket.indices)
            bucket.ready = False
            for i, view in zip(bucket.indices, bucket.views):
                self._leaves[i].grad = view
        for i in self._bucket_of:
            self._hooks.append(self._leaves[i].register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, i: int) -> Any:
        def accumulated(_: Tensor) -> None:
            self._touched.add(i)
            if self._armed and self.OVERLAP:
                bucket = self._bucket_of[i]
                bucket.pending.discard(i)
                if not bucket.pending:
                    bucket.ready = True
                    self._launch_ready()
        return accumulated

    def accumulated_outside_autograd(self, leaves: Sequence[Tensor]) -> None:
        """``leaves``' ``.grad`` was added to in place by code, not by autograd's accumulation (a split backward's
        weight pass: torch's ``stage_backward_weight`` does ``weight.grad += dw``), so no post-accumulate hook
        ran: do what it would have done."""
        index = {id(leaf): i for i, leaf in enumerate(self._leaves)}
        for leaf in leaves:
            i = index.get(id(leaf))
            if i is not None and i in self._bucket_of:
                self._hook(i)(leaf)

    def arm(self) -> None:
        """The batch's last backward on this stage starts: each leaf's next accumulation is its last."""
        self._armed = True

    def launch_rest(self) -> None:
        """After the last backward: launch every bucket not launched yet (leaves that took no gradient then), then
        the exchange of which parameters each replica used (complete only now)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if not self.buckets:
            return
        for bucket in self.buckets:
            bucket.ready = True
        self._launch_ready()
        used = torch.tensor([i in self._touched for i in range(len(self._used))], dtype=torch.int32)
        if self._used.is_cuda:  # a pageable copy to the GPU waits for the device; torch's pinned cache is reused safely
            used = used.pin_memory()
        self._used.copy_(used, non_blocking=True)
        self._used_work = dist.all_reduce(self._used, group=self.group, async_op=True)

    def _launch_ready(self) -> None:
        # In bucket order only: collectives on a group pair up by their order on each rank, and a bucket whose
        # leaf one replica did not use becomes ready later there than on the others.
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            bucket = self.buckets[self._next]
            if self.started is None:
                self.started = time.perf_counter()
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self._next += 1

    def finish(self, gradients: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
        """Wait for every bucket and divide by the number of replicas. Returns ``gradients`` (the leaves'
        ``.grad``, one per parameter): the mean over the replicas for a parameter that any replica used in this
        step (also where this one did not), ``None`` on every replica for one that none used, as with one
        pipeline."""
        if not self.pending:
            return gradients
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
                bucket.buffer.div_(self.size)
        self._used_work.wait()
        self._used_work = None
        used = set(self._touched)
        if any(i not in used for i in self._bucket_of):  # only then read the map (on a GPU, a wait for it)
            used = {i for i, count in enumerate(self._used.tolist()) if count > 0}
        end = time.perf_counter()
        self.exposed_s = end - start
        self.total_s = end - (self.started if self.started is not None else start)
        self._leaves = []
        # A leaf's .grad is its bucket view, also where this replica added nothing (zero before the all-reduce).
        return [g if i in self.skip or (i in self._bucket_of and i in used) else None for i, g in enumerate(gradients)]
