"""The monitoring pages' Python examples run as shown (tests/test_docs.py): each page's ``L.Trainer(...)`` call is
executed as the page writes it, with ``L.Trainer`` recording its arguments; the run then uses the callbacks and
strategy the page built (a default ``AsyncPipelineStrategy`` where the page leaves the strategy to ``...``), on a
tiny model, with the page's own ``log_every_n_steps`` lowered to 1 so that the monitors write within the few steps.

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
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callback_fit import MemoryLogger  # noqa: E402
from helpers import TinyLM, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: page name -> (file, the heading its example follows; None: the page's first Python block)
PAGES = {"guide/monitoring": ("guide/monitoring.md", None), "monitoring": ("monitoring.md", "## Turning them on")}


def page_example(name: str) -> str:
    file, heading = PAGES[name]
    text = (DOCS / file).read_text()
    if heading is not None:
        text = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def trainer_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments the page's example passes to ``L.Trainer`` (its ``...`` is a positional Ellipsis)."""
    seen: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        assert all(a is Ellipsis for a in args), args
        seen.update(kwargs)

    real = L.Trainer
    L.Trainer = record  # type: ignore[misc]
    try:
        exec(compile(page_example(name), f"docs/{PAGES[name][0]}", "exec"), {"L": L})
    finally:
        L.Trainer = real  # type: ignore[misc]
    return seen


def fit_page(name: str, cfg: dict, devices: int) -> tuple[dict, L.Trainer]:
    kwargs = trainer_arguments(name)
    strategy = kwargs.get("strategy") or AsyncPipelineStrategy()
    microbatches = strategy.config.num_microbatches or 4
    if devices == 1 and cfg.get("num_stages"):  # the page's schedule, its stages in one process
        strategy = AsyncPipelineStrategy(strategy.config.schedule, microbatches, num_stages=cfg["num_stages"])
    logger = MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=cfg.get("steps", 3), strategy=strategy,
                        callbacks=kwargs.get("callbacks", []) if cfg.get("callbacks", True) else [],
                        logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    model = TinyLM(seed=0)
    trainer.fit(model, DataLoader(make_dataset(64), batch_size=2 * microbatches, drop_last=True))
    result = {"metrics": sorted(logger.metrics)}
    if trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result, trainer


def run(cfg: dict, devices: int = 1) -> tuple[dict, Any, L.Trainer]:
    results, trainer = {}, None
    for name in cfg["pages"]:
        L.seed_everything(0, verbose=False)
        results[name], trainer = fit_page(name, cfg, devices)
    return results, None, trainer


if __name__ == "__main__":
    script_main(run)
