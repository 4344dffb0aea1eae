"""Callbacks that make the pipeline visible in the logger (TensorBoard): staleness, throughput, bubble, traces,
the experts' load, and what the model writes (``TextSamples``).

See ``docs/guide/monitoring.md`` for what each figure means and how to read it.
"""
from lightning_async_pp.callbacks.experts import ExpertMonitor
from lightning_async_pp.callbacks.pipeline import PipelineMonitor
from lightning_async_pp.callbacks.staleness import StalenessMonitor
from lightning_async_pp.callbacks.text import TextSamples

__all__ = ["ExpertMonitor", "PipelineMonitor", "StalenessMonitor", "TextSamples"]
