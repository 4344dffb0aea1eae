"""Optimizers that tolerate a one-step gradient delay: ``Muon`` (with AdamW for non-matrix parameters); the delay
corrections around any ``torch.optim.Optimizer``, ``ErrorFeedback`` and ``DelayCompensation`` (DC-ASGD);
``AsyncNesterov`` (AsyncPP's NAdam rule); ``PipeMareLR`` (PipeMare's rescheduling around any LR schedule);
``WeightPrediction`` (delayed batches run on predicted weights); ``WarmupCosine``, a pretraining schedule."""
from lightning_async_pp.optim.async_nesterov import AsyncNesterov
from lightning_async_pp.optim.delay_compensation import DelayCompensation
from lightning_async_pp.optim.error_feedback import PREV_UPDATE, ErrorFeedback
from lightning_async_pp.optim.muon import DEFAULT_ADAMW_NAMES, Muon
from lightning_async_pp.optim.pipemare import PipeMareLR
from lightning_async_pp.optim.schedulers import WarmupCosine
from lightning_async_pp.optim.weight_prediction import WeightPrediction

__all__ = ["DEFAULT_ADAMW_NAMES", "PREV_UPDATE", "AsyncNesterov", "DelayCompensation", "ErrorFeedback", "Muon",
           "PipeMareLR", "WarmupCosine", "WeightPrediction"]
