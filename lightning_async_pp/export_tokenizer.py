"""The run's tokenizer as an exported folder's readers see it: its special tokens, the ids the model's config and
generation config carry, and a ``tokenizer_config.json`` for a tokenizer that came as a bare ``tokenizer.json``.

Without a ``tokenizer_config.json``, ``AutoTokenizer`` picks the tokenizer class from ``config.json``'s
``model_type`` (a ``LlamaTokenizerFast`` for a Llama), which adds that family's special tokens (``<s>``, ``</s>``,
``<unk>``) as new ids past the vocabulary and prepends a BOS; and the config keeps the family's default ids (Llama:
bos 1, eos 2), which are other tokens of the user's vocabulary. So the folder names the generic
``PreTrainedTokenizerFast`` (the ``tokenizer.json`` as it is) and special tokens the vocabulary has, and the config's
ids are those tokens' (see docs/design/checkpoints.md, 'Checkpoints').

The tokens are read as the data reads them (:func:`~lightning_async_pp.data.tokenized.eos_id`): the EOS is
``tokenizer_config.json``'s ``eos_token``, else the first known end-of-text name the vocabulary has; BOS, PAD and
UNK are the ones ``tokenizer_config.json`` names. Without a named BOS the EOS stands for it: every document the
model trained on follows an EOS, and none starts with anything else (GPT-2's convention). UNK defaults to the
tokenizer model's own ``unk_token``; PAD to none in the config's ids, but the EOS pads in ``tokenizer_config.json`` and
the generation config (``export.pad_with_eos``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from lightning_async_pp.data.tokenized import eos_id, load_tokenizer, tokenizer_file

TOKENIZER_CONFIG = "tokenizer_config.json"
#: The special tokens written to ``tokenizer_config.json``, and the config fields of their ids.
ID_FIELDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "pad_token_id"}


def special_tokens(path: str | os.PathLike) -> dict[str, str]:
    """The special tokens of the tokenizer at ``path`` (a ``tokenizer.json`` or its folder) that its vocabulary has,
    by ``tokenizer_config.json`` name (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``); see the module's
    docstring for the rule. A ``tokenizer.json`` that ``tokenizers`` cannot read is a ``ValueError``."""
    main = tokenizer_file(path)
    try:
        tokenizer = load_tokenizer(main)
    except Exception as err:  # tokenizers raises its own Exception type for a malformed file
        raise ValueError(f"the tokenizer {os.fspath(main)!r} cannot be read by tokenizers ({err}); give the "
                         f"tokenizer.json the run used") from err
    named = _named(main.parent / TOKENIZER_CONFIG)
    tokens: dict[str, str] = {}
    try:
        tokens["eos_token"] = tokenizer.id_to_token(eos_id(main, tokenizer))
    except ValueError:
        pass  # no end-of-text token: the data module refuses such a tokenizer; a model gets no eos id
    for name in ("bos_token", "pad_token", "unk_token"):
        token = named.get(name)
        if token is not None and tokenizer.token_to_id(token) is None:
            raise ValueError(f"{main.parent / TOKENIZER_CONFIG} names {name} {token!r}, which the tokenizer's "
                             f"vocabulary lacks")
        if token is not None:
            tokens[name] = token
    if "bos_token" not in tokens and "eos_token" in tokens:
        tokens["bos_token"] = tokens["eos_token"]
    unk = getattr(tokenizer.model, "unk_token", None)
    if "unk_token" not in tokens and isinstance(unk, str) and tokenizer.token_to_id(unk) is not None:
        tokens["unk_token"] = unk
    return tokens


def _named(config: os.PathLike) -> dict[str, str]:
    """The special tokens a ``tokenizer_config.json`` names (a token may be written as ``{"content": ...}``)."""
    if not os.path.isfile(config):
        return {}
    with open(config) as f:
        fields = json.load(f)
    named = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = fields.get(name)
        token = token.get("content") if isinstance(token, Mapping) else token
        if isinstance(token, str):
            named[name] = token
    return named


def token_ids(path: str | os.PathLike, tokens: Mapping[str, str]) -> dict[str, Optional[int]]:
    """The config fields (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) of ``tokens``, ``None`` for a
    token the tokenizer has none of."""
    tokenizer = load_tokenizer(path)
    return {field: (tokenizer.token_to_id(tokens[name]) if name in tokens else None) for name, field in ID_FIELDS.items()}


def vocab_size(path: str | os.PathLike) -> int:
    """The tokenizer's ids ``0 .. V - 1``, added tokens included (as the data module counts them)."""
    return load_tokenizer(path).get_vocab_size(with_added_tokens=True)


def tokenizer_config(tokens: Mapping[str, str]) -> dict[str, Any]:
    """A ``tokenizer_config.json`` for a bare ``tokenizer.json``: the generic fast class (the file as it is: no
    family's tokens added, the file's own post-processor), ``tokens`` (the EOS as the PAD where none is named, as
    the generation config's pad id, ``export.pad_with_eos``), and decoding without transformers' space
    clean-up (``"a ."`` stays ``"a ."``, as ``tokenizers`` decodes it), and no ``token_type_ids`` among the inputs
    (a causal LM's ``generate`` refuses them)."""
    pad = {"pad_token": tokens["eos_token"]} if "eos_token" in tokens else {}  # batched prompts need one
    return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"], **pad, **tokens}


def set_token_ids(target: Any, ids: Mapping[str, Optional[int]]) -> dict[str, tuple[Any, Any]]:
    """Set the ids on a ``PretrainedConfig`` or ``GenerationConfig``; returns ``{field: (old, new)}`` of those that
    changed. A generation config's list of stop ids that holds the EOS is kept (an upstream chat model's stops)."""
    changed = {}
    for field, new in ids.items():
        old = getattr(target, field, None)
        if field == "eos_token_id" and isinstance(old, list) and new in old:
            continue
        if old != new:
            setattr(target, field, new)
            changed[field] = (old, new)
    return changed

