"""``AsyncPipelineStrategy``: the Lightning adapter around the pipeline engine (``lightning_async_pp/pipeline/engine.py``).

Lightning keeps doing what it does (launching processes, the loops, the optimizer/scheduler/clipping calls,
logging, checkpoints); this class only builds a :class:`PipelineEngine` in ``setup``, runs it from the module's
steps, hands its batch gradient to Lightning's optimizer step, and saves its weight versions with checkpoints.
The rest of the seam is delegated to the modules beside it: ``options.py`` (keyword arguments, refused settings),
``batches.py`` (the training batches and the lookahead), ``data_rows.py``, ``failures.py``, ``processes.py`` (the
run's shape, the launcher, the process groups and the mesh),
``state.py`` (checkpoints, the gather after each call) and ``requeue.py``.
How it meets Lightning is described in docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_async_pp import checkpoint as ckpt
from lightning_async_pp.module import PipelineModule
from lightning_async_pp.optim.checks import check_corrections, set_step_delay
from lightning_async_pp.optim.empty import allowing_empty_parameter_lists
from lightning_async_pp.optim.weight_prediction import prediction_scales
from lightning_async_pp.parallel.placement import (
    layer_paths,
    parameters_on_meta,
    reassemble_layers,
    refusing_loads_onto_meta,
)
from lightning_async_pp.parallel.tensor_parallel import meta_tensors_set_aside, parameter_grad
from lightning_async_pp.parallel.zero import local_optimizer, shard_optimizers
from lightning_async_pp.pipeline.config import CheckpointingSpec, CompileSpec, DelaySpec, PipelineConfig
from lightning_async_pp.pipeline.engine import PipelineEngine
from lightning_async_pp.plan.partition import PartitionSpec
from lightning_async_pp.strategy import _lightning, data_rows, options
from lightning_async_pp.strategy.batches import TrainingBatches
from lightning_async_pp.strategy.experts import refuse_with_expert_parallelism_at_setup
from lightning_async_pp.strategy.failures import FailureReporting, not_raised_over_a_failure
from lightning_async_pp.strategy.lookahead import LookaheadLoader
from lightning_async_pp.strategy.optimizer_state import optimizer_state_per_layer
from lightning_async_pp.strategy.processes import ProcessLayout
from lightning_async_pp.strategy.requeue import RequeueAtStepBoundary
from lightning_async_pp.strategy.state import PipelineStateHooks, continued_state


class AsyncPipelineStrategy(PipelineStateHooks, TrainingBatches, FailureReporting, ProcessLayout, DDPStrategy):
    """Pipeline-parallel training of a :class:`~lightning_async_pp.PipelineModule`.

    Args:
        schedule: ``"2bw"`` (asynchronous PipeDream-2BW: no flushes, two weight versions, every batch's gradient
            taken at the previous version), ``"1f1b"``, ``"gpipe"`` or ``"zb_h1"`` (synchronous, flush every
            batch; ``zb_h1`` is 1F1B with each backward split into its input and weight gradients, the latter
            filling the drain: zero-bubble ZB-H1, same numbers as ``1f1b``).
        num_microbatches: microbatches each training batch is split into along dim 0. Default: the number of
            stages, at least 4 (``2bw`` needs at least one per stage).
        data_parallel_size: pipelines side by side; the stages are the processes divided by this.
        tensor_parallel_size: processes per stage (default 1): each stage's matrices are split over this many
            processes with torch's DTensor tensor parallelism, the model's own ``parallelize_module`` plan applied in
            ``configure_model`` to ``self.device_mesh["tensor_parallel"]`` (as under Lightning's
            ``ModelParallelStrategy``); stages = processes / (``data_parallel_size`` x this). Runs ``models.Llama``,
            ``models.HuggingFaceCausalLM`` (``llama``, ``qwen2``) and a module applying its own plan, with
            ``torch.optim.AdamW`` or ``optim.Muon`` (alone or in ``ErrorFeedback``) under ``2bw``, ``1f1b`` and
            ``gpipe``; checkpoints, evaluation and the gather run;
            everything else is refused with it (docs/design/tensor-parallel.md, "What runs").
        expert_parallel_size: ranks of a stage that split its mixture-of-experts layers' experts (default 1): each
            of ``expert_parallel_size`` consecutive data-parallel replicas holds ``num_experts / expert_parallel_size``
            whole experts of each MoE layer, tokens reach them by all-to-all; no extra processes. Must divide
            ``data_parallel_size x tensor_parallel_size`` and each MoE layer's number of experts. The model shards
            its experts in ``configure_model`` over ``self.device_mesh["expert_parallel"]`` (``models.Llama`` with
            ``num_experts``). See docs/design/expert-parallel.md.
        partition: ``"balanced"`` (default: the contiguous split whose slowest stage is fastest, each layer's
            forward and backward FLOPs counted on fake tensors for the model's example batch, every stage's
            predicted memory under ``stage_memory_gib``; without an example batch, parameter counts, with a
            warning), ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer counts) or a list
            of layer counts per stage. The split is printed at setup and read as ``engine.stats.split``; see
            docs/design/planner.md, 'Balanced split'.
        stage_memory_gib: with ``partition="balanced"``, a cap on every stage's predicted peak memory (GiB).
        layer_cost: what the balanced split (and the split's printed report) weighs each layer by: ``"flops"``
            (default: forward and backward FLOPs counted on fake tensors, nothing run) or ``"measured"`` (rank 0
            times each layer's forward and backward on its device, one layer in memory at a time, and every
            process takes its times; under tensor parallelism rank 0's stage's ranks time them together, their
            collectives included, each layer's time the slowest rank's; memory-bound work and overheads that FLOPs
            miss are counted; noise can choose another split in another run: copy the printed one into
            ``partition`` to reproduce a run). See
            docs/design/planner.md, 'Balanced split'.
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
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
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
        layer_cost: str = "flops",
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
        options.refuse_unknown_keywords(unknown)
        self.config = PipelineConfig(
            schedule=schedule, num_microbatches=num_microbatches, data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size, expert_parallel_size=expert_parallel_size, partition=partition,
            delay=delay, sync_steps=sync_steps, sync_from_step=sync_from_step,
            num_stages=num_stages,
            pipeline_timeout=pipeline_timeout, check_batches=check_batches,
            activation_checkpointing=activation_checkpointing, shard_optimizer=shard_optimizer,
            save_distributed_checkpoint=save_distributed_checkpoint, async_checkpoint=async_checkpoint,
            compile=compile, stage_memory_gib=stage_memory_gib,
            last_stage_run_ahead=last_stage_run_ahead, layer_cost=layer_cost,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout if timeout is not None else timedelta(seconds=pipeline_timeout), start_method=start_method,
        )
        self.gather_final_weights = gather_final_weights
        self._pending_save: Optional[ckpt.PendingSave] = None  # an async_checkpoint save still being written
        self._in_trainer_call = False  # between setup and teardown, where teardown awaits a background save
        self._stage_state: Optional[dict] = None  # rank 0's tensor-parallel stage, kept when the gather replaced it
        self._checkpoint_group: Any = None  # async saves' own gloo group: their collectives run in a background thread
        self._source: Optional[ckpt.TensorSource] = None  # the checkpoint being restored, between its two loads
        self._tensors: dict[str, Any] = {}
        self.engine: Optional[PipelineEngine] = None
        self._train_loader: Optional[LookaheadLoader] = None
        self._lookahead: Any = None  # the batch whose forwards ran ahead (2BW across processes)
        self._update_started: Optional[float] = None
        self._reported: Optional[BaseException] = None  # the failure already reported to the other stages
        self._requeue: Optional[RequeueAtStepBoundary] = None
        self._device_mesh: Any = None  # tensor_parallel_size > 1: the mesh of data_parallel x pipeline x tensor_parallel

    # ---- building the engine ------------------------------------------------------------------------------------
    def _optimizer_state_for_split(self, trainer: Trainer, module: Any, previous: Optional[PipelineEngine]) -> dict:
        """The engine's ``optimizer_state_bytes`` and ``optimizer_state_shared``, found only where the split reads
        them, under ``stage_memory_gib``, and only in ``fit`` (validate, test and predict build no optimizer and do
        not call ``configure_optimizers``); a later call of a Trainer reuses its first call's (one split per
        Trainer). Found on the whole model: after a multi-process call each process's tree holds placeholders for
        other stages' layers, whose parameters would count nothing, and the processes would choose different
        splits. Elsewhere the account assumes AdamW (the printed peaks too)."""
        if previous is not None:
            return {"optimizer_state_bytes": previous.optimizer_state_bytes,
                    "optimizer_state_shared": previous.optimizer_state_shared}
        if self.config.stage_memory_gib is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        layers = module._pipeline_all_layers
        reassemble_layers(module, layers, module._pipeline_layer_paths)
        found = optimizer_state_per_layer(module, layers)
        return {} if found is None else {"optimizer_state_bytes": found.per_layer,
                                         "optimizer_state_shared": found.shared}

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        options.require_pipeline_module(module)
        if _lightning.undo_whole_model_compile(module):
            self.config = options.compile_per_layer(self.config)
        options.refuse_unsupported(trainer, self.precision_plugin, self.config)
        options.refuse_with_tensor_parallelism(trainer, module, self.config, self.gather_final_weights,
                                               previous_call=self.engine is not None)
        refuse_with_expert_parallelism_at_setup(trainer, module, self.config)
        data_rows.check_rows(trainer.datamodule, module)  # rows the model refuses: before costing or building
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
            input_fn=module.pipeline_input, loss_fn=module.pipeline_loss, weight_fn=module.pipeline_loss_weight,
            device=self.root_device, world_size=self.world_size_total, rank=self.global_rank,
            metric_names=module.pipeline_metric_names(), metrics_fn=module.pipeline_metrics,
            # the sample as training batches reach the layers (bf16-true: floating inputs in bf16), computed as they are
            sample_batch=self.precision_plugin.convert_input(module.pipeline_sample()),
            compute_context=self.precision_plugin.train_step_context,
            # one split per Trainer: a later call reuses the layer times the first call measured
            layer_times=previous.layer_times if previous is not None else None,
            # the split's memory check counts the optimizer's state as the configured optimizer keeps it
            **self._optimizer_state_for_split(trainer, module, previous),
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
            options.refuse_optimizers_with_tensor_parallelism(self.optimizers, self.config)
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
            p.grad = parameter_grad(p, g)  # a DTensor parameter's gradient as a DTensor of its local shard
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

    def teardown(self) -> None:
        self._in_trainer_call = False  # a save from now on (trainer.save_checkpoint() after fit) is written at once
        module = self.lightning_module
        if isinstance(module, PipelineModule):
            module._pipeline_executor = None
        self._train_loader = None
        self._lookahead = None
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)  # the plugin's own method again
        self._requeue = None
        # A setup that failed before materializing leaves meta tensors, which Lightning's move to the CPU cannot
        # copy: set aside meanwhile. Whatever fails here is not raised over the call's own failure.
        with not_raised_over_a_failure(module), meta_tensors_set_aside(module) if module else nullcontext():
            self.finish_pending_save()
            super().teardown()


StrategyRegistry.register(
    AsyncPipelineStrategy.strategy_name,
    AsyncPipelineStrategy,
    description="Pipeline parallelism with asynchronous PipeDream-2BW (lightning-async-pp)",
)
