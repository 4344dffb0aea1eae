"""Example models built on ``PipelineModule``."""
from lightning_async_pp.models.gpt import GPT
from lightning_async_pp.models.llama import Llama

__all__ = ["GPT", "Llama"]
