"""``model_vocab_size``: how many token ids a model's embedding takes, for the checks of the data module and
``TextSamples`` (one place for every kind of model)."""
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
