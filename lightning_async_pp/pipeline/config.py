"""``PipelineConfig``: every option of the pipeline, checked in one place.

The strategy builds one from its keyword arguments; the engine, the benchmarks and the tests build it the same
way. ``check(...)`` adds the checks that need the shape of the run (processes, layers).
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_async_pp.parallel.mesh import MeshLayout
from lightning_async_pp.pipeline.schedule import MULTI_CHUNK_SCHEDULES, SCHEDULES, check_schedule
from lightning_async_pp.plan.partition import PARTITION_METHODS, PartitionSpec

DelaySpec = Union[int, Sequence[int], None]
CheckpointingSpec = Union[bool, Sequence[int]]
CompileSpec = Union[bool, Mapping[str, Any]]
#: What a layer's cost is, for the balanced split and the split's report: FLOPs counted on fake tensors, or the
#: forward and backward timed on the device, one layer at a time (docs/design/planner.md, "Balanced split").
LAYER_COSTS = ("flops", "measured")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PipelineConfig:
    """What the pipeline does; see ``AsyncPipelineStrategy`` for the meaning of each field."""

    schedule: str = "2bw"
    num_microbatches: Optional[int] = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1  # each stage split over this many processes (DTensor tensor parallelism)
    expert_parallel_size: int = 1  # each stage's experts split over this many of its ranks (parallel/expert.py)
    partition: PartitionSpec = "balanced"
    stage_memory_gib: Optional[float] = None  # partition="balanced": every stage's predicted peak at most this
    layer_cost: str = "flops"  # one of LAYER_COSTS
    # 2bw's last stage runs the next batch's first microbatch before its update (a second gradient there); None: on,
    # unless stage_memory_gib leaves the last stage room for one gradient only (docs/design/planner.md, "Run-ahead")
    last_stage_run_ahead: Optional[bool] = None
    delay: DelaySpec = None
    sync_steps: int = 0
    sync_from_step: Optional[int] = None
    num_stages: Optional[int] = None  # one device only: how many stages the layers are split into
    pipeline_timeout: float = 300.0
    check_batches: bool = True
    activation_checkpointing: CheckpointingSpec = False  # True (every layer) or indices into pipeline_layers()
    shard_optimizer: bool = False  # ZeRO-1: each stage's optimizer state split across its data-parallel replicas
    save_distributed_checkpoint: bool = True  # checkpoints as directories through torch.distributed.checkpoint
    async_checkpoint: bool = False  # sharded saves written in the background (torch.distributed.checkpoint.async_save)
    compile: CompileSpec = False  # True or torch.compile keyword arguments: each pipeline layer compiled

    def __post_init__(self) -> None:
        if self.schedule in MULTI_CHUNK_SCHEDULES:
            raise ValueError(
                f"schedule={self.schedule!r} is priced by the planner (lightning-async-pp-plan) against 2bw but not run "
                f"by this engine (one stage per process); valid schedules are {', '.join(map(repr, SCHEDULES))}"
            )
        if self.schedule not in SCHEDULES:
            close = difflib.get_close_matches(str(self.schedule), SCHEDULES, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"Unknown schedule {self.schedule!r}{hint}; valid schedules are "
                             f"{', '.join(map(repr, SCHEDULES))}")
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {self.data_parallel_size!r}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not _is_int(self.expert_parallel_size) or self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be a positive integer, got {self.expert_parallel_size!r}")
        if self.num_microbatches is not None and (not _is_int(self.num_microbatches) or self.num_microbatches < 1):
            raise ValueError(f"num_microbatches must be a positive integer, got {self.num_microbatches!r}")
        if not _is_int(self.sync_steps) or self.sync_steps < 0:
            raise ValueError(f"sync_steps must be an integer >= 0, got {self.sync_steps!r}")
        if self.sync_from_step is not None and (not _is_int(self.sync_from_step) or self.sync_from_step < 0):
            raise ValueError(
                f"sync_from_step must be None (never) or an integer >= 0 (the first synchronous update), "
                f"got {self.sync_from_step!r}"
            )
        if self.num_stages is not None and (not _is_int(self.num_stages) or self.num_stages < 1):
            raise ValueError(f"num_stages must be a positive integer, got {self.num_stages!r}")
        if not isinstance(self.pipeline_timeout, (int, float)) or not self.pipeline_timeout > 0:
            raise ValueError(f"pipeline_timeout must be > 0 seconds, got {self.pipeline_timeout!r}")
        if isinstance(self.partition, str):
            if self.partition not in PARTITION_METHODS:
                raise ValueError(
                    f"Unknown partition method {self.partition!r}; use one of {PARTITION_METHODS} or a list of layer counts"
                )
        elif not isinstance(self.partition, Sequence) or not all(_is_int(c) for c in self.partition):
            raise ValueError(f"partition must be one of {PARTITION_METHODS} or a list of layer counts, got {self.partition!r}")
        if self.layer_cost not in LAYER_COSTS:
            close = difflib.get_close_matches(str(self.layer_cost), LAYER_COSTS, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"Unknown layer_cost {self.layer_cost!r}{hint}; valid ones are "
                             f"{', '.join(map(repr, LAYER_COSTS))}")
        if self.stage_memory_gib is not None and (isinstance(self.stage_memory_gib, bool) or not isinstance(
                self.stage_memory_gib, (int, float)) or not self.stage_memory_gib > 0):
            raise ValueError(f"stage_memory_gib must be None (no cap) or a number of GiB > 0, got {self.stage_memory_gib!r}")
        if self.last_stage_run_ahead not in (None, True, False) or not isinstance(self.last_stage_run_ahead, (bool, type(None))):
            raise ValueError(
                f"last_stage_run_ahead must be None (on where the last stage has the memory), True or False, got "
                f"{self.last_stage_run_ahead!r}"
            )
        if self.delay is not None:
            values = [self.delay] if _is_int(self.delay) else self.delay
            if not isinstance(values, (list, tuple)) or not values or not all(_is_int(d) for d in values):
                raise ValueError(f"delay must be an integer >= 0 or a non-empty list of them, got {self.delay!r}")
            if any(d < 0 for d in values):
                raise ValueError(f"delay must be >= 0 (0 is synchronous, 1 is 2BW), got {self.delay!r}")
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(
                f"shard_optimizer must be True (each stage's optimizer state split across its data-parallel "
                f"replicas) or False, got {self.shard_optimizer!r}"
            )
        for name in ("save_distributed_checkpoint", "async_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.async_checkpoint and not self.save_distributed_checkpoint:
            raise ValueError(
                "async_checkpoint=True writes sharded checkpoints in the background through "
                "torch.distributed.checkpoint.async_save, but save_distributed_checkpoint=False asks for one file "
                "assembled on rank 0; use save_distributed_checkpoint=True with it, or async_checkpoint=False"
            )
        spec = self.activation_checkpointing
        if not isinstance(spec, bool):
            valid = "True, False or a list of layer indices (positions in pipeline_layers())"
            if not isinstance(spec, Sequence) or isinstance(spec, str) or not all(_is_int(i) for i in spec):
                raise ValueError(f"activation_checkpointing must be {valid}, got {spec!r}")
            if any(i < 0 for i in spec) or len(set(spec)) != len(spec):
                raise ValueError(f"activation_checkpointing must list distinct layer indices >= 0, got {list(spec)!r}")
            object.__setattr__(self, "activation_checkpointing", tuple(spec))  # frozen: keep an immutable copy
        self._check_compile()
        if self.tensor_parallel_size > 1:
            self._refuse_with_tensor_parallelism()
        if self.expert_parallel_size > 1:
            from lightning_async_pp.parallel.expert import refuse_with_expert_parallelism

            refuse_with_expert_parallelism(self)

    def _refuse_with_tensor_parallelism(self) -> None:
        """The options not supported with ``tensor_parallel_size > 1`` yet (docs/design/tensor-parallel.md, "What
        runs"): refused here, before any process starts."""
        unsupported = [
            (self.num_stages is not None, f"num_stages={self.num_stages!r}", "drop num_stages (the stages are the "
             "processes / tensor_parallel_size)"),
        ]
        for refused, what, instead in unsupported:
            if refused:
                raise ValueError(f"{what} is not supported with tensor_parallel_size > 1 yet "
                                 f"(tensor_parallel_size={self.tensor_parallel_size}); {instead}")

    def _check_compile(self) -> None:
        spec = self.compile
        if spec is not False and self.schedule == "zb_h1":
            raise ValueError(
                f"compile={spec!r} with schedule='zb_h1': a compiled layer is one autograd node, so zb_h1's split "
                f"backward would run its backward twice (once for the input gradient, once for the weights'); use "
                f"schedule='1f1b' with compile, or zb_h1 without"
            )
        if isinstance(spec, bool):
            return
        defaults = compile_defaults()
        valid = list(defaults)
        if not isinstance(spec, Mapping) or not all(isinstance(k, str) for k in spec):
            raise ValueError(
                f"compile must be True, False or a mapping of torch.compile keyword arguments ({', '.join(valid)}), "
                f"got {spec!r}"
            )
        unknown = [k for k in spec if k not in valid]
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                     for k in unknown]
            raise ValueError(
                f"compile got unknown torch.compile keyword argument(s) {', '.join(hints)}; valid ones are "
                f"{', '.join(valid)}"
            )
        flags = [k for k, v in spec.items() if isinstance(defaults[k], bool) and not isinstance(v, bool)]
        if flags:
            raise ValueError(f"compile: torch.compile's {', '.join(map(repr, flags))} must be True or False, got "
                             + ", ".join(f"{spec[k]!r}" for k in flags))
        # torch.compile checks the backend, mode and options when it wraps a function (nothing is compiled yet):
        # its refusal, with its list of what is valid, reaches the user before training.
        try:
            torch.compile(_identity, **spec)
        except Exception as err:  # InvalidBackend, RuntimeError (mode, options), AssertionError (dynamic)
            raise ValueError(f"compile={dict(spec)!r} is refused by torch.compile: {type(err).__name__}: {err}") from err
        object.__setattr__(self, "compile", dict(spec))  # a copy: later changes to the caller's dict do not leak in

    def compile_options(self) -> Optional[dict[str, Any]]:
        """The keyword arguments each pipeline layer is compiled with, or ``None`` (layers run eagerly).

        ``True`` is inductor with the two options that keep its results equal to eager ones: intermediate results
        rounded to bf16 where eager rounds them (``emulate_precision_casts``; without it fused bf16 kernels keep
        fp32 intermediates) and eager's random numbers for dropout (``fallback_random``). A dict is passed as
        given (``{}``: torch.compile's own defaults)."""
        if self.compile is False:
            return None
        return {"options": dict(EXACT_INDUCTOR_OPTIONS)} if self.compile is True else dict(self.compile)

    # ---- what follows from the number of processes ---------------------------------------------------------
    def stages_for(self, world_size: int) -> int:
        """Pipeline stages for ``world_size`` processes (on one process: ``num_stages`` or the delay list's length)."""
        if world_size > 1:
            # refuses a world that data_parallel_size x tensor_parallel_size does not divide, naming the numbers
            return MeshLayout(world_size, self.data_parallel_size, self.tensor_parallel_size,
                              self.expert_parallel_size).num_stages
        if self.num_stages is not None:
            return self.num_stages
        return len(self.delay) if isinstance(self.delay, (list, tuple)) else 1

    def microbatches_for(self, num_stages: int) -> int:
        return self.num_microbatches if self.num_microbatches is not None else max(4, num_stages)

    def stage_delays(self, num_stages: int) -> list[int]:
        """The delay (in updates) of each stage's gradients."""
        if self.delay is None:
            return [1 if self.schedule == "2bw" else 0] * num_stages
        if _is_int(self.delay):
            return [int(self.delay)] * num_stages
        delays = [int(d) for d in self.delay]
        if len(delays) != num_stages:
            raise ValueError(
                f"delay={delays} gives {len(delays)} per-stage delays but the pipeline has {num_stages} "
                f"stage(s); give one delay per stage (num_stages={len(delays)} on one device)"
            )
        return delays

    def checkpointed_layers(self, num_layers: int) -> frozenset[int]:
        """The indices of the layers whose forward is recomputed in backward (activation checkpointing)."""
        spec = self.activation_checkpointing
        if isinstance(spec, bool):
            return frozenset(range(num_layers)) if spec else frozenset()
        outside = [i for i in spec if i >= num_layers]
        if outside:
            raise ValueError(
                f"activation_checkpointing lists layer(s) {outside}, but the model has {num_layers} pipeline layers "
                f"(valid indices 0..{num_layers - 1})"
            )
        return frozenset(spec)

    def check(self, world_size: int) -> None:
        """Everything that can be checked from the process count alone: run before any process starts."""
        num_stages = self.stages_for(world_size)
        if world_size > 1:
            if self.num_stages not in (None, num_stages):
                raise ValueError(
                    f"num_stages={self.num_stages} does not match the {num_stages} stages given by "
                    f"{world_size} processes / data_parallel_size={self.data_parallel_size}"
                )
            expected = 1 if self.schedule == "2bw" else 0
            if self.delay is not None and any(d != expected for d in self.stage_delays(num_stages)):
                raise ValueError(
                    f"delay={self.delay!r} is a one-device research variant; across processes the delay follows the "
                    f"schedule ({self.schedule!r} has delay {expected}). Run it with devices=1 or drop delay"
                )
        elif self.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} needs at least that many processes; got one device")
        elif self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs at least that many processes (one "
                             f"per shard of a stage); got one device")
        self.stage_delays(num_stages)
        check_schedule(self.schedule, num_stages, self.microbatches_for(num_stages))


#: What ``compile=True`` gives inductor (see ``PipelineConfig.compile_options``).
EXACT_INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "fallback_random": True}


def compile_defaults() -> dict[str, Any]:
    """The keyword arguments ``torch.compile`` takes besides the callable, with their defaults (its signature)."""
    return {name: p.default for name, p in inspect.signature(torch.compile).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _identity(x: Any) -> Any:
    return x
