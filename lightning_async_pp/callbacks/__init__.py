"""Callbacks that make the pipeline visible in the logger (TensorBoard): staleness, throughput, bubble, traces.

See ``docs/monitoring.md`` for what each figure means and how to read it.
"""
from lightning_async_pp.callbacks.pipeline import PipelineMonitor
from lightning_async_pp.callbacks.staleness import StalenessMonitor

__all__ = ["PipelineMonitor", "StalenessMonitor"]
