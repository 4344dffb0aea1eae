"""The processes of a multi-process run, around Lightning's launch: RNG states kept across DDP's re-seeding, and
every process group destroyed at exit. Used by ``AsyncPipelineStrategy.setup_distributed``; see
docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

import atexit
import random

import numpy as np
import torch

_DESTROY_AT_EXIT = [False]  # registered once per process


def destroy_process_groups_at_exit() -> None:
    """Destroy every process group while the interpreter is still alive at exit. Lightning does this under NCCL
    only; under gloo an undestroyed group's worker threads may still hold finished work when the interpreter
    finalizes, and the process then aborts after a successful run ("terminate called without an active
    exception", exit code -6: one run in about ten of the 4-process tests). Registered after Lightning's own
    handler, so it runs first; Lightning's then finds nothing to destroy."""
    if not _DESTROY_AT_EXIT[0]:
        _DESTROY_AT_EXIT[0] = True
        atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rng_states() -> tuple:
    """This process's RNG states (Python, NumPy, torch's CPU and, where CUDA is initialized, CUDA generators)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_states(states: tuple) -> None:
    """Put back what :func:`rng_states` returned."""
    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
