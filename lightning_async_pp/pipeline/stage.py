"""``Stage``: one pipeline stage's layers, run on the weight version each batch is due."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from lightning_async_pp.pipeline.versions import WeightVersions


class StageLayers(nn.Module):
    """The layers of one stage, applied in order; each takes the previous output."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class Stage:
    """Runs ``layers`` forward on the weight version a batch is due (see :class:`WeightVersions`).

    Forward and backward of every microbatch of batch ``b`` read the same version; gradients accumulate in that
    version's autograd leaves and are taken once the batch is complete.
    """

    def __init__(self, layers: Sequence[nn.Module], index: int, num_stages: int, delay: int = 1, sync_steps: int = 0):
        self.index = index
        self.num_stages = num_stages
        self.layers = StageLayers(layers)
        named = list(self.layers.named_parameters())
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.versions = WeightVersions(self.params, delay=delay, sync_steps=sync_steps)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, batch_index: int, x: Any) -> Any:
        leaves = self.versions.leaves_for_batch(batch_index)
        return functional_call(self.layers, dict(zip(self.param_names, leaves)), (x,), tie_weights=False)

    def forward_newest(self, x: Any) -> Any:
        """Forward on the newest version (validation, test, predict)."""
        return self.layers(x)

    def take_gradients(self, batch_index: int) -> list[Tensor | None]:
        return self.versions.take_gradients(batch_index)
