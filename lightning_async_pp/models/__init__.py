"""Example models built on ``PipelineModule``."""
from lightning_async_pp.models.gpt import GPT

__all__ = ["GPT"]
