"""``model_vocab_size``: how many token ids a model's embedding takes, for the checks of the data module and
``TextSamples`` (one place for every kind of model)."""
from __future__ import annotations

from typing import Any, Optional


def model_vocab_size(module: Any) -> Optional[int]:
    """The number of token ids ``module`` embeds, read without building its layers: an adapter's ``config``
    (litgpt's ``padded_vocab_size``, the embedding's rows, else ``vocab_size``: transformers), else the
    ``vocab_size`` hyperparameter (``models.GPT``, ``models.Llama``, and any module that saves one); ``None`` if
    the module names none."""
    config = getattr(module, "config", None)
    for name in ("padded_vocab_size", "vocab_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    hparams = getattr(module, "hparams", None)
    value = hparams.get("vocab_size") if hparams is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
