"""``WeightVersions``: the weight versions one stage keeps for delayed (stale) gradients.

Version ``W_j`` lives in slot ``j % (delay + 1)``. The module's parameters always point at the newest slot, so
the optimizer updates the newest version in place. Before an update the newest version is copied into the slot
of the version that just went out of use and the parameters are re-pointed there: microbatches still in flight
keep reading the old slot untouched, which is what weight stashing means. With ``delay=1`` (PipeDream-2BW) that
is exactly two versions: the parameters and one stash.

Weight prediction (:meth:`enable_prediction`, see docs/design/update-rule.md, 'Weight prediction') changes what the slots
hold: a delayed batch due version ``W_v`` runs on the predicted ``W_v + s * delay * (W_v - W_{v-1})`` (``s`` per
parameter) instead of ``W_v`` itself. The parameters then get their own tensors (the true newest version, which the
optimizer updates and evaluation reads), and slot ``v % (delay + 1)`` holds the prediction for ``v``: the versions
plus one, i.e. with ``delay=1`` two versions and one update's worth of memory.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_async_pp.parallel.tensor_parallel import local_tensor, point_at


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
        # A DTensor parameter (tensor parallelism) keeps its local shard here: the slots are this rank's shards.
        for p in self.params:
            for slot in self.slots:
                slot.append(local_tensor(p).detach().clone())
            point_at(p, self.slots[0][-1])
        self._leaves: dict[int, list[Tensor]] = {}
        self.scales: Optional[list[float]] = None  # weight prediction: ``s`` per parameter, None when off
        self._predicted = 0  # the newest version whose prediction its slot holds (prediction on)

    # ---- weight prediction ---------------------------------------------------------------------------------
    @torch.no_grad()
    def enable_prediction(self, scales: Sequence[float]) -> None:
        """Run delayed batches on predicted versions, parameter ``i`` extrapolated with scale ``scales[i]``.

        Call before training (or before loading a checkpoint). The parameters move to tensors of their own; the
        slots keep the versions held now, which serve as their own predictions (no update to extrapolate yet).
        """
        if len(scales) != len(self.params):
            raise ValueError(f"enable_prediction needs one scale per parameter ({len(self.params)}), got {len(scales)}")
        if self.delay == 0:
            raise ValueError("weight prediction needs a delay >= 1 (with delay 0 no batch runs on an older version)")
        if self.scales is not None:
            self.scales = [float(s) for s in scales]
            return
        self.scales = [float(s) for s in scales]
        newest = self.slots[self.num_updates % len(self.slots)]
        for p, t in zip(self.params, newest):
            point_at(p, t.clone())
        self._predicted = self.num_updates

    @property
    def predicts(self) -> bool:
        return self.scales is not None

    @torch.no_grad()
    def _form_prediction(self) -> None:
        """Turn the slot of the newest version ``k`` (holding a copy of ``W_{k-1}``) into the prediction
        ``W_k + s d (W_k - W_{k-1})``; a no-op once done. Runs while the parameters hold ``W_k``: before the next
        update moves them on, and before any batch due ``k`` first reads its slot."""
        if self.scales is None or self._predicted == self.num_updates:
            return
        slot = self.slots[self.num_updates % len(self.slots)]
        for t, p, s in zip(slot, self.params, self.scales):
            factor = s * self.delay
            t.mul_(-factor).add_(local_tensor(p).detach(), alpha=1.0 + factor)  # W_k + f (W_k - W_{k-1})
        self._predicted = self.num_updates

    def predicted_newest(self) -> list[Tensor]:
        """Prediction on: the tensors batches due the newest version will run on (a checkpoint saves them)."""
        if self.scales is None:
            raise RuntimeError("weight prediction is off")
        self._form_prediction()
        return self.slots[self.num_updates % len(self.slots)]

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
        Made here (by a 2BW lookahead's forward, before Lightning's hooks for that batch ran) every floating leaf
        needs a gradient: a layer unfrozen by those hooks must get the lookahead microbatches' share too.
        :meth:`settle_batch` then gives the leaves the parameters' ``requires_grad`` when the batch is trained.
        """
        leaves = self._leaves.get(batch_index)
        if leaves is None:
            version = self.version_for_batch(batch_index)
            if not self.num_updates - self.delay <= version <= self.num_updates:
                raise RuntimeError(
                    f"batch {batch_index} needs weight version {version}, but only versions "
                    f"{max(0, self.num_updates - self.delay)}..{self.num_updates} are held"
                )
            if self.scales is not None and self.delay_for_batch(batch_index) == 0:
                slot = [local_tensor(p).detach() for p in self.params]  # a synchronous batch: the true W_k, before its update
            else:
                self._form_prediction()
                slot = self.slots[version % len(self.slots)]
            leaves = [t.detach().requires_grad_(p.is_floating_point()) for t, p in zip(slot, self.params)]
            self._leaves[batch_index] = leaves
        return leaves

    def settle_batch(self, batch_index: int) -> None:
        """Batch ``batch_index`` is trained now: its leaves need a gradient where the parameters do (as Lightning's
        hooks for this batch left them). Autograd accumulates nothing into a leaf that no longer needs one, so a
        layer frozen after the lookahead ran gets no gradient from it either."""
        for leaf, p in zip(self.leaves_for_batch(batch_index), self.params):
            leaf.requires_grad_(p.requires_grad)

    def take_gradients(self, batch_index: int) -> list[Tensor | None]:
        """The accumulated gradient of batch ``batch_index``; forgets that batch's leaves."""
        leaves = self._leaves.pop(batch_index)
        return [leaf.grad if leaf.requires_grad else None for leaf in leaves]

    def forget_batch(self, batch_index: int) -> None:
        """Drop the leaves of a batch that will not be trained (a cancelled lookahead)."""
        self._leaves.pop(batch_index, None)

    # ---- updates -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_update(self) -> None:
        """Make the parameters point at the slot that will hold ``W_{k+1}``, holding a copy of ``W_k``.

        Call this after the gradient of batch k is complete and before the optimizer writes the parameters.
        Prediction on: the slot freed by batch k (that of ``W_{k-delay}``) receives the copy of ``W_k`` instead, and
        becomes the prediction for ``W_{k+1}`` once the optimizer has written it.
        """
        if self.scales is not None:
            self._form_prediction()  # the one for W_k, while the parameters still hold W_k
            target = (self.num_updates + 1) % len(self.slots)
            for dst, p in zip(self.slots[target], self.params):
                dst.copy_(local_tensor(p).detach())
            self.num_updates += 1
            return
        current = (self.num_updates) % len(self.slots)
        target = (self.num_updates + 1) % len(self.slots)
        if target != current:
            for dst, src in zip(self.slots[target], self.slots[current]):
                dst.copy_(src)
            self._point_params_at(target)
        self.num_updates += 1

    def _point_params_at(self, slot_index: int) -> None:
        for p, t in zip(self.params, self.slots[slot_index]):
            point_at(p, t)

    # ---- introspection and checkpoints -------------------------------------------------------------------
    def stash_nbytes(self) -> int:
        """Bytes held beyond the parameters themselves (the stashed or predicted versions)."""
        slots = self.slots if self.scales is not None else self.slots[1:]
        return sum(t.numel() * t.element_size() for slot in slots for t in slot)

    def version(self, j: int) -> list[Tensor]:
        """The tensors of version ``W_j`` (one of the held ones). Prediction on: the newest is the parameters'
        own tensors and an older one is the prediction its delayed batches run on."""
        if not max(0, self.num_updates - self.delay) <= j <= self.num_updates:
            raise IndexError(f"version {j} is not held (held: {max(0, self.num_updates - self.delay)}..{self.num_updates})")
        if self.scales is not None and j == self.num_updates:
            return [local_tensor(p).detach() for p in self.params]
        return self.slots[j % len(self.slots)]

    def state_dict(self) -> dict[str, Any]:
        held = range(max(0, self.num_updates - self.delay), self.num_updates + 1)
        state = {
            "num_updates": self.num_updates,
            "delay": self.delay,
            "versions": {j: [t.clone() for t in self.version(j)] for j in held},
        }
        if self.scales is not None:
            state["predicted_newest"] = [t.clone() for t in self.predicted_newest()]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved. Prediction on and no ``predicted_newest`` (a checkpoint saved
        without prediction): the newest version's prediction is formed from the two newest versions saved."""
        if state["delay"] != self.delay:
            raise ValueError(f"checkpoint was saved with delay {state['delay']}, this run uses delay {self.delay}")
        self.num_updates = k = int(state["num_updates"])
        # A DTensor (a checkpoint's tensor-parallel weights) gives its local shard, which is what the slots hold.
        versions = {int(j): [local_tensor(t) for t in tensors] for j, tensors in state["versions"].items()}
        for j, tensors in versions.items():
            for dst, src in zip(self.slots[j % len(self.slots)], tensors):
                dst.copy_(src)
        self._leaves.clear()
        if self.scales is None:
            self._point_params_at(k % len(self.slots))
            return
        for p, src in zip(self.params, versions[k]):
            local_tensor(p).detach().copy_(src)
        predicted = state.get("predicted_newest")
        predicted = [local_tensor(t) for t in predicted] if predicted is not None else None
        for dst, src in zip(self.slots[k % len(self.slots)], predicted or versions.get(k - 1, versions[k])):
            dst.copy_(src)
        self._predicted = k if predicted is not None or k - 1 not in versions else k - 1
