"""How long one checkpoint save stalls training, synchronous against ``async_checkpoint=True``, in the same run.

One device, ``--stages`` emulated stages of ``--layers`` x ``Linear(--width, --width)`` under ``2bw`` with AdamW
(weights, the stash and two moments: about 4x the parameter bytes are written). After ``--warmup`` steps a callback
times ``trainer.save_checkpoint`` at every ``--every``-th step: training waits for the whole write when it is
synchronous, and only for the copy of the tensors (DCP's staging) when it is asynchronous; the write itself goes on
in a background thread, and the next save (or the end of training) waits for it. Printed: the median stall of each,
their ratio, and the steps' median time between saves (to see what the background write costs the steps).

    .venv/bin/python benchmarks/checkpoint_stall.py
    .venv/bin/python benchmarks/checkpoint_stall.py --layers 16 --width 2048 --accelerator cuda
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule


class MLP(PipelineModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return ((output - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TimeSaves(L.Callback):
    def __init__(self, folder: str, warmup: int, every: int) -> None:
        self.folder, self.warmup, self.every = folder, warmup, every
        self.stalls: list[float] = []
        self.steps: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        step = trainer.global_step
        if self._last is not None and step > self.warmup:
            self.steps.append(now - self._last)
        if step >= self.warmup and (step - self.warmup) % self.every == 0:
            start = time.perf_counter()
            trainer.save_checkpoint(f"{self.folder}/step={step}.ckpt")
            self.stalls.append(time.perf_counter() - start)
        self._last = time.perf_counter()


def measure(args: argparse.Namespace, async_checkpoint: bool) -> TimeSaves:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(args.batch * 8, args.width), torch.randn(args.batch * 8, args.width))
    with tempfile.TemporaryDirectory() as folder:
        timer = TimeSaves(folder, args.warmup, args.every)
        strategy = AsyncPipelineStrategy("2bw", num_stages=args.stages, num_microbatches=4,
                                         async_checkpoint=async_checkpoint)
        trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, callbacks=[timer],
                            max_steps=args.warmup + args.saves * args.every, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(MLP(args.layers, args.width), DataLoader(data, batch_size=args.batch, drop_last=True))
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--every", type=int, default=3, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}): {params / 1e6:.1f}M parameters, about "
          f"{4 * params * 4 / 2**20:.0f} MiB per checkpoint (weights, stash, AdamW's two moments)")
    sync, background = measure(args, False), measure(args, True)
    s, a = statistics.median(sync.stalls), statistics.median(background.stalls)
    print(f"stall of one save (median of {args.saves}): synchronous {s * 1e3:.1f} ms, async_checkpoint "
          f"{a * 1e3:.1f} ms; ratio sync/async {s / a:.1f}x")
    print(f"step time between saves (median): synchronous run {statistics.median(sync.steps) * 1e3:.1f} ms, "
          f"async run {statistics.median(background.steps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
