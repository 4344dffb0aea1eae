"""Pretrained weights for the adapters, read layer by layer.

A :class:`PretrainedTensors` is a weights file opened lazily: ``read(key)`` loads one tensor. The adapters build
their model as usual (under the strategy, layers on the ``meta`` device) and, in ``init_layer``, copy the file's
tensors into the layer just initialized, so each process reads only the tensors of the layers it runs (see
docs/design/adapters.md, 'Starting from pretrained weights').

- :class:`SafetensorsFolder`: a Hugging Face ``save_pretrained`` folder (``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``), read through safetensors' ``safe_open`` (memory-mapped, one tensor at a time).
- :class:`TorchFile`: a ``torch.save`` state dict (litgpt's ``lit_model.pth``), opened with ``torch.load(mmap=True)``
  so only the tensors read are paged in.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class PretrainedTensors:
    """A weights file read one tensor at a time; ``keys_read`` lists what was read (each process: its stage's)."""

    path: str
    keys_read: set[str]

    def keys(self) -> set[str]:
        raise NotImplementedError

    def read(self, key: str) -> Tensor:
        raise NotImplementedError


class SafetensorsFolder(PretrainedTensors):
    """The safetensors weights of a ``save_pretrained`` folder, single file or sharded."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = os.fspath(folder)
        index = os.path.join(self.path, SAFETENSORS_INDEX)
        single = os.path.join(self.path, SAFETENSORS_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {key: os.path.join(self.path, name) for key, name in weight_map.items()}
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.file_of = {key: single for key in f.keys()}
        else:
            found = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else "not a folder"
            raise FileNotFoundError(
                f"no safetensors weights in {self.path!r} (looked for {SAFETENSORS_FILE} and {SAFETENSORS_INDEX}; found "
                f"{found}). Give a folder written by save_pretrained(..., safe_serialization=True)"
            )
        self._open: dict[str, Any] = {}
        self.keys_read = set()

    def keys(self) -> set[str]:
        return set(self.file_of)

    def __getstate__(self) -> dict[str, Any]:  # a copied or pickled module reopens the files when it reads
        return {**self.__dict__, "_open": {}}

    def read(self, key: str) -> Tensor:
        from safetensors import safe_open

        file = self.file_of[key]
        self.keys_read.add(key)
        if file not in self._open:  # each shard opened once, and only if one of its tensors is needed
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file].get_tensor(key)


class TorchFile(PretrainedTensors):
    """A state dict saved with ``torch.save`` (litgpt's ``lit_model.pth``; a ``{"model": state_dict}`` wrapper, as
    litgpt's training scripts save, is unwrapped), memory-mapped."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no weights file {self.path!r}")
        self._state: Optional[Mapping[str, Tensor]] = None
        self.keys_read = set()

    @property
    def state(self) -> Mapping[str, Tensor]:
        if self._state is None:
            state = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
            if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
                state = state["model"]
            self._state = state
        return self._state

    def keys(self) -> set[str]:
        return set(self.state)

    def read(self, key: str) -> Tensor:
        self.keys_read.add(key)
        return self.state[key]

    def __getstate__(self) -> dict[str, Any]:  # a copied or pickled module maps the file again when it reads
        return {**self.__dict__, "_state": None}


def tensor_aliases(root: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter and buffer of ``root``, keyed by each of its names: a tied head's weight is also
    known by the embedding's name, which is the one a file with tied weights holds."""
    names: dict[int, list[str]] = {}
    for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return {name: group for group in names.values() for name in group}


@torch.no_grad()
def load_layer(layer: nn.Module, path: str, source: PretrainedTensors, aliases: Mapping[str, Sequence[str]],
               file_keys: Optional[set[str]] = None) -> None:
    """Copy into ``layer`` (at dotted ``path`` in its model) the file's value of each of its persistent tensors.

    A tensor is looked up under its own name, then under the other names it has in the model (a tie). A tensor the
    file holds under none of them is an error, tied or not (a model partly random would train silently wrong).
    Values are copied (cast to the layer's dtype); shapes must match."""
    keys = source.keys() if file_keys is None else file_keys
    prefix = f"{path}." if path else ""
    for local, tensor in layer.state_dict(keep_vars=True).items():
        name = prefix + local
        candidates = [name, *(n for n in aliases.get(name, ()) if n != name)]
        key = next((k for k in candidates if k in keys), None)
        if key is None:  # the candidates are every name of the tensor: no other layer would load it either
            raise KeyError(f"the pretrained weights {source.path!r} hold no {name!r} (nor any other name of that tensor); "
                           f"is this the model they were saved from? The file holds e.g. {sorted(keys)[:4]}")
        value = source.read(key)
        if value.shape != tensor.shape:
            raise ValueError(f"the pretrained weights {source.path!r} hold {key!r} of shape {tuple(value.shape)}, the model's "
                             f"{name!r} has shape {tuple(tensor.shape)}: the config does not match the weights")
        tensor.copy_(value)


def unused_keys(source: PretrainedTensors, aliases: Mapping[str, Sequence[str]]) -> list[str]:
    """The file's tensors that no name of the model takes (checked before any layer is built)."""
    return sorted(k for k in source.keys() if k not in aliases)
