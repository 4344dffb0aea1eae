"""DTensor parameters in the engine: what the engine keeps per parameter is the parameter's **local tensor**
(this tensor-parallel rank's shard), and these helpers are the only place that tells a DTensor parameter from a
plain one. See docs/design/tensor-parallel.md, "Weights, gradients and optimizer state per shard".
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.distributed.tensor import DTensor

#: What a DTensor parameter's leaf is wrapped with for the forward: (mesh, placements, global shape, stride).
DTensorSpec = tuple[Any, tuple[Any, ...], Any, tuple[int, ...]]


def local_tensor(t: Tensor) -> Tensor:
    """The tensor that holds ``t``'s values on this process: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def point_at(p: Tensor, storage: Tensor) -> None:
    """Make parameter ``p`` hold ``storage`` (a plain tensor of its local shape) without copying, so that an
    in-place update of ``p`` writes ``storage``. ``p.data = storage`` would replace a DTensor parameter's wrapper
    but leave its local tensor where it was (torch 2.14): the local tensor itself is re-pointed (torch-private
    ``_local_tensor``; tests/test_tensor_parallel.py fails if torch changes it)."""
    if isinstance(p, DTensor):
        p._local_tensor.data = storage
    else:
        p.data = storage


def dtensor_spec(p: Tensor) -> Optional[DTensorSpec]:
    """How to wrap a local shard of ``p`` as ``p`` is laid out (``None`` for a plain parameter)."""
    if not isinstance(p, DTensor):
        return None
    return (p.device_mesh, tuple(p.placements), p.shape, p.stride())


def as_laid_out(local: Tensor, spec: Optional[DTensorSpec]) -> Tensor:
    """``local`` as its parameter is laid out: a DTensor view of it (no copy, no communication; autograd flows back
    to ``local`` as a plain gradient of its shape) or ``local`` itself."""
    if spec is None:
        return local
    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def parameter_grad(p: Tensor, grad: Optional[Tensor]) -> Optional[Tensor]:
    """The ``.grad`` an optimizer expects on ``p`` for the engine's local gradient ``grad``: a DTensor view of it
    for a DTensor parameter."""
    if grad is None:
        return None
    return as_laid_out(grad, dtensor_spec(p))


def whole(t: Tensor) -> Tensor:
    """``t`` whole: a DTensor's shards gathered over its mesh (a collective: every rank of the mesh calls it), else
    ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def laid_out_like(full: Tensor, like: Tensor) -> Tensor:
    """The whole tensor ``full`` laid out as ``like``: for a DTensor ``like``, a DTensor of its mesh and placements
    whose local tensor is this rank's slice of ``full`` (``src_data_rank=None``: each rank cuts its own slice of
    the ``full`` it holds, no communication); else ``full``."""
    if not isinstance(like, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
