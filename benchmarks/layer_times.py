#!/usr/bin/env python
"""Each pipeline layer's forward and backward timed alone, in one process on one thread, in units of a decoder
block: what a stage would cost with the machine to itself, to set beside the FLOPs the balanced split uses and the
per-stage times a two-process run measures (BENCHMARKS.md, "A realistic shape").

    PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_times.py                       # vocabulary 8192, 4 rows
    PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_times.py --vocab 49152 --rows 2

The model is models.Llama at SmolLM-135M's width with ``--layers`` blocks (``--hf``: transformers' LlamaForCausalLM
at the same widths, as ``benchmarks/realistic_llama.py`` trains it); the last layer's time includes the loss.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the benchmarks package

from lightning_async_pp.models import Llama  # noqa: E402

from benchmarks.harness import one_thread  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=4, help="rows of one microbatch")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM through models.HuggingFaceCausalLM "
                                                      "(as benchmarks/realistic_llama.py) instead of models.Llama")
    args = ap.parse_args()
    one_thread()  # as each process of a two-process run on two cores
    torch.manual_seed(0)
    if args.hf:
        from benchmarks.realistic_llama import llama_config
        from lightning_async_pp.models import HuggingFaceCausalLM

        model = HuggingFaceCausalLM(config=llama_config(dict(vocab=args.vocab, layers=args.layers, seq=args.seq)))
    else:
        model = Llama("smollm-135m", vocab_size=args.vocab, num_layers=args.layers, max_seq_len=args.seq)
    model.configure_model()
    layers = list(model.pipeline_layers())
    batch = torch.randint(0, args.vocab, (args.rows, args.seq + 1))
    inputs, x = [], model.pipeline_input(batch)
    with torch.no_grad():
        for layer in layers:
            inputs.append(x)
            x = layer(x)
    rows = []
    for i, layer in enumerate(layers):
        forward, backward = [], []
        for _ in range(args.repeats):
            inp = inputs[i].detach().requires_grad_(inputs[i].is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if i == len(layers) - 1:
                out = model.pipeline_loss(out, batch)
            mid = time.perf_counter()
            out.backward(torch.ones_like(out))
            forward.append(mid - start)
            backward.append(time.perf_counter() - mid)
        rows.append((f"{i} {type(layer).__name__}", statistics.median(forward), statistics.median(backward)))
    block = rows[1][1] + rows[1][2]
    print(f"vocabulary {args.vocab}, {args.rows} x {args.seq} tokens, one thread: | layer | forward ms | backward ms | blocks |")
    for name, f, b in rows:
        print(f"  | {name} | {f * 1e3:.0f} | {b * 1e3:.0f} | {(f + b) / block:.2f} |")


if __name__ == "__main__":
    main()
