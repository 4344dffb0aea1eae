"""``Stage``: one pipeline stage's layers, run on the weight version each batch is due; and the read-only views of
the stages and the running pipeline that callbacks read (``StageView``, ``PipelineStats``)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.parallel.expert import LocalExperts
from lightning_async_pp.parallel.tensor_parallel import as_laid_out, dtensor_spec
from lightning_async_pp.pipeline.compiled import compile_layers
from lightning_async_pp.pipeline.versions import WeightVersions
from lightning_async_pp.plan.balanced import SplitReport
from lightning_async_pp.trace import StepTimes


class StageLayers(nn.Module):
    """The layers of one stage, applied in order; each takes the previous output.

    ``calls`` (one per layer) are what runs each layer: the layer itself, or its compiled wrapper. They are kept
    outside the module tree, so parameter names stay the layers' own."""

    def __init__(self, layers: Sequence[nn.Module], calls: Optional[Sequence[Callable[[Any], Any]]] = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.calls = tuple(calls) if calls is not None else tuple(layers)  # a tuple: not registered as submodules

    def forward(self, x: Any) -> Any:
        for call in self.calls:
            x = call(x)
        return x


class Stage:
    """Runs ``layers`` forward on the weight version a batch is due (see :class:`WeightVersions`).

    Forward and backward of every microbatch of batch ``b`` read the same version; gradients accumulate in that
    version's autograd leaves and are taken once the batch is complete. A parameter used by several layers of
    the stage is one leaf (``functional_call`` ties the names), so its gradient sums over every use. A parameter
    listed in ``borrowed`` (``name -> (owner stage, index)``) belongs to another stage in this process: it reads
    that stage's version through a leaf of its own (the same memory), so its gradient sums this stage's uses
    alone, as a stage's copy of a tied weight does across processes; the runtime then adds it to the owner's
    (docs/design/stages.md, "Tied weights").

    ``checkpointed`` (one flag per layer) marks the layers whose forward is recomputed during backward
    (activation checkpointing). Each such layer runs under ``torch.utils.checkpoint`` with its weight tensors as
    explicit arguments, so the recomputation reads the same version as the first forward (the stash under 2BW),
    not the module's own parameters, which hold the newest version by then.

    ``compile_options`` (``torch.compile`` keyword arguments, or ``None``) compiles each layer once, here: the
    weights reach the compiled code as inputs (``functional_call`` swaps them in), so another weight version or
    microbatch reuses the compiled graph (see docs/design/stages.md, 'Compiled layers').
    """

    def __init__(self, layers: Sequence[nn.Module], index: int, num_stages: int, delay: int = 1, sync_steps: int = 0,
                 sync_from_step: Optional[int] = None, borrowed: Optional[dict[str, tuple["Stage", int]]] = None,
                 checkpointed: Optional[Sequence[bool]] = None, compile_options: Optional[Mapping[str, Any]] = None):
        self.index = index
        self.num_stages = num_stages
        # Each layer's compiled wrapper holds the layer itself: functional_call on the wrapper (names prefixed
        # "layer.") swaps the version's tensors into the layer.
        compiled = compile_layers(layers, compile_options) if compile_options is not None else None
        self.layers = StageLayers(layers, compiled)
        self.borrowed = dict(borrowed or {})
        # batch -> per borrowed name, the owner's leaf and this stage's own leaf on the same memory
        self._borrowed_leaves: dict[int, list[tuple[Tensor, Tensor]]] = {}
        # named_parameters() lists a tensor shared by several layers once: one leaf serves every use.
        named = [(n, p) for n, p in self.layers.named_parameters() if n not in self.borrowed]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        # A DTensor parameter's leaves are its local shards; the forward reads them as DTensors laid out alike.
        self._specs = [dtensor_spec(p) for p in self.params]
        self.versions = WeightVersions(self.params, delay=delay, sync_steps=sync_steps, sync_from_step=sync_from_step)
        self.checkpointed = [bool(c) for c in checkpointed] if checkpointed is not None else [False] * len(layers)
        if len(self.checkpointed) != len(layers):
            raise ValueError(f"checkpointed has {len(self.checkpointed)} flags for {len(layers)} layers; give one per layer")
        # Per layer: its own parameter names (every alias of a tied one) and the stage-level name of each tensor.
        stage_name = {id(p): n for n, p in self.layers.named_parameters()}
        self._layer_calls: Sequence[nn.Module] = compiled if compiled is not None else list(self.layers.layers)
        self._layer_params = [[(n, stage_name[id(p)]) for n, p in call.named_parameters(remove_duplicate=False)]
                              for call in self._layer_calls]
        # Every further name of a tensor used twice in the stage, with the name it is given under: passing each
        # alias explicitly lets functional_call skip its search for ties on every forward.
        self._aliases = [(n, stage_name[id(p)]) for n, p in self.layers.named_parameters(remove_duplicate=False)
                         if stage_name[id(p)] != n]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def weights(self, leaves: Sequence[Tensor], batch_index: Optional[int] = None) -> dict[str, Tensor]:
        """The tensors ``functional_call`` takes: ``leaves`` (laid out as their shards, under tensor parallelism) for
        this stage's own parameters; for borrowed ones, this stage's own leaves on the owner's version of the batch
        (the owner's parameters without a batch)."""
        tensors = {n: as_laid_out(leaf, spec) for n, leaf, spec in zip(self.param_names, leaves, self._specs)}
        if batch_index is not None:
            tensors.update(zip(self.borrowed, self._borrowed_for_batch(batch_index)))
        else:
            tensors.update((name, owner.params[i]) for name, (owner, i) in self.borrowed.items())
        return tensors

    def _borrowed_for_batch(self, batch_index: int) -> list[Tensor]:
        """This stage's leaves for the borrowed parameters in batch ``batch_index``: each views the owner's leaf
        for that batch, made again should the owner's leaves have been made anew."""
        held = self._borrowed_leaves.get(batch_index)
        sources = [owner.versions.leaves_for_batch(batch_index)[i] for owner, i in self.borrowed.values()]
        if held is None or any(src is not old for src, (old, _) in zip(sources, held)):
            held = [(src, src.detach().requires_grad_(src.requires_grad)) for src in sources]
            self._borrowed_leaves[batch_index] = held
        return [leaf for _, leaf in held]

    def settle_batch(self, batch_index: int) -> None:
        """Batch ``batch_index`` is trained now: every leaf it reads needs a gradient where the parameter does
        (:meth:`WeightVersions.settle_batch`)."""
        self.versions.settle_batch(batch_index)
        for leaf, (owner, i) in zip(self._borrowed_for_batch(batch_index), self.borrowed.values()):
            leaf.requires_grad_(owner.params[i].requires_grad)

    def forward(self, batch_index: int, x: Any) -> Any:
        leaves = self.versions.leaves_for_batch(batch_index)
        weights = self.weights(leaves, batch_index)
        if not any(self.checkpointed):
            for alias, name in self._aliases:
                weights[alias] = weights[name]
            return functional_call(self.layers, weights, (x,), tie_weights=False)  # one call: the cheapest path
        for layer, names, recompute in zip(self._layer_calls, self._layer_params, self.checkpointed):
            local = [n for n, _ in names]
            tensors = [weights[s] for _, s in names]
            if recompute:
                # Non-reentrant: the recomputation replays the saved RNG and autocast state, and takes the very
                # tensors passed here (this batch's version), so it equals the first forward.
                x = checkpoint(_run_layer, layer, local, x, *tensors, use_reentrant=False)
            else:
                x = _run_layer(layer, local, x, *tensors)
        return x

    def persistent_buffers(self) -> list[tuple[nn.Module, str]]:
        """Where the buffers a checkpoint saves live (running statistics, say): those a forward may change."""
        return [(m, n) for m in self.layers.modules() for n, b in m._buffers.items()
                if b is not None and n not in m._non_persistent_buffers_set]

    def grad_leaves(self, batch_index: int) -> list[Tensor]:
        """Every leaf the forward of batch ``batch_index`` read: this stage's and the borrowed ones, the weights a
        split backward's weight pass computes gradients for. The leaves themselves, not the DTensor views
        :meth:`weights` lays them out as (each call makes new views, which are not in the forward's graph)."""
        return [*self.versions.leaves_for_batch(batch_index), *self._borrowed_for_batch(batch_index)]

    def forward_newest(self, x: Any) -> Any:
        """Forward on the newest version (validation, test, predict)."""
        return self.layers(x)

    def take_gradients(self, batch_index: int) -> list[Tensor | None]:
        return self.versions.take_gradients(batch_index)

    def take_borrowed_gradients(self, batch_index: int) -> list[tuple["Stage", int, Optional[Tensor]]]:
        """``(owner stage, index there, gradient)`` of this stage's uses of each borrowed parameter in batch
        ``batch_index`` (``None`` where none was needed); forgets that batch's borrowed leaves."""
        held = self._borrowed_leaves.pop(batch_index, [])
        return [(owner, i, leaf.grad if leaf.requires_grad else None)
                for (owner, i), (_, leaf) in zip(self.borrowed.values(), held)]

    def forget_batch(self, batch_index: int) -> None:
        """Drop the leaves of a batch that will not be trained (a cancelled lookahead)."""
        self.versions.forget_batch(batch_index)
        self._borrowed_leaves.pop(batch_index, None)


def _run_layer(layer: nn.Module, names: list[str], x: Any, *tensors: Tensor) -> Any:
    """``layer(x)`` with its parameters replaced by ``tensors`` (one per name in ``names``)."""
    return functional_call(layer, dict(zip(names, tensors)), (x,))


@dataclass(frozen=True)
class StageView:
    """Read-only view of one stage this process runs."""

    index: int
    delay: int
    param_names: tuple[str, ...]  # global names (in the model), in the order of ``params``
    _stage: Stage
    # per parameter: this process counts its local tensor in a whole-model sum (not a tied copy another stage
    # owns, nor a whole parameter on tensor-parallel ranks but 0; a shard on every rank)
    counted: tuple[bool, ...] = ()
    # per parameter: the factor on its squares in this process's share of a replica's figures, which the monitors
    # average over the stage's replicas: e for an expert under expert parallelism (the replicas holding it are 1 / e
    # of them, so the mean counts it once), else 1
    scales: tuple[float, ...] = ()

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._stage.params)

    def version(self, j: int) -> list[Tensor]:
        """The tensors of weight version ``W_j`` (one of those held)."""
        return self._stage.versions.version(j)

    def version_for_batch(self, k: int) -> int:
        return self._stage.versions.version_for_batch(k)

    @property
    def predicts(self) -> bool:
        """Weight prediction is on: older versions are the predictions delayed batches run on, and the
        parameters are the only copy of the newest (an update overwrites it in place)."""
        return self._stage.versions.predicts

    def predicted_newest(self) -> list[Tensor]:
        """Prediction on: what the batches due the newest version will run on."""
        return self._stage.versions.predicted_newest()


class PipelineStats:
    """What callbacks may read about the running pipeline (never the engine's internals)."""

    def __init__(self, engine: Any) -> None:  # the PipelineEngine it views
        self._engine = engine

    @property
    def batch_index(self) -> int:
        """k: updates applied so far; the parameters hold ``W_k``."""
        return self._engine.runtime.batch_index

    @property
    def num_stages(self) -> int:
        return self._engine.num_stages

    @property
    def num_microbatches(self) -> int:
        return self._engine.num_microbatches

    @property
    def schedule(self) -> str:
        return self._engine.config.schedule

    @property
    def tensor_parallel_size(self) -> int:
        """``t``: the processes of one stage, each holding its shards of the stage's parameters (1 without)."""
        return self._engine.tensor_parallel_size

    @property
    def tensor_parallel_rank(self) -> int:
        return self._engine.topology.tp_rank if self._engine.topology is not None else 0

    @property
    def stages(self) -> list[StageView]:
        """The stages this process runs (one across processes, all of them on one device)."""
        return self._engine.stage_views

    @property
    def last_times(self) -> StepTimes:
        return self._engine.runtime.last_times

    def realized_delay(self) -> Optional[int]:
        """The delay of the batch being trained (``batch_index``'s gradient): 0 for a synchronous one, less than the
        configured delay for the first batches; ``None`` when this process's stages differ."""
        k = self.batch_index
        delays = {k - stage.version_for_batch(k) for stage in self.stages}
        return delays.pop() if len(delays) == 1 else None

    @property
    def split(self) -> SplitReport:
        """The layers per stage, each stage's predicted share of the compute and peak memory (docs/design/planner.md,
        "Balanced split")."""
        return self._engine.split

    @property
    def stash_nbytes(self) -> int:
        return sum(stage.versions.stash_nbytes() for stage in self._engine.stages)

    def expert_layers(self) -> dict[str, int]:
        """Every mixture-of-experts layer of the model, this process's or not: the global name of its
        ``LocalExperts`` and its number of experts, in the model's order (the same on every process)."""
        engine = self._engine
        return {f"{path}.{name}" if name else path: m.num_experts for layer, path in zip(engine.layers, engine.paths)
                for name, m in layer.named_modules() if isinstance(m, LocalExperts)}

    def expert_tokens(self) -> dict[str, Tensor]:
        """For each MoE layer this process runs (by :meth:`expert_layers`'s name): the token copies each of its
        experts received in the trained microbatches so far (``(num_experts,)``, on the device; an expert held
        elsewhere 0). Summed over every process, one device's counts: each token copy is counted where its expert
        computes it; under tensor parallelism, whose ranks of a stage compute alike, on rank 0 only."""
        engine, out = self._engine, {}
        for i in engine.own_layer_indices():
            for name, m in engine.layers[i].named_modules():
                if isinstance(m, LocalExperts):
                    held = m.received_tokens
                    counted = held is not None and self.tensor_parallel_rank == 0
                    out[f"{engine.paths[i]}.{name}" if name else engine.paths[i]] = (
                        held.clone() if counted else torch.zeros(m.num_experts, dtype=torch.long, device=engine.device))
        return out
