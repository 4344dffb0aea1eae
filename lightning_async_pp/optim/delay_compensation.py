"""``DelayCompensation``: DC-ASGD's first-order correction of a stale gradient, around any ``torch.optim.Optimizer``.

Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017 (public code:
MXNet's ``optimizer.DCASGD``). A gradient ``g`` taken at the stale weights ``W_b`` instead of the current ``W_k`` is
corrected by a Taylor step of the gradient, with the Hessian approximated by the outer product's diagonal
``g * g``:

    g~ = g + c * g * g * (W_k - W_b)

and the wrapped optimizer steps with ``g~`` (so with ``optim.Muon`` the correction enters before
orthogonalization, as in marin's delay experiments). Under 2BW, ``W_b = W_{k-1}``: the version rule of
docs/design/update-rule.md ('The update rule and the version rule') with ``delay=1``. ``ema=beta`` replaces ``g * g`` by its
exponential moving average ``s_k = beta s_{k-1} + (1 - beta) g_k * g_k`` (no bias correction), the smoother
variant marin tried; ``ema=None`` is the paper's rule.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from lightning.pytorch.cli import OptimizerCallable

from lightning_async_pp.optim.wrapper import OptimizerWrapper, check_coefficient, group_coefficient

#: Key, in ``state[p]``, of the weights the last ``delay`` steps started from, oldest first: ``W_{k-d} .. W_{k-1}``
#: stacked along a new first dimension (``W_j = W_0`` for ``j < 0``).
WEIGHT_HISTORY = "dc_weight_history"
#: Key of the moving average of ``g * g`` (only with ``ema``).
SQUARE_AVERAGE = "dc_square_average"


class DelayCompensation(OptimizerWrapper):
    """Wrap the optimizer that ``optimizer(params)`` builds so that it steps on ``g + c g g (W_k - W_b)``.

    Guarantees:

    - ``W_b = W_{max(k - delay, 0)}``: the weights ``delay`` steps of this optimizer ago (``delay=1``: 2BW's
      stale version). The wrapper keeps them itself (``delay`` parameter-sized buffers per parameter, stacked in
      ``state[p]["dc_weight_history"]``), recorded at the start of each step, so the difference is the one really
      applied, whatever else (e.g. an ``ErrorFeedback`` wrapped around this one) changed the weights after the
      wrapped step. On the first step ``W_b = W_0 = W_k``: no correction.
    - The wrapped optimizer steps once per :meth:`step` with ``p.grad`` replaced by the corrected gradient; the
      original ``p.grad`` is put back afterwards, so anything reading gradients after the step sees them unchanged.
    - ``c`` is per parameter group: the group's own ``coefficient`` key, else the constructor's. ``c = 0`` keeps no
      buffers and is the wrapped optimizer untouched. A parameter without a gradient in a step is not stepped, but
      its weight history still records that step's start (``W_b`` is the weights ``delay`` steps back, whichever
      steps it had gradients in); the moving average of ``g * g`` stays as it was.
    - The buffers live in the wrapped optimizer's per-parameter state, so checkpoints, device moves and
      ``shard_optimizer=True`` carry them like moments.
    - ``delay`` is the pipeline's; :attr:`step_delay`, when set, is the delay of the next step only (at most
      ``delay``): ``AsyncPipelineStrategy`` sets it before every update to the realized delay of the batch, so a
      synchronous step (``sync_steps``, ``sync_from_step``: 0) is not compensated and ``W_b = W_{k - step_delay}``.
      Unset (``None``, e.g. without the strategy), every step is taken as ``delay`` stale. Use ``delay=0`` (no
      correction, no buffers) for synchronous schedules.
    - After each step, :attr:`last_square_norms` maps every parameter it compensated (``c > 0``) to two 0-dim
      float64 tensors on its device, ``(||c s (W_k - W_b)||^2, ||g||^2)``: the squared norms of the compensation
      term and of the stale gradient, for ``StalenessMonitor``'s ``compensation_ratio`` (no parameter-sized buffer;
      not in ``state_dict``).
    """

    def __init__(self, params: Iterable[Any], optimizer: OptimizerCallable, coefficient: float = 1.0,
                 delay: int = 1, ema: Optional[float] = None) -> None:
        self.coefficient = check_coefficient(coefficient, "coefficient", "DelayCompensation")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"DelayCompensation delay must be an integer >= 0 (updates between the version a "
                             f"gradient was taken on and the current one; 2bw: 1), got {delay!r}")
        if ema is not None and (isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 <= ema < 1):
            raise ValueError(f"DelayCompensation ema must be None (the paper's g*g) or a decay in [0, 1), got {ema!r}")
        self.delay = delay
        self.ema = None if ema is None else float(ema)
        super().__init__(params, optimizer)  # checks every group's coefficient
        self.step_delay: Optional[int] = None  # the realized delay of the next step (set by the strategy)
        self.last_square_norms: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    def group_coefficient(self, group: dict[str, Any], index: Optional[int] = None) -> float:
        return group_coefficient(group, index, self.coefficient, "DelayCompensation")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Evaluate ``closure`` once, then step the wrapped optimizer on the compensated gradients."""
        loss = self.evaluate_closure(closure)
        originals = []  # (param, its own gradient) to put back after the wrapped step
        buffers = []  # (param, its new buffers): written after the wrapped step, which initializes an empty state itself
        self.last_square_norms = {}
        stale = self._stale_index()  # where W_b sits in the history this step (None: a synchronous step)
        for index, group in enumerate(self.param_groups):
            c = self.group_coefficient(group, index)
            for p in group["params"]:
                if p.grad is None:
                    self._record_without_gradient(p, c)
                    continue
                state = self.state[p]
                if c == 0 or self.delay == 0:
                    state.pop(WEIGHT_HISTORY, None)  # a group set to 0 mid-run keeps no buffers
                    state.pop(SQUARE_AVERAGE, None)
                    continue
                g, new = p.grad, {}
                square = g * g
                if self.ema is not None:
                    average = state.get(SQUARE_AVERAGE)
                    square = square.mul_(1 - self.ema) if average is None else average.mul_(self.ema).add_(square, alpha=1 - self.ema)
                    new[SQUARE_AVERAGE] = square
                history = state.get(WEIGHT_HISTORY)
                if history is None:  # W_{k-d} .. W_{k-1} are all W_0 = W_k: no correction yet
                    history = p.detach().unsqueeze(0).repeat(self.delay, *([1] * p.dim()))
                    corrected, term_sq = g, g.new_zeros((), dtype=torch.float64)
                elif stale is None:  # a synchronous step: W_b = W_k
                    corrected, term_sq = g, g.new_zeros((), dtype=torch.float64)
                else:
                    term = c * square * (p - history[stale])  # c s (W_k - W_b)
                    term_sq = _square_norm(term)
                    corrected = term.add_(g)
                self.last_square_norms[p] = (term_sq, _square_norm(g))
                new[WEIGHT_HISTORY] = torch.cat([history[1:], p.detach().unsqueeze(0)])  # W_{k-d+1} .. W_k
                buffers.append((p, new))
                originals.append((p, g))
                p.grad = corrected
        try:
            self.wrapped.step()
        finally:
            for p, g in originals:
                p.grad = g
        for p, new in buffers:
            self.state[p].update(new)
        return loss

    def _record_without_gradient(self, p: torch.Tensor, c: float) -> None:
        """A parameter without a gradient this step (an MoE expert no token chose, a frozen branch) is not stepped,
        but its history still moves on by one step, so that ``W_b`` stays the weights ``delay`` steps back: the
        weights it starts this step from are recorded (``W_k``). One that has no history yet (it has never had a
        gradient, so nothing here changed it) keeps none."""
        history = self.state[p].get(WEIGHT_HISTORY) if p in self.state else None
        if history is None or c == 0 or self.delay == 0:
            return
        self.state[p][WEIGHT_HISTORY] = torch.cat([history[1:], p.detach().unsqueeze(0)])

    def _stale_index(self) -> Optional[int]:
        """Where ``W_b`` sits in the history ``W_{k-d} .. W_{k-1}``: ``d - r`` for this step's delay ``r``; None
        for ``r = 0``."""
        r = self.delay if self.step_delay is None else min(self.step_delay, self.delay)
        return None if r == 0 else self.delay - r

    def rewrap(self, params: Iterable[Any], optimizer: OptimizerCallable) -> "DelayCompensation":
        return type(self)(params, optimizer=optimizer, coefficient=self.coefficient, delay=self.delay, ema=self.ema)

    def __repr__(self) -> str:
        ema = "" if self.ema is None else f", ema={self.ema}"
        return f"DelayCompensation(coefficient={self.coefficient}, delay={self.delay}{ema}, optimizer={self.wrapped!r})"


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64) ** 2
