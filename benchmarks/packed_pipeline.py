#!/usr/bin/env python
"""A packed 2bw step over a plain one on 2 processes (gloo, one thread each), at SmolLM-135M's width: the same
tokens as plain rows (causal attention over each row) and as packed rows (positions restarting at each of
``--docs`` documents per row, attended document by document: models/packing.py), one Trainer.fit of ``--steps``
steps each, plain and packed in turn (the order alternating by round). Prints each round's median steps, and the
median over rounds of packed / plain, for ``models.Llama`` and ``HuggingFaceCausalLM`` (llama family, sdpa),
and each fit's peak resident memory on each rank.

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/packed_pipeline.py --rounds 2 --steps 3

Each row is ``--seq`` tokens, ``--microbatches`` rows per step; both models have ``--layers`` decoder layers
(the embedding and a half of them on stage 0, the rest, the norm and the head on stage 1) at SmolLM-135M's width.
SmolLM-135M has 30 layers and a vocabulary of 49152; by default the vocabulary scales with the layers kept
(``49152 * layers / 30``, to a multiple of 64) so that the head is the share of a step it is in the full model
(about a sixth) and attention the share it is in a layer, rather than a head that dwarfs one or two layers.
Peak memory is VmHWM reset before each fit (``harness.reset_peak_rss``), with glibc's mmap threshold fixed so
that freed activations leave the resident set. Nothing is downloaded (docs/design/data.md, 'Packed documents').
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SMOLLM_HF = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, attn_implementation="sdpa")


def scaled_vocab(layers: int) -> int:
    """SmolLM-135M's 49152 scaled by ``layers / 30``, to a multiple of 64."""
    return max(64, round(49152 * layers / 30 / 64) * 64)


def rows(count: int, seq: int, docs: int, packed: bool, vocab: int) -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (seq + 1,), generator=g)
        if not packed:
            out.append(ids)
            continue
        cuts = sorted(torch.randperm(seq, generator=g)[: docs - 1].add(1).tolist())
        bounds = [0, *cuts, seq + 1]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        out.append({"input_ids": ids, "position_ids": pos})
    return out


def build(model: str, layers: int, seq: int, vocab: int):
    from lightning_async_pp.models import HuggingFaceCausalLM, Llama

    if model == "llama":
        return Llama("smollm-135m", vocab_size=vocab, num_layers=layers, max_seq_len=seq, init_seed=0)
    return HuggingFaceCausalLM({**SMOLLM_HF, "vocab_size": vocab, "num_hidden_layers": layers,
                                "max_position_embeddings": seq}, init_seed=0)


def child(args: argparse.Namespace) -> None:
    """One rank: every round's fits, in turn; writes its step times."""
    harness.one_thread()
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy

    results = []
    for r in range(args.rounds):
        for model_name in args.models:
            for kind in harness.in_turn(["plain", "packed"], r):
                L.seed_everything(0, verbose=False)
                model = build(model_name, args.layers, args.seq, args.vocab)
                data = rows(args.steps * args.microbatches, args.seq, args.docs, kind == "packed", args.vocab)
                recorder = harness.step_recorder()
                half, ends = args.layers // 2, 1 if model_name == "llama" else 2  # head; norm and head
                trainer = L.Trainer(
                    strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=args.microbatches,
                                                   partition=[1 + half, args.layers - half + ends], pipeline_timeout=600.0),
                    accelerator="cpu", devices=2, max_steps=args.steps, logger=False, callbacks=[recorder],
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
                before = harness.resident_mib()
                harness.reset_peak_rss()
                trainer.fit(model, DataLoader(data, batch_size=args.microbatches))
                results.append({"round": r, "model": model_name, "kind": kind, "step": recorder.median_step(),
                                "peak_mib": harness.peak_rss_mib(), "peak_over_start_mib": harness.peak_rss_mib() - before})
                rank = trainer.global_rank
                del model, trainer
    Path(args.out_dir, f"packed_pipeline{rank}.json").write_text(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama", "hf"], choices=["llama", "hf"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=6, help="documents per row")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: 49152 * layers / 30)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="per fit; the first is not counted")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.vocab = args.vocab or scaled_vocab(args.layers)
    if args.child:
        child(args)
        return
    harness.one_thread_env()
    argv = [__file__, "--child", *sys.argv[1:]]
    ranks = harness.run_ranks(argv, "packed_pipeline*.json", "the packed pipeline benchmark", timeout=3600,
                              env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"})
    results = ranks[0]  # rank 0 times the steps; rank 1's ends are the same steps
    print(f"2 processes, 2bw, {args.microbatches} microbatches of one {args.seq}-token row, {args.docs} documents "
          f"per packed row, {args.layers} layers at SmolLM-135M's width, vocabulary {args.vocab}; {harness.load_line()}")
    print("| model | round | plain step, s | packed step, s | packed / plain |")
    print("|---|---:|---:|---:|---:|")
    summary = {}
    for model in args.models:
        ratios = []
        for r in range(args.rounds):
            step = {x["kind"]: x["step"] for x in results if x["model"] == model and x["round"] == r}
            ratios.append(step["packed"] / step["plain"])
            print(f"| {model} | {r} | {step['plain']:.2f} | {step['packed']:.2f} | {ratios[-1]:.2f} |")
        summary[model] = statistics.median(ratios)
        print(f"| {model} | median of rounds | | | **{summary[model]:.2f}** |", flush=True)
    print("\nPeak resident memory of each fit over the resident memory at its start, MiB (median of rounds):")
    print("| model | rank | plain | packed | packed / plain |")
    print("|---|---:|---:|---:|---:|")
    for model in args.models:
        for rank, res in enumerate(ranks):
            peak = {k: statistics.median(x["peak_over_start_mib"] for x in res if x["model"] == model and x["kind"] == k)
                    for k in ("plain", "packed")}
            print(f"| {model} | {rank} | {peak['plain']:.0f} | {peak['packed']:.0f} | {peak['packed'] / peak['plain']:.2f} |")
    harness.write_json(args.json, {"args": vars(args), "results": ranks, "median_ratio": summary})


if __name__ == "__main__":
    main()
