"""``StalenessMonitor``: how stale the gradients of asynchronous pipeline training are, in the logger.

Notation (docs/design/update-rule.md, "The update rule and the version rule"): ``W_k`` is the weights after ``k`` updates; batch ``k``'s gradient is taken at
``W_{k-d}`` (``d``: the realized delay, 1 under 2BW, 0 for the synchronous schedules, during ``sync_steps`` and from ``sync_from_step`` on,
the configured value under the delay variants) and the update is applied to ``W_k``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_async_pp.callbacks.figures import (
    StageFigures,
    log_to_loggers,
    logged_pipeline_strategy,
    logging_step_due,
    pipeline_strategy,
)
from lightning_async_pp.optim.async_nesterov import AsyncNesterov
from lightning_async_pp.optim.delay_compensation import DelayCompensation
from lightning_async_pp.optim.error_feedback import PREV_UPDATE, ErrorFeedback
from lightning_async_pp.optim.pipemare import PipeMareLR
from lightning_async_pp.optim.weight_prediction import WeightPrediction, prediction_scales
from lightning_async_pp.parallel.tensor_parallel import local_tensor, whole_value
from lightning_async_pp.pipeline.microbatch import split_microbatches

# Squared norms: each process adds its part (its shards, each parameter counted once: StageView.counted; its experts
# times e: StageView.scales), summed over a stage's tensor-parallel ranks and averaged over its data-parallel replicas;
# the delay is the largest reported.
_FIELDS = ("drift_sq", "weight_sq", "update_sq", "correction_sq", "compensation_sq", "stale_grad_sq")
# Per parameter group (``staleness/<group>/<metric>``): the squared norms summed per stage (reduced like the stage
# figures, square root taken after the sum over stages), and the figures that are not sums (largest reported).
_GROUP_SUMS = {"correction_norm": ("correction_sq",), "compensation_ratio": ("compensation_sq", "stale_grad_sq"),
               "prediction_norm": ("prediction_sq",)}
_GROUP_MAXIMA = {"nesterov_momentum": ("nesterov_momentum",)}


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

    Every figure is of whole tensors, each element counted once, so any layout logs one device's figures: a weight
    tied across stages (an embedding and its head) counts on the stage that owns it (the first, as on one device);
    under tensor parallelism each of a stage's ranks adds the squares of its own shards and a parameter every rank
    holds whole counts once (the engine's ``StageView.counted``), and the stage's figures are summed over its ranks;
    under expert parallelism (``expert_parallel_size=e``) a rank adds its own experts' squares times ``e``
    (``StageView.scales``): the replicas holding an expert are ``1 / e`` of the stage's, so the figures' mean over
    the replicas counts every expert once.

    Per parameter group (``per_group=True``), under ``staleness/opt{i}/<group>/<metric>``: ``<group>`` is the
    group's ``name`` key if it has one (as Lightning's ``LearningRateMonitor`` names groups), else ``group{j}``;
    ``i`` counts the optimizers of ``configure_optimizers`` and ``j`` the optimizer's ``param_groups``, from 0.
    For every group with a correction at the start of training (the set of tags is fixed then), over the group's
    parameters in all stages:

    - ``correction_norm``: as above, in ``ErrorFeedback`` groups with a coefficient > 0;
    - ``compensation_ratio``: as above, in ``DelayCompensation`` groups with a coefficient > 0 (and ``delay`` > 0);
    - ``lr_factor``: ``PipeMareLR``'s factor for update ``k`` (the same for all groups of one optimizer);
    - ``prediction_norm`` (under :class:`~lightning_async_pp.optim.WeightPrediction`, scale ``s > 0``):
      ``s d ||W_{k+1} - W_k||``, how far the prediction the next delayed batch runs on lies beyond ``W_{k+1}``
      (``d`` each stage's delay);
    - ``nesterov_momentum`` (under :class:`~lightning_async_pp.optim.AsyncNesterov`, also inside a correction):
      NAdam's ``mu_{t+1} = beta1 (1 - 0.5 * 0.96 ** ((t + 1) psi))``, the weight of the momentum look-ahead in
      update ``k``, with the group's ``beta1`` and ``momentum_decay`` ``psi`` and ``t`` its step count after the
      update.

    Groups sharing a ``name`` are reported together. Across processes the per-group squared norms travel in the
    same reduction as the stage figures (a group's norm is the square root of the sum over stages); the set of
    groups is agreed once at the start of training (one ``all_gather_object``), leaving out, with a warning, a
    ``group{j}`` whose settings differ between processes (each stage's optimizer is built over its own parameters).

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
        per_group: also log each correction per parameter group (``staleness/opt{i}/<group>/...``).
    """

    def __init__(self, probe_every: Optional[int] = None, per_stage: bool = True, per_group: bool = True) -> None:
        if probe_every is not None and (isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1):
            raise ValueError(f"probe_every must be a positive integer or None, got {probe_every!r}")
        self.probe_every = probe_every
        self.per_stage = per_stage
        self.per_group = per_group
        self._group_metrics: dict[str, tuple[str, ...]] = {}  # group label -> its metrics, fixed at the start
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
        strategy = logged_pipeline_strategy(trainer, type(self).__name__)
        if self.probe_every is not None and strategy.is_multiprocess:
            raise ValueError(
                f"{type(self).__name__}(probe_every={self.probe_every}) needs the whole model in one process: the "
                f"probe runs the model forward and backward at two weight versions, and with "
                f"{strategy.world_size_total} processes each holds only its own stage. Run the probe with devices=1 "
                f"(all stages in one process) or drop probe_every; the other staleness figures work across processes"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = pipeline_strategy(trainer, type(self).__name__)
        self._group_metrics = {}
        if self.per_group:
            layout = _group_corrections(trainer.optimizers, trainer.lr_scheduler_configs)
            if strategy.is_multiprocess and dist.is_initialized():
                # Every rank must reduce the same table, and a label must mean the same group on every rank: agree
                # once, before the first step.
                mine = (layout, _group_settings(trainer.optimizers))
                everyone: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, mine)
                layout, mixed = _agreed_layout(everyone)
                if mixed:
                    rank_zero_warn(
                        f"{type(self).__name__}: the parameter group(s) {mixed} have different settings on different "
                        f"processes (each stage's optimizer is built over its own parameters, and e.g. optim.Muon "
                        f"holds a group as one or two groups depending on the stage), so their per-group figures would "
                        f"mix groups; they are not logged. Give the parameter groups a 'name' key to log them"
                    )
            self._group_metrics = {label: tuple(sorted(layout[label])) for label in sorted(layout)}
        sums = [_group_field(label, f) for label, metrics in self._group_metrics.items() for m in metrics
                for f in _GROUP_SUMS.get(m, ())]
        maxima = [_group_field(label, f) for label, metrics in self._group_metrics.items() for m in metrics
                  for f in _GROUP_MAXIMA.get(m, ())]
        # Under tensor parallelism each of a stage's t ranks reports its shards' part of the stage's figures.
        self._figures = StageFigures(strategy.num_stages, list(_FIELDS) + sums, ["delay"] + maxima,
                                     parts=strategy.engine.stats.tensor_parallel_size).to(strategy.root_device)

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
                counted, scales = _counted(stage), _scales(stage)
                self._pending[stage.index] = {
                    "drift_sq": _sq_distance(_only(stage.version(k), counted), _only(stage.version(stale), counted),
                                             _only(scales, counted)),
                    "weight_sq": _sq_norm(_only(stage.version(k), counted), _only(scales, counted)),
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
                self._snapshots[stage.index] = [local_tensor(p).detach().clone() for p in stage.params]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._due:
            return
        self._due = False
        k = self._batch
        corrected = _error_feedback_states(trainer.optimizers)
        compensated = _compensation_norms(trainer.optimizers)
        groups = _parameter_groups(trainer.optimizers) if self._group_metrics else {}
        scales = prediction_scales(trainer.optimizers) if self._group_metrics else {}
        assert self._figures is not None
        stats = trainer.strategy.engine.stats
        for stage in stats.stages:
            before = self._snapshots.pop(stage.index, None)
            if before is None:
                before = stage.version(k)  # W_k, held when the delay is >= 1
            update_sq, correction_sq = [], []  # accumulated on the device: one host sync per stage
            compensation_sq, stale_grad_sq = [], []
            group_sq: dict[str, list[Tensor]] = defaultdict(list)  # per-group field -> squared norms
            group_max: dict[str, float] = {}
            for p, w_k, counted, scale in zip(stage.params, before, _counted(stage), _scales(stage)):
                label, group, state_of = groups.get(p, (None, None, None))
                metrics_of_group = self._group_metrics.get(label, ()) if label is not None else ()
                # DelayCompensation's norms are of whole tensors (a DTensor's: replicated on every tensor-parallel
                # rank, no communication to read): counted on one rank of the stage
                norms = compensated.get(p)
                norms = tuple(whole_value(n) for n in norms) if norms is not None else None
                once = counted and stats.tensor_parallel_rank == 0
                if "nesterov_momentum" in metrics_of_group:
                    mu = _nesterov_momentum(group, state_of.get(p))
                    field = _group_field(label, "nesterov_momentum")
                    if mu is not None and mu > group_max.get(field, -math.inf):
                        group_max[field] = mu
                if not counted:  # a tied copy another stage counts, or a whole parameter another rank counts
                    continue
                change = _wide(w_k) - _wide(local_tensor(p).detach())  # W_k - W_{k+1}, one tensor at a time
                if "prediction_norm" in metrics_of_group and id(p) in scales:
                    extrapolation = scales[id(p)] * stage.delay  # the next prediction adds s d (W_{k+1} - W_k)
                    group_sq[_group_field(label, "prediction_sq")].append(_sq(change) * extrapolation**2 * scale)
                state = corrected.get(p)
                if state is not None and PREV_UPDATE in state:
                    u = _wide(local_tensor(state[PREV_UPDATE]))  # u_k
                    update_sq.append(_sq(u) * scale)
                    correction_sq.append(_sq(change - u) * scale)  # c (u_k - u_{k-1}) = (W_k - W_{k+1}) - u_k
                    if "correction_norm" in metrics_of_group:
                        group_sq[_group_field(label, "correction_sq")].append(correction_sq[-1])
                else:
                    update_sq.append(_sq(change) * scale)
                if norms is not None and once:
                    norms = (norms[0] * scale, norms[1] * scale)
                    compensation_sq.append(norms[0])
                    stale_grad_sq.append(norms[1])
                    if "compensation_ratio" in metrics_of_group:
                        group_sq[_group_field(label, "compensation_sq")].append(norms[0])
                        group_sq[_group_field(label, "stale_grad_sq")].append(norms[1])
            figures = dict(self._pending.get(stage.index, {}), update_sq=_total(update_sq),
                           correction_sq=_total(correction_sq), compensation_sq=_total(compensation_sq),
                           stale_grad_sq=_total(stale_grad_sq))
            figures.update(_totals(group_sq, self._figures.mean_fields[len(_FIELDS):]))
            group_max["delay"] = figures.pop("delay")
            self._figures.update(stage.index, figures, group_max)
        table = self._figures.reduce()  # across processes: every rank calls this at the same step
        metrics = self._metrics(table, has_correction=bool(corrected), has_compensation=bool(compensated))
        factors = [s.factor(k) for s in _pipemare_schedulers(trainer)]
        if factors:
            metrics["staleness/lr_factor"] = min(factors)
        metrics.update(self._group_figures(table, _group_lr_factors(trainer, k)))
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
        total = {f: sum(row[f] for row in table.values()) for f in _FIELDS}
        values = _norm_figures(total["drift_sq"], total["weight_sq"], max(row["delay"] for row in table.values()),
                               total["update_sq"], total["correction_sq"], total["compensation_sq"],
                               total["stale_grad_sq"])
        out.update({f"staleness/{n}": values[n] for n in names})
        return out

    def _group_figures(self, table: dict[int, dict[str, float]], lr_factors: dict[str, float]) -> dict[str, float]:
        """``staleness/<group>/<metric>`` from the reduced table: sums over stages before the square root."""
        out: dict[str, float] = {}

        def total(label: str, field: str) -> float:
            return sum(row[_group_field(label, field)] for row in table.values())

        for label, metrics in self._group_metrics.items():
            if "correction_norm" in metrics:
                out[f"staleness/{label}/correction_norm"] = math.sqrt(total(label, "correction_sq"))
            if "compensation_ratio" in metrics:
                grad_sq = total(label, "stale_grad_sq")
                ratio = math.sqrt(total(label, "compensation_sq") / grad_sq) if grad_sq > 0 else 0.0
                out[f"staleness/{label}/compensation_ratio"] = ratio
            if "prediction_norm" in metrics:
                out[f"staleness/{label}/prediction_norm"] = math.sqrt(total(label, "prediction_sq"))
            if "nesterov_momentum" in metrics:
                reported = [row[_group_field(label, "nesterov_momentum")] for row in table.values()]
                reported = [v for v in reported if math.isfinite(v)]  # -inf: no stage holds its state yet
                if reported:
                    out[f"staleness/{label}/nesterov_momentum"] = max(reported)
            if "lr_factor" in metrics and label in lr_factors:
                out[f"staleness/{label}/lr_factor"] = lr_factors[label]
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


# ---- per parameter group ------------------------------------------------------------------------------------------

def _group_labels(optimizers: Sequence[Any]) -> list[tuple[Any, list[str]]]:
    """``(optimizer, [label of each group])``: ``opt{i}/<name>`` for a group with a ``name`` key, else
    ``opt{i}/group{j}``."""
    out = []
    for i, opt in enumerate(optimizers):
        opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the real one
        out.append((opt, [f"opt{i}/{group['name']}" if "name" in group else f"opt{i}/group{j}"
                          for j, group in enumerate(opt.param_groups)]))
    return out


def _chain(opt: Any) -> list[Any]:
    """``opt`` and the optimizers it wraps (``ErrorFeedback(DelayCompensation(...))``), outermost first."""
    chain = []
    while opt is not None:
        chain.append(opt)
        opt = getattr(opt, "wrapped", None)
    return chain


def _group_corrections(optimizers: Sequence[Any], scheduler_configs: Sequence[Any]) -> dict[str, set[str]]:
    """``{group label: the per-group metrics of its corrections}`` for the groups with a correction now.

    Error feedback is found where the stage figures find it (the outermost optimizer); the others anywhere in the
    chain of wrappers."""
    pipemare = {id(c.scheduler.optimizer) for c in scheduler_configs if isinstance(c.scheduler, PipeMareLR)}
    layout: dict[str, set[str]] = {}
    for opt, labels in _group_labels(optimizers):
        chain = _chain(opt)
        for j, (group, label) in enumerate(zip(opt.param_groups, labels)):
            metrics = set()
            if isinstance(opt, ErrorFeedback) and opt.group_coefficient(group, j) > 0:
                metrics.add("correction_norm")
            if any(isinstance(o, DelayCompensation) and o.delay > 0 and o.group_coefficient(group, j) > 0
                   for o in chain):
                metrics.add("compensation_ratio")
            if any(isinstance(o, AsyncNesterov) for o in chain):
                metrics.add("nesterov_momentum")
            if any(isinstance(o, WeightPrediction) and o.group_coefficient(group, j) > 0 for o in chain):
                metrics.add("prediction_norm")
            if any(id(o) in pipemare for o in chain):
                metrics.add("lr_factor")
            if metrics:
                layout[label] = layout.get(label, set()) | metrics
    return layout


def _group_settings(optimizers: Sequence[Any]) -> dict[str, set[str]]:
    """``{label: the settings of its groups}`` for the groups labelled by their position (no ``name``)."""
    settings: dict[str, set[str]] = {}
    for opt, labels in _group_labels(optimizers):
        for group, label in zip(opt.param_groups, labels):
            if "name" not in group:
                items = sorted((k, v.tolist() if isinstance(v, Tensor) else v)  # a tensor's repr names its device
                               for k, v in group.items() if k not in ("params", "param_names"))
                settings.setdefault(label, set()).add(repr(items))
    return settings


_Layout = dict[str, set[str]]  # group label -> metrics (or -> the settings of its groups)


def _agreed_layout(everyone: Sequence[tuple[_Layout, _Layout]]) -> tuple[_Layout, list[str]]:
    """The per-group layout every rank uses, from each rank's ``(layout, settings)``: the union of the layouts (a
    stage may lack a group's correction that another has) without the position-labelled groups whose settings
    differ between ranks (the same position holds another group there); and those labels."""
    layout: dict[str, set[str]] = {}
    for mine, _ in everyone:
        for label, metrics in mine.items():
            layout[label] = layout.get(label, set()) | set(metrics)
    mixed = sorted(label for label in layout
                   if len({frozenset(settings[label]) for _, settings in everyone if label in settings}) > 1)
    return {label: metrics for label, metrics in layout.items() if label not in mixed}, mixed


def _parameter_groups(optimizers: Sequence[Any]) -> dict[Any, tuple[str, dict, Any]]:
    """``{parameter: (its group's label, the group, the optimizer's state)}``; the first optimizer holding it wins."""
    out: dict[Any, tuple[str, dict, Any]] = {}
    for opt, labels in _group_labels(optimizers):
        for group, label in zip(opt.param_groups, labels):
            for p in group["params"]:
                out.setdefault(p, (label, group, opt.state))
    return out


def _group_lr_factors(trainer: Trainer, k: int) -> dict[str, float]:
    """``{group label: PipeMareLR's factor of update k}`` (the smallest, for an optimizer with several)."""
    factors: dict[str, float] = {}
    schedulers = _pipemare_schedulers(trainer)
    for opt, labels in _group_labels(trainer.optimizers):
        mine = [s.factor(k) for s in schedulers if any(s.optimizer is o for o in _chain(opt))]
        for label in labels if mine else ():
            factors[label] = min(mine + ([factors[label]] if label in factors else []))
    return factors


def _nesterov_momentum(group: dict, state: Optional[dict]) -> Optional[float]:
    """NAdam's look-ahead momentum of the update just taken, ``beta1 (1 - 0.5 * 0.96 ** ((t + 1) psi))`` (torch's
    ``mu_next``, ``t`` the parameter's step count); ``None`` before the parameter's first update."""
    if not state or "step" not in state:
        return None
    t = float(state["step"])
    return group["betas"][0] * (1.0 - 0.5 * 0.96 ** ((t + 1.0) * group["momentum_decay"]))


def _group_field(label: str, field: str) -> str:
    return f"{label}:{field}"


def _totals(squares: dict[str, list[Tensor]], fields: Sequence[str]) -> dict[str, float]:
    """``{field: sum of its squares}`` for every field (0 where none), with one host sync for all."""
    present = [f for f in fields if squares.get(f)]
    out = dict.fromkeys(fields, 0.0)
    if present:
        sums = torch.stack([torch.stack(squares[f]).sum() for f in present]).tolist()
        out.update(zip(present, sums))
    return out


def _wide(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _sq(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(_wide(t.detach()), dtype=torch.float64) ** 2


def _total(squares: Sequence[Tensor]) -> float:
    return float(torch.stack(list(squares)).sum()) if squares else 0.0


def _sq_norm(tensors: Sequence[Tensor], scales: Optional[Sequence[float]] = None) -> float:
    return _total([_sq(t) * s for t, s in zip(tensors, scales or (1.0,) * len(tensors))])


def _counted(stage: Any) -> Sequence[bool]:
    """Per parameter of ``stage``, whether this process adds it to the figures (``StageView.counted``)."""
    return stage.counted or (True,) * len(stage.params)


def _scales(stage: Any) -> Sequence[float]:
    """Per parameter of ``stage``, the factor on its squares (``StageView.scales``: an expert's, ``e``)."""
    return stage.scales or (1.0,) * len(stage.params)


def _only(items: Sequence[Any], counted: Sequence[bool]) -> list[Any]:
    return [t for t, c in zip(items, counted) if c]


def _sq_distance(a: Sequence[Tensor], b: Sequence[Tensor], scales: Sequence[float]) -> float:
    # The same version (the same tensors) is exactly zero apart: no arithmetic, no rounding.
    return _total([_sq(_wide(x) - _wide(y)) * s for x, y, s in zip(a, b, scales) if x is not y])


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
