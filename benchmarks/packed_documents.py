#!/usr/bin/env python
"""A packed training step with and without document masks, at SmolLM-135M's width (fp32, one thread): the same
tokens as a plain row (causal attention over the whole row) and as a packed batch (positions restarting at each
document, attention within each document as models/packing.py chooses it), taking steps in turn so that the machine's
drift reaches both alike. Prints the median step of each and the median of the per-step ratios.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/packed_documents.py                  # 2048 x 1, 8 steps
    PYTHONPATH=$PWD .venv/bin/python benchmarks/packed_documents.py --shapes 2048x1 1024x2 --steps 12

Two models: ``models.Llama`` (``--layers`` decoder blocks, embedding, head and loss: forward and backward) and one
decoder layer of ``HuggingFaceCausalLM`` (llama family, sdpa). On 2 processes under 2bw:
benchmarks/packed_pipeline.py. Documents
are drawn with lengths uniform in ``[--min-doc, --max-doc]`` (default 64..1024 tokens). ``--device cuda`` runs the
same on a GPU. Nothing is downloaded (docs/design/data.md, 'Packed documents').
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_async_pp.models import HuggingFaceCausalLM, Llama

VOCAB = 8192
SMOLLM_HF = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, num_hidden_layers=1, vocab_size=VOCAB, attn_implementation="sdpa")


def packed_batch(seq: int, batch: int, min_doc: int, max_doc: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    rows = []
    for _ in range(batch):
        pos: list[int] = []
        while len(pos) < seq + 1:
            pos.extend(range(int(torch.randint(min_doc, max_doc + 1, (1,), generator=g))))
        rows.append(pos[: seq + 1])
    return {"input_ids": ids.to(device), "position_ids": torch.tensor(rows).to(device)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def in_turn(steps: dict[str, callable], n: int, device: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(n + 2):  # the first two warm up
        for name in list(steps)[:: 1 if step % 2 else -1]:
            sync(device)
            start = time.perf_counter()
            steps[name]()
            sync(device)
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def llama_steps(packed: dict[str, torch.Tensor], layers: int, device: str) -> dict[str, callable]:
    model = Llama("smollm-135m", vocab_size=VOCAB, num_layers=layers, max_seq_len=packed["input_ids"].shape[1])
    model.configure_model()
    model.to(device)

    def step(batch) -> None:
        model.zero_grad(set_to_none=True)
        model.pipeline_loss(model.pipeline_forward(batch), batch).backward()

    return {"plain": lambda: step(packed["input_ids"]), "packed": lambda: step(packed)}


def hf_layer_steps(packed: dict[str, torch.Tensor], device: str) -> dict[str, callable]:
    seq = packed["input_ids"].shape[1]
    model = HuggingFaceCausalLM(config={**SMOLLM_HF, "max_position_embeddings": seq})
    model.configure_model()
    model.to(device)
    layer = model.model.layers[0]
    x = torch.randn(packed["input_ids"].shape[0], seq - 1, SMOLLM_HF["hidden_size"], device=device)
    positions = packed["position_ids"][:, :-1]

    def plain() -> None:
        layer(x.clone().requires_grad_()).sum().backward()

    def masked() -> None:
        # a fresh positions tensor per step, as each microbatch brings: the documents are found in every step
        out = layer({"hidden": x.clone().requires_grad_(), "position_ids": positions.clone()})
        out["hidden"].sum().backward()

    return {"plain": plain, "packed": masked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2048x1"], help="SEQxBATCH per measurement")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="models.Llama's decoder blocks")
    ap.add_argument("--min-doc", type=int, default=64)
    ap.add_argument("--max-doc", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"device {args.device}, torch {torch.__version__}, one thread; documents {args.min_doc}..{args.max_doc} tokens")
    print("| model | sequence x batch | documents per row | plain (causal), ms | packed (document attention), ms | "
          "packed / plain (median of steps) |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        seq, batch = (int(v) for v in shape.split("x"))
        packed = packed_batch(seq, batch, args.min_doc, args.max_doc, args.device)
        docs = (packed["position_ids"] == 0).sum().item() / batch
        for name, steps in ((f"models.Llama, {args.layers} blocks + head + loss",
                             llama_steps(packed, args.layers, args.device)),
                            ("HuggingFaceCausalLM, one decoder layer", hf_layer_steps(packed, args.device))):
            t = in_turn(steps, args.steps, args.device)
            ratio = statistics.median(b / a for a, b in zip(t["plain"], t["packed"]))
            print(f"| {name} | {seq} x {batch} | {docs:.1f} | {statistics.median(t['plain']) * 1e3:.1f} | "
                  f"{statistics.median(t['packed']) * 1e3:.1f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
