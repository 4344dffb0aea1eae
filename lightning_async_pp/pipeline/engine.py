"""``PipelineEngine``: the one facade of the pipeline engine (no Lightning here).

Built from a model's layers, a :class:`PipelineConfig` and the process layout, it owns the stages this process
runs, their weight versions, the links to other processes and the runtime. The Lightning strategy, the
callbacks (through :attr:`stats`) and the benchmarks all drive the pipeline through it:

    engine = PipelineEngine.build(root, layers, config, input_fn=..., loss_fn=..., device=..., world_size=..., rank=...)
    loss = engine.train_step(batch, next_batch)    # forward and backward of every microbatch
    engine.prepare_update(); optimizer.step()       # the optimizer writes W_{k+1}; W_k stays stashed
    engine.evaluate(batch); engine.predict(batch)   # newest weights, forward only

See docs/design/update-rule.md for the version rule and the invariants.
"""
from __future__ import annotations

import functools
import operator
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from lightning_async_pp.parallel.expert import ExpertGroups, start_alike
from lightning_async_pp.parallel.mesh import describe_layout
from lightning_async_pp.parallel.placement import (
    Tie,
    check_parameters_covered,
    layer_paths,
    materialize_layers,
    reassemble_layers,
    remove_other_stages,
    restore_layers,
)
from lightning_async_pp.parallel.tensor_parallel import is_whole, local_tensor
from lightning_async_pp.parallel.topology import PipelineTopology
from lightning_async_pp.pipeline.comm import FailureBoard, StageLink
from lightning_async_pp.pipeline.config import PipelineConfig
from lightning_async_pp.pipeline.randomness import ForwardRandomness
from lightning_async_pp.pipeline.runtime import PipelineRuntime
from lightning_async_pp.pipeline.stage import PipelineStats, Stage, StageView
from lightning_async_pp.pipeline.versions import WeightVersions
from lightning_async_pp.plan.balanced import (MemoryModel, SplitReport, layer_costs, report_for, shared_parameters,
                                              split_and_run_ahead, stage_memory_bytes)
from lightning_async_pp.plan.partition import partition_layers
from lightning_async_pp.plan.timing import agreed_layer_times
from lightning_async_pp.trace import Span


class PipelineEngine:
    def __init__(self, root: nn.Module, layers: Sequence[nn.Module], paths: Sequence[str], config: PipelineConfig, *,
                 input_fn: Callable[[Any], Any], loss_fn: Callable[[Any, Any], Tensor], device: torch.device,
                 world_size: int = 1, rank: int = 0, metric_names: Sequence[str] = (),
                 metrics_fn: Optional[Callable[[], dict[str, Tensor]]] = None, sample_batch: Any = None,
                 compute_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                 weight_fn: Optional[Callable[[Any], Any]] = None,
                 layer_times: Optional[Sequence[float]] = None,
                 optimizer_state_bytes: Optional[Sequence[int]] = None,
                 optimizer_state_shared: Sequence[tuple[int, Sequence[int]]] = ()) -> None:
        self.config = config
        self.root, self.layers, self.paths = root, list(layers), list(paths)
        self.world_size, self.rank, self.device = world_size, rank, device
        self.is_multiprocess = world_size > 1
        self.num_stages = config.stages_for(world_size)
        self.num_microbatches = config.microbatches_for(self.num_stages)
        self.tensor_parallel_size = config.tensor_parallel_size
        self.topology = (PipelineTopology(world_size, config.data_parallel_size, rank, config.tensor_parallel_size,
                                          config.expert_parallel_size) if self.is_multiprocess else None)
        config.check(world_size)
        # A previous engine on this model (an earlier trainer call) took other stages' layers out of the tree:
        # put them back, so the ties, names and groups below are derived from the same model on every process.
        reassemble_layers(root, self.layers, self.paths)
        self.checkpointed_layers = config.checkpointed_layers(len(self.layers))
        self._metrics_fn = metrics_fn
        self._compute_context = compute_context  # what training computes in (autocast): measured layer times too
        # layer_cost="measured": the times an earlier engine of the same run took (every process holds the same
        # ones), reused so that one run keeps one split: timing again could choose another by noise
        self.layer_times: Optional[list[float]] = list(layer_times) if layer_times is not None else None
        # per layer, the configured optimizer's state (None: AdamW's two moments are assumed)
        if optimizer_state_bytes is not None and len(optimizer_state_bytes) != len(self.layers):
            raise ValueError(f"optimizer_state_bytes has {len(optimizer_state_bytes)} values for "
                             f"{len(self.layers)} layers; give one per layer")
        self.optimizer_state_bytes = tuple(optimizer_state_bytes) if optimizer_state_bytes is not None else None
        # of those, each parameter several layers hold (a tied weight): its bytes and the layers holding it
        self.optimizer_state_shared = tuple((int(b), tuple(held)) for b, held in optimizer_state_shared)
        self.split = self._choose_split(sample_batch, input_fn, loss_fn)
        if self.is_multiprocess:
            self.split = replace(self.split, layout=describe_layout(self.num_stages, config.tensor_parallel_size,
                                                                    config.data_parallel_size))
        self.ranges = partition_layers(self.layers, self.num_stages, list(self.split.counts))
        self.stage_of_layer = [s for s, r in enumerate(self.ranges) for _ in r]
        self.ties: list[Tie] = check_parameters_covered(root, self.layers, self.stage_of_layer)
        # Each parameter's name in the whole model (a tied one under its first name), taken before other stages'
        # layers leave this process: checkpoints key tensors by these, whatever the layout.
        self.global_names: dict[int, str] = {}
        self.aliases: dict[str, str] = {}  # second and later names of a shared parameter -> its global name
        for name, p in root.named_parameters(remove_duplicate=False):
            first = self.global_names.setdefault(id(p), name)
            if first != name:
                self.aliases[name] = first
        delays = config.stage_delays(self.num_stages)
        self._tie_groups: list[tuple[Tie, Any]] = []
        self.pipeline_group: Any = None
        self.experts: Optional[ExpertGroups] = None  # expert parallelism (parallel/expert.py)
        self.board = FailureBoard(None)
        link, dp_group, loss_group = None, None, None
        if self.is_multiprocess:
            topology = self.topology
            assert topology is not None
            local = [topology.stage]
            self.board = FailureBoard.from_default_group()
            dp_group = topology.create_dp_group()
            loss_group = topology.create_dp_group()  # the batch loss's mean, apart from the gradient buckets
            self._create_groups(topology)
            remove_other_stages(root, self.layers, self.paths, self.stage_of_layer, topology.stage)
            # Forget the parameters that left (their ids may be reused by new objects).
            held = {id(p) for p in root.parameters()}
            self.global_names = {i: n for i, n in self.global_names.items() if i in held}
            ranks = topology.pipeline_ranks
            s = topology.stage
            link = StageLink(
                stage=s, rank=rank, prev_rank=ranks[s - 1] if s > 0 else None,
                next_rank=ranks[s + 1] if s + 1 < len(ranks) else None, device=device,
                timeout=float(config.pipeline_timeout), board=self.board, rank_to_stage=topology.rank_to_stage,
            )
        else:
            local = list(range(self.num_stages))
            for tie in self.ties:
                if len({delays[s] for s in tie.stages}) > 1:
                    raise ValueError(
                        f"a parameter of shape {tuple(tie.param.shape)} is tied across stages {tie.stages} whose delays "
                        f"differ ({[delays[s] for s in tie.stages]}); tied copies must use one weight version"
                    )
        # Each forward draws from a stream seeded by the run's seed and its own (stage, replica, batch, microbatch):
        # rank 0's seed on every process, so p processes draw as one device does (pipeline/randomness.py).
        base = [torch.initial_seed()]
        if self.is_multiprocess:
            dist.broadcast_object_list(base, src=0)
        self.randomness = ForwardRandomness(base[0], device, replica=self.topology.dp_rank if self.topology else 0)
        self._local, self._delays, self._link = local, delays, link
        self._dp_group = dp_group if self.is_multiprocess else None
        self._loss_group = loss_group
        self._ties_due = False  # the tied-gradient sum waits for the data-parallel reduction
        self._input_fn, self._loss_fn, self._weight_fn = input_fn, loss_fn, weight_fn
        self._metric_names, self._metrics_fn = tuple(metric_names), metrics_fn
        self.stages: list[Stage] = []

    def _choose_split(self, sample_batch: Any, input_fn: Callable[[Any], Any],
                      loss_fn: Callable[[Any, Any], Tensor]) -> SplitReport:
        """The layers per stage, and what the cost model predicts of them (docs/design/planner.md, "Balanced split").
        Every process computes the same split: the FLOPs depend only on the layers' shapes and the sample's, and
        measured times are rank 0's on every process."""
        config, p = self.config, self.num_stages
        method = config.partition
        # One device models the p devices its stages stand for, so it picks the split p processes pick.
        model = MemoryModel(config.schedule, p, self.num_microbatches, config.data_parallel_size, config.shard_optimizer,
                            run_ahead=config.last_stage_run_ahead is not False, state_bytes=self.optimizer_state_bytes,
                            state_shared=self.optimizer_state_shared, param_shared=shared_parameters(self.layers))
        costs, measured = None, None
        if sample_batch is not None:
            try:
                # as training runs them: in the precision's autocast, checkpointed layers recomputed
                costs = layer_costs(self.layers, sample_batch, input_fn, loss_fn, device=self.device,
                                    checkpointed=self.checkpointed_layers, context=self._compute_context)
            except Exception as err:  # a layer that cannot run on fake tensors (data-dependent shapes, .item())
                if method == "balanced" and self.rank == 0:
                    warnings.warn(f"partition='balanced' could not cost the layers on fake tensors "
                                  f"({type(err).__name__}: {err}); splitting by parameter counts instead", stacklevel=3)
                costs = None
        # Whether the times are exchanged follows from the configuration alone, so every process joins the broadcast
        # even where its own costing differed; a process uses the times only with costs of its own.
        if config.layer_cost == "measured" and p > 1:
            if self.layer_times is None or len(self.layer_times) != len(self.layers):
                self.layer_times = self._measured_times(sample_batch if costs is not None else None, input_fn, loss_fn)
            measured = self.layer_times
            if costs is None or measured is None or len(measured) != len(costs):
                measured = None
        if sample_batch is not None and self._metrics_fn is not None:
            # what the costing's loss recorded must not count in a batch: read it once and drop it, as for a
            # lookahead batch Lightning did not train
            try:
                self._metrics_fn()
            except Exception:  # nothing (or only fake values) recorded: nothing to drop
                pass
        if method == "balanced":
            if costs is None:
                if sample_batch is None and self.rank == 0:
                    warnings.warn("partition='balanced' has no example batch to cost the layers on: splitting by "
                                  "parameter counts; set the model's example_input_array (or pipeline_example_batch) "
                                  "to one microbatch, or pass partition='parameters'", stacklevel=3)
                counts = [len(r) for r in partition_layers(self.layers, p, "parameters")]
                return report_for(counts, "parameters", None, model)
            cap = config.stage_memory_gib * 2**30 if config.stage_memory_gib is not None else None
            times = measured if measured is not None else [float(c.flops) for c in costs]
            counts, model = split_and_run_ahead(times, p, model, memory_cap=cap,
                                                memory=lambda i, j, s, mm: stage_memory_bytes(costs, i, j, s, mm),
                                                run_ahead=config.last_stage_run_ahead)
            return report_for(counts, "balanced", costs, model, measured_times=measured)
        counts = [len(r) for r in partition_layers(self.layers, p, method)]
        return report_for(counts, method if isinstance(method, str) else "explicit", costs, model,
                          measured_times=measured)

    def _measured_times(self, sample_batch: Any, input_fn: Callable[[Any], Any],
                        loss_fn: Callable[[Any, Any], Tensor]) -> Optional[list[float]]:
        """``layer_cost="measured"``: rank 0's layer times (under tensor parallelism its tensor-parallel group's,
        each layer's slowest) on every process, so all choose one split (plan/timing.py). ``None`` (the FLOPs
        are used) where they could not be timed or there is no sample (``sample_batch`` None)."""
        return agreed_layer_times(self.layers, sample_batch, input_fn, loss_fn, self.device, rank=self.rank,
                                  multiprocess=self.is_multiprocess, context=self._compute_context,
                                  checkpointed=self.checkpointed_layers)

    def own_layer_indices(self) -> list[int]:
        """The global indices of the layers this process runs."""
        return [i for s in self._local for i in self.ranges[s]]

    def materialize(self, device: torch.device, init_layer: Callable[[int, nn.Module], None]) -> None:
        """Give this process's layers that were built on the ``meta`` device their memory on ``device`` and
        initialize them, layer by layer (``init_layer(index, layer)``); other stages' layers stay without memory.
        Then the copies of a parameter tied across processes take the value of the stage that owns it.
        Call after construction, before :meth:`start`."""
        own = self.own_layer_indices()
        materialize_layers([self.layers[i] for i in own], own, device, init_layer)
        topology = self.topology
        for tie, group in self._tie_groups:
            assert topology is not None
            dist.broadcast(local_tensor(tie.param).data, src=topology.rank_of(tie.owner), group=group)
        if self._dp_group is not None:  # replicas start from the same weights and buffers, as DDP does
            assert topology is not None
            start_alike(nn.ModuleList([self.layers[i] for i in own]), topology.layout, self.rank, self._dp_group, self.experts)

    @contextmanager
    def whole_model(self) -> Iterator[None]:
        """Every layer back in the model (other stages' layers still without memory), as on one device, for code
        that must see the whole model's structure (the order a plain checkpoint's optimizer saw); then split
        again."""
        if self.topology is None:
            yield
            return
        reassemble_layers(self.root, self.layers, self.paths)
        try:
            yield
        finally:
            remove_other_stages(self.root, self.layers, self.paths, self.stage_of_layer, self.topology.stage)

    def start(self) -> "PipelineEngine":
        """Create this process's stages from its layers as they are now (on their device): call after moving the
        model, before the first step. Each stage copies its parameters into its weight-version slots."""
        self.stages = self._build_stages(self._local, self._delays)
        self.runtime = PipelineRuntime(
            self.stages, schedule=self.config.schedule, num_microbatches=self.num_microbatches,
            input_fn=self._input_fn, loss_fn=self._loss_fn, weight_fn=self._weight_fn, link=self._link,
            pipeline_ranks=self.topology.pipeline_ranks if self.topology else [0],
            dp_group=self._dp_group, dp_size=self.config.data_parallel_size, check_batches=self.config.check_batches,
            loss_group=self._loss_group, metric_names=self._metric_names, metrics_fn=self._metrics_fn,
            randomness=self.randomness, last_ahead=self.split.run_ahead is not False,
            tensor_parallel=self.tensor_parallel_size > 1, expert_gradients=self.experts and self.experts.gradients(self.stages),
        )
        # Where each tied parameter sits among this process's gradients, and the parameters another stage counts
        # in a global norm (a tied one only on the stage that owns it): fixed once the stages exist.
        index = {id(p): i for i, p in enumerate(self.params)}
        self._tied_slots = [(index[id(tie.param)], tie, group) for tie, group in self._tie_groups]
        self._counted_elsewhere = {id(t.param) for t in self.ties if self.topology and t.owner != self.topology.stage}
        if self.topology is not None and self.topology.tp_rank != 0:
            # A whole (plain or replicated) parameter's gradient is whole and equal on every tensor-parallel rank:
            # counted on rank 0 only; a sharded parameter's local shard on every rank.
            self._counted_elsewhere |= {id(p) for p in self.params if is_whole(p)}
        # the monitors count an expert on the rank holding it, its squares scaled by e (StageView.scales)
        shown_elsewhere, experts = set(self._counted_elsewhere), self.experts.ids if self.experts else set()
        self._counted_elsewhere |= experts  # the clipping norm sums them over their group instead
        names, e = self.global_names, self.config.expert_parallel_size
        self.stage_views = [StageView(st.index, st.versions.delay, tuple(names[id(p)] for p in st.params), st,
                                      tuple(id(p) not in shown_elsewhere for p in st.params),
                                      tuple(float(e) if id(p) in experts else 1.0 for p in st.params))
                            for st in self.stages]
        self.stats = PipelineStats(self)
        return self

    @classmethod
    def build(cls, root: nn.Module, layers: Sequence[nn.Module], config: PipelineConfig, **kwargs: Any) -> "PipelineEngine":
        """Build the engine for ``layers`` of the model ``root`` (each a submodule of it)."""
        layers = list(layers)
        if not layers:
            raise ValueError(f"{type(root).__name__}.pipeline_layers() returned no layers; return at least one nn.Module")
        return cls(root, layers, layer_paths(root, layers), config, **kwargs)

    def _create_groups(self, topology: PipelineTopology) -> None:
        # new_group is collective: every rank creates every group, in the same order. Processes that disagree on
        # the groups would wait in new_group until the timeout, so they first compare what they will create.
        mine = (self.num_stages, [r.start for r in self.ranges], [(tuple(t.param.shape), t.stages) for t in self.ties])
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if any(other != mine for other in everyone):
            raise RuntimeError(
                "the processes see different pipelines (stages, first layer of each stage, tied parameters as "
                "(shape, stages)): " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
                + ". Every process must build the same model with the same pipeline_layers()"
            )
        # The global norm's group: every stage and tensor-parallel rank of one replica.
        t = topology.tensor_parallel_size
        for d in range(topology.data_parallel_size):
            group = dist.new_group([topology.rank_of(s, d, i) for s in range(topology.num_stages) for i in range(t)])
            if d == topology.dp_rank:
                self.pipeline_group = group
        self.experts = ExpertGroups(topology.layout, self.rank) if topology.layout.expert_parallel_size > 1 else None
        # A tie per replica and tensor-parallel rank: rank i of each stage holds the same shard of the tied tensor.
        for tie in self.ties:
            for d in range(topology.data_parallel_size):
                for i in range(t):
                    group = dist.new_group([topology.rank_of(s, d, i) for s in tie.stages])
                    if (d, i) == (topology.dp_rank, topology.tp_rank) and topology.stage in tie.stages:
                        self._tie_groups.append((tie, group))

    def _build_stages(self, local: list[int], delays: list[int]) -> list[Stage]:
        stages: list[Stage] = []
        owner_of: dict[int, tuple[Stage, int]] = {}  # id(param) -> (stage in this process, index there)
        for s in local:
            layers = [self.layers[i] for i in self.ranges[s]]
            holder = nn.ModuleList(layers)
            borrowed = {f"layers.{name}": owner_of[id(p)] for name, p in holder.named_parameters() if id(p) in owner_of}
            stage = Stage(layers, s, self.num_stages, delay=delays[s], sync_steps=self.config.sync_steps,
                          sync_from_step=self.config.sync_from_step, borrowed=borrowed,
                          checkpointed=[i in self.checkpointed_layers for i in self.ranges[s]],
                          compile_options=self.config.compile_options())
            for i, p in enumerate(stage.params):
                owner_of.setdefault(id(p), (stage, i))
            stages.append(stage)
        return stages

    def set_weight_prediction(self, scales: dict[int, float]) -> None:
        """Delayed batches run on predicted versions (see docs/design/update-rule.md, 'Weight prediction'): ``scales`` maps
        ``id(parameter)`` to its scale ``s``; a parameter not in it is not extrapolated (``s = 0``). A stage
        with delay 0, or none of whose parameters is in ``scales``, is left as it is."""
        for stage in self.stages:
            mine = [scales.get(id(p), 0.0) for p in stage.params]
            if stage.versions.delay > 0 and any(s != 0 for s in mine):
                stage.versions.enable_prediction(mine)

    def check_tied_hyperparameters(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Copies of a parameter tied across processes must be updated alike: refuse (on every process, before
        training) optimizer groups whose hyperparameters differ between the copies. Collective over all ranks."""
        if not self.is_multiprocess:
            return
        tied = {id(t.param) for t in self.ties}
        mine: dict[str, list] = {}
        for i, optimizer in enumerate(optimizers):
            for group in optimizer.param_groups:
                hyper = repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names")))
                for p in group["params"]:
                    if id(p) in tied:
                        mine.setdefault(self.global_names[id(p)], []).append((i, hyper))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.rank, mine))
        seen: dict[str, tuple[int, list]] = {}
        for rank, groups in everyone:
            for name, hyper in groups.items():
                first = seen.setdefault(name, (rank, hyper))
                if first[1] != hyper:
                    raise ValueError(
                        f"the parameter {name!r} is tied across pipeline stages, but its optimizer groups differ: "
                        f"rank {first[0]} has {first[1]}, rank {rank} has {hyper}. Its copies would drift apart; "
                        f"give it the same group (lr, weight decay, ...) on every stage"
                    )

    # ---- training --------------------------------------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        return self.runtime.params

    @property
    def dp_group(self) -> Any:
        """The process group of this stage's data-parallel replicas (``None`` with one pipeline)."""
        return self._dp_group

    @property
    def gradients(self) -> list[Optional[Tensor]]:
        """The last batch's gradient, averaged over data-parallel replicas and summed over tied copies. The
        data-parallel reduction runs in the background from the batch's last backward; this waits for it (the
        first read after :meth:`train_step`, which is Lightning's ``backward``)."""
        if self._ties_due:
            self._ties_due = False
            self.runtime.finish_reduction()
            self._sum_tied_gradients()
        return self.runtime.gradients

    @property
    def has_lookahead(self) -> bool:
        return self.runtime.has_lookahead

    def uses_lookahead(self, next_batch_exists: bool = True) -> bool:
        return self.runtime.uses_lookahead(next_batch_exists)

    def train_step(self, batch: Any, next_batch: Any = None) -> Tensor:
        """Forward and backward of every microbatch of ``batch`` (and, under 2BW across processes, the first
        forwards of ``next_batch``); returns the batch's mean loss and leaves its gradient in :attr:`gradients`."""
        loss = self.runtime.train_batch(batch, next_batch)
        self._ties_due = True  # summed on the first read of ``gradients``, once the replicas' mean is there
        return loss

    @property
    def last_metrics(self) -> dict[str, Tensor]:
        """The last trained batch's ``metrics_fn()`` scalars (computed on the last stage), on every rank."""
        return self.runtime.last_metrics

    def _sum_tied_gradients(self) -> None:
        if not self._tied_slots:
            return
        start = time.perf_counter()
        for i, tie, group in self._tied_slots:
            g = self.runtime.gradients[i]
            self.runtime.gradients[i] = _sum_in_stage_order(
                g if g is not None else torch.zeros_like(local_tensor(tie.param)), group, len(tie.stages))
        self.runtime.record_tied_sum(start, time.perf_counter())

    def cancel_lookahead(self) -> None:
        """The batch whose forwards already ran will not be trained: drop them (see ``PipelineRuntime``)."""
        self.runtime.cancel_lookahead()

    def trained_buffers(self) -> dict[int, Tensor]:
        """``id(buffer) -> value`` as the trained batches left each buffer that the next batch's forwards (2BW's
        lookahead) have since changed in place: a checkpoint saves these values."""
        return self.runtime.trained_buffers()

    def prepare_update(self) -> None:
        """Move the parameters onto the slot of ``W_{k+1}``; call after the gradient is complete, before the
        optimizer writes the parameters in place."""
        self.runtime.prepare_update()

    def record_optimizer(self, start: float, end: float) -> None:
        self.runtime.record_optimizer(start, end)

    def release_gradients(self) -> None:
        """Drop the gradient the optimizer just applied (``.grad`` and the engine's own reference): the next
        batch's gradient accumulates during its step, and two would otherwise be alive at once."""
        for p in self.params:
            p.grad = None
        self.runtime.gradients = [None] * len(self.runtime.gradients)

    @torch.no_grad()
    def clip_grad_norm(self, params: Sequence[Tensor], max_norm: float) -> Tensor:
        """Global-norm clipping of the ``.grad`` of ``params`` (one optimizer's, on this process) by their norm over
        every stage of the pipeline, as ``torch.nn.utils.clip_grad_norm_`` would clip the whole model's; returns
        that norm.

        Each stage adds its squared norm (a parameter tied across stages counted on the stage that owns it); the
        stages' sums are added in stage order, across processes in one scalar collective, so every stage calls
        this for the same optimizers at the same step. Data-parallel replicas hold the same (averaged, whole)
        gradient: no reduction across them. Scaling is torch's ``clip_grads_with_norm_``. Under tensor parallelism
        every rank adds its shards' squares (a replicated parameter on tensor-parallel rank 0 only) and the sum
        spans every stage's tensor-parallel ranks (docs/design/tensor-parallel-shards.md, "Weights, gradients and
        optimizer state per shard").
        """
        params = [p for p in params if p.grad is not None]
        device = local_tensor(params[0].grad).device if params else self.device
        # Each stage's sum, then the stages' sums in stage order: on one device as across processes, to the bit.
        stage_of = {id(p): stage.index for stage in self.stages for p in stage.params}
        by_stage: dict[int, list[Tensor]] = {}
        for p in params:
            if id(p) not in self._counted_elsewhere:
                by_stage.setdefault(stage_of.get(id(p), 0), []).append(local_tensor(p.grad))
        sums = [torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) ** 2 for g in grads]).sum()
                for _, grads in sorted(by_stage.items())]
        sums += [self.experts.square_sum(params, device)] if self.experts else []  # each expert once, over its group
        sq = functools.reduce(operator.add, sums) if sums else torch.zeros((), device=device)
        if self.pipeline_group is not None:
            sq = _sum_in_stage_order(sq, self.pipeline_group, self.num_stages * self.tensor_parallel_size)
        total = sq.sqrt()
        if params and self.tensor_parallel_size > 1:
            # clip_grads_with_norm_'s scaling, on the local shards (it cannot mix DTensor gradients and a plain norm)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([local_tensor(p.grad) for p in params], coef)
        elif params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # ---- evaluation and prediction --------------------------------------------------------------------------
    def evaluate(self, batch: Any) -> Tensor:
        """The mean loss of ``batch`` on the newest weights (any batch size)."""
        return self.runtime.eval_loss(batch)

    def predict(self, batch: Any) -> Any:
        """The last layer's output for ``batch`` on the newest weights, on the pipeline's first stage (``None``
        on the other stages)."""
        return self.runtime.predict(batch)

    def loss_and_gradients(self, weights: Sequence[Sequence[Tensor]], microbatch: Any) -> tuple[Tensor, list]:
        """Loss of ``microbatch`` through this process's stages at the given weights (one list per stage, as
        :meth:`StageView.version` returns them) and its gradient per stage; nothing is written anywhere.

        Needs every stage in this process (one device)."""
        if self.is_multiprocess:
            raise RuntimeError("loss_and_gradients needs every stage in this process (one device)")
        leaves = [[t.detach().requires_grad_(p.requires_grad) for t, p in zip(tensors, stage.params)]
                  for stage, tensors in zip(self.stages, weights)]
        owner = {id(p): leaf for stage, stage_leaves in zip(self.stages, leaves) for p, leaf in zip(stage.params, stage_leaves)}
        with torch.enable_grad():
            x = self.runtime.input_fn(microbatch)
            for stage, stage_leaves in zip(self.stages, leaves):
                tensors = dict(zip(stage.param_names, stage_leaves))
                for name, (lender, i) in stage.borrowed.items():
                    tensors[name] = owner[id(lender.params[i])]
                tensors.update({name: b.clone() for name, b in stage.layers.named_buffers()})
                x = functional_call(stage.layers, tensors, (x,))
            loss = self.runtime.loss_fn(x, microbatch)
            wanted = [leaf for stage_leaves in leaves for leaf in stage_leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
        per_stage = [[next(grads) if leaf.requires_grad else None for leaf in stage_leaves] for stage_leaves in leaves]
        return loss.detach(), per_stage

    # ---- tracing ------------------------------------------------------------------------------------------
    def start_trace(self) -> None:
        """Record a :class:`Span` for every forward, backward and wait from now on."""
        self.runtime.trace = []

    def stop_trace(self) -> list[Span]:
        spans, self.runtime.trace = self.runtime.trace or [], None
        return spans

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's stages: each held weight version keyed by global parameter name, and the counters."""
        out: dict[str, Any] = {}
        for view, stage in zip(self.stage_views, self.stages):
            versions = stage.versions
            held = range(max(0, versions.num_updates - versions.delay), versions.num_updates + 1)
            out[str(stage.index)] = {
                "num_updates": versions.num_updates,
                "delay": versions.delay,
                "versions": {j: {n: t.detach().clone() for n, t in zip(view.param_names, versions.version(j))} for j in held},
            }
            if versions.predicts:
                out[str(stage.index)]["predicted_newest"] = {
                    n: t.detach().clone() for n, t in zip(view.param_names, versions.predicted_newest())}
        return {"stages": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved; names and shapes must match (the error says what differs)."""
        stages = state.get("stages", {})
        for view, stage in zip(self.stage_views, self.stages):
            saved = stages.get(str(stage.index), stages.get(stage.index))
            if saved is None:
                raise ValueError(
                    f"the checkpoint holds no weight versions for pipeline stage {stage.index} (it has stages "
                    f"{sorted(stages)}); it was saved with another number of stages"
                )
            expected = {n: tuple(p.shape) for n, p in zip(view.param_names, stage.params)}
            for j, tensors in saved["versions"].items():
                check_names_and_shapes(expected, {n: tuple(t.shape) for n, t in tensors.items()},
                                       f"weight version W_{j} of stage {stage.index}")
            converted = dict(saved, versions={j: [tensors[n] for n in view.param_names]
                                              for j, tensors in saved["versions"].items()})
            if saved.get("predicted_newest") is not None:
                check_names_and_shapes(expected, {n: tuple(t.shape) for n, t in saved["predicted_newest"].items()},
                                       f"the predicted newest version of stage {stage.index}")
                converted["predicted_newest"] = [saved["predicted_newest"][n] for n in view.param_names]
            stage.versions.load_state_dict(converted)

    # ---- the whole model on one process -----------------------------------------------------------------------
    def restore_all_layers(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Put every other stage's layers back into the model, loaded from ``state`` (full-model keys)."""
        restore_layers(self.root, self.layers, self.paths, state, device)


def check_names_and_shapes(expected: dict[str, tuple], found: dict[str, tuple], what: str) -> None:
    """Raise a ValueError that lists missing and unexpected names and differing shapes."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [f"{n}: checkpoint {found[n]} vs model {expected[n]}" for n in sorted(set(expected) & set(found))
              if tuple(found[n]) != tuple(expected[n])]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if shapes:
            parts.append("different shapes: " + "; ".join(shapes[:8]))
        raise ValueError(f"the checkpoint does not fit this model ({what}): " + ", ".join(parts))


def _sum_in_stage_order(t: Tensor, group: Any, size: int) -> Tensor:
    """The sum of ``t`` over ``group`` (a replica's processes, ranks ascending with the stage, then the
    tensor-parallel rank), added left to right in stage order as one device adds its stages' parts, so both give
    the same bits. Two parts are one addition, the same either way round: an all-reduce. More would be added in the
    backend's order: each part is gathered and added here."""
    if size == 2:
        dist.all_reduce(t, group=group)
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return functools.reduce(operator.add, parts)


__all__ = ["PipelineConfig", "PipelineEngine", "PipelineStats", "StageView", "WeightVersions", "check_names_and_shapes"]
