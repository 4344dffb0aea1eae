"""``PipeMareLR``: PipeMare's learning-rate rescheduling for delayed gradients, around any LR schedule.

Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN Training", MLSys 2021. Early in training, when the
weights move fastest and a stale gradient is most wrong, the learning rate is divided by the delay ``tau``, and the
division fades out over a warm-up of ``T`` updates:

    lr_k = lr_k^inner / tau ** (1 - min((k + 1) / T, 1))

``k`` counts the updates taken (0 for the first), ``lr_k^inner`` is the wrapped schedule's rate. This is the form
PluralisResearch/AsyncPP applies with ``--lr_correction`` (``adjust_learning_rate`` in ``main_with_runtime.py``, with
``tau`` its number of weight versions minus 1, i.e. the delay, and ``T`` = ``lr_correction_epoch`` epochs of steps);
the paper's schedule has the same shape (``p_k`` decaying linearly from 1 to 0 over the warm-up).

With 2BW's delay of 1, ``tau = 1`` and the rule is the identity (AsyncPP also skips it then): it acts only at
delays >= 2, the research variants (``AsyncPipelineStrategy(..., delay=d)``).
"""
from __future__ import annotations

from typing import Any, Optional, Union

from lightning.pytorch.cli import LRSchedulerCallable
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


class PipeMareLR(LRScheduler):
    """Multiply the rate of ``scheduler`` (or the optimizer's constant rate) by ``tau ** -(1 - min((k + 1) / T, 1))``.

    Guarantees:

    - The factor multiplies the inner schedule's rate without compounding, for closed-form schedules (``LambdaLR``,
      ``CosineAnnealingLR``) and recursive ones (``ExponentialLR``, which scales the group's current ``lr``) alike:
      the wrapper keeps each group's undivided rate, puts it back before every inner step and re-applies the factor
      after it. So the rate used by update ``k`` is the inner schedule's ``k``-th rate times the factor of ``k``.
    - ``tau = delay``; ``delay`` 0 or 1 leaves the rates untouched. The factor is 1 from update ``T - 1`` on.
    - A Lightning ``lr_scheduler`` with ``interval: "step"`` (one :meth:`step` per update). ``state_dict`` holds the
      update count, the undivided rates and the inner scheduler's own state; ``load_state_dict`` restores all three
      and sets the groups' rates to match, so a resumed run continues with the same rates.
    - ``ReduceLROnPlateau`` is refused (its steps need a metric; wrap it yourself if you need both).

    Args:
        optimizer: the optimizer whose parameter groups' ``lr`` it sets (named ``optimizer`` so that LightningCLI
            passes it, as for any scheduler).
        delay: ``tau``, the updates between the version a gradient is taken on and the one it is applied to (the
            strategy's ``delay``; 2BW: 1). With per-stage delays, give the largest, or one ``PipeMareLR`` per
            optimizer.
        warmup_steps: ``T``, the updates over which the division fades out (>= 1).
        scheduler: the inner schedule: an ``LRScheduler`` already built on ``optimizer``, or a callable that builds
            one from it (YAML: ``class_path``/``init_args``); ``None``: the optimizer's rates, constant.
    """

    def __init__(self, optimizer: Optimizer, delay: int, warmup_steps: int,
                 scheduler: Optional[Union[LRScheduler, LRSchedulerCallable]] = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"PipeMareLR needs the torch.optim.Optimizer whose rates it sets, got {optimizer!r}")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"PipeMareLR delay must be an integer >= 0 (tau: updates between the version a gradient "
                             f"is taken on and the one it is applied to; 2bw: 1), got {delay!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"PipeMareLR warmup_steps must be an integer >= 1 (T: the updates over which the "
                             f"division by tau fades out), got {warmup_steps!r}")
        if scheduler is not None and not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
            scheduler = scheduler(optimizer)
        if isinstance(scheduler, ReduceLROnPlateau):
            raise ValueError("PipeMareLR cannot wrap ReduceLROnPlateau (its steps need a metric); give a schedule "
                             "stepped once per update, e.g. LambdaLR, CosineAnnealingLR, ExponentialLR")
        if scheduler is not None and not isinstance(scheduler, LRScheduler):
            raise TypeError(f"PipeMareLR scheduler must be a torch LRScheduler or a callable building one from the "
                            f"optimizer, got {scheduler!r}")
        if scheduler is not None and scheduler.optimizer is not optimizer:
            raise ValueError("PipeMareLR scheduler must be built on the same optimizer as the one given to PipeMareLR")
        # LRScheduler.__init__ is not called: it would step a schedule of its own. These are the attributes that
        # torch and Lightning read from a scheduler.
        self.optimizer = optimizer
        self.inner = scheduler
        self.delay, self.warmup_steps = delay, warmup_steps
        self.last_epoch = 0  # k: updates taken
        self.undivided = [group["lr"] for group in optimizer.param_groups]  # the inner schedule's rates
        self.base_lrs = list(scheduler.base_lrs) if scheduler is not None else list(self.undivided)
        self._apply()

    def factor(self, step: Optional[int] = None) -> float:
        """``tau ** -(1 - min((k + 1) / T, 1))`` for update ``k`` (default: the next one); 1 when ``tau <= 1``."""
        k = self.last_epoch if step is None else step
        if self.delay <= 1:
            return 1.0
        return float(self.delay) ** -(1.0 - min((k + 1) / self.warmup_steps, 1.0))

    def _apply(self) -> None:
        factor = self.factor()
        for group, lr in zip(self.optimizer.param_groups, self.undivided):
            group["lr"] = lr * factor
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch: Optional[int] = None) -> None:  # type: ignore[override]
        """One update taken: step the inner schedule on the undivided rates, then apply the next factor."""
        if epoch is not None:
            raise ValueError("PipeMareLR.step takes no epoch: it counts updates itself (one step() per update)")
        if self.inner is not None:
            for group, lr in zip(self.optimizer.param_groups, self.undivided):
                group["lr"] = lr  # a recursive schedule (ExponentialLR) scales the rate it finds: the undivided one
            self.inner.step()
            self.undivided = [group["lr"] for group in self.optimizer.param_groups]
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "undivided": list(self.undivided),
                "inner": None if self.inner is None else self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict["inner"] is None) != (self.inner is None):
            raise ValueError("PipeMareLR checkpoint and scheduler disagree on whether an inner schedule is wrapped")
        if self.inner is not None:
            self.inner.load_state_dict(state_dict["inner"])
        self.last_epoch = state_dict["last_epoch"]
        self.undivided = list(state_dict["undivided"])
        self._apply()

    def __repr__(self) -> str:
        return f"PipeMareLR(delay={self.delay}, warmup_steps={self.warmup_steps}, scheduler={self.inner!r})"
