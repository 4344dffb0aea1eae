"""A trained adapter's checkpoint as the upstream library's own folder (``consolidate --hf`` / ``--litgpt``).

- :func:`export_hf`: a Hugging Face ``save_pretrained`` folder (``config.json``, safetensors, ``generation_config.json``,
  the tokenizer's files) that ``AutoModelForCausalLM.from_pretrained(folder)`` loads with the trained weights.
- :func:`export_litgpt`: a litgpt checkpoint folder (``lit_model.pth``, ``model_config.yaml``, the tokenizer's files).

The model's config comes from the checkpoint's ``hyper_parameters`` (``HuggingFaceCausalLM`` and ``LitGPT`` save
their config there as a plain mapping); the weights are the checkpoint's newest. The tokenizer's files come from
``tokenizer=`` (a folder or a ``tokenizer.json``), else from the data module's ``tokenizer`` hyperparameter, else
from the folder a prepared ``data_path`` carries, else from the folder the run started from (``pretrained``), where
one of these holds them. With a ``tokenizer.json``, the HF folder's ``tokenizer_config.json`` and the ids of the
model's ``config.json`` and ``generation_config.json`` follow that tokenizer (:mod:`lightning_async_pp.export_tokenizer`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_async_pp import export_tokenizer
from lightning_async_pp import checkpoint as _checkpoint
from lightning_async_pp.data.tokenized import TOKENIZER_FILE, TOKENIZER_FILES, prepared_tokenizer, tokenizer_files
from lightning_async_pp.models.litgpt_model import LIT_MODEL

GENERATION_CONFIG = "generation_config.json"


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A checkpoint's non-tensor part and its module ``state_dict``: a sharded directory, or one file (a
    consolidated one, or one written with ``save_distributed_checkpoint=False``)."""
    path = os.fspath(path)
    if _checkpoint.is_sharded(path):
        return _checkpoint.read_model_state(path)
    _checkpoint.check_file(path)
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as err:
        raise _checkpoint.unreadable_file(path, err) from err
    return checkpoint, checkpoint["state_dict"]


def adapter_config(checkpoint: Mapping[str, Any], path: str, flag: str, needs: str, adapter: str) -> dict[str, Any]:
    """The adapter's config saved in the checkpoint's ``hyper_parameters``; refuses another model's checkpoint."""
    hparams = checkpoint.get("hyper_parameters") or {}
    config = hparams.get("config")
    if not isinstance(config, Mapping) or needs not in config:
        raise ValueError(f"{flag} needs a checkpoint of {adapter} (its hyper_parameters hold the model's config, with "
                         f"{needs!r}); {path!r} has hyper_parameters {sorted(hparams)}"
                         f"{'' if not isinstance(config, Mapping) else f' and a config with keys {sorted(config)[:8]}'}")
    return dict(config)


def export_hf(src: str | os.PathLike, out: str | os.PathLike, tokenizer: Optional[str | os.PathLike] = None) -> list[str]:
    """Write the ``HuggingFaceCausalLM`` checkpoint ``src`` as a ``save_pretrained`` folder ``out``; returns the
    files written. With a ``tokenizer.json`` among the tokenizer's files, the folder's ``tokenizer_config.json``
    (written, or the run's with what it lacks added) names ``PreTrainedTokenizerFast`` and the run's special
    tokens, and ``config.json``'s and ``generation_config.json``'s bos/eos/pad ids are those tokens' ids."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from lightning_async_pp.models.hf_config import as_pretrained_config

    src, out = os.fspath(src), os.fspath(out)
    checkpoint, state = read_checkpoint(src)
    config = as_pretrained_config(adapter_config(checkpoint, src, "--hf", "model_type", "HuggingFaceCausalLM"))
    extras = run_files(checkpoint, tokenizer)
    generation = extras.pop(GENERATION_CONFIG, None)
    tokens, ids = run_tokens(extras, config.vocab_size)
    export_tokenizer.set_token_ids(config, ids)
    with torch.device("meta"):  # no memory until the checkpoint's tensors are assigned
        model = AutoModelForCausalLM.from_config(config)  # its generation config takes the config's ids
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gave the tied names separate tensors (equal values): one again
    if generation is not None:  # the upstream one (sampling settings, stop ids), with the run's tokenizer's ids
        model.generation_config = GenerationConfig.from_pretrained(os.path.dirname(generation))
        export_tokenizer.set_token_ids(model.generation_config, ids)
    pad_with_eos(model.generation_config)
    _check_out(out)
    model.save_pretrained(out)
    _copy(extras, out)
    if tokens:
        _write_tokenizer_config(extras, tokens, out)
    return sorted(os.listdir(out))


def export_litgpt(src: str | os.PathLike, out: str | os.PathLike, tokenizer: Optional[str | os.PathLike] = None) -> list[str]:
    """Write the ``LitGPT`` checkpoint ``src`` as a litgpt checkpoint folder ``out`` (``lit_model.pth``,
    ``model_config.yaml``: what litgpt's ``GPT(Config.from_file(...)).load_state_dict(torch.load(...))`` reads);
    returns the files written."""
    src, out = os.fspath(src), os.fspath(out)
    checkpoint, state = read_checkpoint(src)
    fields = adapter_config(checkpoint, src, "--litgpt", "n_embd", "LitGPT")  # another model's checkpoint: said first
    try:
        from litgpt import Config
        from litgpt.utils import save_config
    except ImportError as err:
        from lightning_async_pp.models.adopted import missing_package

        raise missing_package("litgpt", "litgpt") from err
    config = Config(**fields)
    extras = run_files(checkpoint, tokenizer)
    tokens, _ = run_tokens(extras, config.padded_vocab_size)
    _check_out(out)
    torch.save(dict(state), os.path.join(out, LIT_MODEL))
    save_config(config, Path(out))
    _copy(extras, out)
    if tokens:  # litgpt's Tokenizer reads its bos/eos from there
        _write_tokenizer_config(extras, tokens, out)
    return sorted(os.listdir(out))


def pad_with_eos(generation: Any) -> None:
    """A generation config without a pad id takes the (first) EOS id, as ``generate`` would, which otherwise warns
    at every call. Only there: ``config.json``'s ``pad_token_id`` becomes the embedding's ``padding_idx`` in some
    families (Llama), whose row then never trains again."""
    eos = generation.eos_token_id
    if generation.pad_token_id is None and eos is not None:
        generation.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos


def _check_out(out: str) -> None:
    if os.path.isfile(out):
        raise ValueError(f"{out!r} is a file; give the folder to write")
    if os.path.isdir(out) and os.listdir(out):  # stale files of another export would sit beside the new ones
        raise ValueError(f"{out!r} is not empty ({', '.join(sorted(os.listdir(out))[:5])}); give a new or empty "
                         f"folder to write")
    os.makedirs(out, exist_ok=True)


def run_files(checkpoint: Mapping[str, Any], tokenizer: Optional[str | os.PathLike]) -> dict[str, str]:
    """What goes into the folder beside the weights, by name: the tokenizer's files, from ``tokenizer`` (which must
    hold some), else the data module's ``tokenizer`` hyperparameter, else the tokenizer its prepared ``data_path``
    carries, else the ``pretrained`` folder the model started from; and that folder's generation config. Checked
    before anything is written."""
    pretrained = (checkpoint.get("hyper_parameters") or {}).get("pretrained")
    if tokenizer is not None:
        files = {name: os.fspath(f) for name, f in tokenizer_files(tokenizer).items()}
        if not files:
            raise ValueError(f"--tokenizer {os.fspath(tokenizer)!r} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    else:
        data = checkpoint.get("datamodule_hyper_parameters") or {}
        data_path = data.get("data_path")
        prepared = prepared_tokenizer(data_path) if isinstance(data_path, (str, os.PathLike)) else None
        candidates = [data.get("tokenizer"), prepared, pretrained]
        found = ({name: os.fspath(f) for name, f in tokenizer_files(c).items()}
                 for c in candidates if isinstance(c, (str, os.PathLike)))
        files = next((f for f in found if f), {})
        named = data.get("tokenizer")
        if not files and isinstance(named, (str, os.PathLike)):  # e.g. a relative path, consolidate run elsewhere
            print(f"warning: the run's tokenizer {os.fspath(named)!r} was not found from {os.getcwd()!r}; no tokenizer "
                  f"files exported: give --tokenizer", file=sys.stderr)
    if isinstance(pretrained, str) and os.path.isfile(os.path.join(pretrained, GENERATION_CONFIG)):
        files[GENERATION_CONFIG] = os.path.join(pretrained, GENERATION_CONFIG)  # the upstream one, not a default
    return files


def run_tokens(files: Mapping[str, str], vocab_size: int) -> tuple[dict[str, str], dict[str, Optional[int]]]:
    """The special tokens of the exported ``tokenizer.json`` and the config's ids of them (both empty without one);
    a tokenizer with more ids than the model's ``vocab_size`` is refused (it is not the run's)."""
    main = files.get(TOKENIZER_FILE)
    if main is None:
        return {}, {}
    tokens = export_tokenizer.special_tokens(main)
    size = export_tokenizer.vocab_size(main)
    if size > vocab_size:
        raise ValueError(f"the tokenizer {main!r} has {size} ids, more than the model's vocab_size {vocab_size}: it is "
                         f"not the tokenizer the model trained with; give that one with --tokenizer")
    return tokens, export_tokenizer.token_ids(main, tokens)


def _write_tokenizer_config(files: Mapping[str, str], tokens: Mapping[str, str], out: str) -> None:
    """``tokenizer_config.json`` in ``out``: the run's own, if any, with what it lacks of
    :func:`~lightning_async_pp.export_tokenizer.tokenizer_config` added (its own fields kept)."""
    own = files.get(export_tokenizer.TOKENIZER_CONFIG)
    fields = {}
    if own is not None:
        with open(own) as f:
            fields = json.load(f)
    with open(os.path.join(out, export_tokenizer.TOKENIZER_CONFIG), "w") as f:
        json.dump({**export_tokenizer.tokenizer_config(tokens), **fields}, f, indent=2)


def _copy(files: Mapping[str, str], out: str) -> list[str]:
    for name, file in files.items():
        shutil.copyfile(file, os.path.join(out, name))
    return sorted(os.listdir(out))
