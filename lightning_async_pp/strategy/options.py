"""What ``AsyncPipelineStrategy`` accepts: its keyword arguments, and the trainer settings it refuses at setup
(before any training) with the reason and what to use instead. A model given to the Trainer compiled as a whole
becomes the strategy's own per-layer ``compile`` option here. See docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_async_pp.module import PipelineModule
from lightning_async_pp.parallel.mesh import check_tensor_parallel_no_dropout
from lightning_async_pp.parallel.tensor_parallel import dropout_in_split_layers
from lightning_async_pp.pipeline.config import PipelineConfig

#: Keyword arguments of Lightning's DDPStrategy that are meaningful here (the accelerator connector and users
#: may pass them); anything else is refused instead of reaching DistributedDataParallel, which is not used.
LIGHTNING_KWARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                    "process_group_backend", "timeout", "start_method")
OWN_KWARGS = ("schedule", "num_microbatches", "data_parallel_size", "tensor_parallel_size", "expert_parallel_size",
              "partition", "delay",
              "sync_steps", "num_stages",
              "gather_final_weights", "pipeline_timeout", "check_batches", "save_distributed_checkpoint",
              "activation_checkpointing", "sync_from_step", "shard_optimizer", "async_checkpoint",
              "compile", "stage_memory_gib", "last_stage_run_ahead", "layer_cost")


def refuse_unknown_keywords(unknown: dict[str, Any]) -> None:
    """Raise for keyword arguments the strategy does not take, naming the closest valid one. They are only
    reported, never forwarded: DDP's own options do not apply to a pipeline."""
    if not unknown:
        return
    valid = OWN_KWARGS + LIGHTNING_KWARGS
    hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, valid, 1)) else repr(u)
             for u in sorted(unknown)]
    raise TypeError(
        f"AsyncPipelineStrategy got unknown keyword argument(s) {', '.join(hints)}; valid ones are "
        f"{', '.join(valid)}"
    )


def require_pipeline_module(module: Any) -> None:
    if not isinstance(module, PipelineModule):
        raise TypeError(
            f"AsyncPipelineStrategy trains a lightning_async_pp.PipelineModule; got {type(module).__name__}. "
            f"Derive your model from PipelineModule and implement pipeline_layers() and pipeline_loss()"
        )


def refuse_unsupported(trainer: Any, precision_plugin: Any, config: PipelineConfig) -> None:
    """The trainer settings the pipeline cannot run exactly, refused at setup."""
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise ValueError(
            f"precision={precision_plugin.precision!r} scales the loss with a GradScaler, which the pipeline "
            f"does not apply to its microbatch losses; use precision='bf16-mixed' or 'bf16-true' (no scaling "
            f"needed) or 32"
        )
    if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by "
            f"AsyncPipelineStrategy; raise num_microbatches and the batch size instead (use 1)"
        )
    if config.async_checkpoint and any(getattr(c, "save_last", None) == "link" for c in trainer.checkpoint_callbacks):
        # The link would point at a checkpoint still being written: a crash then leaves "last" dangling.
        raise ValueError("async_checkpoint=True cannot be combined with ModelCheckpoint(save_last='link'); use "
                         "save_last=True (a second checkpoint, written after the first) or async_checkpoint=False")


def _tensor_parallel_ready(optimizer: Any) -> bool:
    """Whether ``optimizer`` is tested exact on tensor-parallel shards against one device (docs/design/
    tensor-parallel.md, "What runs"): AdamW's and AsyncNesterov's (NAdam's) updates are elementwise, so each
    shard's is the slice of one device's; ``optim.Muon`` gathers each matrix for its Newton-Schulz; the corrections
    ``ErrorFeedback``, ``DelayCompensation`` and ``WeightPrediction`` are elementwise around any of them."""
    from lightning_async_pp.optim import AsyncNesterov, DelayCompensation, ErrorFeedback, Muon, WeightPrediction

    if type(optimizer) in (ErrorFeedback, DelayCompensation, WeightPrediction):
        return _tensor_parallel_ready(optimizer.wrapped)
    return type(optimizer) in (torch.optim.AdamW, Muon, AsyncNesterov)


def _short_name(optimizer: Any) -> str:
    inner = getattr(optimizer, "wrapped", None)
    return type(optimizer).__name__ + (f"({_short_name(inner)})" if inner is not None else "")

#: Set on a module whose tensor-parallel stages were gathered into rank 0 (``gather_final_weights``), on every rank.
GATHERED = "_pipeline_tensor_parallel_gathered"


def refuse_with_tensor_parallelism(trainer: Any, module: Any, config: PipelineConfig, gather_final_weights: bool,
                                   previous_call: bool) -> None:
    """What ``tensor_parallel_size > 1`` does not run yet and that needs the trainer or the model to see: refused
    at setup, before training (the options alone are refused by ``PipelineConfig``)."""
    if config.tensor_parallel_size == 1:
        return
    from lightning_async_pp.models.huggingface import HuggingFaceCausalLM
    from lightning_async_pp.models.llama import Llama

    t = config.tensor_parallel_size
    refused = []
    split = any(isinstance(p, DTensor) for p in module.parameters())  # the plan applied (in configure_model)
    # Llama and the transformers adapter apply their plan in configure_model (under the strategy it ran before
    # setup); any other module (models.GPT included) must have applied its own: a DTensor parameter shows a plan.
    if not (isinstance(module, (Llama, HuggingFaceCausalLM)) or split):
        refused.append((f"the model {type(module).__name__}", "it applies no tensor-parallel plan (it has no DTensor "
                        "parameter after configure_model); models.Llama, models.GPT and models.HuggingFaceCausalLM "
                        "come with one, your own PipelineModule applies its own in configure_model over "
                        "self.device_mesh['tensor_parallel'] (docs/guide/models.md, 'Tensor parallelism in your own "
                        "model'); or use tensor_parallel_size=1"))
    if split and trainer.state.fn == TrainerFn.FITTING:  # dropout in a layer the plan splits (evaluation draws none)
        check_tensor_parallel_no_dropout(t, dropout_in_split_layers(module.pipeline_layers()),
                                         f"the model {type(module).__name__}")
    if previous_call:
        refused.append(("a second trainer call on the same Trainer", "use a new Trainer"))
    if getattr(module, GATHERED, False):
        # Rank 0's module became a plain one-device model, the others kept their shards: the stages disagree.
        refused.append(("a trainer call on a model gathered by an earlier one (gather_final_weights=True)",
                        "pass gather_final_weights=False to the earlier Trainer, or build the model again and load "
                        "the gathered weights or a checkpoint"))
    if refused:
        what, instead = refused[0]
        raise ValueError(f"{what} is not supported with tensor_parallel_size > 1 yet (tensor_parallel_size={t}); "
                         f"{instead}")


def refuse_optimizers_with_tensor_parallelism(optimizers: Any, config: PipelineConfig) -> None:
    if config.tensor_parallel_size == 1:
        return
    for optimizer in optimizers:
        if not _tensor_parallel_ready(optimizer):
            raise ValueError(
                f"the optimizer {_short_name(optimizer)} is not supported with tensor_parallel_size > 1 yet "
                f"(tensor_parallel_size={config.tensor_parallel_size}); use torch.optim.AdamW, "
                f"lightning_async_pp.optim.Muon or AsyncNesterov, alone or inside ErrorFeedback, DelayCompensation "
                f"or WeightPrediction")


def compile_per_layer(config: PipelineConfig) -> PipelineConfig:
    """The Trainer was given ``torch.compile(model)`` (undone by ``_lightning.undo_whole_model_compile``): the
    configuration that compiles the pipeline layers instead (see docs/design/stages.md, 'Compiled layers')."""
    if config.compile is not False:
        how = f"with the strategy's compile={config.compile!r}"
    elif config.schedule == "zb_h1":
        how = "not at all: schedule='zb_h1' runs eager layers"
    else:
        config = dataclasses.replace(config, compile=True)
        how = "with torch.compile's defaults (compile=True)"
    rank_zero_warn(
        "The model was given to the Trainer as torch.compile(model). A compiled training_step would trace into "
        "the pipeline engine and gain nothing, so the whole-model compile is undone and each pipeline layer "
        f"is compiled {how}. Pass the model uncompiled and set AsyncPipelineStrategy(compile=True or "
        "{torch.compile arguments}) to choose the backend or mode; the whole-model compile's own arguments "
        "are not carried over."
    )
    return config
