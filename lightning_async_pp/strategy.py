"""``AsyncPipelineStrategy``: the Lightning adapter around the pipeline engine.

Lightning keeps doing what it does (launching processes, the training loop, the optimizer/scheduler/clipping
calls, logging, checkpoints); this class only

- builds the stage(s) from ``PipelineModule.pipeline_layers()`` in ``setup``,
- runs the pipeline inside ``training_step`` (the engine does every microbatch's forward and backward),
- puts the batch gradient back in ``backward`` (Lightning zeroes ``.grad`` between ``training_step`` and
  ``backward``, so the engine keeps the gradient itself) and moves the parameters onto the slot that will hold
  the next version, so the optimizer's in-place update leaves the stashed version intact,
- saves and restores the stashed versions with the checkpoint.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_async_pp.module import PipelineModule
from lightning_async_pp.pipeline.comm import FailureBoard, StageLink
from lightning_async_pp.pipeline.partition import PartitionSpec, partition_layers
from lightning_async_pp.pipeline.placement import (
    check_parameters_covered,
    layer_paths,
    remove_other_stages,
    restore_layers,
)
from lightning_async_pp.pipeline.runtime import DistributedPipeline, LocalPipeline
from lightning_async_pp.pipeline.schedule import SCHEDULES, check_schedule
from lightning_async_pp.pipeline.stage import Stage
from lightning_async_pp.pipeline.topology import PipelineTopology

log = logging.getLogger(__name__)

DelaySpec = Union[int, Sequence[int], None]


class AsyncPipelineStrategy(DDPStrategy):
    """Pipeline-parallel training of a :class:`~lightning_async_pp.PipelineModule`.

    Args:
        schedule: ``"2bw"`` (asynchronous PipeDream-2BW: no flushes, two weight versions, every batch's gradient
            taken at the previous version), ``"1f1b"`` or ``"gpipe"`` (synchronous, flush every batch).
        num_microbatches: microbatches each batch is split into along dim 0. Default: the number of stages, at
            least 4 (``2bw`` needs at least one per stage).
        data_parallel_size: pipelines side by side; the stages are the processes divided by this.
        partition: ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer counts) or a list of
            layer counts per stage.
        delay: research variants (one device): an integer ``d >= 0`` takes every gradient at ``W_{k-d}``; a list
            gives each stage its own delay (``[p-1, ..., 1, 0]`` models original PipeDream). Default: 1 for ``2bw``,
            0 for the synchronous schedules.
        sync_steps: run the first ``sync_steps`` updates synchronously, then the configured schedule.
        num_stages: stages on one device (the layers are split and each stage keeps its own versions; only
            meaningful with a per-stage ``delay``). With several processes the stages are the processes.
        gather_final_weights: at the end of ``fit``, gather every stage's weights into rank 0's module (turn off
            for models too large for one host).
        pipeline_timeout: seconds a stage waits for a neighbour before it gives up and names it; also the process
            group timeout, so a failed or dead stage stops the others within about this long.
    """

    strategy_name = "async_pipeline"

    def __init__(
        self,
        schedule: str = "2bw",
        num_microbatches: Optional[int] = None,
        data_parallel_size: int = 1,
        partition: PartitionSpec = "parameters",
        delay: DelaySpec = None,
        sync_steps: int = 0,
        num_stages: Optional[int] = None,
        gather_final_weights: bool = True,
        pipeline_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}; valid schedules are {', '.join(map(repr, SCHEDULES))}")
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
            raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        if not isinstance(sync_steps, int) or sync_steps < 0:
            raise ValueError(f"sync_steps must be an integer >= 0, got {sync_steps!r}")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
        if pipeline_timeout <= 0:
            raise ValueError(f"pipeline_timeout must be > 0 seconds, got {pipeline_timeout!r}")
        _check_delay(delay)
        kwargs.setdefault("timeout", timedelta(seconds=pipeline_timeout))
        super().__init__(**kwargs)
        self.schedule = schedule
        self._num_microbatches = num_microbatches
        self.data_parallel_size = data_parallel_size
        self.partition = partition
        self.delay = delay
        self.sync_steps = sync_steps
        self._requested_num_stages = num_stages
        self.gather_final_weights = gather_final_weights
        self.pipeline_timeout = float(pipeline_timeout)
        self.executor: Optional[Union[LocalPipeline, DistributedPipeline]] = None
        self._layers: list[torch.nn.Module] = []
        self._layer_paths: list[str] = []
        self._stage_of_layer: list[int] = []
        self._pipeline_group: Any = None
        self._board = FailureBoard(None)
        self._update_started: Optional[float] = None
        # Data-loader states recorded before each fetch, so a checkpoint can record the position before batches
        # that were fetched ahead (by the lookahead and by the fetcher's refill after it) but not trained yet.
        self._states_before_fetch: deque = deque(maxlen=8)

    # ---- shape of the run -------------------------------------------------------------------------------------
    @property
    def world_size_total(self) -> int:
        return max(1, self.num_nodes * self.num_processes)

    @property
    def is_multiprocess(self) -> bool:
        return self.world_size_total > 1

    @property
    def topology(self) -> PipelineTopology:
        return PipelineTopology(self.world_size_total, self.data_parallel_size, self.global_rank)

    @property
    def num_stages(self) -> int:
        if self.is_multiprocess:
            return self.topology.num_stages
        if self._requested_num_stages is not None:
            return self._requested_num_stages
        return len(self.delay) if isinstance(self.delay, (list, tuple)) else 1

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches if self._num_microbatches is not None else max(4, self.num_stages)

    def stage_delays(self) -> list[int]:
        """The delay (in updates) of each stage's gradients."""
        if self.delay is None:
            return [1 if self.schedule == "2bw" else 0] * self.num_stages
        if isinstance(self.delay, int):
            return [self.delay] * self.num_stages
        delays = [int(d) for d in self.delay]
        if len(delays) != self.num_stages:
            raise ValueError(
                f"delay={delays} gives {len(delays)} per-stage delays but the pipeline has {self.num_stages} "
                f"stage(s); give one delay per stage (num_stages={len(delays)} on one device)"
            )
        return delays

    def _validate_layout(self) -> None:
        """Checks that need only the process count: run before any process is started."""
        if self.is_multiprocess:
            topology = self.topology  # raises if the processes do not split into data_parallel_size pipelines
            if self._requested_num_stages not in (None, topology.num_stages):
                raise ValueError(
                    f"num_stages={self._requested_num_stages} does not match the {topology.num_stages} stages given by "
                    f"{self.world_size_total} processes / data_parallel_size={self.data_parallel_size}"
                )
            expected = 1 if self.schedule == "2bw" else 0
            if any(d != expected for d in self.stage_delays()) and self.delay is not None:
                raise ValueError(
                    f"delay={self.delay!r} is a one-device research variant; across processes the delay follows the "
                    f"schedule ({self.schedule!r} has delay {expected}). Run it with devices=1 or drop delay"
                )
        elif self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} needs at least that many processes; got one device"
            )
        self.stage_delays()
        check_schedule(self.schedule, self.num_stages, self.num_microbatches)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of one pipeline must see the same batch: shard by data-parallel rank only.
        if not self.is_multiprocess:
            return {"num_replicas": 1, "rank": 0}
        topology = self.topology
        return {"num_replicas": topology.data_parallel_size, "rank": topology.dp_rank}

    # ---- launching and process groups -------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._validate_layout()
        super()._configure_launcher()

    def setup_environment(self) -> None:
        if self.is_multiprocess and self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Stages on one host share its cores: give each process its share instead of letting every process
            # start a thread per core and oversubscribe them (torchrun does the same with OMP_NUM_THREADS=1).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        if not self.is_multiprocess:
            # One process is not data parallel: keep the user's own sampler, as single-device Lightning does,
            # instead of the shuffling DistributedSampler that Lightning injects for a DDP-derived strategy.
            self.lightning_module.trainer._accelerator_connector.use_distributed_sampler = False
        super().setup_environment()

    def setup_distributed(self) -> None:
        if not self.is_multiprocess:
            return  # one process needs no process group: every stage runs here
        super().setup_distributed()
        self._board = FailureBoard.from_default_group()
        topology = self.topology
        self._dp_group = topology.create_dp_group()
        # One group per pipeline, for the cross-stage gradient norm when clipping is on.
        for d in range(topology.data_parallel_size):
            group = dist.new_group([topology.rank_of(s, d) for s in range(topology.num_stages)])
            if d == topology.dp_rank:
                self._pipeline_group = group

    # ---- building the pipeline --------------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(
                f"AsyncPipelineStrategy trains a lightning_async_pp.PipelineModule; got {type(module).__name__}. "
                f"Derive your model from PipelineModule and implement pipeline_layers() and pipeline_loss()"
            )
        self._validate_layout()
        self.model = self.precision_plugin.convert_module(self.model)
        self._build_pipeline(module)
        self.model_to_device()
        self._build_executor(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.is_multiprocess:
            # Lightning broadcasts a SIGTERM flag from rank 0 at the start of every training step: a barrier
            # across all stages that would put a bubble back into 2BW. Check the local flag instead; a stage that
            # stops makes its neighbours stop through the pipeline's own failure handling.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self._check_sigterm_locally
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by "
                    f"AsyncPipelineStrategy; raise num_microbatches and the batch size instead (use 1)"
                )

    def _build_pipeline(self, module: PipelineModule) -> None:
        # The full layer list is remembered on the module: after a multi-process fit, other stages' layers are
        # RemoteLayer placeholders in the tree, and a later validate/test must still find the originals.
        layers = getattr(module, "_pipeline_all_layers", None) or list(module.pipeline_layers())
        if len(layers) == 0:
            raise ValueError(f"{type(module).__name__}.pipeline_layers() returned no layers; return at least one nn.Module")
        if not getattr(module, "_pipeline_all_layers", None):
            object.__setattr__(module, "_pipeline_all_layers", layers)
            object.__setattr__(module, "_pipeline_layer_paths", layer_paths(module, layers))
        self._layers, self._layer_paths = layers, module._pipeline_layer_paths
        ranges = partition_layers(layers, self.num_stages, self.partition)
        self._stage_of_layer = [s for s, r in enumerate(ranges) for _ in r]
        check_parameters_covered(module, layers, self._stage_of_layer)
        self._ranges = ranges
        if self.is_multiprocess:
            remove_other_stages(module, layers, self._layer_paths, self._stage_of_layer, self.topology.stage)

    def _build_executor(self, module: PipelineModule) -> None:
        delays = self.stage_delays()
        input_fn, loss_fn = module.pipeline_input, module.pipeline_loss
        if not self.is_multiprocess:
            stages = [
                Stage([self._layers[i] for i in r], s, self.num_stages, delay=delays[s], sync_steps=self.sync_steps)
                for s, r in enumerate(self._ranges)
            ]
            self.executor = LocalPipeline(stages, self.num_microbatches, input_fn, loss_fn)
        else:
            topology = self.topology
            s = topology.stage
            stage = Stage([self._layers[i] for i in self._ranges[s]], s, self.num_stages, delay=delays[s],
                          sync_steps=self.sync_steps)
            ranks = topology.pipeline_ranks
            link = StageLink(
                stage=s, rank=self.global_rank,
                prev_rank=ranks[s - 1] if s > 0 else None,
                next_rank=ranks[s + 1] if s + 1 < len(ranks) else None,
                device=self.root_device, timeout=self.pipeline_timeout, board=self._board,
                rank_to_stage=topology.rank_to_stage,
            )
            self.executor = DistributedPipeline(
                stage, link, schedule=self.schedule, num_microbatches=self.num_microbatches,
                input_fn=input_fn, loss_fn=loss_fn, pipeline_ranks=ranks,
                dp_group=getattr(self, "_dp_group", None), dp_size=topology.data_parallel_size,
            )
        module._pipeline_executor = self

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- the PipelineExecutor protocol that PipelineModule calls ----------------------------------------------
    def train_loss(self, batch: Any) -> Tensor:
        assert self.executor is not None
        try:
            return self.executor.train_batch(batch, self._next_batch())
        except BaseException as err:
            self._report_failure(err)
            raise

    def eval_loss(self, batch: Any) -> Tensor:
        assert self.executor is not None
        try:
            return self.executor.eval_loss(batch)
        except BaseException as err:
            self._report_failure(err)
            raise

    def _next_batch(self) -> Any:
        """The next training batch, for 2BW's lookahead, or ``None`` when this step is the last before a stop.

        Lightning fetches batches one step at a time; 2BW starts the next batch's forwards before this batch's
        last backwards. The batch is fetched through Lightning's own data fetcher, which then hands it to the
        loop as usual at the next step.
        """
        executor = self.executor
        if not isinstance(executor, DistributedPipeline) or not executor.uses_lookahead(True):
            return None
        trainer = self.lightning_module.trainer
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return None
        fetch_loop = trainer.fit_loop
        if fetch_loop.epoch_loop.batch_progress.current.ready + 1 > trainer.num_training_batches:
            return None
        fetcher = fetch_loop._data_fetcher
        batches = getattr(fetcher, "batches", None)
        if fetcher is None or batches is None:
            return None
        if not isinstance(fetcher.iterator, _StateRecordingIterator) and fetch_loop._combined_loader is not None:
            fetcher.iterator = _StateRecordingIterator(fetcher.iterator, fetch_loop._combined_loader, self._states_before_fetch)
        if not batches:
            if fetcher.done:
                return None
            done = fetcher.done
            try:
                batches.append(_DataFetcher.__next__(fetcher))  # fetch one more without consuming it
            except StopIteration:
                return None
            # The batch is not consumed yet: undo the count and flag so that Lightning, which takes it from
            # `batches` at the next step, still ends the epoch after its last batch, not one before.
            fetcher.fetched -= 1
            fetcher.done = done
        batch = batches[0][0] if isinstance(batches[0], tuple) else batches[0]
        module = self.lightning_module
        batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
        return self.batch_to_device(batch, dataloader_idx=0)

    # ---- gradients and the update -----------------------------------------------------------------------------
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Hand the pipeline's batch gradient to the optimizer (the backward passes already ran in the pipeline)."""
        assert self.executor is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, g in zip(self.executor.params, self.executor.gradients):
            p.grad = g
        if self._pipeline_group is not None and module.trainer.gradient_clip_val:
            self._clip_across_stages(float(module.trainer.gradient_clip_val), module.trainer.gradient_clip_algorithm)
        # From here the optimizer writes W_{k+1} into the other slot; the stash W_k stays for batch k+1.
        self.executor.prepare_update()
        self._update_started = time.perf_counter()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.executor is not None and self._update_started is not None:
            self.executor.record_optimizer(self._update_started, time.perf_counter())
            self._update_started = None
        return output

    @torch.no_grad()
    def _clip_across_stages(self, clip_val: float, algorithm: Optional[str]) -> None:
        """Global-norm clipping needs the norm over all stages: scale the local gradients by the global factor.

        Lightning's own (per-stage) clipping that follows then sees a norm below the bound and changes nothing.
        This all-reduce is one small synchronization per step between stages, paid only when clipping by norm.
        """
        if algorithm not in (None, "norm"):
            return  # clipping by value is elementwise: local clipping is already exact
        grads = [g for g in self.executor.gradients if g is not None]
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=self.root_device)
        dist.all_reduce(sq, group=self._pipeline_group)
        total = sq.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    # ---- failures -------------------------------------------------------------------------------------------
    def _check_sigterm_locally(self) -> None:
        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            self._board.report(f"stage {self.topology.stage} (rank {self.global_rank}) received SIGTERM")
            raise SIGTERMException()

    def _report_failure(self, err: BaseException) -> None:
        if self.is_multiprocess:
            from lightning_async_pp.pipeline.comm import PipelineFailure

            if not isinstance(err, PipelineFailure):
                message = f"stage {self.topology.stage} (rank {self.global_rank}) failed: {type(err).__name__}: {err}"
                self._board.report(message)
                # Said here too: Lightning's launcher may stop the other processes before they can repeat it.
                print(f"lightning_async_pp: {message}", file=sys.stderr, flush=True)

    def on_exception(self, exception: BaseException) -> None:
        self._report_failure(exception)
        super().on_exception(exception)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The stashed versions live in the pipeline's stages, which exist only after setup.
        return True

    def _gather_to_zero(self, obj: Any) -> Optional[list[Any]]:
        if not self.is_multiprocess:
            return [obj]
        out = [None] * self.world_size_total if self.is_global_zero else None
        dist.gather_object(obj, out, dst=0)
        return out

    def _pipeline_state(self) -> dict[str, Any]:
        """This stage's part of a checkpoint: its weight versions and optimizer state."""
        assert self.executor is not None
        return {
            "versions": self.executor.state_dict(),
            "optimizer": [opt.state_dict() for opt in self.optimizers],
        }

    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        if not self.is_multiprocess:
            return module.state_dict()
        parts = self._gather_to_zero(_cpu(module.state_dict()) if self.topology.dp_rank == 0 else {})
        if parts is None:
            return {}
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # Across processes each stage has its own optimizer; their states are saved per stage (_pipeline_state).
        return {} if self.is_multiprocess else optimizer.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.executor is not None:
            parts = self._gather_to_zero(_cpu(self._pipeline_state()) if self.topology.dp_rank == 0 else None)
            if parts is not None:
                stages = [p for p in parts if p is not None]
                checkpoint["async_pipeline"] = {
                    "schedule": self.schedule,
                    "num_stages": self.num_stages,
                    "stages": stages if self.is_multiprocess else None,
                    "versions": stages[0]["versions"] if not self.is_multiprocess else None,
                }
        self._rewind_data_position(checkpoint)
        if self.is_global_zero:
            # Write beside the target and rename: a crash mid-write leaves the previous checkpoint intact.
            path = os.fspath(filepath)
            tmp = f"{path}.tmp-{os.getpid()}"
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            os.replace(tmp, path)

    def _rewind_data_position(self, checkpoint: dict[str, Any]) -> None:
        """Record the data position before the batches fetched ahead: they have not been trained on yet."""
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        fetcher = self.lightning_module.trainer.fit_loop._data_fetcher
        pending = len(getattr(fetcher, "batches", None) or [])
        if "combined_loader" in fit_state and isinstance(getattr(fetcher, "iterator", None), _StateRecordingIterator):
            if 0 < pending <= len(self._states_before_fetch):
                fit_state["combined_loader"] = self._states_before_fetch[-pending]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        state = checkpoint["state_dict"]
        if self.is_multiprocess:
            own = module.state_dict()
            module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=strict)
        else:
            module.load_state_dict(state, strict=strict)
        saved = checkpoint.get("async_pipeline")
        if saved is None or self.executor is None:
            return
        if saved.get("num_stages") != self.num_stages:
            raise ValueError(
                f"checkpoint was saved with {saved.get('num_stages')} pipeline stage(s); this run has {self.num_stages}"
            )
        if self.is_multiprocess:
            part = saved["stages"][self.topology.stage]
            self.executor.load_state_dict(part["versions"])
        else:
            self.executor.load_state_dict(saved["versions"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.is_multiprocess:
            return super().load_optimizer_state_dict(checkpoint)
        part = checkpoint["async_pipeline"]["stages"][self.topology.stage]
        for optimizer, opt_state in zip(self.optimizers, part["optimizer"]):
            optimizer.load_state_dict(opt_state)
            _optimizer_to_device(optimizer, self.root_device)

    # ---- end of training ----------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        """Every stage is at ``W_N`` (each update was applied in its own step); gather them into rank 0's module."""
        super().on_train_end()
        if self.is_multiprocess and self.gather_final_weights:
            self.gather_model_to_rank_zero()

    def gather_model_to_rank_zero(self) -> None:
        module = self.lightning_module
        own = _cpu(module.state_dict()) if self.topology.dp_rank == 0 else {}
        parts = self._gather_to_zero(own)
        if parts is not None:
            merged: dict[str, Tensor] = {}
            for part in parts:
                merged.update(part)
            restore_layers(module, self._layers, self._layer_paths, merged, self.root_device)
            module.load_state_dict(merged)

    def teardown(self) -> None:
        module = self.lightning_module
        if isinstance(module, PipelineModule):
            module._pipeline_executor = None
        super().teardown()


class _StateRecordingIterator:
    """Wraps the fit loop's batch iterator to record the stateful loaders' states before every fetch."""

    def __init__(self, iterator: Any, combined_loader: Any, states: deque) -> None:
        self.iterator, self.combined_loader, self.states = iterator, combined_loader, states

    def __iter__(self) -> "_StateRecordingIterator":
        return self

    def __next__(self) -> Any:
        self.states.append(copy.deepcopy(self.combined_loader._state_dicts()))
        return next(self.iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.iterator, name)


def _check_delay(delay: DelaySpec) -> None:
    if delay is None:
        return
    values = [delay] if isinstance(delay, int) and not isinstance(delay, bool) else delay
    if not isinstance(values, (list, tuple)) or not values or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in values
    ):
        raise ValueError(f"delay must be an integer >= 0 or a non-empty list of them, got {delay!r}")
    if any(d < 0 for d in values):
        raise ValueError(f"delay must be >= 0 (0 is synchronous, 1 is 2BW), got {delay!r}")


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return type(obj)((k, _cpu(v)) for k, v in obj.items()) if not isinstance(obj, dict) else {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


StrategyRegistry.register(
    AsyncPipelineStrategy.strategy_name,
    AsyncPipelineStrategy,
    description="Pipeline parallelism with asynchronous PipeDream-2BW (lightning-async-pp)",
)
