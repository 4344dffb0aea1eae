"""The hooks of ``AsyncPipelineStrategy`` that move the model's state: checkpoints (saved and loaded through the
layout-free dictionary of :mod:`lightning_async_pp.checkpoint`) and the gather of the whole model into rank 0 after every
trainer call, and what a later call of the same Trainer continues from. A mixin, so that ``adapter.py`` keeps the
run itself; see docs/design/checkpoints.md, "Checkpoints".
"""
from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_async_pp import checkpoint as ckpt
from lightning_async_pp.lightning_callbacks import check_resume
from lightning_async_pp.parallel.tensor_parallel import undo_tensor_parallelism, whole
from lightning_async_pp.pipeline.engine import PipelineEngine, check_names_and_shapes
from lightning_async_pp.parallel.expert import expert_entries, expert_names, unshard_experts
from lightning_async_pp.strategy import _lightning
from lightning_async_pp.strategy.options import GATHERED


class PipelineStateHooks:
    """Mixed into ``AsyncPipelineStrategy`` (before ``DDPStrategy``, whose hooks these replace)."""

    # ---- checkpoints ------------------------------------------------------------------------------------------
    # Every stage contributes its own tensors, keyed by global names (checkpoint/layouts.py); see docs/design/checkpoints.md,
    # "Checkpoints". Nothing is gathered for a sharded checkpoint; a single file is assembled on rank 0.
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The stashed versions live in the engine's stages, which exist only after setup.
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # This stage's part (save_checkpoint assembles the rest), with buffers as the trained batches left them:
        # the lookahead's forwards of the next batch may have updated running statistics already.
        if self._stage_state is not None:
            return self._stage_state  # rank 0's stage as it was before the gather made its module a whole one
        trained = self.engine.trained_buffers() if self.engine is not None else {}
        return {k: trained.get(id(v), v).detach() for k, v in self.lightning_module.state_dict(keep_vars=True).items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved by parameter name with the weights (save_checkpoint), so any layout can load it

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.engine is None:
            if sys.exc_info()[0] is not None:
                # A save on failure (OnExceptionCheckpoint) when setup failed before the engine existed: there is
                # no training state to save, and the error that stopped setup must surface, not this one.
                rank_zero_warn(f"no checkpoint written to {os.fspath(filepath)}: AsyncPipelineStrategy's setup did "
                               f"not complete, so there is no training state to save")
                return
            raise RuntimeError("AsyncPipelineStrategy can save a checkpoint only once its setup has run (inside a "
                               "trainer call, or after one)")
        path = os.fspath(filepath)
        own = self.not_a_replica
        module_state = checkpoint.pop("state_dict")
        sharded = ckpt.owned_parameters(self.optimizers, self.engine.global_names) is not None
        # Replicas hold the same weights; with a sharded optimizer each one adds the state it holds.
        flat = ckpt.engine_tensors(self.engine, module_state, self.optimizers, weights=own) if own or sharded else {}
        if not own and self.config.expert_parallel_size > 1:  # the other replicas hold other experts: theirs too
            flat = expert_entries(ckpt.engine_tensors(self.engine, module_state, self.optimizers),
                                  {self.engine.global_names[i] for i in self.engine.experts.ids})
        meta = ckpt.checkpoint_meta(self.engine, self.schedule, self.data_parallel_size)
        self.finish_pending_save()  # one save in flight at a time, in order
        if self.config.save_distributed_checkpoint:
            checkpoint["async_pipeline"] = meta
            # Only inside a trainer call, whose teardown waits for the write: a save after it (or between calls)
            # has nothing left to finish it before the process exits, so it is written before returning.
            if self.config.async_checkpoint and self._in_trainer_call:
                self._pending_save = ckpt.PendingSave(path, flat, checkpoint, is_coordinator=self.is_global_zero,
                                                      barrier=self.barrier, process_group=self._checkpoint_group)
                return
            ckpt.save_sharded(path, flat, checkpoint, is_coordinator=self.is_global_zero, barrier=self.barrier)
            return
        if self.tensor_parallel_size > 1:
            # One file: each DTensor gathered whole over its stage's tensor-parallel ranks; their rank 0 sends it.
            flat = whole(flat)
            if self.topology.tp_rank != 0:
                flat = {}
        parts = self._gather_to_zero(_cpu(flat) if self.is_multiprocess else flat)
        if self.is_global_zero:
            merged: dict[str, Any] = {}
            for part in parts or []:
                merged.update(part)
            checkpoint.update(ckpt.single_file_parts(merged, meta))
            # Write beside the target (out of the names Lightning lists) and rename: a crash mid-write leaves the
            # previous checkpoint intact and no partial file where a resume looks.
            tmp = ckpt.partial_path(path)
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            ckpt.put_in_place(tmp, path)

    def finish_pending_save(self, failing: bool = False) -> None:
        """Wait for an ``async_checkpoint`` save still being written and put it in place. When training is failing
        (``failing``), a write that failed too is only reported, so the original error surfaces."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        try:
            pending.finish()
        except Exception as err:
            if not failing:
                raise
            print(f"lightning_async_pp: the checkpoint {pending.path} being written when training failed was not "
                  f"completed ({type(err).__name__}: {err}); the previous one stays", file=sys.stderr, flush=True)

    def remove_checkpoint(self, filepath: Any) -> None:
        pending = self._pending_save
        if pending is not None:
            # Lightning removes the previous top-k checkpoint right after saving the next one; while that one is
            # still being written, the previous one stays until it is in place.
            pending.removals.append(lambda: super(PipelineStateHooks, self).remove_checkpoint(filepath))
            return
        super().remove_checkpoint(filepath)

    @property
    def not_a_replica(self) -> bool:
        """This process's stage belongs to the first pipeline (replicas hold the same tensors)."""
        return not self.is_multiprocess or self.topology.dp_rank == 0

    def _gather_to_zero(self, obj: Any) -> Optional[list[Any]]:
        if not self.is_multiprocess:
            return [obj]
        out = [None] * self.world_size_total if self.is_global_zero else None
        dist.gather_object(obj, out, dst=0)
        return out

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            check_resume(self.lightning_module.trainer.callbacks)  # before anything is loaded
        self.finish_pending_save()
        path = ckpt.resolve(os.fspath(checkpoint_path))
        if ckpt.is_sharded(path):
            self._source = ckpt.ShardedSource(path)
            return ckpt.read_meta(path, weights_only)
        local = "://" not in path  # a remote file (fsspec: s3://, http://) is Lightning's to fetch
        if local:
            ckpt.check_file(path)
        try:
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        except Exception as err:
            if local or isinstance(err, pickle.UnpicklingError):  # not a remote fetch's own error
                raise ckpt.unreadable_file(path, err) from err
            raise
        self._source = ckpt.file_source(checkpoint)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        engine, module, source = self.engine, self.lightning_module, self._source
        assert engine is not None
        if source is None:  # a checkpoint dict handed over without load_checkpoint
            source = self._source = ckpt.file_source(checkpoint)
        own = module.state_dict()
        # strict is the module's strict_loading (Lightning's checkpoint connector passes it).
        ckpt.check_model_fits(engine, own, source, not self.is_multiprocess, check_names_and_shapes, strict)
        owned = ckpt.owned_parameters(self.optimizers, engine.global_names)
        keys = ckpt.needed_keys(engine, own, source, owned)
        tensors = source.read(keys, ckpt.layouts(engine, keys, source))  # tensor parallelism: this rank's shards
        # A plain Lightning checkpoint counts its updates in the loop's state: sync_from_step counts from the start.
        num_updates = (checkpoint["async_pipeline"].get("num_updates", 0) if "async_pipeline" in checkpoint
                       else _lightning.batches_trained(checkpoint))
        ckpt.load_engine(engine, module, tensors, num_updates, strict)
        # Keep only what load_optimizer_state_dict will take (nothing outside fit), not a second copy of the model.
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        saved = checkpoint.get("async_pipeline", {}).get("layers_per_stage")
        if fitting and saved is not None and len(saved) == engine.num_stages and tuple(saved) != engine.split.counts:
            rank_zero_warn(  # same stage count, other split: a noisy measured split, another example batch
                f"resuming with layers per stage {list(engine.split.counts)}, but the checkpoint was trained with "
                f"{list(saved)}: dropout's random streams and per-stage delays follow each layer's stage, so this run "
                f"can draw other numbers than the uninterrupted run; pass partition={list(saved)} to continue it "
                f"exactly (layer_cost='measured' can choose another split in each run)")
        self._tensors = {k: v for k, v in tensors.items() if k.startswith(ckpt.OPTIM)} if fitting else {}
        if not fitting:
            self._source = None

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        if self._source is not None and ckpt.has_optimizer_state(self._source):
            ckpt.load_optimizers(self.optimizers, self.engine.global_names, self._tensors)
        elif not self.is_multiprocess:
            super().load_optimizer_state_dict(checkpoint)  # a plain Lightning checkpoint
        elif checkpoint.get("optimizer_states"):
            # A plain Lightning checkpoint knows parameters by index in the whole model's optimizers: name them as
            # the whole model's configure_optimizers() orders them, then load by name like our own checkpoints.
            module = self.lightning_module
            with self.engine.whole_model():
                names = {id(p): n for n, p in module.named_parameters()}
                order = [[names[id(p)] for g in o.param_groups for p in g["params"]]
                         for o in _lightning.configure_optimizers(module)]
            tensors = ckpt.plain_optimizer_tensors(checkpoint["optimizer_states"], order)
            ckpt.load_optimizers(self.optimizers, self.engine.global_names, tensors)
        for optimizer in self.optimizers:
            _optimizer_to_device(optimizer, self.root_device)
        self._source, self._tensors = None, {}

    # ---- after each trainer call ------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        """Every stage is at ``W_N`` (each update was applied in its own step); gather them into rank 0."""
        super().on_train_end()
        if self.engine is not None:
            self.engine.cancel_lookahead()
            self.engine.release_gradients()
        self._gather_after_call()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.lightning_module.trainer.state.fn == TrainerFn.VALIDATING:
            self._gather_after_call()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._gather_after_call()

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._gather_after_call()

    def _gather_after_call(self) -> None:
        if self.is_multiprocess and self.gather_final_weights:
            self.gather_model_to_rank_zero()

    def _merged_module_state(self) -> dict[str, Tensor]:
        """The whole model's state dict on rank 0 (each stage of replica 0 contributes its own layers; a
        tensor-parallel stage its tensors gathered whole, sent by its tensor-parallel rank 0)."""
        module = self.lightning_module
        if not self.is_multiprocess:
            return module.state_dict()
        state = module.state_dict()
        if self.tensor_parallel_size > 1:
            state = whole(state)  # collective over each stage's tensor-parallel ranks, replicas included
        own = self.not_a_replica and (self.tensor_parallel_size == 1 or self.topology.tp_rank == 0)
        if not own and self.config.expert_parallel_size > 1:  # the other replicas hold other experts: theirs too
            names = expert_names(module)
            state, own = {k: v for k, v in state.items() if k in names}, True
        parts = self._gather_to_zero(_cpu(state) if own else {})
        merged: dict[str, Tensor] = {}
        for part in parts or []:
            merged.update(part)
        return merged

    def gather_model_to_rank_zero(self) -> None:
        """Put every stage's layers and weights into rank 0's module (the others keep their own stage)."""
        assert self.engine is not None
        merged = self._merged_module_state()
        if self.tensor_parallel_size > 1 or self.config.expert_parallel_size > 1:
            # on every rank: a later call on this model is refused on all alike
            object.__setattr__(self.lightning_module, GATHERED, True)
        if self.is_global_zero:
            if self.tensor_parallel_size > 1 or self.config.expert_parallel_size > 1:
                # A save after the call (trainer.save_checkpoint after fit) takes rank 0's stage as the other
                # ranks take theirs: its shards and its experts, which the engine and the optimizer keep (the
                # buffers copied, since loading the gathered state writes into them).
                self._stage_state = {k: v if isinstance(v, DTensor) else v.clone()
                                     for k, v in self.lightning_module_state_dict().items()}
            if self.tensor_parallel_size > 1:
                # Rank 0's module becomes a plain one-device model of whole tensors
                # (docs/design/tensor-parallel.md, "What runs").
                module = self.lightning_module
                undo_tensor_parallelism([module, *module._pipeline_all_layers], self.root_device)
            if self.config.expert_parallel_size > 1:  # every expert in rank 0's module, computed there alone
                unshard_experts([self.lightning_module, *self.lightning_module._pipeline_all_layers])
            self.engine.restore_all_layers(merged, self.root_device)
            self.lightning_module.load_state_dict(merged)


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



def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj
