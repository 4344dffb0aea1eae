"""What the adapters of upstream language models share (``HuggingFaceCausalLM``, ``LitGPT``).

An adapter builds the upstream model in ``__init__`` with its parameters on the meta device (so callbacks'
``setup``, which Lightning runs before ``configure_model``, finds the modules: ``models/meta_built.py``), adopts
its top-level children as its own (so its ``state_dict()`` keys are the upstream model's), and lists the upstream
embedding, blocks, final norm and output head as pipeline layers. What crosses a stage boundary is the hidden state (B, T, C): each block gets what the
upstream model's ``forward`` would give it (rotary tables, the causal mask) from a forward pre-hook that fills
them in when the block is called with the hidden state alone, so the upstream modules run unchanged (their class,
code and key paths stay the upstream ones). Each layer is initialized by the upstream model's own rule, from the
global RNG seeded by the layer's index, so a layer's weights do not depend on which process builds it.
``configure_model()`` gives the parameters memory where the context creates them (under the strategy: nowhere; the
engine materializes each process's stage) and initializes the materialized layers.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_async_pp.models.meta_built import BuiltInInit
from lightning_async_pp.models.pretrained import PretrainedTensors, load_layer, tensor_aliases, unused_keys
from lightning_async_pp.module import PipelineModule, layer_seed
from lightning_async_pp.optim.groups import decay_matrices_only
from lightning_async_pp.parallel.placement import layer_paths
from lightning_async_pp.parallel.tensor_parallel import whole_parameters


def missing_package(package: str, extra: str) -> ImportError:
    return ImportError(f"this model needs the {package!r} package: pip install 'lightning-async-pp[{extra}]'")


class AdoptedCausalLM(BuiltInInit, PipelineModule):
    """Base of the upstream-model adapters: batches are LongTensors (B, T + 1) of token ids; inputs are all but the
    last token, targets all but the first (as :class:`~lightning_async_pp.models.Llama`).

    Subclasses implement :meth:`build_upstream` (assign the upstream children, return the pipeline layers) and
    :meth:`init_module` (the upstream initialization of one submodule), and :meth:`open_pretrained` where they take
    pretrained weights (``self.pretrained``, a path); their ``__init__`` ends with :meth:`_build`.
    """

    def __init__(self, lr: float = 3e-4, weight_decay: float = 0.1, init_seed: Optional[int] = None) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.init_seed = lr, weight_decay, init_seed
        self._layers: Optional[list[nn.Module]] = None  # set by configure_model()
        self._built_layers: list[nn.Module] = []  # by _build(), in __init__
        self._constructor_values: dict[str, Tensor] = {}  # by _build(): vectors' values from their constructors
        self._layer_paths: list[str] = []  # by configure_model()
        self.pretrained: Optional[str] = None  # set by subclasses that start from a weights file
        self._pretrained_tensors: Optional[PretrainedTensors] = None

    # ---- for subclasses ----------------------------------------------------------------------------------------
    def build_upstream(self) -> list[nn.Module]:
        raise NotImplementedError

    def init_module(self, module: nn.Module) -> None:
        raise NotImplementedError

    def open_pretrained(self, path: str) -> PretrainedTensors:
        raise NotImplementedError(f"{type(self).__name__} takes no pretrained weights")

    # ---- building ----------------------------------------------------------------------------------------------
    def _build(self) -> None:
        """The upstream model's tree, parameters on the meta device (the end of a subclass's ``__init__``)."""
        self._built_layers, self._constructor_values = self._build_on_meta_keeping_vectors(self.build_upstream)

    def _is_configured(self) -> bool:
        return self._layers is not None

    def configure_model(self) -> None:
        if self._layers is not None:  # Lightning calls this hook on every trainer entry point
            return
        self._materialize()  # what a model built here would get; keeps requires_grad (a layer frozen in setup)
        self._layers = self._built_layers
        self._layer_paths = layer_paths(self, self._layers)  # while the model is whole
        if self.pretrained is not None:
            self._open_pretrained_tensors(self.pretrained)
        self.init_weights()

    def _open_pretrained_tensors(self, path: str) -> None:
        """Open the weights file (no tensor is read yet) and remember each layer's path and each tensor's names, taken
        while the model is whole (under the strategy other stages' layers leave the tree later)."""
        try:
            source = self.open_pretrained(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{err}. (A module rebuilt from the checkpoint of a run that started from pretrained={path!r} reads "
                f"it again before the checkpoint's weights replace it; without it, pass pretrained=None, e.g. "
                f"{type(self).__name__}.load_from_checkpoint(path, pretrained=None))") from err
        aliases = tensor_aliases(self)
        unused = unused_keys(source, aliases)
        if unused:
            warnings.warn(f"{type(self).__name__}: the pretrained weights {source.path!r} hold {len(unused)} tensor(s) the model "
                          f"has no place for, left unused: {unused[:5]}{' ...' if len(unused) > 5 else ''}", stacklevel=3)
        self._pretrained_tensors = source
        self._pretrained_keys = source.keys()
        self._pretrained_aliases = aliases
        self._pretrained_paths = layer_paths(self, self.pipeline_layers())

    def init_weights(self) -> None:
        """(Re-)initialize every materialized layer (layers on the ``meta`` device are skipped). As the pipeline's
        materialization does, a parameter shared by two layers (a tied embedding and head) keeps the value its first
        layer gave it."""
        done: set[int] = set()
        for index, layer in enumerate(self.pipeline_layers()):
            if any(p.is_meta for p in layer.parameters()):
                continue
            kept = [(p, p.detach().clone()) for p in layer.parameters() if id(p) in done]
            self.init_layer(index, layer)
            with torch.no_grad():
                for p, value in kept:
                    p.copy_(value)
            done.update(id(p) for p in layer.parameters())

    @torch.no_grad()
    def init_layer(self, index: int, layer: nn.Module) -> None:
        """The upstream rule for every submodule of pipeline layer ``index``, drawing from the global RNG seeded by
        ``init_seed`` (default ``torch.initial_seed()``) and ``index`` (the global RNG is left as it was). With pretrained
        weights the file's values then replace every tensor of the layer. A tensor-parallel layer is initialized
        whole and each rank keeps its shard (``whole_parameters``), so its values are one device's."""
        with whole_parameters(layer):
            self._init_layer_whole(index, layer)

    def _init_layer_whole(self, index: int, layer: nn.Module) -> None:
        # First the values the constructors gave the vectors (norms at 1), as upstream's model has them before its
        # init rule runs: a rule that leaves a norm to its constructor would leave it uninitialized on meta.
        prefix = f"{self._layer_paths[index]}." if self._layer_paths[index] else ""
        for name, p in layer.named_parameters(remove_duplicate=False):
            value = self._constructor_values.get(prefix + name)
            if value is not None and not p.is_meta:
                p.copy_(value)
        devices = [p.device for p in layer.parameters() if p.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(layer_seed(index, self.init_seed))
            for module in layer.modules():
                self.init_module(module)
        if self._pretrained_tensors is not None:  # init as usual, then the file's values (see docs/design/adapters.md)
            load_layer(layer, self._pretrained_paths[index], self._pretrained_tensors, self._pretrained_aliases,
                       self._pretrained_keys)

    # ---- the PipelineModule contract -------------------------------------------------------------------------
    def pipeline_layers(self) -> Sequence[nn.Module]:
        if self._layers is None:
            raise RuntimeError(f"{type(self).__name__}'s layers get memory in configure_model(); call it (or let the Trainer) first")
        return self._layers

    def pipeline_input(self, batch: Tensor) -> Tensor:
        return self.token_rows(batch)[:, :-1]

    def pipeline_sample(self) -> Any:
        """The example batch if one is set, else one row of 128 tokens (fewer if the config's
        ``max_position_embeddings`` or ``block_size`` is smaller) and its target."""
        sample = super().pipeline_sample()
        if sample is not None:
            return sample
        limits = [getattr(self.config, name, None) for name in ("max_position_embeddings", "block_size")]
        length = min([128, *(n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0)])
        return torch.zeros(1, length + 1, dtype=torch.long)

    def pipeline_loss(self, logits: Tensor, batch: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), self.token_rows(batch)[:, 1:].flatten())

    def token_rows(self, batch: object) -> Tensor:
        """The batch if it is what the adapters take, a LongTensor (B, T + 1) of token ids; otherwise a clear error
        before the first update (the first microbatch's forward). Padded batches (``attention_mask``, ``labels``
        with -100) are refused: a mask would have to cross the stages, and a token-mean loss over microbatches with
        different numbers of valid tokens is not the mean of their means (see docs/design/adapters.md, 'Adapters of
        upstream models')."""
        if isinstance(batch, Tensor) and batch.dim() == 2 and not batch.is_floating_point() and not batch.is_complex():
            return batch
        if isinstance(batch, Mapping):
            got = f"a mapping with keys {sorted(batch)}"
        elif isinstance(batch, Tensor):
            got = f"a {batch.dtype} tensor of shape {tuple(batch.shape)}"
        else:
            got = f"a {type(batch).__name__}"
        raise TypeError(
            f"{type(self).__name__} takes batches of token ids, an integer tensor (B, T + 1) per batch (inputs all "
            f"but the last token, targets all but the first; unpadded rows, as the project's data modules give); got "
            f"{got}. Dict batches with attention_mask/labels (padding) are not supported: pack the text into full "
            f"rows (data.TextDataModule) or write a PipelineModule whose pipeline_input/pipeline_loss take your batch")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # As models.Llama: weight decay on matrices only; a tied matrix is listed once, under its first name.
        groups = decay_matrices_only(self.named_parameters(), self.weight_decay)
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
