"""Asynchronous pipeline-parallel (PipeDream-2BW) pretraining for PyTorch Lightning."""
from lightning_async_pp.module import PipelineModule
from lightning_async_pp.strategy import AsyncPipelineStrategy  # also registers the strategy name "async_pipeline"

__all__ = ["AsyncPipelineStrategy", "PipelineModule"]
__version__ = "0.6.0"
