"""A transformers config for ``HuggingFaceCausalLM``: built from a mapping or a local folder, every key checked.

A mapping's keys are checked against what the family knows (its config class's signature and ``attribute_map``, the
attributes its modeling code reads, its defaults): transformers keeps an unknown key as an attribute nothing reads,
so a misspelt ``hiden_size`` would train the family's default width without a word. An unknown ``model_type`` is
refused with the close causal-LM families.

Also the config's tensor-parallel plan (``base_model_tp_plan``, its entries under ``layers.*.``), read as the
adapter applies it: the styles torch's column- and row-wise styles implement, and the parameters whose gradient is
summed over the ranks, which the check on a tiny copy (``hf_probe.check_tensor_parallel``) finds. See
docs/design/tensor-parallel-families.md.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib
import inspect
import os
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_async_pp.models.adopted import missing_package


def as_pretrained_config(config: Any) -> Any:
    """A ``transformers.PretrainedConfig`` from one, or from a mapping with ``model_type`` (``AutoConfig.for_model``).

    A mapping's keys are checked (:func:`check_config_keys`) unless it holds ``transformers_version``: a config
    transformers wrote (``to_dict()``, as the checkpoint's hyperparameters hold it; a ``config.json``) is taken as
    it is, extra keys included (SmolLM's ``config.json`` has keys no ``LlamaConfig`` names)."""
    try:
        from transformers import AutoConfig, PretrainedConfig
    except ImportError as err:
        raise missing_package("transformers", "hf") from err
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, Mapping):
        if "model_type" not in config:
            raise ValueError(f"a HuggingFaceCausalLM config mapping needs a 'model_type' (e.g. llama, mistral, qwen2); got keys {sorted(config)}")
        check_model_type(config["model_type"])
        rest = {k: v for k, v in config.items() if k != "model_type"}
        by_hand = "transformers_version" not in config  # one transformers wrote may hold extra keys
        try:
            made = AutoConfig.for_model(config["model_type"], **rest)
        except Exception as err:  # a transformers that refuses unknown keys itself: still name the key meant
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if by_hand and config["model_type"] in CONFIG_MAPPING:
                check_config_keys(CONFIG_MAPPING[config["model_type"]], rest, None, err)
            raise
        if by_hand:
            check_config_keys(type(made), rest, made)
        return made
    raise TypeError(f"config must be a transformers.PretrainedConfig or a mapping with 'model_type', got {type(config).__name__}")


def check_model_type(model_type: Any) -> None:
    """Refuse a ``model_type`` transformers does not know with the close ones (``llamma``: did you mean 'llama'?),
    not transformers' list of every model type it has (300 of them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in CONFIG_MAPPING:
        return
    close = difflib.get_close_matches(str(model_type), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(f"HuggingFaceCausalLM: model_type {model_type!r} is not one transformers knows; {hint}Its "
                     f"causal-LM families are listed in docs/models.md (the Llama family's layout: llama, mistral, "
                     f"qwen2, qwen3, gemma, ...)")


#: Keys a config mapping may hold that the family's signature and defaults need not show: the rope settings,
#: which transformers 4.x and 5.x spell differently and move between each other.
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def config_keys(config_class: type, common: bool = True) -> set[str]:
    """The keys ``config_class`` names: its constructor's and its bases' (``PretrainedConfig``'s common ones unless
    ``common=False``) and its ``attribute_map``'s."""
    from transformers import PretrainedConfig

    names: set[str] = set(getattr(config_class, "attribute_map", {}) or {})
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for klass in config_class.__mro__:
        if not common and not (issubclass(klass, PretrainedConfig) and klass is not PretrainedConfig):
            continue
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(p.name for p in parameters if p.kind not in variadic and p.name != "self")
    return names


#: transformers' modules that read a family's config besides its own modeling module (rope parameters, masks).
SHARED_READERS = ("transformers.modeling_rope_utils", "transformers.masking_utils")


_ATTRIBUTE_READ = re.compile(r"\bconfig\.(\w+)|\b(?:get|has)attr\(\s*[\w.]*config\w*\s*,\s*[\"'](\w+)[\"']")


@functools.lru_cache(maxsize=None)
def read_by_the_code(config_class: type) -> frozenset[str]:
    """The config attributes the family's modeling code (and :data:`SHARED_READERS`) reads, as
    ``config.name`` or ``getattr(config, "name", ...)``: a family may use a key its config class does not name
    (Qwen3-MoE's ``head_dim``, read with a default)."""
    modules = [config_class.__module__.replace(".configuration_", ".modeling_"), *SHARED_READERS]
    names: set[str] = set()
    for name in modules:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except Exception:  # a family without such a module; a transformers without such a helper
            continue
        names.update(a or b for a, b in _ATTRIBUTE_READ.findall(source))
    return frozenset(names)


def check_config_keys(config_class: type, keys: Mapping[str, Any], made: Any, error: Optional[Exception] = None) -> None:
    """Raises ``ValueError`` for a key of ``keys`` that the family of ``config_class`` does not know: transformers
    keeps such a key in the config ``made`` from ``keys`` as an attribute nothing reads, so ``hiden_size: 256``
    would train the family's default width without a word. A key is known if the config class names it
    (:func:`config_keys`), its modeling code reads it (:func:`read_by_the_code`), its default config has it, it is a rope setting (:data:`ROPE_KEYS`), or the constructor
    took it (it is not kept in ``made`` as given: ``torch_dtype``, ``attn_implementation``). ``made=None``: the
    constructor failed with ``error``; the keys the class does not name that the error names are reported with it."""
    known = config_keys(config_class) | read_by_the_code(config_class)
    try:
        default: Any = config_class()
    except Exception:  # a family whose defaults do not build: its signature and attribute_map alone
        default = None
    unknown = [key for key in keys if key not in known and key not in ROPE_KEYS
               and (default is None or not hasattr(default, key))
               and (key in vars(made) if made is not None else key in str(error))]
    if not unknown:
        return
    names = sorted(known | (set(default.to_dict()) if default is not None else set()))
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""))
    consequence = (f"building it fails with {type(error).__name__}: {error}" if made is None else
                   "transformers would keep it unused and build the family's default instead")
    raise ValueError(
        f"HuggingFaceCausalLM: the {getattr(config_class, 'model_type', '')!r} config ({config_class.__name__}) has "
        f"no key {', '.join(hints)}; {consequence}. Its keys: {', '.join(sorted(config_keys(config_class, common=False)))}, "
        f"and PretrainedConfig's common ones (tie_word_embeddings, bos_token_id, ...)") from error


def pretrained_config(folder: str, **overrides: Any) -> Any:
    """The config of a local ``save_pretrained`` folder (its ``config.json``), with ``overrides``."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"pretrained={folder!r} is not a save_pretrained folder: it has no config.json "
                                f"(a local folder is needed; nothing is downloaded)")
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise missing_package("transformers", "hf") from err
    config, unused = AutoConfig.from_pretrained(folder, local_files_only=True, return_unused_kwargs=True, **overrides)
    if unused:  # transformers ignores a key its config does not have: a typo would train another model silently
        raise ValueError(f"the config overrides {sorted(unused)} are not fields of {type(config).__name__} (from "
                         f"{folder!r}); its fields include {', '.join(sorted(config.to_dict())[:12])}, ...")
    return config


# ---- the tensor-parallel plan (docs/design/tensor-parallel-families.md) ----------------------------------------------
#: The plan's prefix of the decoder layers' entries.
LAYERS_PREFIX = "layers.*."
#: transformers' style names (``integrations/tensor_parallel.py``, 4.5x and 5.x spellings) and what they are here:
#: a column-wise matrix gives its output's shard, or (``gathered``) the whole output gathered over the ranks; a
#: row-wise one takes its input's shard, or (``split``) the whole input and keeps its share, and all-reduces its
#: partial products into the whole output.
STYLES = {"colwise": "colwise", "rowwise": "rowwise",
          "colwise_rep": "colwise_gathered", "colwise_gather_output": "colwise_gathered",
          "rowwise_rep": "rowwise_split", "rowwise_split_input": "rowwise_split"}
#: Styles that leave a module's parameters whole; the check measures whether their gradient needs the sum over
#: ranks (transformers 5 names Qwen3's q/k norms so).
WHOLE_STYLES = ("replicated_with_grad_allreduce",)


class TensorParallelRefusal(ValueError):
    """A family the adapter cannot split exactly; ``reason`` is the short why (the family table's cell)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def refusal(family: str, t: int, reason: str, advice: str = "use tensor_parallel_size=1") -> TensorParallelRefusal:
    return TensorParallelRefusal(f"HuggingFaceCausalLM: tensor_parallel_size={t} is not supported for model_type "
                                 f"{family!r}: {reason}; {advice}", reason)


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer gets: ``kinds`` maps each plan key (a module path inside the layer, ``*`` matching any
    child, as torch's ``parallelize_module`` reads it) to ``colwise``, ``rowwise``, ``colwise_gathered`` or
    ``rowwise_split``; ``summed`` names the parameters (paths inside the layer) kept whole whose gradient is summed
    over the tensor-parallel ranks."""

    kinds: Mapping[str, str]
    summed: tuple[str, ...] = ()

    def styles(self) -> dict[str, Any]:
        """torch's ``ParallelStyle`` of each plan key."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        made = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
                "colwise_gathered": lambda: ColwiseParallel(output_layouts=Replicate()),
                "rowwise_split": lambda: RowwiseParallel(input_layouts=Replicate())}
        return {key: made[kind]() for key, kind in self.kinds.items()}


def layer_entries(config: Any) -> dict[str, str]:
    """The config's plan entries under the decoder layers, by path inside a layer (transformers' style names)."""
    upstream = getattr(config, "base_model_tp_plan", None) or {}
    return {k[len(LAYERS_PREFIX):]: v for k, v in upstream.items() if k.startswith(LAYERS_PREFIX)}


def read_plan(config: Any, t: int, processes: Optional[int] = None,
              read: Optional[Collection[str]] = None) -> dict[str, str]:
    """The kinds of :class:`LayerPlan` from the config's plan, or a :class:`TensorParallelRefusal` naming what is
    missing: no plan, or a style torch's column- and row-wise styles do not implement. Also refused: a ``t`` that
    does not divide the vocabulary, the heads or the MLP's width (the sizes suggested instead also divide
    ``processes``, a pipeline replica's, where known), and a dropout rate above 0 among the config's fields its
    code reads (``read``: every rank would draw one device's mask for its own heads)."""
    from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides, check_tensor_parallel_no_dropout

    family = config.model_type
    entries = layer_entries(config)
    if not entries:
        raise refusal(family, t, "transformers has no tensor-parallel plan for its decoder layers (its config's "
                                 "base_model_tp_plan names none)")
    other = {k: v for k, v in entries.items() if v not in STYLES and v not in WHOLE_STYLES}
    if other:
        shown = ", ".join(f"{k}: {v}" for k, v in list(other.items())[:4]) + (", ..." if len(other) > 4 else "")
        raise refusal(family, t, f"its plan has styles the adapter does not apply ({shown}; it applies "
                                 f"{', '.join(sorted(set(STYLES) | set(WHOLE_STYLES)))})")
    check_tensor_parallel_divides(t, {"vocab_size": config.vocab_size,
                                      "num_attention_heads": getattr(config, "num_attention_heads", None),
                                      "num_key_value_heads": getattr(config, "num_key_value_heads", None),
                                      "intermediate_size": getattr(config, "intermediate_size", None)},
                                  f"model_type {family!r}", processes)
    if read is not None:
        rates = {k: v for k, v in config.to_dict().items() if ("dropout" in k or "pdrop" in k) and k in read}
        check_tensor_parallel_no_dropout(t, rates, f"model_type {family!r}")
    return {k: STYLES[v] for k, v in entries.items() if v in STYLES}


def resolve(layer: nn.Module, key: str) -> Iterator[tuple[str, nn.Module]]:
    """The submodules of ``layer`` that plan key ``key`` names (each dotted part matched against child names with
    ``fnmatch``, as ``parallelize_module`` does), with their paths; none where the layer lacks them (a dense layer
    of a model whose other layers hold experts)."""
    found = [("", layer)]
    for part in key.split("."):
        found = [(f"{path}.{name}" if path else name, child) for path, module in found
                 for name, child in module.named_children() if fnmatch.fnmatchcase(name, part)]
    return iter(found)


def split_dim(kind: str) -> int:
    """The dimension of a planned ``nn.Linear``'s weight that its kind splits: rows (outputs) for column-wise."""
    return 0 if kind.startswith("colwise") else 1


def parallelize_layer(layer: nn.Module, mesh: Any, plan: LayerPlan, where: str) -> None:
    """Apply ``plan`` to one decoder layer over ``mesh``: torch's column- and row-wise styles on the planned
    matrices (each checked to split evenly over the ranks: torch would shard an uneven one unevenly), and the summed
    parameters replicated with their gradient summed over the ranks."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides

    styles = plan.styles()
    resolved = {}
    for key, kind in plan.kinds.items():
        for path, module in resolve(layer, key):
            check_tensor_parallel_divides(mesh.size(), {f"{path}.weight dimension {split_dim(kind)}":
                                                        module.weight.shape[split_dim(kind)]}, where)
            resolved[path] = styles[key]
    parallelize_module(layer, mesh, resolved)
    by_module: dict[str, list[str]] = {}
    for name in plan.summed:
        path, _, leaf = name.rpartition(".")
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue  # a layer of another kind
        by_module.setdefault(path, []).append(leaf)
    for path, names in by_module.items():
        sum_gradient_over_ranks(layer.get_submodule(path), names, mesh)


def sum_gradient_over_ranks(module: nn.Module, names: list[str], mesh: Any) -> None:
    """Make ``module``'s parameters ``names`` replicated DTensors (whole on every rank, as a norm's weight) that its
    forward uses as plain local tensors whose gradient is marked partial: each rank's is the part its own shard of
    the activations contributes (Qwen3's q norm sees this rank's heads), and the backward of the DTensor view the
    engine wraps each weight in (``DTensor.from_local``) sums them over the ranks."""
    from torch.distributed.tensor import DTensor, Replicate

    present = [n for n in names if isinstance(module._parameters.get(n), nn.Parameter)]
    for name in present:
        p = module._parameters[name]
        if not isinstance(p, DTensor):
            module._parameters[name] = nn.Parameter(
                DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False), p.requires_grad)
    hook = LocalWithSummedGradient(tuple(present))
    module.register_forward_pre_hook(hook.enter)
    module.register_forward_hook(hook.leave, always_call=True)


class LocalWithSummedGradient:
    """Forward hooks that hand the module its replicated parameters as local tensors for the call
    (``to_local(grad_placements=(Partial(),))``) and put the DTensors back after it. A parameter that is not a
    DTensor (the memory account's stand-ins, a model made whole again by the gather) is left alone."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._held: list[dict[str, Any]] = []  # one per call in progress (a recomputation nests none, but be safe)

    def enter(self, module: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import DTensor, Partial

        held = {}
        for name in self.names:
            p = module._parameters.get(name)
            if isinstance(p, DTensor):
                held[name] = p
                module._parameters[name] = p.to_local(grad_placements=(Partial(),))
        self._held.append(held)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._held:
            module._parameters.update(self._held.pop())
