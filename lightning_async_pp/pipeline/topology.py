"""Which rank is which stage of which pipeline, and the process groups that follow from it.

Ranks are laid out pipeline by pipeline: rank ``r`` is stage ``r % p`` of data-parallel replica ``r // p``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class PipelineTopology:
    world_size: int
    data_parallel_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1 or self.world_size % self.data_parallel_size != 0:
            raise ValueError(
                f"{self.world_size} process(es) cannot be split into data_parallel_size={self.data_parallel_size} "
                f"equal pipelines; use a device count (devices x num_nodes) that is a multiple of "
                f"{self.data_parallel_size}, or a data_parallel_size that divides {self.world_size}"
            )

    @property
    def num_stages(self) -> int:
        return self.world_size // self.data_parallel_size

    @property
    def stage(self) -> int:
        return self.rank % self.num_stages

    @property
    def dp_rank(self) -> int:
        return self.rank // self.num_stages

    def rank_of(self, stage: int, dp_rank: Optional[int] = None) -> int:
        return (self.dp_rank if dp_rank is None else dp_rank) * self.num_stages + stage

    @property
    def pipeline_ranks(self) -> list[int]:
        return [self.rank_of(s) for s in range(self.num_stages)]

    @property
    def rank_to_stage(self) -> dict[int, int]:
        return {r: r % self.num_stages for r in range(self.world_size)}

    def create_dp_group(self) -> Any:
        """The group of this stage's data-parallel replicas. Every rank must call this (``new_group`` is collective)."""
        if self.data_parallel_size == 1 or not dist.is_initialized():
            return None
        mine = None
        for stage in range(self.num_stages):
            group = dist.new_group([self.rank_of(stage, d) for d in range(self.data_parallel_size)])
            if stage == self.stage:
                mine = group
        return mine
