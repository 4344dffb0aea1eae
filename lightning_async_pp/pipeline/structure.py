"""What crosses a stage boundary: any nesting of tuples, lists and dicts of tensors (and ``None``).

A value is flattened into its tensor leaves and a *spec* (plain JSON-able data describing the nesting), so the
same rules hold on one device (an in-process hand-over) and across processes (the spec travels once in a
header, the tensors as themselves). See docs/design/runtime.md, "What crosses a stage boundary".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# The dtypes a leaf may have on the wire, by index.
DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]

Spec = Any  # "T" (a tensor leaf), None, ["tuple"|"list", [specs]] or ["dict", [[key, spec], ...]]


# The walks are module-level functions, not nested closures: a recursive closure refers to itself through its cell,
# a reference cycle that would keep the leaves (activations, and through their graphs the gradients) alive until
# the garbage collector happens to run.
def flatten(value: Any, where: str = "a stage's output") -> tuple[list[Tensor], Spec]:
    """The tensor leaves of ``value`` in order, and the spec that rebuilds it; anything else is refused."""
    leaves: list[Tensor] = []
    return leaves, _flatten(value, "", where, leaves)


def _flatten(v: Any, path: str, where: str, leaves: list[Tensor]) -> Spec:
    if isinstance(v, Tensor):
        leaves.append(v)
        return "T"
    if v is None:
        return None
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return ["tuple", [_flatten(x, f"{path}[{i}]", where, leaves) for i, x in enumerate(v)]]
    if isinstance(v, list):
        return ["list", [_flatten(x, f"{path}[{i}]", where, leaves) for i, x in enumerate(v)]]
    if isinstance(v, dict):
        for key in v:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{where}{path} has a dict key {key!r}; only str and int keys can cross a stage boundary")
        return ["dict", [[key, _flatten(x, f"{path}[{key!r}]", where, leaves)] for key, x in v.items()]]
    raise TypeError(
        f"{where}{path} is a {type(v).__name__}; what crosses a pipeline stage boundary must be a tensor, None, "
        f"or tuples, lists and dicts of them"
    )


def unflatten(leaves: list[Tensor], spec: Spec) -> Any:
    return _unflatten(spec, iter(leaves))


def _unflatten(s: Spec, it: Any) -> Any:
    if s == "T":
        return next(it)
    if s is None:
        return None
    kind, items = s
    if kind == "dict":
        return {key: _unflatten(sub, it) for key, sub in items}
    built = [_unflatten(sub, it) for sub in items]
    return tuple(built) if kind == "tuple" else built


def carries_grad(t: Tensor) -> bool:
    """Whether a gradient flows back for this leaf across a boundary: floating and requiring grad."""
    return t.requires_grad and t.dtype.is_floating_point


def as_received(leaves: list[Tensor]) -> list[Tensor]:
    """A sender's output leaves as the receiving stage's inputs: new autograd leaves where a gradient flows back."""
    return [t.detach().requires_grad_(carries_grad(t)) for t in leaves]


def input_gradient(t: Tensor) -> Tensor:
    """What goes back for a received leaf that carries a gradient (zeros when its stage did not use it)."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


@dataclass(frozen=True)
class LeafMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def needs_grad(self) -> bool:
        """A gradient flows back for this leaf."""
        return self.requires_grad and self.dtype.is_floating_point

    @classmethod
    def of(cls, t: Tensor, with_grad: bool = True) -> "LeafMeta":
        if t.dtype not in DTYPES:
            raise TypeError(f"a tensor of dtype {t.dtype} cannot cross a stage boundary; use one of {DTYPES}")
        return cls(tuple(t.shape), t.dtype, bool(with_grad and t.requires_grad))


@dataclass(frozen=True)
class Layout:
    """The spec and the leaves' metas: everything a receiver needs to allocate buffers and rebuild a value."""

    spec: Spec
    metas: tuple[LeafMeta, ...]

    @classmethod
    def of(cls, leaves: list[Tensor], spec: Spec, with_grad: bool = True) -> "Layout":
        return cls(spec, tuple(LeafMeta.of(t, with_grad) for t in leaves))

    def describe(self) -> str:
        return f"{[m.shape for m in self.metas]}"

    def same_shapes(self, other: "Layout") -> bool:
        return self.spec == other.spec and [(m.shape, m.dtype) for m in self.metas] == [(m.shape, m.dtype) for m in other.metas]

    def encode(self) -> Tensor:
        """As a uint8 tensor (JSON), to send in a header."""
        payload = {"spec": self.spec, "leaves": [[DTYPES.index(m.dtype), int(m.requires_grad), list(m.shape)] for m in self.metas]}
        return torch.tensor(list(json.dumps(payload).encode()), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: Tensor) -> "Layout":
        payload = json.loads(bytes(data.cpu().tolist()).decode())
        metas = tuple(LeafMeta(tuple(shape), DTYPES[d], bool(g)) for d, g, shape in payload["leaves"])
        return cls(_tuples_to_lists(payload["spec"]), metas)


def _tuples_to_lists(spec: Spec) -> Spec:
    # JSON gives lists for both; specs are compared after a round trip, so keep them as lists throughout.
    if isinstance(spec, (list, tuple)):
        return [_tuples_to_lists(s) for s in spec]
    return spec


def normalize(spec: Spec) -> Spec:
    """The spec as it looks after a JSON round trip (dict keys that are ints stay ints inside the item lists)."""
    return _tuples_to_lists(spec)
