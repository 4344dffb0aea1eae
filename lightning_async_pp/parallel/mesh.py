"""The layout of data parallelism x pipeline stages x tensor parallelism over the processes, and its ``DeviceMesh``.

``rank = (replica * stages + stage) * t + tp_rank``: the ``t`` tensor-parallel ranks of a stage are adjacent (one
node, whose fast link carries the per-layer collectives), then a replica's stages, then the replicas. With ``t = 1``
this is :class:`~lightning_async_pp.parallel.topology.PipelineTopology`'s layout. The mesh dimensions are named as
under Lightning's ``ModelParallelStrategy`` (``"data_parallel"``, ``"tensor_parallel"``) plus ``"pipeline"``.
See docs/design/tensor-parallel.md, "The mesh". The engine runs it (``tensor_parallel_size``) as "What runs" there says.
Expert parallelism (``expert_parallel_size = e``) adds no process: a stage's experts are split over ``e`` consecutive
replicas of it, an expert group (docs/design/expert-parallel.md, "The layout").
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

#: The mesh's dimension names, outermost first (the order of :func:`build_device_mesh`'s shape).
MESH_DIMS = ("data_parallel", "pipeline", "tensor_parallel")
#: With ``expert_parallel_size > 1`` the data-parallel dimension is two: which copy of the stage's experts a replica
#: holds them with (``"expert_data_parallel"``: the ranks holding the same experts, whose expert gradients add up),
#: and its place in an expert group (``"expert_parallel"``); ``"data_parallel"`` is their flattening.
EXPERT_MESH_DIMS = ("expert_data_parallel", "expert_parallel", "pipeline", "tensor_parallel")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def describe_layout(stages: int, tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> str:
    """The layout in words, as the split report and ``PipelineMonitor`` name it: "2 stages x 2 tensor-parallel
    ranks", with " x 2 data-parallel replicas" where there are several."""
    text = f"{stages} stage{'s' if stages != 1 else ''}"
    if tensor_parallel_size > 1:
        text += f" x {tensor_parallel_size} tensor-parallel ranks"
    if data_parallel_size > 1:
        text += f" x {data_parallel_size} data-parallel replicas"
    return text


@dataclass(frozen=True)
class MeshLayout:
    """Which process is which (replica, stage, tensor-parallel rank); pure arithmetic, no process group."""

    world_size: int
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("expert_parallel_size", self.expert_parallel_size)
        if self.data_parallel_size * self.tensor_parallel_size % self.expert_parallel_size != 0:
            raise ValueError(expert_size_message(self.expert_parallel_size, self.data_parallel_size,
                                                 self.tensor_parallel_size))
        r, t = self.data_parallel_size, self.tensor_parallel_size
        if self.world_size % (r * t) != 0:
            multiples = ", ".join(str(r * t * k) for k in range(1, 4))
            per_replica = self.world_size // r
            hint = (f"; or, with {self.world_size} processes and data_parallel_size={r}, a tensor_parallel_size among "
                    f"{[d for d in range(1, per_replica + 1) if per_replica % d == 0]}"
                    if self.world_size % r == 0 else "")
            raise ValueError(
                f"{self.world_size} process(es) cannot be split into data_parallel_size={r} x pipeline stages x "
                f"tensor_parallel_size={t}: {self.world_size} is not a multiple of {r} x {t} = {r * t}; use a "
                f"process count (devices x num_nodes) of {multiples}, ...{hint}"
            )

    @property
    def num_stages(self) -> int:
        return self.world_size // (self.data_parallel_size * self.tensor_parallel_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, in :data:`MESH_DIMS` order (:data:`EXPERT_MESH_DIMS` where expert groups are cut
        from the replicas alone)."""
        e = self.expert_parallel_size
        if e > 1 and self.data_parallel_size % e == 0:
            return (self.data_parallel_size // e, e, self.num_stages, self.tensor_parallel_size)
        return (self.data_parallel_size, self.num_stages, self.tensor_parallel_size)

    def rank_of(self, replica: int, stage: int, tp_rank: int) -> int:
        for name, value, size in (("replica", replica, self.data_parallel_size), ("stage", stage, self.num_stages),
                                  ("tp_rank", tp_rank, self.tensor_parallel_size)):
            if not 0 <= value < size:
                raise ValueError(f"{name} {value} is out of range: the layout has {size} (0..{size - 1})")
        return (replica * self.num_stages + stage) * self.tensor_parallel_size + tp_rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replica, stage, tp_rank)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for {self.world_size} process(es)")
        tp_rank = rank % self.tensor_parallel_size
        stage = rank // self.tensor_parallel_size % self.num_stages
        return rank // (self.tensor_parallel_size * self.num_stages), stage, tp_rank

    def tensor_parallel_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the shards of ``rank``'s stage (its tensor-parallel group), ``rank`` among them."""
        replica, stage, _ = self.coordinates(rank)
        return [self.rank_of(replica, stage, i) for i in range(self.tensor_parallel_size)]

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Stage by stage, the ranks with ``rank``'s replica and tensor-parallel rank: its point-to-point peers
        are its neighbours in this list (each rank exchanges its own part of a microbatch with its peer only)."""
        replica, _, tp_rank = self.coordinates(rank)
        return [self.rank_of(replica, s, tp_rank) for s in range(self.num_stages)]

    def data_parallel_ranks(self, rank: int) -> list[int]:
        """The replicas of ``rank``'s shard: same stage and tensor-parallel rank, every replica (its gradient
        reduction's group)."""
        _, stage, tp_rank = self.coordinates(rank)
        return [self.rank_of(d, stage, tp_rank) for d in range(self.data_parallel_size)]

    def stage_ranks(self, rank: int) -> list[int]:
        """Every rank of ``rank``'s stage, replica by replica, the tensor-parallel rank innermost: the ranks that
        expert groups are cut from."""
        _, stage, _ = self.coordinates(rank)
        return [self.rank_of(d, stage, i) for d in range(self.data_parallel_size)
                for i in range(self.tensor_parallel_size)]

    def expert_parallel_ranks(self, rank: int) -> list[int]:
        """``rank``'s expert group: ``expert_parallel_size`` consecutive ranks of :meth:`stage_ranks` (with
        ``tensor_parallel_size = 1``, consecutive replicas, as Megatron and torchtitan take them), which split the
        stage's experts between them; ``rank`` among them."""
        ranks, e = self.stage_ranks(rank), self.expert_parallel_size
        first = ranks.index(rank) // e * e
        return ranks[first : first + e]

    def expert_data_parallel_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s stage that hold the same experts as ``rank`` (the same place in each expert group):
        the copies whose expert gradients are summed; ``[rank]`` alone where one group spans the stage."""
        ranks, e = self.stage_ranks(rank), self.expert_parallel_size
        return ranks[ranks.index(rank) % e :: e]


def expert_size_message(expert_parallel_size: int, data_parallel_size: int, tensor_parallel_size: int) -> str:
    """Why ``expert_parallel_size`` does not fit the ranks of a stage, naming the numbers and the sizes that do."""
    e, r, t = expert_parallel_size, data_parallel_size, tensor_parallel_size
    n = r * t
    valid = [d for d in range(1, n + 1) if n % d == 0]
    return (f"expert_parallel_size={e} does not divide the {n} ranks of a stage (data_parallel_size={r} x "
            f"tensor_parallel_size={t}), from which each expert group of {e} ranks is cut; use an "
            f"expert_parallel_size among {valid}")


def tensor_parallel_mesh(mesh: Any) -> Any:
    """The ``"tensor_parallel"`` dimension of ``mesh`` (a model's ``self.device_mesh``: ours or Lightning's
    ``ModelParallelStrategy``'s) where it splits a stage over more than one rank, else ``None``: what a model's
    ``configure_model`` applies its plan over."""
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return None
    tp_mesh = mesh["tensor_parallel"]
    return tp_mesh if tp_mesh.size() > 1 else None


def replica_processes(mesh: Any) -> Optional[int]:
    """The processes of one data-parallel replica in a model's ``device_mesh`` under this package's strategy
    (pipeline stages x tensor-parallel ranks): every ``tensor_parallel_size`` the layout can take divides it.
    ``None`` for another mesh (Lightning's ``ModelParallelStrategy``, whose sizes are both the user's)."""
    if mesh is None or "pipeline" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["pipeline"].size() * mesh["tensor_parallel"].size()


def check_tensor_parallel_divides(tensor_parallel_size: int, sizes: Mapping[str, Optional[int]],
                                  where: str = "the model", processes: Optional[int] = None) -> None:
    """Refuse a ``tensor_parallel_size`` that does not evenly split each of ``sizes`` (``{"num_heads": 32,
    "num_kv_heads": 8, ...}``; ``None`` values are skipped), naming the size and the values that would work: those
    that split every one of ``sizes`` and divide ``processes`` (a pipeline replica's, :func:`replica_processes`),
    where it is known."""
    _positive("tensor_parallel_size", tensor_parallel_size)
    t = tensor_parallel_size
    known = [size for size in sizes.values() if size is not None]
    for name, size in sizes.items():
        if size is None:
            continue
        if size < t or size % t != 0:
            valid = [d for d in range(1, min(known) + 1) if d <= 64 and all(s % d == 0 for s in known)
                     and (processes is None or processes % d == 0)]
            reason = "is larger than" if t > size else "does not divide"
            among = f"tensor_parallel_size={valid[0]}" if len(valid) == 1 else f"a tensor_parallel_size among {valid}"
            split = ", ".join(n for n, v in sizes.items() if v is not None)
            also = f" and divide the {processes} processes of a pipeline replica" if processes is not None else ""
            raise ValueError(
                f"tensor_parallel_size={t} {reason} {where}'s {name}={size}: each tensor-parallel rank must hold "
                f"an equal share; use {among} (the sizes that split {split}{also})"
            )


def check_tensor_parallel_no_dropout(tensor_parallel_size: int, probabilities: Mapping[str, Any],
                                     where: str = "the model") -> None:
    """Refuse dropout under tensor parallelism: any of ``probabilities`` (``{"attention_dropout": 0.1}``, or a
    module's path and its ``p``) above 0 with ``tensor_parallel_size > 1``, naming it and what would run. Every rank
    of a stage draws from one stream (pipeline/randomness.py), so each would drop the same positions of its own
    shard (its heads, its columns), not its slice of one device's mask: another model would be trained."""
    drawn = {name: p for name, p in probabilities.items()
             if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0}
    if tensor_parallel_size == 1 or not drawn:
        return
    given = ", ".join(f"{name}={p}" for name, p in drawn.items())
    zeros = ", ".join(f"{name}=0" for name in drawn)
    raise ValueError(f"{where} with tensor_parallel_size={tensor_parallel_size} takes no dropout, got {given}: "
                     f"every tensor-parallel rank would draw the same mask for its own shard, not its slice of one "
                     f"device's mask; set {zeros}, or use tensor_parallel_size=1")


def build_device_mesh(layout: MeshLayout, device_type: str) -> Any:
    """The ``DeviceMesh`` of ``layout`` over the default process group (collective: every rank calls it), with
    dimensions :data:`MESH_DIMS`; with ``expert_parallel_size > 1``, :data:`EXPERT_MESH_DIMS`, whose first two
    flattened are ``"data_parallel"``. Its row-major order is :class:`MeshLayout`'s, which is checked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_device_mesh needs an initialized default process group")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the layout is for {layout.world_size} process(es), the process group has "
                         f"{dist.get_world_size()}")
    rank = dist.get_rank()
    expected = {"data_parallel": layout.data_parallel_ranks(rank), "pipeline": layout.pipeline_ranks(rank),
                "tensor_parallel": layout.tensor_parallel_ranks(rank)}
    if layout.expert_parallel_size > 1:
        if layout.tensor_parallel_size > 1 or layout.data_parallel_size % layout.expert_parallel_size:
            raise ValueError("expert parallelism with tensor_parallel_size > 1 has no device mesh yet "
                             f"(tensor_parallel_size={layout.tensor_parallel_size}); use tensor_parallel_size=1")
        # The replicas as (copy, place in the expert group); "data_parallel" the two flattened, as torchtitan cuts
        # its expert view out of the data-parallel ranks.
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=EXPERT_MESH_DIMS)
        flat = mesh["expert_data_parallel", "expert_parallel"]._flatten("data_parallel")  # torch-private
        views = {"data_parallel": flat}  # held here: torch warns when a flattened dimension is sliced from the root
        expected.update(expert_parallel=layout.expert_parallel_ranks(rank),
                        expert_data_parallel=layout.expert_data_parallel_ranks(rank))
    else:
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
        views = {}
    for name, ranks in expected.items():
        found = (views[name] if name in views else mesh[name]).mesh.flatten().tolist()
        if found != ranks:  # torch's mesh order changed: the groups would not be the layout's
            raise RuntimeError(f"DeviceMesh dimension {name!r} of rank {rank} holds ranks {found}, the layout "
                               f"expects {ranks}")
    return mesh
