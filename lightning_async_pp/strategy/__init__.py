"""The Lightning seam: everything that meets Lightning, in one folder, with one entry point (this module).

``AsyncPipelineStrategy`` (``adapter.py``) is the thin adapter Lightning talks to; it delegates each concern to a
module of its own here: ``options.py`` (its keyword arguments and what it refuses at setup), ``batches.py`` (the
training batches: the lookahead loader of ``lookahead.py``, the transfer hooks, the shared sampler seed),
``data_rows.py`` (the data module's rows checked against the model at setup), ``failures.py`` (a failed
stage reported to the others and what each process prints, SIGTERM), ``processes.py`` (process groups and RNG
state across the launch), ``state.py`` (checkpoints and the gather after each call) and ``requeue.py`` (SLURM's
auto-requeue at a step boundary). ``_lightning.py`` is the one module that touches Lightning's private parts.
See docs/design/lightning.md, "The Lightning seam".

The class is imported on first use of the name (``lightning_async_pp/__init__.py`` uses it at once, which
registers the strategy name ``"async_pipeline"``), so that ``PipelineModule`` (``module.py``) can take its
batch-transfer pass-through from ``_lightning.py`` without importing the strategy, which imports it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and the API reference; at run time, __getattr__ below
    from lightning_async_pp.strategy.adapter import AsyncPipelineStrategy

__all__ = ["AsyncPipelineStrategy"]


def __getattr__(name: str) -> Any:
    if name == "AsyncPipelineStrategy":
        from lightning_async_pp.strategy.adapter import AsyncPipelineStrategy  # registers "async_pipeline"

        globals()[name] = AsyncPipelineStrategy
        return AsyncPipelineStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
