"""A model of your own under ``AsyncPipelineStrategy``: an ordered list of layers and a loss.

``MyLM`` is a small byte-level transformer written with plain torch modules; subclassing ``PipelineModule`` and
listing its parts in ``pipeline_layers()`` is all the pipeline needs (each layer takes the previous layer's output,
``pipeline_loss`` is the mean loss of the last layer's output). It trains with 2BW on the embedded corpus (the
Python standard library's sources, read as bytes; nothing is downloaded)::

    python examples/own_model.py                              # 2 CPU processes = 2 pipeline stages
    python examples/own_model.py --devices 1 --num-stages 2   # the same schedule on one device
    python examples/own_model.py --accelerator gpu --devices 4 --max-steps 2000

``tests/test_examples.py`` runs it at tiny size.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import lightning as L
import torch
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule
from lightning_async_pp.data import TextDataModule
from lightning_async_pp.optim import Muon


class MyLM(PipelineModule):
    """Embedding, ``n_layer`` transformer blocks, output head: ``n_layer + 2`` pipeline layers."""

    def __init__(self, vocab_size: int = 256, width: int = 64, n_layer: int = 4, lr: float = 0.02) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(CausalBlock(width) for _ in range(n_layer))
        self.head = nn.Linear(width, vocab_size)

    def pipeline_layers(self) -> list[nn.Module]:  # in order; each takes the previous output
        return [self.embed, *self.blocks, self.head]

    def pipeline_input(self, batch: torch.Tensor) -> torch.Tensor:  # rows of block_size + 1 token ids
        return batch[:, :-1]

    def pipeline_loss(self, logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return Muon(self.named_parameters(), lr=self.lr)  # hidden matrices: Muon; embedding, head, norms: AdamW


class CausalBlock(nn.Module):
    """A pre-norm transformer block that makes its causal mask from the length of what it receives: only the
    hidden state crosses a stage boundary."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device, dtype=h.dtype)
        return self.block(h, src_mask=mask, is_causal=True)


def main(argv: Optional[Sequence[str]] = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes; each is one pipeline stage")
    parser.add_argument("--num-stages", type=int, help="on one device: the stages to emulate")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="cap on the corpus read")
    parser.add_argument("--root", default="lightning_logs", help="where logs go")
    args = parser.parse_args(argv)
    L.seed_everything(1234)
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=4, num_stages=args.num_stages)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        max_steps=args.max_steps, default_root_dir=args.root, log_every_n_steps=10,
                        limit_val_batches=4, val_check_interval=min(50, args.max_steps), enable_progress_bar=False)
    data = TextDataModule(block_size=64, batch_size=8, max_bytes=args.max_bytes)
    trainer.fit(MyLM(), datamodule=data)
    return trainer


if __name__ == "__main__":
    main()
