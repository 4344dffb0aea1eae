"""Models whose module tree exists from ``__init__``, its parameters on the meta device, and gets memory in
``configure_model``.

Lightning runs the callbacks' ``setup`` before ``configure_model``: a fine-tuning callback
(``BaseFinetuning.freeze_before_training``) that freezes ``model.model.embed_tokens`` there finds nothing if the
layers are built in ``configure_model``. The package's models (``Llama``, ``HuggingFaceCausalLM``, ``LitGPT``)
therefore build their whole tree in ``__init__`` with parameters on the meta device (no memory; buffers real, as
under the strategy's ``configure_model``), and ``configure_model`` gives the parameters exactly what a module built
there would get: memory on the device the calling context gives new parameters, in the default dtype of then (a
parameter built in ``__init__``'s default dtype follows it; others keep theirs). Under ``AsyncPipelineStrategy``
that context puts new parameters on the meta device, so they stay there and the engine materializes only this
process's stage. Each parameter keeps its ``requires_grad`` (a layer frozen in ``setup`` stays frozen) and stays
the same object (ties hold).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_async_pp.parallel.placement import parameters_on_meta, replace_meta_tensors

T = TypeVar("T")


def new_parameter_device() -> torch.device:
    """Where a parameter created now would live: the ``torch.device`` context's device (Lightning's
    ``tensor_init_context``), ``meta`` under the strategy's ``configure_model`` (or ``torch.device("meta")``)."""
    probe = nn.Module()
    probe.register_parameter("p", nn.Parameter(torch.empty(0)))
    return probe.p.device


class BuiltInInit:
    """Mixin of a ``LightningModule``: :meth:`_build_on_meta` in ``__init__``, :meth:`_materialize` in
    ``configure_model``; ``load_state_dict`` before ``configure_model`` raises (it would copy into meta tensors,
    that is copy nothing). Subclasses say when they are configured (:meth:`_is_configured`)."""

    _built_dtype: torch.dtype = torch.float32

    def _is_configured(self) -> bool:
        raise NotImplementedError

    def _build_on_meta(self, build: Callable[[], T]) -> T:
        self._built_dtype = torch.get_default_dtype()
        with parameters_on_meta():
            return build()

    def _build_on_meta_keeping_vectors(self, build: Callable[[], T]) -> tuple[T, dict[str, torch.Tensor]]:
        """:meth:`_build_on_meta`, and the value each parameter of at most one dimension (norm gains, biases,
        scalars: small) had when its constructor registered it, by its names in this module: an upstream init
        rule may leave the constructor's value (``torch.ones``) to a norm, which a build on the meta device loses."""
        kept: dict[int, torch.Tensor] = {}
        on_meta: Callable[..., None]  # parameters_on_meta's register_parameter, set inside it

        def register_keeping(module: nn.Module, name: str, param: Any) -> None:
            value = param.detach().clone() if param is not None and not param.is_meta and param.dim() <= 1 else None
            on_meta(module, name, param)
            if value is not None:
                kept[id(module._parameters[name])] = value

        self._built_dtype = torch.get_default_dtype()
        with parameters_on_meta():
            on_meta = nn.Module.register_parameter
            nn.Module.register_parameter = register_keeping  # type: ignore[method-assign]
            try:
                built = build()
            finally:
                nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        assert isinstance(self, nn.Module)
        values = {name: kept[id(p)] for name, p in self.named_parameters(remove_duplicate=False) if id(p) in kept}
        return built, values

    def _materialize(self) -> None:
        """Give the meta parameters (and buffers) memory where the calling context creates parameters; nothing
        under a context that creates them on the meta device."""
        device = new_parameter_device()
        if device.type == "meta":
            return
        default, built = torch.get_default_dtype(), self._built_dtype

        def make(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=default if t.dtype == built else t.dtype, device=device)

        assert isinstance(self, nn.Module)
        replace_meta_tensors(self, make)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if not self._is_configured():
            raise RuntimeError(
                f"{type(self).__name__}.load_state_dict() before configure_model(): its parameters are on the meta "
                f"device until configure_model() gives them memory, so nothing would be copied. Call "
                f"model.configure_model() first (the Trainer and load_from_checkpoint call it)")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
