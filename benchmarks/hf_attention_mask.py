#!/usr/bin/env python
"""One decoder layer of ``HuggingFaceCausalLM`` at SmolLM-135M's width, forward and backward, as the adapter
builds its inputs now (the mask upstream's forward gives: none under SDPA, whose causal kernel then runs) and as
it built them before (a ``(B, 1, T, T)`` mask for every layer, which SDPA attends through), taking steps in turn
so that the machine's drift reaches both alike. Prints the median of each and of the per-step ratios.

    .venv/bin/python benchmarks/hf_attention_mask.py                          # seq 256 x 4 and 1024 x 1, fp32
    .venv/bin/python benchmarks/hf_attention_mask.py --shapes 2048x1 --steps 8

One thread (as Lightning gives each of two processes on two cores). Nothing is downloaded: the model is built
from a config (docs/design/adapters.md, "Adapters of upstream models").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_async_pp.models import HuggingFaceCausalLM

SMOLLM = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, num_hidden_layers=1, vocab_size=8192)


def measure(seq: int, batch: int, steps: int) -> dict[str, float]:
    config = {**SMOLLM, "max_position_embeddings": seq}
    now = HuggingFaceCausalLM(config=config)
    now.configure_model()  # the build-time check finds that upstream passes no mask
    before = HuggingFaceCausalLM(config=config)
    before.check_exact = False  # unchecked, the layers build every mask (what they always did before)
    before.configure_model()
    before.load_state_dict(now.state_dict())
    blocks = {"as upstream": now.model.layers[0], "mask built": before.model.layers[0]}
    x = torch.randn(batch, seq, SMOLLM["hidden_size"])
    times: dict[str, list[float]] = {name: [] for name in blocks}
    for step in range(steps + 2):  # the first two warm up
        for name in list(blocks)[:: 1 if step % 2 else -1]:
            h = x.clone().requires_grad_()
            start = time.perf_counter()
            blocks[name](h).sum().backward()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(times["as upstream"], times["mask built"]))
    return {**{name: statistics.median(t) for name, t in times.items()}, "ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["256x4", "1024x1"], help="SEQxBATCH per measurement")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| sequence x batch | as upstream (no mask), ms | mask built, ms | built / as upstream (median of steps) |")
    print("|---|---:|---:|---:|")
    for shape in args.shapes:
        seq, batch = (int(v) for v in shape.split("x"))
        r = measure(seq, batch, args.steps)
        print(f"| {seq} x {batch} | {r['as upstream'] * 1e3:.1f} | {r['mask built'] * 1e3:.1f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
