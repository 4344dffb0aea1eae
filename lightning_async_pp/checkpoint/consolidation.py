"""Consolidation: a sharded checkpoint into one file (every key, so the file still resumes a pipeline in any
layout) or into the module's ``state_dict`` alone, and the parts a single-file checkpoint holds."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_async_pp.checkpoint.format import MODEL
from lightning_async_pp.checkpoint.sources import ShardedSource, read_meta
from lightning_async_pp.checkpoint.writing import resolve

def consolidate(src: str, dst: str) -> dict[str, Any]:
    """Turn the sharded checkpoint ``src`` into one checkpoint file ``dst``: the module's ``state_dict`` (newest
    weights, under every name a tied parameter has) plus the rest of the flat dictionary, so the file loads with
    ``load_from_checkpoint`` anywhere and still resumes a pipeline in any layout. Returns the checkpoint."""
    src = resolve(src)
    source = ShardedSource(src)
    checkpoint = read_meta(src)
    flat = source.read(source.shapes)
    checkpoint.update(single_file_parts(flat, checkpoint["async_pipeline"]))
    tmp = f"{dst}.tmp-{os.getpid()}"
    torch.save(checkpoint, tmp)
    os.replace(tmp, dst)
    return checkpoint

def read_model_state(src: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The sharded checkpoint ``src``'s non-tensor part (hyperparameters and the rest) and its module ``state_dict``
    (newest weights, aliases included), without reading the optimizer states."""
    src = resolve(src)
    source = ShardedSource(src)
    checkpoint = read_meta(src)
    flat = source.read([k for k in source.shapes if k.startswith(MODEL)])
    return checkpoint, single_file_parts(flat, checkpoint["async_pipeline"])["state_dict"]

def single_file_parts(flat: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a single-file checkpoint holds: ``state_dict`` (newest weights, aliases included) and the rest."""
    state = {k[len(MODEL):]: v for k, v in flat.items() if k.startswith(MODEL)}
    for alias, name in meta.get("aliases", {}).items():
        if name in state:
            state[alias] = state[name]
    rest = {k: v for k, v in flat.items() if not k.startswith(MODEL)}
    return {"state_dict": state, "async_pipeline": {**meta, "tensors": rest}}
