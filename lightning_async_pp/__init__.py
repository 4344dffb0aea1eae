"""Asynchronous pipeline-parallel (PipeDream-2BW) pretraining for PyTorch Lightning."""
from lightning_async_pp.module import PipelineModule

__all__ = ["PipelineModule"]
__version__ = "0.1.0"
