"""The data parallel x pipeline x tensor-parallel layout (parallel/mesh.py): its arithmetic against a layout
written out by hand and against PipelineTopology, its refusals, and torch's DeviceMesh built from it on a fake
process group of 8 ranks (one process; no communication)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_async_pp.parallel.mesh import MESH_DIMS, MeshLayout, build_device_mesh, check_tensor_parallel_divides
from lightning_async_pp.parallel.topology import PipelineTopology


def test_tensor_parallel_ranks_of_a_stage_are_adjacent_then_stages_then_replicas():
    layout = MeshLayout(world_size=8, data_parallel_size=2, tensor_parallel_size=2)
    assert layout.num_stages == 2 and layout.shape == (2, 2, 2)
    # written out: (replica, stage, tp_rank) of ranks 0..7
    expected = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [layout.coordinates(r) for r in range(8)] == expected
    assert [layout.rank_of(*c) for c in expected] == list(range(8))
    assert layout.tensor_parallel_ranks(5) == [4, 5]
    assert layout.pipeline_ranks(5) == [5, 7]  # its peer in the other stage has the same tp_rank
    assert layout.data_parallel_ranks(5) == [1, 5]


def test_one_tensor_parallel_rank_is_the_pipeline_topology_layout():
    for world, dp in ((6, 1), (6, 2), (6, 3), (8, 4)):
        layout, topo = MeshLayout(world, dp), PipelineTopology(world, dp, rank=0)
        assert layout.num_stages == topo.num_stages
        for r in range(world):
            replica, stage, tp = layout.coordinates(r)
            assert tp == 0 and (stage, replica) == (PipelineTopology(world, dp, r).stage, PipelineTopology(world, dp, r).dp_rank)
            assert layout.rank_of(replica, stage, 0) == topo.rank_of(stage, replica)


def test_sizes_that_do_not_divide_the_processes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"6 process\(es\).*tensor_parallel_size=4.*1 x 4 = 4.*among \[1, 2, 3, 6\]"):
        MeshLayout(world_size=6, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"8 process\(es\).*data_parallel_size=3.*3 x 2 = 6.*6, 12, 18"):
        MeshLayout(world_size=8, data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        MeshLayout(world_size=4, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="rank 8 is out of range for 8"):
        MeshLayout(world_size=8, tensor_parallel_size=2).coordinates(8)
    with pytest.raises(ValueError, match=r"tp_rank 2 is out of range: the layout has 2"):
        MeshLayout(world_size=8, tensor_parallel_size=2).rank_of(0, 0, 2)


def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused_naming_the_size():
    check_tensor_parallel_divides(4, {"num_heads": 32, "num_kv_heads": 8, "hidden_size": 4096, "bias": None})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 is larger than stage 1's num_kv_heads=2.*\[1, 2\]"):
        check_tensor_parallel_divides(4, {"num_heads": 8, "num_kv_heads": 2}, where="stage 1")
    # the sizes suggested split every size named, not only the one refused
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's hidden_size=6.*among "
                                         r"\[1, 2\] \(the sizes that split num_heads, hidden_size\)"):
        check_tensor_parallel_divides(4, {"num_heads": 4, "hidden_size": 6})


def test_the_tensor_parallel_sizes_suggested_for_a_model_also_divide_the_processes_of_a_pipeline_replica(fake_world):
    """3 heads at tensor_parallel_size=2 on 4 processes: 3 splits the heads but not the 4 processes (it suggested
    [1, 3]); on 6 processes it does."""
    from lightning_async_pp.models import Llama
    from lightning_async_pp.parallel.mesh import replica_processes
    from lightning_async_pp.parallel.placement import parameters_on_meta

    def refusal(world: int, data_parallel: int = 1) -> str:
        fake_world(0, world_size=world)
        model = Llama("tiny", vocab_size=264, hidden_size=48, num_heads=3, num_kv_heads=3, intermediate_size=96)
        model._device_mesh = build_device_mesh(MeshLayout(world, data_parallel, tensor_parallel_size=2), "cpu")
        assert replica_processes(model._device_mesh) == world // data_parallel
        with parameters_on_meta(), pytest.raises(ValueError) as caught:
            model.configure_model()
        dist.destroy_process_group()
        return str(caught.value)

    assert ("tensor_parallel_size=2 does not divide Llama's num_heads=3: each tensor-parallel rank must hold an equal "
            "share; use tensor_parallel_size=1 (the sizes that split num_heads, num_kv_heads, intermediate_size, "
            "vocab_size and divide the 4 processes of a pipeline replica)") == refusal(4)
    assert "use a tensor_parallel_size among [1, 3] (" in refusal(6) and "divide the 6 processes" in refusal(6)
    assert "divide the 6 processes" in refusal(12, data_parallel=2)  # a replica's processes, not all
    assert replica_processes(None) is None


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process (torch's test backend: collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world_size: int = 8) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 5, 6])
def test_device_mesh_dimensions_hold_the_layouts_groups(fake_world, rank):
    fake_world(rank)
    layout = MeshLayout(world_size=8, data_parallel_size=2, tensor_parallel_size=2)
    mesh = build_device_mesh(layout, "cpu")
    assert mesh.mesh_dim_names == MESH_DIMS
    assert mesh["tensor_parallel"].mesh.tolist() == layout.tensor_parallel_ranks(rank)
    assert mesh["pipeline"].mesh.tolist() == layout.pipeline_ranks(rank)
    assert mesh["data_parallel"].mesh.tolist() == layout.data_parallel_ranks(rank)
    assert tuple(mesh.get_coordinate()) == layout.coordinates(rank)


def test_device_mesh_refuses_a_layout_for_another_process_count(fake_world):
    fake_world(0, world_size=4)
    with pytest.raises(ValueError, match=r"layout is for 8 process\(es\), the process group has 4"):
        build_device_mesh(MeshLayout(world_size=8, tensor_parallel_size=2), "cpu")
