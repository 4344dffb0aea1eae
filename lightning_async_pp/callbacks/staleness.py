"""``StalenessMonitor``: how stale the gradients of asynchronous pipeline training are, in the logger.

Notation (docs/design.md, "The update rule and the version rule"): ``W_k`` is the weights after ``k`` updates; batch ``k``'s gradient is taken at
``W_{k-d}`` (``d``: the realized delay, 1 under 2BW, 0 for the synchronous schedules, during ``sync_steps`` and from ``sync_from_step`` on,
the configured value under the delay variants) and the update is applied to ``W_k``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from lightning_async_pp.callbacks.figures import (
    StageFigures,
    log_to_loggers,
    logging_step_due,
    pipeline_strategy,
)
from lightning_async_pp.optim.delay_compensation import DelayCompensation
from lightning_async_pp.optim.error_feedback import PREV_UPDATE, ErrorFeedback
from lightning_async_pp.optim.pipemare import PipeMareLR
from lightning_async_pp.pipeline.microbatch import split_microbatches

_FIELDS = ("drift_sq", "weight_sq", "delay", "update_sq", "correction_sq", "compensation_sq", "stale_grad_sq")


class StalenessMonitor(Callback):
    """Log staleness figures under ``staleness/`` for every stage (``staleness/stage{s}/...``) and the whole model.

    At every logging step (Lightning's ``log_every_n_steps``), for batch ``k`` with realized delay ``d``:

    - ``drift``: ``||W_k - W_{k-d}|| / ||W_k||``, the relative distance between the version the batch's gradient
      is computed on and the version its update is applied to. Exactly 0 under synchronous schedules.
    - ``delay``: the realized delay ``d`` in updates (whole model: the largest over stages).
    - ``update_norm``: ``||u_k||``, the optimizer's update of this step. Under
      :class:`~lightning_async_pp.optim.ErrorFeedback` it is the wrapped optimizer's update ``u_k``, and
      ``correction_norm`` is ``c ||u_k - u_{k-1}||``, the norm of what the correction added
      (``(W_k - W_{k+1}) - u_k``). Without error feedback ``u_k = W_k - W_{k+1}`` and no correction is logged.
    - ``compensation_ratio`` (only under :class:`~lightning_async_pp.optim.DelayCompensation`, coefficient > 0,
      also inside ``ErrorFeedback``): ``||c s (W_k - W_b)|| / ||g||``, DC-ASGD's compensation term relative to the
      stale gradient it corrects, over the compensated parameters (0 at the first update).
    - ``lr_factor`` (whole model only, under :class:`~lightning_async_pp.optim.PipeMareLR`): the factor
      ``tau ** -(1 - min((k + 1) / T, 1))`` that multiplied update ``k``'s learning rate (1 once the warm-up is over,
      and always with ``delay <= 1``). With several ``PipeMareLR``, the smallest.

    Whole-model figures combine the stages' squared norms (``drift = sqrt(sum_s ||dW_s||^2 / sum_s ||W_s||^2)``),
    not their ratios.

    Probe (``probe_every=n``, off by default; every ``n``-th step, ``k = n-1, 2n-1, ...``, written at that step
    whatever ``log_every_n_steps`` is): on the first microbatch of batch ``k`` it takes the stale gradient (at
    ``W_{k-d}``) and a fresh one (at ``W_k``) and logs

    - ``grad_cosine`` (whole model and per stage): their cosine similarity; 1 means the stale gradient points
      where a fresh one would;
    - ``loss_delta``: ``f(W_{k-d}) - f(W_k)`` on that microbatch (positive: the newer weights fit it better).

    Cost of the probe: two forward+backward passes on one microbatch per probe step (about ``2 / m`` of a step's
    compute with ``m`` microbatches): the pipeline keeps only the batch's summed gradient, so the stale
    microbatch gradient is recomputed next to the fresh one. The probe never changes training: it reads the held
    versions through ``torch.func.functional_call`` with its own autograd leaves (parameters and ``.grad`` are
    not touched), gives the layers copies of their buffers (batch-norm statistics stay as they were), and
    restores the random-number state, so dropout masks in training stay the same. It needs the whole model in
    one process: with several processes it is refused at setup (the stages of other processes are not here).

    Cost of the figures: per logging step, a few norms over the parameters (one temporary of one tensor's size
    at a time). With ``d = 0`` only one version exists, so ``W_k`` is copied before the update on logging steps
    (one parameter-sized copy, freed at the end of the step). Across processes the figures are reduced with
    torchmetrics (an ``all_gather`` on every rank) only at logging steps.

    Args:
        probe_every: run the probe every this many steps (``None``: never).
        per_stage: also log the per-stage figures (``staleness/stage{s}/...``).
    """

    def __init__(self, probe_every: Optional[int] = None, per_stage: bool = True) -> None:
        if probe_every is not None and (isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1):
            raise ValueError(f"probe_every must be a positive integer or None, got {probe_every!r}")
        self.probe_every = probe_every
        self.per_stage = per_stage
        self.metrics: dict[str, float] = {}  # the figures of the last logging step (and probe), as logged
        self._figures: Optional[StageFigures] = None
        self._due = False
        self._batch = -1
        self._pending: dict[int, dict[str, float]] = {}
        self._snapshots: dict[int, list[Tensor]] = {}

    # ---- setup ------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = pipeline_strategy(trainer, type(self).__name__)
        if not trainer.loggers:
            raise MisconfigurationException(f"Cannot use {type(self).__name__} with a Trainer that has no logger")
        if self.probe_every is not None and strategy.is_multiprocess:
            raise ValueError(
                f"{type(self).__name__}(probe_every={self.probe_every}) needs the whole model in one process: the "
                f"probe runs the model forward and backward at two weight versions, and with "
                f"{strategy.world_size_total} processes each holds only its own stage. Run the probe with devices=1 "
                f"(all stages in one process) or drop probe_every; the other staleness figures work across processes"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = pipeline_strategy(trainer, type(self).__name__)
        self._figures = StageFigures(strategy.num_stages, _FIELDS).to(strategy.root_device)

    # ---- per batch ----------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        stats = trainer.strategy.engine.stats
        k = stats.batch_index  # params hold W_k; W_{k-d} is held too
        self._batch = k
        self._due = logging_step_due(trainer)
        self._pending.clear()
        self._snapshots.clear()
        if self._due:
            for stage in stats.stages:
                stale = stage.version_for_batch(k)
                self._pending[stage.index] = {
                    "drift_sq": _sq_distance(stage.version(k), stage.version(stale)),
                    "weight_sq": _sq_norm(stage.version(k)),
                    "delay": float(k - stale),
                }
        if self.probe_every is not None and (k + 1) % self.probe_every == 0:
            figures = self._probe(trainer.strategy.engine, batch, k)
            self.metrics.update(figures)
            log_to_loggers(trainer, figures)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # The strategy has already moved the parameters onto the slot of W_{k+1}, holding a copy of W_k that the
        # optimizer is about to overwrite. With delay 0 no other copy of W_k survives the update, nor with weight
        # prediction (the older slots hold predictions): keep one.
        if not self._due:
            return
        for stage in trainer.strategy.engine.stats.stages:
            if stage.delay == 0 or stage.predicts:
                self._snapshots[stage.index] = [p.detach().clone() for p in stage.params]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._due:
            return
        self._due = False
        k = self._batch
        corrected = _error_feedback_states(trainer.optimizers)
        compensated = _compensation_norms(trainer.optimizers)
        assert self._figures is not None
        for stage in trainer.strategy.engine.stats.stages:
            before = self._snapshots.pop(stage.index, None)
            if before is None:
                before = stage.version(k)  # W_k, held when the delay is >= 1
            update_sq, correction_sq = [], []  # accumulated on the device: one host sync per stage
            compensation_sq, stale_grad_sq = [], []
            for p, w_k in zip(stage.params, before):
                change = _wide(w_k) - _wide(p.detach())  # W_k - W_{k+1}, one tensor at a time
                state = corrected.get(p)
                if state is not None and PREV_UPDATE in state:
                    u = _wide(state[PREV_UPDATE])  # u_k
                    update_sq.append(_sq(u))
                    correction_sq.append(_sq(change - u))  # c (u_k - u_{k-1}) = (W_k - W_{k+1}) - u_k
                else:
                    update_sq.append(_sq(change))
                norms = compensated.get(p)
                if norms is not None:
                    compensation_sq.append(norms[0])
                    stale_grad_sq.append(norms[1])
            figures = dict(self._pending.get(stage.index, {}), update_sq=_total(update_sq),
                           correction_sq=_total(correction_sq), compensation_sq=_total(compensation_sq),
                           stale_grad_sq=_total(stale_grad_sq))
            self._figures.update(stage.index, figures)
        table = self._figures.reduce()  # across processes: every rank calls this at the same step
        metrics = self._metrics(table, has_correction=bool(corrected), has_compensation=bool(compensated))
        factors = [s.factor(k) for s in _pipemare_schedulers(trainer)]
        if factors:
            metrics["staleness/lr_factor"] = min(factors)
        self.metrics.update(metrics)
        log_to_loggers(trainer, metrics)

    # ---- figures --------------------------------------------------------------------------------------------
    def _metrics(self, table: dict[int, dict[str, float]], has_correction: bool,
                 has_compensation: bool = False) -> dict[str, float]:
        out: dict[str, float] = {}
        names = (["drift", "delay", "update_norm"] + (["correction_norm"] if has_correction else [])
                 + (["compensation_ratio"] if has_compensation else []))
        if self.per_stage:
            for s, row in sorted(table.items()):
                values = _norm_figures(row["drift_sq"], row["weight_sq"], row["delay"], row["update_sq"],
                                       row["correction_sq"], row["compensation_sq"], row["stale_grad_sq"])
                out.update({f"staleness/stage{s}/{n}": values[n] for n in names})
        total = {f: sum(row[f] for row in table.values()) for f in _FIELDS if f != "delay"}
        values = _norm_figures(total["drift_sq"], total["weight_sq"], max(row["delay"] for row in table.values()),
                               total["update_sq"], total["correction_sq"], total["compensation_sq"],
                               total["stale_grad_sq"])
        out.update({f"staleness/{n}": values[n] for n in names})
        return out

    # ---- the probe ------------------------------------------------------------------------------------------
    def _probe(self, engine: Any, batch: Any, k: int) -> dict[str, float]:
        stages = engine.stats.stages
        microbatch = split_microbatches(batch, engine.stats.num_microbatches)[0]
        fresh = [stage.version(k) for stage in stages]
        stale = [stage.version(stage.version_for_batch(k)) for stage in stages]
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):  # restores the RNG state on exit
            state = _rng_state(cuda)
            fresh_loss, fresh_grads = engine.loss_and_gradients(fresh, microbatch)
            _set_rng_state(cuda, state)  # the same dropout masks for both passes
            stale_loss, stale_grads = engine.loss_and_gradients(stale, microbatch)
        out: dict[str, float] = {}
        dots, fresh_sq, stale_sq = [], [], []
        for stage, g_fresh, g_stale in zip(stages, fresh_grads, stale_grads):
            pairs = [(a, b) for a, b in zip(g_fresh, g_stale) if a is not None and b is not None]
            dot = sum(torch.sum(a.double() * b.double()) for a, b in pairs)
            na = _sq_norm([a for a, _ in pairs])
            nb = _sq_norm([b for _, b in pairs])
            dots.append(float(dot)), fresh_sq.append(na), stale_sq.append(nb)
            if self.per_stage:
                out[f"staleness/stage{stage.index}/grad_cosine"] = _cosine(float(dot), na, nb)
        out["staleness/grad_cosine"] = _cosine(sum(dots), sum(fresh_sq), sum(stale_sq))
        out["staleness/loss_delta"] = float(stale_loss) - float(fresh_loss)
        return out


def _rng_state(cuda: list[int]) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda]


def _set_rng_state(cuda: list[int], state: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(cuda, state[1]):
        torch.cuda.set_rng_state(s, d)


def _error_feedback_states(optimizers: Sequence[Any]) -> dict[Any, dict]:
    """``{parameter: its optimizer state}`` for parameters in ErrorFeedback groups with a non-zero coefficient."""
    states: dict[Any, dict] = {}
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the real one
        if isinstance(opt, ErrorFeedback):
            for group in opt.param_groups:
                if opt.group_coefficient(group) == 0:
                    continue
                for p in group["params"]:
                    state = opt.state.get(p)  # .get: do not add empty entries to the optimizer's state
                    if state is not None:
                        states[p] = state
    return states


def _compensation_norms(optimizers: Sequence[Any]) -> dict[Any, tuple[Tensor, Tensor]]:
    """``{parameter: (||compensation||^2, ||stale gradient||^2)}`` of the last step of every DelayCompensation,
    also one wrapped by another correction (``ErrorFeedback(optimizer=DelayCompensation...)``)."""
    norms: dict[Any, tuple[Tensor, Tensor]] = {}
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the real one
        while opt is not None:
            if isinstance(opt, DelayCompensation):
                norms.update(opt.last_square_norms)
            opt = getattr(opt, "wrapped", None)
    return norms


def _pipemare_schedulers(trainer: Trainer) -> list[PipeMareLR]:
    return [c.scheduler for c in trainer.lr_scheduler_configs if isinstance(c.scheduler, PipeMareLR)]


def _wide(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _sq(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(_wide(t.detach()), dtype=torch.float64) ** 2


def _total(squares: Sequence[Tensor]) -> float:
    return float(torch.stack(list(squares)).sum()) if squares else 0.0


def _sq_norm(tensors: Sequence[Tensor]) -> float:
    return _total([_sq(t) for t in tensors])


def _sq_distance(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    # The same version (the same tensors) is exactly zero apart: no arithmetic, no rounding.
    return _total([_sq(_wide(x) - _wide(y)) for x, y in zip(a, b) if x is not y])


def _cosine(dot: float, a_sq: float, b_sq: float) -> float:
    if a_sq == 0.0 or b_sq == 0.0:
        return float("nan")
    return dot / math.sqrt(a_sq * b_sq)


def _norm_figures(drift_sq: float, weight_sq: float, delay: float, update_sq: float, correction_sq: float,
                  compensation_sq: float = 0.0, stale_grad_sq: float = 0.0) -> dict:
    return {
        "compensation_ratio": math.sqrt(compensation_sq / stale_grad_sq) if stale_grad_sq > 0 else 0.0,
        "drift": math.sqrt(drift_sq / weight_sq) if weight_sq > 0 else 0.0,
        "delay": delay,
        "update_norm": math.sqrt(update_sq),
        "correction_norm": math.sqrt(correction_sq),
    }
