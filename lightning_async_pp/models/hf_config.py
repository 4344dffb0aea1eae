"""A transformers config for ``HuggingFaceCausalLM``: built from a mapping or a local folder, every key checked.

A mapping's keys are checked against what the family knows (its config class's signature and ``attribute_map``, the
attributes its modeling code reads, its defaults): transformers keeps an unknown key as an attribute nothing reads,
so a misspelt ``hiden_size`` would train the family's default width without a word. An unknown ``model_type`` is
refused with the close causal-LM families.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

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
