"""Optimizers that tolerate a one-step gradient delay: ``Muon`` (with AdamW for non-matrix parameters) and the
``ErrorFeedback`` correction around any ``torch.optim.Optimizer``."""
from lightning_async_pp.optim.error_feedback import PREV_UPDATE, ErrorFeedback
from lightning_async_pp.optim.muon import DEFAULT_ADAMW_NAMES, Muon

__all__ = ["DEFAULT_ADAMW_NAMES", "PREV_UPDATE", "ErrorFeedback", "Muon"]
