"""``WeightPrediction``: delayed batches run on a prediction of the weights their gradient will be applied to.

Under a delay ``d`` the gradient of batch ``k`` is taken on ``W_{k-d}`` and applied to ``W_k``. Weight prediction
takes it instead on an extrapolation of ``W_{k-d}`` along the last update, the newest one known when the batch
starts:

    W_hat = W_v + s * d * (W_v - W_{v-1}),      v = k - d,

so with updates that repeat, ``s = 1`` predicts ``W_k`` exactly. This is the rule of marin's Muon corrector
(``w + tau * s * u_last``) and, with the optimizer's whole last update in place of a smoothed gradient times the
learning rate, of SpecTrain (Chen et al., "Efficient and Robust Parallel DNN Training through Model Parallelism on
Multi-GPU Platform", 2018) and PipeOptim (Guan et al., 2023), which predict ``W_k`` from ``W_v`` with the update the
optimizer would take. The first update has nothing to extrapolate: ``W_hat = W_0``. The papers' own equations were
not re-derived here; the rule implemented (and tested against a written-out recurrence) is the formula above.

The prediction is the pipeline engine's work (the versions a stage holds, see docs/design/update-rule.md, 'Weight prediction'):
this wrapper only says which parameters are predicted and with which scale. It steps the wrapped optimizer
unchanged, so it composes with ``ErrorFeedback`` either way round, with ``PipeMareLR`` and with any base optimizer
(``AsyncNesterov``, ``optim.Muon``). ``DelayCompensation`` is refused with it: that rule compensates against the
version it records, which prediction replaces.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from lightning.pytorch.cli import OptimizerCallable

from lightning_async_pp.optim.wrapper import OptimizerWrapper, check_coefficient

#: A parameter group's own scale (else the constructor's ``scale``).
GROUP_SCALE = "prediction_scale"


class WeightPrediction(OptimizerWrapper):
    """Mark the parameters of ``optimizer(params)`` for weight prediction with scale ``s``; step it unchanged.

    Guarantees (with ``AsyncPipelineStrategy``, which reads the scales once, at setup):

    - A batch whose gradient is ``d >= 1`` updates stale runs its forward and backward on
      ``W_v + s d (W_v - W_{v-1})`` instead of ``W_v``; ``W_v - W_{v-1}`` is the whole last update (whatever
      produced it: the wrapped optimizer, an ``ErrorFeedback`` around or inside this one, clipping). Synchronous
      batches (``sync_steps``, ``sync_from_step``) run on the true weights. Evaluation reads the true newest weights.
    - ``s`` per parameter group: the group's own ``prediction_scale`` key, else the constructor's ``scale``.
      ``s = 0`` is plain weight stashing for that group.
    - Memory: the stage keeps the true newest weights besides its ``d + 1`` version slots, which hold the
      predictions: one parameter-sized tensor per parameter more than weight stashing (2BW: three instead of two).
      Nothing is added to the optimizer state.
    - Refused before training: a synchronous pipeline (no stage with a delay; nothing to predict) and
      ``DelayCompensation`` in the same chain.
    """

    def __init__(self, params: Iterable[Any], optimizer: OptimizerCallable, scale: float = 1.0) -> None:
        self.scale = check_coefficient(scale, "scale", "WeightPrediction", "0 means no prediction")
        super().__init__(params, optimizer)  # checks every group's scale

    def group_coefficient(self, group: dict[str, Any], index: Optional[int] = None) -> float:
        """The prediction scale ``s`` of one parameter group."""
        if GROUP_SCALE in group:
            where = "parameter group" + (f" {index}" if index is not None else "")
            return check_coefficient(group[GROUP_SCALE], f"{GROUP_SCALE} of {where}", "WeightPrediction",
                                     "0 means no prediction")
        return self.scale

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Evaluate ``closure`` once, then step the wrapped optimizer (the prediction is the engine's)."""
        loss = self.evaluate_closure(closure)
        self.wrapped.step()
        return loss

    def rewrap(self, params: Iterable[Any], optimizer: OptimizerCallable) -> "WeightPrediction":
        return type(self)(params, optimizer=optimizer, scale=self.scale)

    def __repr__(self) -> str:
        return f"WeightPrediction(scale={self.scale}, optimizer={self.wrapped!r})"


def prediction_scales(optimizers: Iterable[Any]) -> dict[int, float]:
    """``id(parameter) -> s`` for every parameter in a ``WeightPrediction`` group with ``s > 0``, looking through
    every wrapper of each optimizer's chain (``ErrorFeedback(WeightPrediction(...))`` and the other way round)."""
    scales: dict[int, float] = {}
    for optimizer in optimizers:
        while optimizer is not None:
            if isinstance(optimizer, WeightPrediction):
                for index, group in enumerate(optimizer.param_groups):
                    s = optimizer.group_coefficient(group, index)
                    if s > 0:
                        scales.update({id(p): s for p in group["params"]})
            optimizer = getattr(optimizer, "wrapped", None)
    return scales
