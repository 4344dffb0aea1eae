"""Which rank is which stage (and tensor-parallel rank) of which pipeline, and the process groups that follow.

The layout is :class:`~lightning_async_pp.parallel.mesh.MeshLayout`'s: ``rank = (replica * stages + stage) * t +
tp_rank``, the ``t`` tensor-parallel ranks of a stage adjacent. With ``t = 1`` rank ``r`` is stage ``r % p`` of
replica ``r // p``. A pipeline is the ranks with one replica and one tensor-parallel rank: each rank's
point-to-point peers are the same tensor-parallel rank of the neighbouring stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from lightning_async_pp.parallel.mesh import MeshLayout


@dataclass(frozen=True)
class PipelineTopology:
    world_size: int
    data_parallel_size: int
    rank: int
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", MeshLayout(self.world_size, self.data_parallel_size,
                                                      self.tensor_parallel_size, self.expert_parallel_size))  # refuses sizes that do not divide

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def stage(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[2]

    def rank_of(self, stage: int, dp_rank: Optional[int] = None, tp_rank: Optional[int] = None) -> int:
        return self.layout.rank_of(self.dp_rank if dp_rank is None else dp_rank, stage,
                                   self.tp_rank if tp_rank is None else tp_rank)

    @property
    def pipeline_ranks(self) -> list[int]:
        """This rank's pipeline, stage by stage (same replica, same tensor-parallel rank)."""
        return self.layout.pipeline_ranks(self.rank)

    @property
    def rank_to_stage(self) -> dict[int, int]:
        return {r: self.layout.coordinates(r)[1] for r in range(self.world_size)}

    def create_dp_group(self) -> Any:
        """The group of this shard's data-parallel replicas (same stage, same tensor-parallel rank). Every rank must
        call this (``new_group`` is collective)."""
        if self.data_parallel_size == 1 or not dist.is_initialized():
            return None
        mine = None
        for stage in range(self.num_stages):
            for tp in range(self.tensor_parallel_size):
                group = dist.new_group([self.rank_of(stage, d, tp) for d in range(self.data_parallel_size)])
                if (stage, tp) == (self.stage, self.tp_rank):
                    mine = group
        return mine
