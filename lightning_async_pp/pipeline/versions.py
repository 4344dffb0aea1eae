"""``WeightVersions``: the weight versions one stage keeps for delayed (stale) gradients.

Version ``W_j`` lives in slot ``j % (delay + 1)``. The module's parameters always point at the newest slot, so
the optimizer updates the newest version in place. Before an update the newest version is copied into the slot
of the version that just went out of use and the parameters are re-pointed there: microbatches still in flight
keep reading the old slot untouched, which is what weight stashing means. With ``delay=1`` (PipeDream-2BW) that
is exactly two versions: the parameters and one stash.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn


class WeightVersions:
    def __init__(self, params: Sequence[nn.Parameter], delay: int = 1, sync_steps: int = 0,
                 sync_from_step: Optional[int] = None) -> None:
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
            raise ValueError(f"delay must be an integer >= 0 (0 is synchronous, 1 is 2BW), got {delay!r}")
        if not isinstance(sync_steps, int) or sync_steps < 0:
            raise ValueError(f"sync_steps must be an integer >= 0, got {sync_steps!r}")
        if sync_from_step is not None and (not isinstance(sync_from_step, int) or sync_from_step < 0):
            raise ValueError(f"sync_from_step must be None or an integer >= 0, got {sync_from_step!r}")
        self.params = list(params)
        self.delay = delay
        self.sync_steps = sync_steps
        self.sync_from_step = sync_from_step
        self.num_updates = 0  # k: the parameters hold W_k
        # Slot tensors are plain tensors, not the Parameters themselves: autograd leaves made from a slot then
        # keep their own version counter, so an in-place update of the Parameter (now pointing at another
        # slot) does not invalidate a microbatch still in flight on the old one.
        # Parameter by parameter, so that each original is freed as soon as its copies exist: the peak is the
        # versions plus one tensor, not the versions plus the whole stage again.
        self.slots: list[list[Tensor]] = [[] for _ in range(delay + 1)]
        for p in self.params:
            for slot in self.slots:
                slot.append(p.detach().clone())
            p.data = self.slots[0][-1]
        self._leaves: dict[int, list[Tensor]] = {}

    # ---- which version a batch uses ----------------------------------------------------------------------
    def delay_for_batch(self, batch_index: int) -> int:
        """Realized delay, in updates, of the gradient of batch ``batch_index``: 0 for a synchronous head
        (``< sync_steps``) or tail (``>= sync_from_step``), otherwise ``delay`` (less for the first batches)."""
        if batch_index < self.sync_steps or self.sync_from_step is not None and batch_index >= self.sync_from_step:
            return 0
        return min(self.delay, batch_index)

    def version_for_batch(self, batch_index: int) -> int:
        return batch_index - self.delay_for_batch(batch_index)

    def leaves_for_batch(self, batch_index: int) -> list[Tensor]:
        """Autograd leaves viewing the version that every microbatch of batch ``batch_index`` uses.

        The same leaves serve all of the batch's microbatches, so their ``.grad`` accumulates the batch gradient.
        """
        leaves = self._leaves.get(batch_index)
        if leaves is None:
            version = self.version_for_batch(batch_index)
            if not self.num_updates - self.delay <= version <= self.num_updates:
                raise RuntimeError(
                    f"batch {batch_index} needs weight version {version}, but only versions "
                    f"{max(0, self.num_updates - self.delay)}..{self.num_updates} are held"
                )
            slot = self.slots[version % len(self.slots)]
            leaves = [t.detach().requires_grad_(p.requires_grad) for t, p in zip(slot, self.params)]
            self._leaves[batch_index] = leaves
        return leaves

    def take_gradients(self, batch_index: int) -> list[Tensor | None]:
        """The accumulated gradient of batch ``batch_index``; forgets that batch's leaves."""
        leaves = self._leaves.pop(batch_index)
        return [leaf.grad for leaf in leaves]

    def forget_batch(self, batch_index: int) -> None:
        """Drop the leaves of a batch that will not be trained (a cancelled lookahead)."""
        self._leaves.pop(batch_index, None)

    # ---- updates -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_update(self) -> None:
        """Make the parameters point at the slot that will hold ``W_{k+1}``, holding a copy of ``W_k``.

        Call this after the gradient of batch k is complete and before the optimizer writes the parameters.
        """
        current = (self.num_updates) % len(self.slots)
        target = (self.num_updates + 1) % len(self.slots)
        if target != current:
            for dst, src in zip(self.slots[target], self.slots[current]):
                dst.copy_(src)
            self._point_params_at(target)
        self.num_updates += 1

    def _point_params_at(self, slot_index: int) -> None:
        for p, t in zip(self.params, self.slots[slot_index]):
            p.data = t

    # ---- introspection and checkpoints -------------------------------------------------------------------
    def stash_nbytes(self) -> int:
        """Bytes held beyond the parameters themselves (the stashed versions)."""
        return sum(t.numel() * t.element_size() for slot in self.slots[1:] for t in slot)

    def version(self, j: int) -> list[Tensor]:
        """The tensors of version ``W_j`` (one of the held ones)."""
        if not max(0, self.num_updates - self.delay) <= j <= self.num_updates:
            raise IndexError(f"version {j} is not held (held: {max(0, self.num_updates - self.delay)}..{self.num_updates})")
        return self.slots[j % len(self.slots)]

    def state_dict(self) -> dict[str, Any]:
        held = range(max(0, self.num_updates - self.delay), self.num_updates + 1)
        return {
            "num_updates": self.num_updates,
            "delay": self.delay,
            "versions": {j: [t.clone() for t in self.version(j)] for j in held},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["delay"] != self.delay:
            raise ValueError(f"checkpoint was saved with delay {state['delay']}, this run uses delay {self.delay}")
        self.num_updates = int(state["num_updates"])
        for j, tensors in state["versions"].items():
            for dst, src in zip(self.slots[int(j) % len(self.slots)], tensors):
                dst.copy_(src)
        self._point_params_at(self.num_updates % len(self.slots))
        self._leaves.clear()
