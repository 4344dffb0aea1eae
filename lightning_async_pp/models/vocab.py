"""``model_vocab_size`` and ``model_positions``: how many token ids a model's embedding takes and how long a row
it reads, for the checks of the data module, the strategy's setup and ``TextSamples`` (one place for every kind
of model)."""
from __future__ import annotations

from typing import Any, Optional


def model_vocab_size(module: Any) -> Optional[int]:
    """The vocabulary of ``module`` (token ids ``0 .. V - 1``), read without building its layers: an adapter's
    ``config.vocab_size`` (transformers and litgpt alike; litgpt's embedding has ``padded_vocab_size >= V`` rows,
    padding that no tokenizer's id reaches, so a byte-level litgpt model padded to 512 still counts as 256), else
    the ``vocab_size`` hyperparameter (``models.GPT``, ``models.Llama``, and any module that saves one); ``None``
    if the module names none."""
    config = getattr(module, "config", None)
    for name in ("vocab_size", "padded_vocab_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    hparams = getattr(module, "hparams", None)
    value = hparams.get("vocab_size") if hparams is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_positions(module: Any) -> Optional[int]:
    """The longest row of tokens ``module`` takes, read without building its layers: a transformers config's
    supported positions (``max_position_embeddings``, or what its rope scaling extends it to), a litgpt config's
    ``block_size``, ``models.Llama``'s ``max_seq_len``, ``models.GPT``'s ``block_size`` hyperparameter (and any
    module that saves one of these); ``None`` if the module names none."""
    config = getattr(module, "config", None)
    if _count(getattr(config, "max_position_embeddings", None)) is not None:
        from lightning_async_pp.models.huggingface import supported_positions

        return supported_positions(config)
    hparams = getattr(module, "hparams", None) or {}
    for value in (getattr(config, "max_seq_len", None), getattr(config, "block_size", None),
                  hparams.get("max_seq_len"), hparams.get("block_size")):
        if _count(value) is not None:
            return value
    return None


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
