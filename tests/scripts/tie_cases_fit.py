"""Several runs of a model whose embedding and head are one tied matrix, in one launch: each case trains
``models.Llama`` (tests/scripts/llama_fit.py) or, with ``"adapter": "hf"``, ``models.HuggingFaceCausalLM``
(tests/scripts/adapter_fit.py), with that script's config keys. Every rank saves ``{"rank", "cases": {name:
what the case's run returned}}`` to ``OUT/rank{r}.pt``; the tests import ``run`` for the same runs on one device.
"""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adapter_fit  # noqa: E402
import llama_fit  # noqa: E402
from helpers import script_main  # noqa: E402


def run(cfg: dict, devices: int) -> tuple[dict, Any, Any]:
    results: dict[str, Any] = {}
    for name, case in cfg["cases"].items():
        script = adapter_fit if case.get("adapter") else llama_fit
        results[name], model, trainer = script.run(case, devices)
    return {"rank": trainer.global_rank, "cases": results}, model, trainer


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
