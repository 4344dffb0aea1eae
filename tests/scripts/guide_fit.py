"""The guide's Trainer examples run as shown (tests/test_docs.py): each page's example is executed as the page
writes it, with ``L.Trainer`` recording its arguments and the module given to ``trainer.fit``; the run then uses
the callbacks, strategy and module the page built (a default ``AsyncPipelineStrategy`` where the page leaves the
strategy to ``...``; TinyLM where it passes no module), on CPU for a few steps (the page's ``accelerator``,
``devices`` and ``max_steps`` replaced), logging every step so that the monitors write within those steps.

Run as a script on several processes (every page, one after the other, in one launch), or imported by the test
for one device. Rank 0 returns, per page, the final weights and the metric names the monitors logged.

Config keys: pages (names in PAGES), steps, callbacks (False: the same run without the page's callbacks, the
reference), num_stages (one device only).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callback_fit import MemoryLogger  # noqa: E402
from helpers import TinyLM, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: page name -> (file, the heading its example follows; None: the page's first Python block)
PAGES = {"guide/monitoring": ("guide/monitoring.md", None), "monitoring": ("guide/monitoring.md", "## Turning them on"),
         "guide/install": ("guide/install.md", "## Use it in your own code")}
#: Trainer arguments a page sets for its own hardware, replaced by the tiny CPU run's.
HARDWARE = ("accelerator", "devices", "max_steps")


def page_example(name: str) -> str:
    file, heading = PAGES[name]
    text = (DOCS / file).read_text()
    if heading is not None:
        text = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def trainer_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments the page's example passes to ``L.Trainer`` (its ``...`` is a positional Ellipsis),
    and under ``"model"`` the module it passes to ``trainer.fit``, if it calls it."""
    seen: dict[str, Any] = {}

    class Recorded:
        def fit(self, model: Any, *args: Any, **kwargs: Any) -> None:
            seen["model"] = model

    def record(*args: Any, **kwargs: Any) -> Recorded:
        assert all(a is Ellipsis for a in args), args
        seen.update(kwargs)
        return Recorded()

    real = L.Trainer
    L.Trainer = record  # type: ignore[misc]
    try:
        exec(compile(page_example(name), f"docs/{PAGES[name][0]}", "exec"), {"L": L, "__name__": "page"})
    finally:
        L.Trainer = real  # type: ignore[misc]
    return seen


def fit_page(name: str, cfg: dict, devices: int) -> tuple[dict, L.Trainer]:
    L.seed_everything(0, verbose=False)
    kwargs = trainer_arguments(name)
    strategy = kwargs.get("strategy") or AsyncPipelineStrategy()
    microbatches = strategy.config.num_microbatches or 4
    if devices == 1 and cfg.get("num_stages"):  # the page's schedule, its stages in one process
        strategy = AsyncPipelineStrategy(strategy.config.schedule, microbatches, num_stages=cfg["num_stages"])
    logger = MemoryLogger()
    page_options = {k: v for k, v in kwargs.items() if k not in ("strategy", "callbacks", "model", *HARDWARE)}
    trainer = L.Trainer(**{**page_options, "accelerator": "cpu", "devices": devices, "max_steps": cfg.get("steps", 3),
                           "strategy": strategy, "logger": logger, "log_every_n_steps": 1,
                           "callbacks": kwargs.get("callbacks", []) if cfg.get("callbacks", True) else [],
                           "enable_checkpointing": False, "enable_progress_bar": False,
                           "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0})
    model = kwargs.get("model")
    if model is None:
        model, data = TinyLM(seed=0), make_dataset(64)
    else:  # the page's own model: a language model on (B, T + 1) token ids
        data = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(1))
    trainer.fit(model, DataLoader(data, batch_size=2 * microbatches, drop_last=True))
    result = {"metrics": sorted(logger.metrics)}
    if trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result, trainer


def run(cfg: dict, devices: int = 1) -> tuple[dict, Any, L.Trainer]:
    results, trainer = {}, None
    for name in cfg["pages"]:
        results[name], trainer = fit_page(name, cfg, devices)
    return results, None, trainer


if __name__ == "__main__":
    script_main(run)
