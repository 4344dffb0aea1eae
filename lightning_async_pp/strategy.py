"""``AsyncPipelineStrategy``: the Lightning adapter around the pipeline engine (:mod:`.pipeline.engine`).

Lightning keeps doing what it does (launching processes, the loops, the optimizer/scheduler/clipping calls,
logging, checkpoints); this class only builds a :class:`PipelineEngine` in ``setup``, runs it from the module's
steps, hands its batch gradient to Lightning's optimizer step, and saves its weight versions with checkpoints.
How it meets Lightning is described in docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

import atexit
import dataclasses
import difflib
from contextlib import contextmanager, nullcontext
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_async_pp import _lightning
from lightning_async_pp.lightning_callbacks import check_callbacks
from lightning_async_pp.lookahead import FetchedBatch, LookaheadLoader, transfer_early
from lightning_async_pp.module import PipelineModule
from lightning_async_pp.optim.checks import check_corrections, set_step_delay
from lightning_async_pp.optim.empty import allowing_empty_parameter_lists
from lightning_async_pp.optim.weight_prediction import prediction_scales
from lightning_async_pp.pipeline import checkpoint as ckpt
from lightning_async_pp.pipeline.comm import elastic_attempt_store, is_lost_connection
from lightning_async_pp.pipeline.config import CheckpointingSpec, CompileSpec, DelaySpec, PipelineConfig
from lightning_async_pp.pipeline.engine import PipelineEngine
from lightning_async_pp.pipeline.microbatch import check_splittable
from lightning_async_pp.pipeline.partition import PartitionSpec
from lightning_async_pp.pipeline.placement import (
    layer_paths,
    parameters_on_meta,
    refusing_loads_onto_meta,
    replace_meta_tensors,
)
from lightning_async_pp.pipeline.sharding import local_optimizer, shard_optimizers
from lightning_async_pp.pipeline.topology import PipelineTopology
from lightning_async_pp.requeue import RequeueAtStepBoundary
from lightning_async_pp.strategy_state import PipelineStateHooks

#: Keyword arguments of Lightning's DDPStrategy that are meaningful here (the accelerator connector and users
#: may pass them); anything else is refused instead of reaching DistributedDataParallel, which is not used.
_LIGHTNING_KWARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                     "process_group_backend", "timeout", "start_method")
_OWN_KWARGS = ("schedule", "num_microbatches", "data_parallel_size", "partition", "delay", "sync_steps", "num_stages",
               "gather_final_weights", "pipeline_timeout", "check_batches", "save_distributed_checkpoint",
               "activation_checkpointing", "sync_from_step", "shard_optimizer", "async_checkpoint",
               "compile", "stage_memory_gib", "last_stage_run_ahead")


class AsyncPipelineStrategy(PipelineStateHooks, DDPStrategy):
    """Pipeline-parallel training of a :class:`~lightning_async_pp.PipelineModule`.

    Args:
        schedule: ``"2bw"`` (asynchronous PipeDream-2BW: no flushes, two weight versions, every batch's gradient
            taken at the previous version), ``"1f1b"``, ``"gpipe"`` or ``"zb_h1"`` (synchronous, flush every
            batch; ``zb_h1`` is 1F1B with each backward split into its input and weight gradients, the latter
            filling the drain: zero-bubble ZB-H1, same numbers as ``1f1b``).
        num_microbatches: microbatches each training batch is split into along dim 0. Default: the number of
            stages, at least 4 (``2bw`` needs at least one per stage).
        data_parallel_size: pipelines side by side; the stages are the processes divided by this.
        partition: ``"balanced"`` (default: the contiguous split whose slowest stage is fastest, each layer's
            forward and backward FLOPs counted on fake tensors for the model's example batch, every stage's
            predicted memory under ``stage_memory_gib``; without an example batch, parameter counts, with a
            warning), ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer counts) or a list
            of layer counts per stage. The split is printed at setup and read as ``engine.stats.split``; see
            docs/design/planner.md, 'Balanced split'.
        stage_memory_gib: with ``partition="balanced"``, a cap on every stage's predicted peak memory (GiB).
        last_stage_run_ahead: 2bw's last stage runs the next batch's first microbatch before its update (a second
            gradient there); None: on unless ``stage_memory_gib`` leaves room for one gradient only; True; False
            (docs/design/planner.md, "Run-ahead").
        delay: research variants (one device): an integer ``d >= 0`` takes every gradient at ``W_{k-d}``; a list
            gives each stage its own delay. Default: 1 for ``2bw``, 0 for the synchronous schedules.
        sync_steps: run the first ``sync_steps`` updates synchronously, then the configured schedule.
        num_stages: stages on one device (each keeps its own versions). With several processes the stages are
            the processes.
        gather_final_weights: after every trainer call, gather every stage's weights into rank 0's module (turn
            off for models too large for one host).
        pipeline_timeout: seconds a stage waits for a neighbour before it gives up and names it; also the process
            group timeout, so a failed or dead stage stops the others within about this long.
        check_batches: stages of a pipeline compare a fingerprint of each batch and stop with an error when they
            were given different data.
        save_distributed_checkpoint: checkpoints are directories written through ``torch.distributed.checkpoint``
            (each stage writes its own tensors, nothing is gathered); ``False`` writes one file assembled on rank
            0. Either kind loads into any number of stages, data-parallel size or partition.
        activation_checkpointing: ``True`` (every layer), a list of layer indices (positions in
            ``pipeline_layers()``) or ``False``: the chosen layers keep no activations for backward and recompute
            their forward there (non-reentrant ``torch.utils.checkpoint``), on the same weight version as the
            first forward. Results are unchanged; memory drops, compute rises by about one forward.
        sync_from_step: updates ``k >= sync_from_step`` are synchronous (delay 0; across processes the pipeline
            flushes every batch from then on): a synchronous tail for the final learning-rate decay, or a guard
            against divergence. Default ``None``: never.
        shard_optimizer: ZeRO-1: each stage's optimizer state (moments, ``ErrorFeedback``'s buffer) is split across
            its ``data_parallel_size`` replicas by ``torch.distributed.optim.ZeroRedundancyOptimizer``, whole
            parameters to each (Muon keeps whole matrices); every replica still holds all weights and the
            gradient. Results are unchanged. Checkpoints keep the same keys, so they load with sharding on or off
            and any layout. No effect with one pipeline.
        async_checkpoint: sharded checkpoints are written in the background
            (``torch.distributed.checkpoint.async_save``): a save stalls training only while the tensors are copied,
            and the checkpoint is put in place once every shard is written. A save still in flight is awaited before
            the next save, a load, at teardown and when training fails. A save outside a trainer call
            (``trainer.save_checkpoint()`` after ``fit``) is written before it returns. Needs
            ``save_distributed_checkpoint=True``.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments (``backend``, ``mode``, ``dynamic``,
            ``options``, ...): each pipeline layer is compiled once per process (identical layers share a graph),
            and every weight version, microbatch and later trainer call reuses its graphs (evaluation adds its
            own, once). ``True`` is inductor with ``emulate_precision_casts`` and ``fallback_random``, so results
            equal eager ones, bf16 and dropout included; a dict is passed as given. Not with ``schedule="zb_h1"``.
            A model given to the Trainer as ``torch.compile(model)`` is run this way too (with a warning): the
            whole-model compile is undone. See docs/design/stages.md, 'Compiled layers'.
    """

    strategy_name = "async_pipeline"
    #: Read by ``PipelineModule.on_load_checkpoint``: this strategy resumes its own checkpoints (any layout).
    resumes_pipeline_checkpoints = True

    def __init__(
        self,
        schedule: str = "2bw",
        num_microbatches: Optional[int] = None,
        data_parallel_size: int = 1,
        partition: PartitionSpec = "balanced",
        delay: DelaySpec = None,
        sync_steps: int = 0,
        num_stages: Optional[int] = None,
        gather_final_weights: bool = True,
        pipeline_timeout: float = 300.0,
        check_batches: bool = True,
        save_distributed_checkpoint: bool = True,
        activation_checkpointing: CheckpointingSpec = False,
        sync_from_step: Optional[int] = None,
        shard_optimizer: bool = False,
        async_checkpoint: bool = False,
        compile: CompileSpec = False,
        stage_memory_gib: Optional[float] = None,
        last_stage_run_ahead: Optional[bool] = None,
        *,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        start_method: str = "popen",
        **unknown: Any,
    ) -> None:
        if unknown:  # only reported, never forwarded: DDP's own options do not apply to a pipeline
            valid = _OWN_KWARGS + _LIGHTNING_KWARGS
            hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, valid, 1)) else repr(u)
                     for u in sorted(unknown)]
            raise TypeError(
                f"AsyncPipelineStrategy got unknown keyword argument(s) {', '.join(hints)}; valid ones are "
                f"{', '.join(valid)}"
            )
        self.config = PipelineConfig(
            schedule=schedule, num_microbatches=num_microbatches, data_parallel_size=data_parallel_size,
            partition=partition, delay=delay, sync_steps=sync_steps, sync_from_step=sync_from_step,
            num_stages=num_stages,
            pipeline_timeout=pipeline_timeout, check_batches=check_batches,
            activation_checkpointing=activation_checkpointing, shard_optimizer=shard_optimizer,
            save_distributed_checkpoint=save_distributed_checkpoint, async_checkpoint=async_checkpoint,
            compile=compile, stage_memory_gib=stage_memory_gib,
            last_stage_run_ahead=last_stage_run_ahead,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout if timeout is not None else timedelta(seconds=pipeline_timeout), start_method=start_method,
        )
        self.gather_final_weights = gather_final_weights
        self._pending_save: Optional[ckpt.PendingSave] = None  # an async_checkpoint save still being written
        self._in_trainer_call = False  # between setup and teardown, where teardown awaits a background save
        self._checkpoint_group: Any = None  # async saves' own gloo group: their collectives run in a background thread
        self._source: Optional[ckpt.TensorSource] = None  # the checkpoint being restored, between its two loads
        self._tensors: dict[str, Any] = {}
        self.engine: Optional[PipelineEngine] = None
        self._train_loader: Optional[LookaheadLoader] = None
        self._lookahead: Any = None  # the batch whose forwards ran ahead (2BW across processes)
        self._update_started: Optional[float] = None
        self._reported: Optional[BaseException] = None  # the failure already reported to the other stages
        self._requeue: Optional[RequeueAtStepBoundary] = None

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
    def topology(self) -> PipelineTopology:
        return PipelineTopology(self.world_size_total, self.data_parallel_size, self.global_rank)

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
        states = _rng_states()
        store = elastic_attempt_store(self._timeout)
        if store is not None and not torch.distributed.is_initialized():
            # Under torchrun: the process group on this restart attempt's own keys (comm.elastic_attempt_store);
            # Lightning's setup then finds it initialized and goes on.
            self.set_world_ranks()
            torch.distributed.init_process_group(self._get_process_group_backend(), store=store, rank=self.global_rank,
                                                 world_size=self.world_size, timeout=self._timeout)
        super().setup_distributed()
        _set_rng_states(states)
        _destroy_process_groups_at_exit()

    # ---- building the engine ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise TypeError(
                f"AsyncPipelineStrategy trains a lightning_async_pp.PipelineModule; got {type(module).__name__}. "
                f"Derive your model from PipelineModule and implement pipeline_layers() and pipeline_loss()"
            )
        if _lightning.undo_whole_model_compile(module):
            self._compile_per_layer()
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                f"precision={self.precision_plugin.precision!r} scales the loss with a GradScaler, which the pipeline "
                f"does not apply to its microbatch losses; use precision='bf16-mixed' or 'bf16-true' (no scaling "
                f"needed) or 32"
            )
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by "
                f"AsyncPipelineStrategy; raise num_microbatches and the batch size instead (use 1)"
            )
        if self.config.async_checkpoint and any(getattr(c, "save_last", None) == "link" for c in trainer.checkpoint_callbacks):
            # The link would point at a checkpoint still being written: a crash then leaves "last" dangling.
            raise ValueError("async_checkpoint=True cannot be combined with ModelCheckpoint(save_last='link'); use "
                             "save_last=True (a second checkpoint, written after the first) or async_checkpoint=False")
        self.model = self.precision_plugin.convert_module(self.model)
        # The full layer list is remembered on the module: after a multi-process call, other stages' layers are
        # placeholders in rank 0's tree (unless gathered back), and a later call must still find the originals.
        if getattr(module, "_pipeline_all_layers", None) is None:
            layers = list(module.pipeline_layers())
            if not layers:
                raise ValueError(f"{type(module).__name__}.pipeline_layers() returned no layers; return at least one nn.Module")
            object.__setattr__(module, "_pipeline_all_layers", layers)
            object.__setattr__(module, "_pipeline_layer_paths", layer_paths(module, layers))
        previous = self.engine  # the engine of this trainer's previous call, if any
        self.engine = PipelineEngine(
            module, module._pipeline_all_layers, module._pipeline_layer_paths, self.config,
            input_fn=module.pipeline_input, loss_fn=module.pipeline_loss,
            device=self.root_device, world_size=self.world_size_total, rank=self.global_rank,
            metric_names=module.pipeline_metric_names(), metrics_fn=module.pipeline_metrics,
            sample_batch=module.pipeline_sample(),
        )
        rank_zero_info(f"lightning_async_pp: {self.engine.split.describe()}")
        # Layers built on the meta device (configure_model) get memory here, this process's stage only.
        self.engine.materialize(self.root_device, module.init_layer)
        self.model_to_device()
        self.engine.start()
        module._pipeline_executor = self
        self._in_trainer_call = True
        if trainer.state.fn == TrainerFn.FITTING:
            _lightning.epoch_title_without_epoch_limit(trainer)
            if self.is_multiprocess:
                # Each process holds only its stage: the model summary counts the whole model's parameters.
                _lightning.summarize_within(trainer, self.engine.whole_model)
            # A stage whose parameters are all frozen builds its optimizer over none (a whole-model run has some).
            with allowing_empty_parameter_lists() if self.is_multiprocess and self.num_stages > 1 else nullcontext():
                self.setup_optimizers(trainer)
            self.engine.check_tied_hyperparameters(self.optimizers)
            check_corrections(self.optimizers, self.lr_scheduler_configs, self.config.stage_delays(self.engine.num_stages))
            self.engine.set_weight_prediction(prediction_scales(self.optimizers))  # before sharding or a restore
            if self.config.shard_optimizer and self.engine.dp_group is not None:
                self.optimizers = shard_optimizers(self.optimizers, self.engine.dp_group)  # ZeRO-1 per stage
            _optimizers_to_device(self.optimizers, self.root_device)
        if previous is not None and trainer.global_step > 0:
            # A later call of this Trainer goes on from the previous call's engine, as a restore would (after the
            # weight prediction is set up, where a checkpoint's restore also comes).
            self.engine.load_state_dict(continued_state(previous, self.engine))
        self.setup_precision_plugin()
        # Every clipping by norm that Lightning offers (Trainer(gradient_clip_val=...), configure_gradient_clipping,
        # self.clip_gradients, automatic or manual) ends in the precision plugin's clip_grad_by_norm, which would
        # take each stage's own norm: this plugin instance takes the norm over every stage instead (as Lightning's
        # FSDPPrecision replaces the method for sharded parameters). Clipping by value is elementwise: unchanged.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if self.config.async_checkpoint and self.is_multiprocess and self._checkpoint_group is None:
            self._checkpoint_group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=self.config.pipeline_timeout))
        if trainer.state.fn == TrainerFn.FITTING:
            # SLURM auto-requeue: save and requeue at a step boundary that every stage agrees on (requeue.py).
            self._requeue = RequeueAtStepBoundary.install(trainer, self.cluster_environment, self.engine.board.store,
                                                          self.data_parallel_size)
        if self.is_multiprocess:
            # A stage that stops makes its neighbours stop through the pipeline's own failure handling, so a
            # local check replaces Lightning's per-step broadcast (a barrier across all stages).
            _lightning.replace_sigterm_broadcast(trainer, self._check_sigterm_locally)

    def _compile_per_layer(self) -> None:
        """The Trainer was given ``torch.compile(model)``: compile the pipeline layers instead (see docs/design/stages.md,
        'Compiled layers')."""
        if self.config.compile is not False:
            how = f"with the strategy's compile={self.config.compile!r}"
        elif self.schedule == "zb_h1":
            how = "not at all: schedule='zb_h1' runs eager layers"
        else:
            self.config = dataclasses.replace(self.config, compile=True)
            how = "with torch.compile's defaults (compile=True)"
        rank_zero_warn(
            "The model was given to the Trainer as torch.compile(model). A compiled training_step would trace into "
            "the pipeline engine and gain nothing, so the whole-model compile is undone and each pipeline layer "
            f"is compiled {how}. Pass the model uncompiled and set AsyncPipelineStrategy(compile=True or "
            "{torch.compile arguments}) to choose the backend or mode; the whole-model compile's own arguments "
            "are not carried over."
        )

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Layers created in ``configure_model`` (or ``trainer.init_module()``) get their parameters on the meta
        device, without memory, as under Lightning's ``ModelParallelStrategy``; buffers stay real, so a table
        computed in ``__init__`` keeps its values. ``setup`` materializes only this process's stage
        (:meth:`PipelineEngine.materialize`). ``empty_init=False`` creates them normally. ``load_state_dict`` onto
        meta parameters raises there (it would copy nothing; see docs/design/adapters.md, 'Starting from pretrained weights')."""
        with parameters_on_meta() if empty_init is not False else nullcontext(), refusing_loads_onto_meta(), \
                self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- data --------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not trainer.training:
            return dataloader
        # Known here, before the first step: a batch the microbatches cannot split would stop training at once.
        batch_size = loader_batch_size(dataloader)
        if batch_size is not None:
            check_splittable(batch_size, self.num_microbatches, "The training dataloader's batch_size={size}")
        on_epoch_start = None
        sampler = getattr(dataloader, "sampler", None)
        if (self.is_multiprocess and self.data_parallel_size == 1
                and isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None):
            on_epoch_start = lambda: self._share_sampler_seed(sampler)  # noqa: E731
        # Wrapped always: besides 2BW's lookahead, the wrapper keeps the data position of a stateful loader right
        # when Lightning's fetcher has read a batch ahead (it does for unsized loaders).
        self._train_loader = LookaheadLoader.wrap(dataloader, on_epoch_start)
        return self._train_loader

    def _share_sampler_seed(self, sampler: torch.utils.data.RandomSampler) -> None:
        """A shuffling sampler without a generator draws each epoch's seed from its process's own RNG, so the
        stages would shuffle differently. Rank 0 draws it exactly as the sampler would (so a seeded run shuffles
        as on one device) and every stage uses it."""
        seed = int(torch.empty((), dtype=torch.int64).random_().item()) if self.is_global_zero else 0
        sampler.generator = torch.Generator().manual_seed(self.broadcast(seed, src=0))

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        if not isinstance(batch, FetchedBatch):
            return super().batch_to_device(batch, device, dataloader_idx)
        # Lightning's loop reached a batch from the lookahead loader: transfer it unless the lookahead already did.
        assert self._train_loader is not None and self._train_loader.iterator is not None
        if self._pending_save is not None and self._pending_save.future.done():
            self.finish_pending_save()  # written in the background meanwhile: put it in place now
        if self._requeue is not None and self.engine is not None:
            # A step boundary: the previous batch is complete, this one not started (the data position is before it).
            self._requeue.at_step_boundary(self.engine.stats.batch_index)
        self._train_loader.iterator.started(batch)
        return transfer_early(batch, self._transfer)

    def _transfer(self, raw: Any) -> Any:
        """What Lightning's training loop does to a fetched batch, in its order: precision input conversion, then
        ``on_before_batch_transfer``, the transfer to the device and ``on_after_batch_transfer``."""
        module = self.lightning_module
        batch = module.trainer.precision_plugin.convert_input(raw)
        batch = _lightning.before_batch_transfer(module, batch)
        return super().batch_to_device(batch, dataloader_idx=0)

    def _next_batch(self, batch_idx: Optional[int]) -> Any:
        """The next training batch, transferred, for 2BW's lookahead; ``None`` when this step is the last one."""
        engine, loader = self.engine, self._train_loader
        if engine is None or loader is None or loader.iterator is None or not engine.uses_lookahead():
            return None
        trainer = self.lightning_module.trainer
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return None
        if batch_idx is None or batch_idx + 1 >= trainer.num_training_batches:
            return None  # the epoch ends after this batch; the next one starts a new pass
        fetched = loader.iterator.peek()
        return None if fetched is None else transfer_early(fetched, self._transfer)

    # ---- the PipelineExecutor protocol that PipelineModule calls ----------------------------------------------
    def train_loss(self, batch: Any, batch_idx: Optional[int] = None) -> Tensor:
        engine = self.engine
        assert engine is not None
        with self._reporting_failures():
            # The previous batch's gradient has been applied by every optimizer that steps (several under manual
            # optimization): drop it before this batch's backward accumulates the next one.
            engine.release_gradients()
            if engine.has_lookahead and batch is not self._lookahead:
                engine.cancel_lookahead()  # Lightning did not train the batch fetched ahead (epoch cut, stop)
            self._lookahead = self._next_batch(batch_idx)
            return engine.train_step(batch, self._lookahead)

    def train_metrics(self) -> dict[str, Tensor]:
        assert self.engine is not None
        return self.engine.last_metrics

    def eval_loss(self, batch: Any) -> Tensor:
        assert self.engine is not None
        with self._reporting_failures():
            return self.engine.evaluate(batch)

    def predict(self, batch: Any) -> Any:
        assert self.engine is not None
        with self._reporting_failures():
            return self.engine.predict(batch)

    # ---- gradients and the update -----------------------------------------------------------------------------
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Hand the pipeline's batch gradient to the optimizer (the backward passes already ran in the pipeline).

        Lightning zeroes ``.grad`` between ``training_step`` and ``backward``, so the engine keeps the gradient
        itself and it is put in place here."""
        engine = self.engine
        assert engine is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, g in zip(engine.params, engine.gradients):
            p.grad = g
        # Clipping is Lightning's to call, after this (configure_gradient_clipping, self.clip_gradients); by norm
        # it reaches _clip_grad_by_norm, which takes the norm over every stage.
        # A synchronous batch's update (sync_steps, sync_from_step) is not compensated as a stale one.
        set_step_delay([local_optimizer(o) for o in self.optimizers], engine.stats.realized_delay())
        # From here the optimizer writes W_{k+1} into the other slot; the stash W_k stays for batch k+1.
        engine.prepare_update()
        self._update_started = time.perf_counter()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """The precision plugin's ``clip_grad_by_norm`` here: the norm of ``optimizer``'s gradients over every stage
        (tied copies once), so one device, p processes and plain Lightning clip alike."""
        assert self.engine is not None
        with self._reporting_failures():
            self.engine.clip_grad_norm(list(self.precision_plugin.main_params(optimizer)), float(clip_val))

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None and self._update_started is not None:
            self.engine.record_optimizer(self._update_started, time.perf_counter())
            self._update_started = None
        return output

    # ---- failures -------------------------------------------------------------------------------------------
    def _check_sigterm_locally(self) -> None:
        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            if self.engine is not None:
                self.engine.board.report(f"stage {self.topology.stage} (rank {self.global_rank}) received SIGTERM")
            raise SIGTERMException()

    @contextmanager
    def _reporting_failures(self) -> Iterator[None]:
        """Report a failure of this stage at once, before Lightning's exception handling (whose callbacks may
        wait for the other stages) runs."""
        try:
            yield
        except BaseException as err:
            self._report_failure(err)
            raise

    def _report_failure(self, err: BaseException) -> None:
        if err is self._reported:
            return  # reported where it was raised; on_exception sees it again
        self._reported = err
        # A lost connection (a collective whose peer died, say) is another process's failure: reporting it would
        # name this survivor as the stage that failed.
        if self.is_multiprocess and self.engine is not None and not is_lost_connection(err):
            message = f"stage {self.topology.stage} (rank {self.global_rank}) failed: {type(err).__name__}: {err}"
            self.engine.board.report(message)
            # Said here too: Lightning's launcher may stop the other processes before they can repeat it.
            print(f"lightning_async_pp: {message}", file=sys.stderr, flush=True)

    def on_exception(self, exception: BaseException) -> None:
        self._report_failure(exception)
        self.finish_pending_save(failing=True)
        super().on_exception(exception)

    def teardown(self) -> None:
        self._in_trainer_call = False  # a save from now on (trainer.save_checkpoint() after fit) is written at once
        module = self.lightning_module
        if isinstance(module, PipelineModule):
            module._pipeline_executor = None
        if module is not None:
            # A setup that failed before materializing leaves meta tensors, which Lightning's move to the CPU
            # cannot copy: give them a placeholder of their shape (no memory) so the original error surfaces.
            replace_meta_tensors(module, lambda t: torch.empty((), dtype=t.dtype).expand(t.shape))
        self._train_loader = None
        self._lookahead = None
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)  # the plugin's own method again
        self._requeue = None
        self.finish_pending_save()
        super().teardown()


_DESTROY_AT_EXIT = [False]  # registered once per process


def _destroy_process_groups_at_exit() -> None:
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


def continued_state(previous: PipelineEngine, engine: PipelineEngine) -> dict[str, Any]:
    """What a later call of the same Trainer (``fit`` then ``fit``) continues from: the previous call's update count
    and the older weight versions it held, so that the update index (``sync_from_step``, the dropout seeds of each
    batch) and 2BW's stash go on as in one call (a checkpoint resume does the same from the files). Where the
    module's weights changed between the calls (a ``load_state_dict``), only the count goes on, every version the
    present weights, as after loading a checkpoint that holds no stash."""
    state, now = previous.state_dict(), engine.state_dict()
    for index, stage in state["stages"].items():
        k, current = stage["num_updates"], now["stages"][index]["versions"][0]
        if all(torch.equal(stage["versions"][k][n], t) for n, t in current.items()):
            continue
        stage["versions"] = {j: current for j in stage["versions"]}
        stage.pop("predicted_newest", None)
    return state


def loader_batch_size(dataloader: object) -> Optional[int]:
    """The batch size a training loader yields, where it says (a ``DataLoader``'s ``batch_size``, or its batch
    sampler's); ``None`` for loaders that do not (an iterable of ready batches, a custom batch sampler)."""
    size = getattr(dataloader, "batch_size", None)
    if size is None:
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _rng_states() -> tuple:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    import random

    import numpy as np

    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


StrategyRegistry.register(
    AsyncPipelineStrategy.strategy_name,
    AsyncPipelineStrategy,
    description="Pipeline parallelism with asynchronous PipeDream-2BW (lightning-async-pp)",
)
