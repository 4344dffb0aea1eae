"""Optimizers that tolerate a one-step gradient delay: ``Muon`` (with AdamW for non-matrix parameters) and the
``ErrorFeedback`` correction around any ``torch.optim.Optimizer``; ``WarmupCosine``, a pretraining schedule."""
from lightning_async_pp.optim.error_feedback import PREV_UPDATE, ErrorFeedback
from lightning_async_pp.optim.muon import DEFAULT_ADAMW_NAMES, Muon
from lightning_async_pp.optim.schedulers import WarmupCosine

__all__ = ["DEFAULT_ADAMW_NAMES", "PREV_UPDATE", "ErrorFeedback", "Muon", "WarmupCosine"]
