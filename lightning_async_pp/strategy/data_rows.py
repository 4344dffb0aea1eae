"""The rows a data module declares, checked against the model at ``AsyncPipelineStrategy``'s setup, before the
split is costed or anything is built: a data module of token rows as ``data.TextDataModule`` makes them (any
``LightningDataModule`` with the attributes ``block_size``, each row ``block_size + 1`` token ids, and
``document_mask``, packed rows with positions). Without it, rows longer than the model's positions only warned at
setup (the layers could not be costed on them) and failed at the first batch, after the start-up; packed rows
that the model refuses under tensor parallelism likewise. The refusal names the key to change in a config
(``data.block_size``, ``data.document_mask``).
"""
from __future__ import annotations

from typing import Any

import torch


def check_rows(datamodule: Any, module: Any) -> None:
    """Refuse, naming the data module's key, rows that ``module`` cannot take (its ``pipeline_input`` refuses them,
    or they are longer than its positions). Nothing is checked where the data module declares no ``block_size``;
    the model's ``pipeline_input`` runs on one row of zeros only where it declares ``document_mask`` too (the
    form of its batches is then known)."""
    block_size = getattr(datamodule, "block_size", None) if datamodule is not None else None
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        return
    from lightning_async_pp.models.packing import INPUT_IDS, POSITION_IDS
    from lightning_async_pp.models.vocab import model_positions

    data, model = type(datamodule).__name__, type(module).__name__
    positions = model_positions(module)
    if positions is not None and block_size > positions:
        raise ValueError(f"{data} has block_size={block_size}, rows longer than the {positions} positions {model} "
                         f"takes: set data.block_size: {positions} (or less) in the config, {data}(block_size="
                         f"{positions}) in code, or use a model with more positions")
    document_mask = getattr(datamodule, "document_mask", None)
    if not isinstance(document_mask, bool):
        return
    row = torch.zeros(1, block_size + 1, dtype=torch.long)
    packed = {INPUT_IDS: row, POSITION_IDS: torch.arange(block_size + 1).unsqueeze(0)}
    try:
        module.pipeline_input(packed if document_mask else row)
    except (ValueError, TypeError) as err:
        if document_mask and _takes(module, row):  # token rows would do: the packing is refused
            key, code = "data.document_mask: false", "document_mask=False"
        else:
            key, code = f"data.block_size (now {block_size})", "block_size"
        raise ValueError(f"{model} refuses the rows of {data} (block_size={block_size}, document_mask="
                         f"{document_mask}), found at setup before training: {err}. Change {key} in the config "
                         f"({data}({code}) in code)") from err


def _takes(module: Any, batch: Any) -> bool:
    try:
        module.pipeline_input(batch)
    except (ValueError, TypeError):
        return False
    return True
