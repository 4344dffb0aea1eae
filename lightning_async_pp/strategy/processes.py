"""The processes of a run: its shape (stages, replicas and tensor-parallel ranks from the process count), the
launcher, the process groups and the device mesh (:class:`ProcessLayout`, a mixin of ``AsyncPipelineStrategy``),
and around Lightning's launch: RNG states kept across DDP's re-seeding, every process group destroyed at exit. See
docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

import atexit
import os
import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_async_pp.lightning_callbacks import check_callbacks
from lightning_async_pp.parallel.mesh import build_device_mesh
from lightning_async_pp.parallel.topology import PipelineTopology
from lightning_async_pp.pipeline.comm import elastic_attempt_store
from lightning_async_pp.strategy import _lightning

_DESTROY_AT_EXIT = [False]  # registered once per process


def destroy_process_groups_at_exit() -> None:
    """Destroy every process group while the interpreter is still alive at exit. Lightning does this under NCCL
    only; under gloo an undestroyed group's worker threads may still hold finished work when the interpreter
    finalizes, and the process then aborts after a successful run ("terminate called without an active
    exception", exit code -6: one run in about ten of the 4-process tests). Registered after Lightning's own
    handler, so it runs first; Lightning's then finds nothing to destroy."""
    if not _DESTROY_AT_EXIT[0]:
        _DESTROY_AT_EXIT[0] = True
        atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rng_states() -> tuple:
    """This process's RNG states (Python, NumPy, torch's CPU and, where CUDA is initialized, CUDA generators)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_states(states: tuple) -> None:
    """Put back what :func:`rng_states` returned."""
    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class ProcessLayout:
    """``AsyncPipelineStrategy``'s processes: the run's shape from the process count (``self.config``, a
    ``PipelineConfig``), one process without a launcher, the process groups and the mesh before the model is built."""

    # ---- shape of the run -------------------------------------------------------------------------------------
    @property
    def schedule(self) -> str:
        return self.config.schedule

    @property
    def data_parallel_size(self) -> int:
        return self.config.data_parallel_size

    @property
    def world_size_total(self) -> int:
        return max(1, self.num_nodes * self.num_processes)

    @property
    def is_multiprocess(self) -> bool:
        return self.world_size_total > 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        # One process runs on its one device, as single-device Lightning does, even where the environment names
        # another local rank (a one-device Trainer in a script that Lightning's launcher re-ran as rank 1).
        return self.parallel_devices[self.local_rank if self.is_multiprocess else 0]

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def topology(self) -> PipelineTopology:
        return PipelineTopology(self.world_size_total, self.data_parallel_size, self.global_rank,
                                self.tensor_parallel_size, self.config.expert_parallel_size)

    @property
    def device_mesh(self) -> Any:
        """With ``tensor_parallel_size > 1``: the ``DeviceMesh`` (dimensions ``"data_parallel"``, ``"pipeline"``,
        ``"tensor_parallel"``; with ``expert_parallel_size > 1`` also ``"expert_parallel"`` and
        ``"expert_data_parallel"``, parallel/mesh.py) that ``configure_model`` reads as ``self.device_mesh``;
        ``None`` otherwise."""
        return self._device_mesh

    @property
    def num_stages(self) -> int:
        return self.config.stages_for(self.world_size_total)

    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches_for(self.num_stages)

    def stage_delays(self) -> list[int]:
        """The delay (in updates) of each stage's gradients."""
        return self.config.stage_delays(self.num_stages)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of one pipeline must see the same batch: shard by data-parallel rank only.
        if not self.is_multiprocess:
            return {"num_replicas": 1, "rank": 0}
        topology = self.topology
        return {"num_replicas": topology.data_parallel_size, "rank": topology.dp_rank}

    # ---- launching and process groups -------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self.config.check(self.world_size_total)  # before any process is started
        if not self.is_multiprocess:
            # One process needs no launcher, as single-device Lightning has none. DDP's would set LOCAL_RANK in
            # the environment, and a later multi-process Trainer in the same script would then take its processes
            # to be started externally and wait for ranks that nobody starts.
            self._launcher = None
            return
        super()._configure_launcher()

    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            # Before the callbacks' own setup (weight averaging copies the model there) and any process group.
            check_callbacks(trainer.callbacks, processes=self.world_size_total, num_stages=self.num_stages)
        if self.is_multiprocess and self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Stages on one host share its cores: give each process its share instead of letting every process
            # start a thread per core and oversubscribe them (torchrun does the same with OMP_NUM_THREADS=1).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        if self.data_parallel_size == 1:
            # One pipeline is not data parallel: keep the user's own sampler, as single-device Lightning does,
            # instead of the shuffling DistributedSampler that Lightning injects for a DDP-derived strategy.
            _lightning.keep_user_sampler(self.lightning_module.trainer)
        super().setup_environment()

    def setup_distributed(self) -> None:
        if not self.is_multiprocess:
            return  # one process needs no process group: every stage runs here
        # DDP re-seeds every process here (reset_seed), after the model was built. Every stage runs the same
        # script, so their RNGs already agree; keeping them as they are makes a seeded run draw (sampler
        # permutations, dropout) as on one device.
        states = rng_states()
        store = elastic_attempt_store(self._timeout)
        if store is not None and not torch.distributed.is_initialized():
            # Under torchrun: the process group on this restart attempt's own keys (comm.elastic_attempt_store);
            # Lightning's setup then finds it initialized and goes on.
            self.set_world_ranks()
            torch.distributed.init_process_group(self._get_process_group_backend(), store=store, rank=self.global_rank,
                                                 world_size=self.world_size, timeout=self._timeout)
        super().setup_distributed()
        set_rng_states(states)
        destroy_process_groups_at_exit()
        if self.tensor_parallel_size > 1 or self.config.expert_parallel_size > 1:
            # Before configure_model, which applies the model's plan to the mesh's "tensor_parallel" dimension (and
            # shards its experts over "expert_parallel").
            self._device_mesh = build_device_mesh(self.topology.layout, self.root_device.type)
            _lightning.set_device_mesh(self.lightning_module, self._device_mesh)
