"""The random numbers a pipeline forward draws (dropout masks, any ``torch.rand`` in a layer or in the loss).

Each forward of one microbatch on one stage draws from the global generators reseeded for it with
:func:`forward_seed` of (base seed, stage, data-parallel replica, batch, microbatch), and the global streams are
restored afterwards (``torch.random.fork_rng``). So a stage's draws depend on nothing but those numbers: not on
the other stages sharing the process (one device runs every stage in one process, interleaved in the schedule's
order), not on when the forward runs (2BW's lookahead runs batch k+1's first forwards during step k) and not on what
else consumed random numbers before (samplers, callbacks). One device and p processes therefore draw the same
masks, and a resumed run draws what the uninterrupted run drew. Activation checkpointing's recomputation replays
the forward's draws by itself: ``torch.utils.checkpoint`` saves the generator state at the checkpointed call, which
is this forward's seeded state. See docs/design/stages.md, "Randomness".
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import torch

TRAIN, EVAL = 0, 1  # the phase of a forward: training steps, or evaluation and prediction


def forward_seed(base: int, stage: int, batch: int, microbatch: int, *, replica: int = 0, phase: int = TRAIN) -> int:
    """The seed of the forward of ``microbatch`` of ``batch`` (the update index k, or the evaluation call) on
    ``stage`` of data-parallel ``replica``: a hash of those numbers, so nearby inputs give unrelated streams."""
    data = struct.pack("<6Q", base % 2**64, phase, stage, replica, batch, microbatch)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % 2**63


class ForwardRandomness:
    """Seeds the global generators of the CPU and of ``device`` (when it is a CUDA device) for one forward.

    ``base``: the run's seed, ``torch.initial_seed()`` (what ``torch.manual_seed``/``seed_everything`` set),
    the same on every process of a run."""

    def __init__(self, base: int, device: torch.device, replica: int = 0) -> None:
        self.base, self.replica = int(base), int(replica)
        index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        self.cuda = [index] if device.type == "cuda" else []

    @contextmanager
    def forward(self, stage: int, batch: int, microbatch: int, phase: int = TRAIN) -> Iterator[None]:
        seed = forward_seed(self.base, stage, batch, microbatch, replica=self.replica, phase=phase)
        with torch.random.fork_rng(devices=self.cuda, device_type="cuda"):  # restores the global streams on exit
            torch.default_generator.manual_seed(seed)
            for d in self.cuda:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
            yield
