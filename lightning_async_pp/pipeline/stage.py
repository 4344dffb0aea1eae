"""``Stage``: one pipeline stage's layers, run on the weight version each batch is due."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.parallel.tensor_parallel import as_laid_out, dtensor_spec
from lightning_async_pp.pipeline.compiled import compile_layers
from lightning_async_pp.pipeline.versions import WeightVersions


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
