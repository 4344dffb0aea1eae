"""``LitGPT``: litgpt's ``GPT`` as a ``PipelineModule``.

The upstream ``litgpt.GPT(config)`` is built in ``__init__``, its parameters on the meta device until
``configure_model()`` gives them memory (``models/meta_built.py``); its children ``transformer`` and ``lm_head``
become this module's, so ``state_dict()`` keys are litgpt's and a consolidated checkpoint loads with
``strict=True`` into ``litgpt.GPT(config)``. Pipeline layers: ``transformer.wte``, each of ``transformer.h``,
``transformer.ln_f``, ``lm_head``. A block called with the hidden state alone gets the rope cos/sin for positions
``0..T-1`` (litgpt's ``GPT.forward`` without a KV cache) from a forward pre-hook. The rope cache (litgpt keeps it
as non-persistent buffers of ``GPT``) is computed off the meta device by litgpt's own ``rope_cache()`` and kept
outside the module tree.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_async_pp.models.adopted import AdoptedCausalLM, missing_package
from lightning_async_pp.models.pretrained import TorchFile

#: The files of a litgpt checkpoint folder: the weights and the config.
LIT_MODEL, LIT_CONFIG = "lit_model.pth", "model_config.yaml"

#: Config fields whose ``GPT.forward`` code sits outside the blocks; the adapter refuses them (value: what is "off").
UNSUPPORTED = {"scale_embeddings": False, "final_logit_softcapping": None, "rope_indices": None}


def as_litgpt_config(config: Any) -> Any:
    """A ``litgpt.Config`` from one, a config name (``Config.from_name``), or a mapping (with ``name``: that
    config with the other keys overriding it; without: ``Config(**mapping)``)."""
    try:
        from litgpt import Config
    except ImportError as err:
        raise missing_package("litgpt", "litgpt") from err
    if isinstance(config, Config):
        return config
    if isinstance(config, str):
        return Config.from_name(config)
    if isinstance(config, Mapping):
        rest = {k: v for k, v in config.items() if k != "name"}
        fields = {f.name for f in dataclasses.fields(Config) if f.init}
        unknown = [k for k in rest if k not in fields]
        if unknown:  # litgpt raises a TypeError naming the key; this also names the key meant
            hints = [f"{k!r}" + "".join(f" (did you mean {c!r}?)" for c in difflib.get_close_matches(k, fields, n=1))
                     for k in unknown]
            raise ValueError(f"LitGPT: litgpt.Config has no field {', '.join(hints)}; its fields: {', '.join(sorted(fields))}")
        return Config.from_name(config["name"], **rest) if "name" in config else Config(**rest)
    raise TypeError(f"config must be a litgpt.Config, a config name or a mapping, got {type(config).__name__}")


class RopeCache:
    """litgpt's rope cos/sin (max_seq_length, n_elem), kept outside the module tree; moved to a device on first use."""

    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        self.cos, self.sin = cos, sin

    def take(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if length > self.cos.shape[0]:
            raise ValueError(f"Cannot forward sequence of length {length}, max seq length is only {self.cos.shape[0]}.")
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self.cos[:length].unsqueeze(0), self.sin[:length].unsqueeze(0)


class BlockInputs:
    """Forward pre-hook of one litgpt ``Block``: called as ``block(x)`` (by the pipeline), it adds ``cos, sin`` for
    positions ``0..T-1`` and no mask (causal), as ``GPT.forward`` does without a KV cache."""

    def __init__(self, rope: RopeCache) -> None:
        self.rope = rope

    def __call__(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        if len(args) != 1:
            return None  # called the upstream way
        (x,) = args
        cos, sin = self.rope.take(x.shape[1], x.device)
        return x, cos, sin


class LitGPT(AdoptedCausalLM):
    """litgpt's ``GPT`` as a ``PipelineModule``.

    Args:
        config: a ``litgpt.Config``, a config name (``"pythia-14m"``: ``Config.from_name``, nothing downloaded), or
            a mapping (``{name: pythia-14m, n_layer: 2, vocab_size: 256}``: that config with overrides; without
            ``name``: ``Config(**mapping)``).
        lr: the learning rate of the AdamW of :meth:`configure_optimizers`.
        weight_decay: that AdamW's weight decay (matrices decayed, norms not).
        init_seed: seed of the per-layer initialization; ``None`` uses ``torch.initial_seed()``. Each layer is
            initialized by litgpt's ``GPT._init_weights`` (``normal(0, 0.02)`` linear and embedding weights, zero
            biases) and norms by their ``reset_parameters`` (as ``GPT(config)`` builds them), drawing from the
            global RNG seeded by this seed and the layer's index.
        pretrained: a litgpt checkpoint folder whose weights replace the initialization (see :meth:`from_checkpoint`);
            ``config`` then defaults to the folder's ``model_config.yaml``.
    """

    # ``dict[str, Any]`` first: jsonargparse then merges ``--model.init_args.config.n_layer 2`` into the mapping from
    # the YAML (under ``Any`` alone it passes a ``NestedArg`` through); ``str``: a config name; ``Any``: a ``Config``.
    def __init__(self, config: Union[dict[str, Any], str, Any] = None, lr: float = 3e-4, weight_decay: float = 0.1,
                 init_seed: Optional[int] = None, pretrained: Optional[str] = None) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, init_seed=init_seed)
        if pretrained is not None:
            pretrained = os.fspath(pretrained)
            if config is None:
                config = checkpoint_config(pretrained)
        elif config is None:
            raise ValueError("LitGPT needs a config, or pretrained=<a litgpt checkpoint folder> to take it from")
        self.config = as_litgpt_config(config)
        self.pretrained = pretrained
        unsupported = {k: getattr(self.config, k) for k, off in UNSUPPORTED.items() if getattr(self.config, k) != off}
        if unsupported:
            raise ValueError(
                f"LitGPT cannot split litgpt config {self.config.name!r} into pipeline layers: GPT.forward applies "
                f"{unsupported} outside its blocks; supported: {UNSUPPORTED}"
            )
        self.save_hyperparameters({"config": dataclasses.asdict(self.config), "lr": lr, "weight_decay": weight_decay,
                                   "init_seed": init_seed, "pretrained": pretrained})
        self._init_weights: Any = None
        self.transformer: nn.Module
        self.lm_head: nn.Module
        self._build()  # transformer and lm_head, parameters on the meta device until configure_model()

    def build_upstream(self) -> list[nn.Module]:
        from litgpt import GPT

        upstream = GPT(self.config)
        # GPT's cos/sin buffers are computed in its constructor (on the meta device under the strategy): computed
        # again here on the CPU, by litgpt's own function, and kept outside the module tree.
        with torch.device("cpu"):
            cos, sin = upstream.rope_cache(device=torch.device("cpu"))
        rope = RopeCache(cos, sin)
        blocks = list(upstream.transformer.h)
        for block in blocks:
            block.register_forward_pre_hook(BlockInputs(rope))
        self.lm_head, self.transformer = upstream.lm_head, upstream.transformer  # litgpt's order of keys
        self._init_weights = upstream._init_weights
        self.rope = rope
        return [upstream.transformer.wte, *blocks, upstream.transformer.ln_f, upstream.lm_head]

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            self._init_weights(module)
        elif any(True for _ in module.parameters(recurse=False)):  # norms: what GPT(config) gives them
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                raise TypeError(f"LitGPT: {type(module).__name__} has parameters but no reset_parameters() to initialize them")
            reset()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | os.PathLike, **kwargs: Any) -> "LitGPT":
        """Start from a litgpt checkpoint folder (``lit_model.pth`` and ``model_config.yaml``, as litgpt's
        ``download``/``convert`` and ``consolidate --litgpt`` write it); ``kwargs`` as the constructor's.

        The model is built as usual (under the strategy, layers on the meta device); each layer, once initialized,
        takes the file's values from the memory-mapped ``lit_model.pth``, so each process reads only its own stage's
        tensors. In LightningCLI YAML: ``init_args: {pretrained: dir}``."""
        return cls(pretrained=checkpoint_dir, **kwargs)

    def open_pretrained(self, path: str) -> TorchFile:
        return TorchFile(os.path.join(path, LIT_MODEL))


def checkpoint_config(checkpoint_dir: str) -> Any:
    """The ``litgpt.Config`` of a litgpt checkpoint folder (its ``model_config.yaml``)."""
    path = os.path.join(checkpoint_dir, LIT_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained={checkpoint_dir!r} is not a litgpt checkpoint folder: it has no {LIT_CONFIG}")
    try:
        from litgpt import Config
    except ImportError as err:
        raise missing_package("litgpt", "litgpt") from err
    return Config.from_file(path)
