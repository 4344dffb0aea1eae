"""``HuggingFaceCausalLM``: a transformers decoder-only causal LM of the Llama family's layout as a ``PipelineModule``.

The upstream model (``AutoModelForCausalLM.from_config(config)``) is built in ``__init__``, its parameters on the
meta device until ``configure_model()`` gives them memory (``models/meta_built.py``); its children ``model`` and
``lm_head`` become this module's, so ``state_dict()`` keys are exactly the upstream ones and a
consolidated checkpoint loads with ``strict=True`` into ``AutoModelForCausalLM.from_config(config)``. Pipeline
layers: ``model.embed_tokens``, each of ``model.layers``, ``model.norm``, ``lm_head``. A decoder layer called with
the hidden state alone gets the rest of what ``model.forward`` gives it (positions, rotary cos/sin, the causal or
sliding-window mask for its attention implementation) from a forward pre-hook; called the upstream way (with
keyword arguments) it is untouched. The rotary embedding holds only a non-persistent buffer: it is rebuilt off
the meta device and kept outside the module tree (``model.rotary_emb`` still names it), so its ``inv_freq`` is
the upstream value whatever device the layers were built on. ``tie_word_embeddings`` ties ``lm_head.weight`` to
``model.embed_tokens.weight`` (one Parameter; across stages the engine keeps identical copies).

Work the upstream ``forward`` does outside the layers (embedding scales, logit scales, soft-capping) is done by
hooks on the embedding and the head (``hf_outside``); layers returning tuples give their hidden state to the
pipeline. Before the parameters get memory, ``configure_model`` checks the family on a tiny copy of the config
against the upstream forward and loss (``hf_probe.check_exact``) and refuses it on any difference or failure: every
family is exact or refused before training (see docs/design/adapters.md, 'Adapters of upstream models'; the table: docs/models.md).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_async_pp.models import hf_config, hf_outside, hf_probe, packing
from lightning_async_pp.models.adopted import AdoptedCausalLM
from lightning_async_pp.models.hf_config import as_pretrained_config, pretrained_config, read_by_the_code
from lightning_async_pp.models.moe import RouterLoss, adds_router_loss, check_router_loss_supported, split_experts
from lightning_async_pp.models.pretrained import SafetensorsFolder
from lightning_async_pp.parallel.expert import expert_parallel_mesh
from lightning_async_pp.parallel.mesh import replica_processes, tensor_parallel_mesh
from lightning_async_pp.parallel.tensor_parallel import layout_hooks_on_entries

#: What the adapter takes from the upstream model, as dotted paths of ``AutoModelForCausalLM.from_config(config)``.
LAYOUT = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class DecoderLayerInputs:
    """Forward pre-hook of one upstream decoder layer: called as ``layer(hidden_states)`` (by the pipeline), it adds
    the keyword arguments ``model.forward`` would pass (no cache, positions ``0..T-1``).

    The names follow the installed transformers: 4.x passes ``cache_position`` and ``past_key_values`` (and the
    mask helpers take ``input_embeds``), 5.x passes neither (and takes ``inputs_embeds``, ``cache``)."""

    def __init__(self, config: Any, rotary: nn.Module, make_mask: Callable[..., Any], layer: nn.Module,
                 causal_without_mask: bool = False) -> None:
        self.config, self.rotary, self.make_mask = config, rotary, make_mask
        #: Whether upstream's forward makes its masks with a cache (``hf_probe.causal_without_mask``).
        self.causal_without_mask = causal_without_mask
        self.pipeline_call = False
        self.positions: Optional[Tensor] = None  # a packed microbatch's, from the pre-hook to the forward hook
        mask_args = inspect.signature(make_mask).parameters
        self.embeds_name = "inputs_embeds" if "inputs_embeds" in mask_args else "input_embeds"
        self.mask_cache = {name: None for name in ("past_key_values", "cache") if name in mask_args}
        self.mask_takes_cache_position = "cache_position" in mask_args
        self.layer_takes_cache_position = "cache_position" in inspect.signature(type(layer).forward).parameters
        #: Whether the layer attends causally over the whole row (no sliding window): then packed rows attend
        #: document by document (:func:`packing.document_attention`) rather than through a (T, T) mask.
        self.full_attention = getattr(make_mask, "__name__", "") == "create_causal_mask"
        #: Whether the layer's modeling file picks its attention function from transformers' attention interface,
        #: where the document-by-document function is registered; older ones (transformers 4.x's OLMoE and
        #: Qwen2-MoE) have their own attention classes and take the block-diagonal mask.
        self.attention_interface = hasattr(sys.modules.get(type(layer).__module__), "ALL_ATTENTION_FUNCTIONS")

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self.pipeline_call = not kwargs and len(args) == 1
        self.positions = None
        if not self.pipeline_call:
            return None  # called the upstream way
        (hidden,) = args
        packed = isinstance(hidden, Mapping)
        if packed:  # a packed microbatch: positions restarting at each document
            hidden, positions = hidden[packing.HIDDEN], hidden[packing.POSITION_IDS]
            self.positions = positions
        if any(b.device != hidden.device for b in self.rotary.buffers()):
            self.rotary.to(hidden.device)  # once per process: the rotary module is shared by its layers
        if packed:
            # Full attention goes document by document (no mask is made); otherwise, given positions that restart
            # and no mask, upstream's mask functions make the block-diagonal causal mask (transformers'
            # packed-sequence convention). Either once per microbatch on this stage, not per layer.
            attention = self.config._attn_implementation
            by_document = self.full_attention and self.attention_interface and attention in DOCUMENT_ATTENTION
            key = (id(self.config), self.make_mask, hidden.dtype, hidden.device, hidden.shape[0], attention, by_document)
            if by_document:
                layer_kwargs = packing.per_positions(positions, key, lambda: self.document_kwargs(hidden, positions))
            else:
                layer_kwargs = packing.per_positions(positions, key, lambda: self.layer_kwargs(hidden, positions, True))
            return (hidden,), dict(layer_kwargs)
        cache_position = torch.arange(hidden.shape[1], device=hidden.device)
        return (hidden,), self.layer_kwargs(hidden, cache_position.unsqueeze(0), not self.causal_without_mask)

    def layer_kwargs(self, hidden: Tensor, position_ids: Tensor, mask_positions: bool) -> dict[str, Any]:
        """What ``model.forward`` passes a decoder layer for ``hidden`` at ``position_ids``; ``mask_positions``:
        the mask function is given the positions (it then looks for packed sequences in them)."""
        cache_position = torch.arange(hidden.shape[1], device=hidden.device)
        # Given positions and no cache, transformers looks for packed sequences in them and then never lets SDPA
        # skip the causal mask: every layer builds a (B, 1, T, T) mask and attends through it (no flash kernel,
        # key/value heads repeated). Where upstream's forward has a cache it passes no mask and SDPA runs causal;
        # then the positions are not given here (they are 0..T-1: nothing is packed).
        mask_kwargs = dict(config=self.config, attention_mask=None,
                           position_ids=position_ids if mask_positions else None, **self.mask_cache)
        mask_kwargs[self.embeds_name] = hidden
        if self.mask_takes_cache_position:
            mask_kwargs["cache_position"] = cache_position
        layer_kwargs = dict(attention_mask=self.make_mask(**mask_kwargs), position_ids=position_ids,
                            position_embeddings=self.rotary(hidden, position_ids), use_cache=False)
        if self.layer_takes_cache_position:
            layer_kwargs["cache_position"] = cache_position
        return layer_kwargs

    def document_kwargs(self, hidden: Tensor, position_ids: Tensor) -> dict[str, Any]:
        """:meth:`layer_kwargs` for a packed microbatch attended document by document: no (T, T) mask is made; the
        attention function takes the microbatch's :class:`packing.Documents` in its place (sdpa, flex_attention:
        :func:`document_attention_function`), or the positions alone (flash_attention_2, whose variable-length
        kernel finds the documents in them, as transformers does for packed sequences)."""
        attention = self.config._attn_implementation
        cache_position = torch.arange(hidden.shape[1], device=hidden.device)
        mask = None
        if attention == "flash_attention_2" and hidden.shape[0] != 1:
            # transformers finds packed sequences for its variable-length kernel only in a one-row batch; with
            # more rows it would attend across documents
            raise ValueError(f"HuggingFaceCausalLM with attn_implementation 'flash_attention_2' takes packed "
                             f"microbatches of one row (transformers' variable-length path); got {hidden.shape[0]} "
                             f"rows: set num_microbatches to the batch size, or use sdpa or flex_attention")
        if attention != "flash_attention_2":
            install_document_attention(attention)
            mask = packing.documents(position_ids)
        layer_kwargs = dict(attention_mask=mask, position_ids=position_ids,
                            position_embeddings=self.rotary(hidden, position_ids), use_cache=False)
        if self.layer_takes_cache_position:
            layer_kwargs["cache_position"] = cache_position
        return layer_kwargs

    def unwrap(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Forward hook: a layer called by the pipeline gives the hidden state alone (transformers 4.x layers of
        some families return ``(hidden_states, ...)``), with its positions for a packed microbatch; called the
        upstream way, its output is untouched."""
        if not self.pipeline_call:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        if self.positions is not None:
            positions, self.positions = self.positions, None
            return {packing.HIDDEN: hidden, packing.POSITION_IDS: positions}
        return hidden if isinstance(output, tuple) else None


class PackedEnds:
    """Hooks on the embedding and the final norm for packed microbatches (``models/packing.py``): the embedding takes
    ``{"input_ids", "position_ids"}`` and gives the hidden state with its positions; the norm takes the hidden
    state out of them (the head needs no positions). Token tensors pass untouched."""

    def __init__(self) -> None:
        self.positions: Optional[Tensor] = None

    def enter_embedding(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        self.positions = None
        if len(args) == 1 and isinstance(args[0], Mapping):
            self.positions = args[0][packing.POSITION_IDS]
            return (args[0][packing.INPUT_IDS],)
        return None

    def leave_embedding(self, module: nn.Module, args: tuple, output: Tensor) -> Any:
        if self.positions is None:
            return None
        positions, self.positions = self.positions, None
        return {packing.HIDDEN: output, packing.POSITION_IDS: positions}

    @staticmethod
    def enter_norm(module: nn.Module, args: tuple) -> Optional[tuple]:
        if len(args) == 1 and isinstance(args[0], Mapping):
            return (args[0][packing.HIDDEN],)
        return None


#: Families whose packed rows (positions restarting at each document) give each document exactly the logits upstream
#: gives it alone, as tests/test_packed_documents.py (MoE: tests/test_moe.py, router loss included) checks for each;
#: others are refused with document masks.
PACKED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: Attention implementations that take packed rows: sdpa attends document by document (on CUDA by flex attention
#: with a block mask), eager through the block-diagonal mask upstream builds from the positions.
PACKED_ATTENTION = ("sdpa", "eager")
#: Further ones that take packed rows on CUDA only: flex_attention (a block mask of the documents) and
#: flash_attention_2 (its variable-length kernel, given the positions); neither has a CPU backward.
PACKED_ATTENTION_CUDA = ("flex_attention", "flash_attention_2")
#: Those whose full-attention layers attend document by document (:meth:`DecoderLayerInputs.document_kwargs`).
DOCUMENT_ATTENTION = ("sdpa", "flex_attention", "flash_attention_2")


def rope_kinds(config: Any) -> list[Mapping[str, Any]]:
    """The config's rope settings (``rope_scaling`` in transformers 4, ``rope_parameters`` in 5, which may hold one
    per kind of layer; ``[{}]`` if none)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, Mapping):
        return [{}]
    return list(rope.values()) if rope and all(isinstance(v, Mapping) for v in rope.values()) else [rope]


def rope_types(config: Any) -> set[str]:
    """The config's rope types (``default`` if none)."""
    return {str(kind.get("rope_type", kind.get("type", "default"))) for kind in rope_kinds(config)}


def supported_positions(config: Any) -> Optional[int]:
    """The longest row the config's rope is meant for: ``max_position_embeddings``, or where a scaled rope extends
    it, ``factor`` times the original length (transformers' config docs: "a factor of x will enable the model to
    handle sequences of length x * original maximum pre-trained length"; the original is ``rope_scaling``'s or the
    config's ``original_max_position_embeddings``, else ``max_position_embeddings``: dynamic, linear, yarn as
    Qwen2.5 keeps 32768). The larger of the two (Llama 3.1's llama3 rope: 8 x 8192 against 131072)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    supported = limit
    for kind in rope_kinds(config):
        factor = kind.get("factor")
        if str(kind.get("rope_type", kind.get("type", "default"))) == "default" or not isinstance(factor, (int, float)):
            continue
        original = (kind.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", None) or limit)
        supported = max(supported, int(factor * original))
    return supported


def position_dependent_rope(config: Any) -> Optional[tuple[str, int]]:
    """``(rope type, length)`` if the rotary tables change once a sequence is longer than ``length``, else ``None``.
    transformers (``modeling_rope_utils.dynamic_rope_update``) then recomputes them from the largest position in the
    call: a ``dynamic`` type past ``max_position_embeddings``, ``longrope`` past ``original_max_position_embeddings``.
    In a packed row that is the longest document's, so a short document would not get the tables it gets alone."""
    for kind in sorted(rope_types(config)):
        if "dynamic" in kind:  # transformers' own test
            return kind, config.max_position_embeddings
        if kind == "longrope":
            return kind, (config.original_max_position_embeddings if hasattr(config, "original_max_position_embeddings")
                          else config.max_position_embeddings)
    return None


def install_document_attention(name: str) -> None:
    """Registers (once) over transformers' attention function ``name`` one that attends document by document when
    its mask is a :class:`packing.Documents` (what the adapter's packed rows pass) and calls the original otherwise:
    transformers' attention interface is how a model's attention is chosen by name (``AttentionInterface``), and the
    config keeps naming ``name``, so a checkpoint or export names the upstream implementation."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[name]
    if getattr(original, "takes_documents", False):
        return
    AttentionInterface.register(name, document_attention_function(original))


def document_attention_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' attention function signature over :func:`packing.attend_documents` (see
    :func:`install_document_attention`)."""

    @functools.wraps(original)
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> tuple[Tensor, None]:
        if not isinstance(attention_mask, packing.Documents):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        dropout = args[0] if args else kwargs.get("dropout", 0.0)
        scaling = args[1] if len(args) > 1 else kwargs.get("scaling")
        if kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
            raise ValueError(f"{type(module).__name__}: packed rows attend document by document only without a "
                             f"sliding window, sinks or soft-capping (got {sorted(k for k in kwargs if kwargs[k] is not None)})")
        output = packing.attend_documents(query, key, value, attention_mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=key.shape[1] != query.shape[1])
        return output.transpose(1, 2).contiguous(), None

    attention.takes_documents = True  # type: ignore[attr-defined]
    return attention


def check_packed_supported(config: Any, length: Optional[int] = None, device: Optional[torch.device] = None) -> None:
    """Refuse, naming the family, a config whose packed rows are not verified exact (see :data:`PACKED_FAMILIES`),
    rows of ``length`` tokens (if given) past which its rotary tables follow the longest document; ``device``: where
    the model runs (the CUDA-only attention implementations, :data:`PACKED_ATTENTION_CUDA`)."""
    family = config.model_type
    if family not in PACKED_FAMILIES:
        why = (" (a mixture of experts whose router loss is not reproduced: models/moe.py)"
               if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) else "")
        raise ValueError(f"HuggingFaceCausalLM cannot take packed batches with document masks (position_ids) for "
                         f"model_type {family!r}{why}: verified exact only for {', '.join(PACKED_FAMILIES)}; train "
                         f"it on token rows (TextDataModule(document_mask=False))")
    rope = position_dependent_rope(config)
    if rope is not None and length is not None and length > rope[1]:
        raise ValueError(f"HuggingFaceCausalLM cannot take packed rows of {length} tokens with rope_type {rope[0]!r}: "
                         f"past {rope[1]} positions its rotary tables follow the largest position of the microbatch "
                         f"(its longest document), so a shorter document would not get the tables it gets alone; "
                         f"use a block_size of at most {rope[1]}, a rope_type whose tables do not depend on the "
                         f"sequence (default, linear, llama3, yarn), or token rows (document_mask=False)")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if attention in PACKED_ATTENTION_CUDA and not on_cuda:
        raise ValueError(f"HuggingFaceCausalLM takes packed batches with attn_implementation {attention!r} on CUDA "
                         f"only (it has no backward on {torch.device(device).type if device is not None else 'CPU'}); "
                         f"set attn_implementation to sdpa (which attends document by document), or eager")
    if attention not in PACKED_ATTENTION + PACKED_ATTENTION_CUDA:
        raise ValueError(f"HuggingFaceCausalLM cannot take packed batches with attn_implementation {attention!r}: "
                         f"verified with {', '.join(PACKED_ATTENTION)} (and on CUDA {', '.join(PACKED_ATTENTION_CUDA)}); "
                         f"set attn_implementation to sdpa, or train on token rows (document_mask=False)")


class HuggingFaceCausalLM(AdoptedCausalLM):
    """A transformers causal LM (Llama/SmolLM, Mistral, Qwen2 and others laid out as ``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) as a ``PipelineModule``.

    Args:
        config: a ``transformers.PretrainedConfig``, or a mapping with ``model_type`` and the config's fields
            (what LightningCLI YAML gives: ``{model_type: llama, hidden_size: 64, ...}``). Nothing is downloaded.
        lr: the learning rate of the AdamW of :meth:`configure_optimizers`.
        weight_decay: that AdamW's weight decay (matrices decayed, norms not).
        init_seed: seed of the per-layer initialization; ``None`` uses ``torch.initial_seed()``. Each layer is
            initialized by the upstream ``_init_weights`` (``normal(0, initializer_range)`` matrices, norms 1,
            padding row 0) drawing from the global RNG seeded by this seed and the layer's index (and left as it
            was), so one device and p processes build the same weights.
        pretrained: a local ``save_pretrained`` folder whose weights replace the initialization (see
            :meth:`from_pretrained`); ``config`` then defaults to the folder's ``config.json``, and a mapping without
            ``model_type`` overrides some of its fields (``{attn_implementation: eager}``).
        skip_document_ends: with packed batches, the loss skips each document's last target (the next document's
            first token).

    A batch may be packed, ``{"input_ids": (B, T + 1), "position_ids": (B, T + 1)}`` (``data.TextDataModule(
    document_mask=True)``): positions restarting at each document are passed as transformers takes packed
    sequences; full-attention layers under ``sdpa`` (and ``flex_attention`` on CUDA) attend document by document
    (:func:`install_document_attention`), ``eager`` and sliding-window layers through the block-diagonal mask
    transformers makes from the positions (once per microbatch on each stage). Families verified exact that way
    (:data:`PACKED_FAMILIES`) take them; others are refused by name.
    """

    # ``dict[str, Any]`` first: jsonargparse then merges ``--model.init_args.config.hidden_size 128`` into the
    # mapping from the YAML (under ``Any`` alone it passes a ``NestedArg`` through); ``Any``: a ``PretrainedConfig``.
    def __init__(self, config: Union[dict[str, Any], Any] = None, lr: float = 3e-4, weight_decay: float = 0.1,
                 init_seed: Optional[int] = None, pretrained: Optional[str] = None,
                 skip_document_ends: bool = False) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, init_seed=init_seed)
        if pretrained is not None:
            pretrained = os.fspath(pretrained)
            if config is None or (isinstance(config, Mapping) and "model_type" not in config):
                config = pretrained_config(pretrained, **(config or {}))  # a mapping without model_type: overrides
        elif config is None:
            raise ValueError("HuggingFaceCausalLM needs a config, or pretrained=<a save_pretrained folder> to take it from")
        self.config = as_pretrained_config(config)
        self.pretrained = pretrained
        self.skip_document_ends = skip_document_ends
        check_router_loss_supported(self.config)
        # A plain mapping, so that load_from_checkpoint rebuilds the config without unpickling transformers objects.
        self.save_hyperparameters({"config": self.config.to_dict(), "lr": lr, "weight_decay": weight_decay, "init_seed": init_seed,
                                   "pretrained": pretrained, "skip_document_ends": skip_document_ends})
        self._init_weights: Optional[Callable[[nn.Module], None]] = None
        self._router_loss: Optional[RouterLoss] = None  # MoE with output_router_logits (models/moe.py)
        #: configure_model first checks the family on a tiny copy of the config (hf_probe.check_exact).
        self.check_exact = True
        self._causal_without_mask = False  # what the check found; unchecked, the layers build every mask
        self._layer_inputs: list[DecoderLayerInputs] = []  # each decoder layer's pre-hook
        self._tensor_parallel_size = 1  # parallelize() sets it
        self.model: nn.Module
        self.lm_head: nn.Module
        self._build()  # model and lm_head, parameters on the meta device until configure_model()

    def build_upstream(self) -> list[nn.Module]:
        from transformers import AutoModelForCausalLM
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        upstream = AutoModelForCausalLM.from_config(self.config)
        name = f"{type(upstream).__name__} (model_type {self.config.model_type!r})"
        missing = [path for path in LAYOUT if not _has_path(upstream, path)]
        if missing:
            raise ValueError(
                f"HuggingFaceCausalLM cannot split {name} into pipeline layers: it has no {', '.join(missing)}. "
                f"The adapter takes decoder-only models laid out as {', '.join(LAYOUT)} (Llama, Mistral, Qwen2, ...); "
                f"for another layout write a PipelineModule whose pipeline_layers() lists its parts (docs/guide/models.md, 'Your own model')"
            )
        base = upstream.model
        blocks = list(base.layers)
        if not blocks:
            raise ValueError(f"HuggingFaceCausalLM: {name} has no decoder layers (num_hidden_layers={self.config.num_hidden_layers})")
        forward_args = inspect.signature(type(blocks[0]).forward).parameters
        if "position_embeddings_global" in forward_args:
            raise ValueError(f"HuggingFaceCausalLM cannot split {name}: its decoder layer {type(blocks[0]).__name__}.forward "
                             f"takes two rotary tables (position_embeddings_global and _local); the adapter computes one")
        if "position_embeddings" not in forward_args:
            raise ValueError(f"HuggingFaceCausalLM cannot split {name}: its decoder layer {type(blocks[0]).__name__}.forward "
                             f"takes no position_embeddings (transformers >= 4.54 passes them to every layer)")
        # The rotary module holds only non-persistent buffers (inv_freq): rebuilt off the meta device (where the
        # strategy builds layers) from the config, as its constructor computes them, and kept out of the module tree.
        with torch.device("cpu"):
            rotary = type(base.rotary_emb)(config=base.config)
        del base._modules["rotary_emb"]
        object.__setattr__(base, "rotary_emb", rotary)  # model.forward still finds it
        layer_types = getattr(self.config, "layer_types", None)
        for index, block in enumerate(blocks):
            attention = getattr(block, "attention_type", None)
            if attention is None and layer_types:  # transformers 5: model.forward picks by config.layer_types[i]
                attention = layer_types[index]
            if attention is None:  # Mistral: one kind of attention, sliding if the config has a window
                attention = "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"
            masks = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            if attention not in masks:
                raise ValueError(f"HuggingFaceCausalLM cannot split {name}: its layers use {attention!r} attention; "
                                 f"supported: {', '.join(masks)}")
            inputs = DecoderLayerInputs(base.config, rotary, masks[attention], block, self._causal_without_mask)
            block.register_forward_pre_hook(inputs, with_kwargs=True)
            self._layer_inputs.append(inputs)
            block.register_forward_hook(inputs.unwrap)
        # Embedding scales, logit scales, soft-capping: on the first and last pipeline layers.
        hf_outside.attach(hf_outside.outside_work(base, upstream, self.config), base.embed_tokens, upstream.lm_head,
                          base, self.config)
        # Packed microbatches: positions ride with the hidden state from the embedding to the final norm.
        ends = PackedEnds()
        base.embed_tokens.register_forward_pre_hook(ends.enter_embedding)
        base.embed_tokens.register_forward_hook(ends.leave_embedding)  # after the outside work's (scales)
        base.norm.register_forward_pre_hook(ends.enter_norm)
        self.model, self.lm_head = base, upstream.lm_head
        self._init_weights = upstream._init_weights
        if adds_router_loss(self.config):  # the router statistics travel with the hidden state (models/moe.py)
            self._router_loss = RouterLoss(upstream, self.config)
            self._router_loss.attach(blocks, [base.norm, upstream.lm_head])
        return [base.embed_tokens, *blocks, base.norm, upstream.lm_head]

    def configure_model(self) -> None:
        if self._layers is not None:  # Lightning calls this hook on every trainer entry point
            return
        tp_mesh = tensor_parallel_mesh(self.device_mesh)  # set by a strategy with tensor parallelism
        # First what the plan refuses by name (styles, sizes it does not divide, dropout), which the checks below
        # would only see fail
        kinds = (hf_config.read_plan(self.config, tp_mesh.size(), replica_processes(self.device_mesh),
                                     read_by_the_code(type(self.config))) if tp_mesh is not None else None)
        if self.check_exact:
            # Before any layer gets memory: refuses a family whose pipeline layers differ from the upstream forward.
            # The adapter itself, not a subclass: a subclass may take other constructor arguments.
            self._mask_as_upstream(hf_probe.check_exact(HuggingFaceCausalLM, self.config))
        # Then whether the plan is exact: its layers split over simulated ranks against one device (on a tiny copy)
        plan = tensor_parallel_plan(self.config, tp_mesh.size(), kinds=kinds) if tp_mesh is not None else None
        ep_mesh = expert_parallel_mesh(self.device_mesh)  # set by a strategy with expert parallelism
        if ep_mesh is not None:  # before the layers get memory: each rank keeps E / e experts (models/moe.py)
            split_experts(list(self.model.layers), self.config, ep_mesh)
        super().configure_model()
        if plan is not None:
            self.parallelize(tp_mesh, plan)

    def parallelize(self, tp_mesh: Any, plan: hf_config.LayerPlan) -> None:
        """Apply the family's tensor-parallel plan (:func:`tensor_parallel_plan`) to every decoder layer over
        ``tp_mesh``, and split the embedding and the head over the vocabulary (docs/design/tensor-parallel.md,
        "Models with a plan"): the embedding's output all-reduced whole (transformers' plan takes and gives whole
        hidden states), the head's logits never gathered (the loss runs under ``loss_parallel``); a tied head keeps
        the embedding's matrix, both split by rows. The norms stay whole on every rank (those the plan's shards
        feed, as Qwen3's q/k norms, with their gradient summed over the ranks)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.model.layers:
            hf_config.parallelize_layer(block, tp_mesh, plan, f"model_type {self.config.model_type!r}")
        parallelize_module(self.model.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        # a packed microbatch: the plan's output hook acts on the hidden state PackedEnds puts beside the positions
        layout_hooks_on_entries(self.model.embed_tokens, None, packing.HIDDEN)
        parallelize_module(self.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        if self.config.tie_word_embeddings:  # each module got its own DTensor of the one matrix: one again
            self.lm_head.weight = self.model.embed_tokens.weight
        self._tensor_parallel_size = tp_mesh.size()

    def _mask_as_upstream(self, causal_without_mask: bool) -> None:
        """Make the decoder layers' masks as upstream's forward does with its cache: none where SDPA can run
        causal without one."""
        self._causal_without_mask = causal_without_mask
        for inputs in self._layer_inputs:
            inputs.causal_without_mask = causal_without_mask

    def init_module(self, module: nn.Module) -> None:
        assert self._init_weights is not None
        self._init_weights(module)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> "HuggingFaceCausalLM":
        """Start from the weights of a local ``save_pretrained`` folder (``config.json`` and ``model.safetensors``, or
        the shards its ``model.safetensors.index.json`` lists); ``kwargs`` as the constructor's. Nothing is downloaded.

        The model is built as usual (under the strategy, layers on the meta device, each process materializing only
        its own stage's); each layer, once initialized, takes the file's values, read lazily, so each process reads
        only its own stage's tensors. In LightningCLI YAML: ``init_args: {pretrained: path}``."""
        return cls(pretrained=path, **kwargs)

    def open_pretrained(self, path: str) -> SafetensorsFolder:
        return SafetensorsFolder(path)

    # ---- packed batches (models/packing.py) ------------------------------------------------------------------
    def pipeline_input(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping) or not (packing.POSITION_IDS in batch or set(batch) == {packing.INPUT_IDS}):
            x = super().pipeline_input(batch)  # token rows, or a refusal naming the batch form taken (padding)
        else:  # a packed batch, or a refusal naming what it lacks
            batch = packing.check_packed(batch, type(self).__name__)
            x = packing.packed_input(batch)
            check_packed_supported(self.model.config, x[packing.INPUT_IDS].shape[-1], self.device)
        length = (x[packing.INPUT_IDS] if isinstance(x, Mapping) else x).shape[-1]
        limit = supported_positions(self.config)
        if limit is not None and length > limit:  # as models.Llama refuses rows past max_seq_len
            what = (f"the {limit} positions the config's {'/'.join(sorted(rope_types(self.config)))} rope scaling "
                    f"supports (its factor times the original length; max_position_embeddings "
                    f"{self.config.max_position_embeddings})" if limit != self.config.max_position_embeddings
                    else f"the config's max_position_embeddings {limit}")
            raise ValueError(f"HuggingFaceCausalLM: rows of {length} tokens are longer than {what}; use a block_size "
                             f"of at most {limit} (or a config whose rope supports {length} positions)")
        return x

    # ---- MoE: the router's load-balancing term (models/moe.py) ---------------------------------------------------
    def pipeline_loss(self, output: Any, batch: Any) -> torch.Tensor:
        logits, statistics = (output, None) if self._router_loss is None else self._router_loss.split(output)
        if packing.is_packed(batch):
            check_packed_supported(self.model.config, device=self.device)
            loss = packing.document_loss(logits, packing.check_packed(batch, type(self).__name__),
                                         self.skip_document_ends)
        else:
            loss = super().pipeline_loss(logits, batch)
        # The balancing term over every token of the microbatch: on packed rows, upstream's over its documents as
        # a padded batch with their attention mask (routing is per token, so each token routes as in its document)
        return loss if self._router_loss is None else loss + self._router_loss.loss(statistics)

    def pipeline_loss_weight(self, batch: Any) -> Any:
        return packing.loss_weight(batch, self.skip_document_ends, type(self).__name__)  # kept targets, where skipped

    def pipeline_metric_names(self) -> tuple[str, ...]:
        return ("train_aux_loss",) if adds_router_loss(self.config) else ()

    def pipeline_metrics(self) -> dict[str, torch.Tensor]:
        if self._router_loss is None:
            return {}
        aux = self._router_loss.take_logged()
        if aux is None:
            raise RuntimeError("pipeline_metrics() was called before any training pipeline_loss() of the batch")
        return {"train_aux_loss": aux}

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        output = super().predict_step(batch, batch_idx, dataloader_idx)
        return output if self._router_loss is None or output is None else self._router_loss.split(output)[0]


def tensor_parallel_plan(config: Any, tensor_parallel_size: int, processes: Optional[int] = None,
                         kinds: Optional[dict[str, str]] = None) -> hf_config.LayerPlan:
    """The tensor-parallel plan of one decoder layer of ``config``'s family, from transformers' own
    (``config.base_model_tp_plan``; ``kinds``, when given, is what :func:`hf_config.read_plan` read of
    it), checked exact on a tiny copy of the config split over simulated ranks
    (:func:`hf_probe.check_tensor_parallel`, which also finds the parameters whose gradient is
    summed over the ranks). Entries outside the decoder layers (the head's ``colwise_rep``) are not applied:
    ``HuggingFaceCausalLM.parallelize`` splits the embedding and the head over the vocabulary itself. Refused,
    naming the reason (:class:`hf_config.TensorParallelRefusal`): a family without a plan, a style the
    adapter does not apply, a difference or failure on the tiny copy, a ``tensor_parallel_size`` that does not
    divide the vocabulary, the heads or the MLP's width (the sizes suggested instead also divide ``processes``, a
    pipeline replica's, where known), and a dropout rate above 0."""
    if kinds is None:
        kinds = hf_config.read_plan(config, tensor_parallel_size, processes, read_by_the_code(type(config)))
    summed = hf_probe.check_tensor_parallel(HuggingFaceCausalLM, config, kinds)
    return hf_config.LayerPlan(kinds, summed)


def _has_path(root: Any, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(root, part):
            return False
        root = getattr(root, part)
    return isinstance(root, nn.Module)

