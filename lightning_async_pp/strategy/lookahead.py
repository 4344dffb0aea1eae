"""The next training batch for 2BW's lookahead, taken so that every Lightning hook sees every batch once.

2BW starts batch ``k+1``'s forwards during step ``k``, before Lightning's loop has fetched that batch. The
strategy wraps the training loader (``Strategy.process_dataloader``) in a :class:`LookaheadLoader`, whose
iterator yields each batch inside a :class:`FetchedBatch`. The lookahead can then *peek* the batch Lightning
will be given next and run the transfer hooks on it early (``on_before_batch_transfer``,
``transfer_batch_to_device``, ``on_after_batch_transfer``, in Lightning's order); when the loop reaches that
batch, ``PipelineModule`` and the strategy's ``batch_to_device`` pass the already transferred batch through,
so the hooks never run twice, and the training step can tell that it was given the very batch the lookahead
started (``batch is lookahead``). A batch that Lightning does not train after all (an epoch cut short by
``on_train_batch_start`` returning -1, a stop) is simply never confirmed, and the engine drops its forwards.

The loader's ``state_dict`` is the inner loader's state before the oldest batch not yet trained, so a
checkpoint taken while a batch is fetched ahead resumes at that batch.
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Any, Callable, Optional


class FetchedBatch:
    """A training batch as fetched; ``transferred`` is set once the transfer hooks ran on it."""

    __slots__ = ("raw", "transferred", "ready")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.transferred: Any = None
        self.ready = False


class LookaheadLoader:
    """Wraps a training loader; its iterators yield :class:`FetchedBatch` and can peek one batch ahead."""

    def __init__(self, loader: Any, on_epoch_start: Optional[Callable[[], None]] = None) -> None:
        self.loader = loader
        self.iterator: Optional[_LookaheadIterator] = None
        self.on_epoch_start = on_epoch_start

    @staticmethod
    def wrap(loader: Any, on_epoch_start: Optional[Callable[[], None]] = None) -> "LookaheadLoader":
        stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        return (StatefulLookaheadLoader if stateful else LookaheadLoader)(loader, on_epoch_start)

    def __iter__(self) -> "_LookaheadIterator":
        inner = iter(self.loader)
        if self.on_epoch_start is not None:
            # After the loader's iterator exists (it may draw worker seeds) and before its first batch (when a
            # sampler draws its permutation), as on one device.
            self.on_epoch_start()
        self.iterator = _LookaheadIterator(inner, self.loader)
        return self.iterator

    def __len__(self) -> int:
        return len(self.loader)  # raises TypeError for an unsized loader, as the loader itself does

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "iterator", "on_epoch_start"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class StatefulLookaheadLoader(LookaheadLoader):
    """For a stateful loader (Lightning saves and restores the data position through these two methods)."""

    def state_dict(self) -> dict:
        if self.iterator is not None:
            return self.iterator.state_before_untrained()
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class _LookaheadIterator:
    def __init__(self, iterator: Any, loader: Any) -> None:
        self.inner = iterator
        self.loader = loader
        self.stateful = hasattr(loader, "state_dict")
        self.untrained: deque[tuple[FetchedBatch, Optional[dict]]] = deque()  # fetched, not yet trained, in order
        self.delivered = 0  # how many of ``untrained`` Lightning's fetcher has taken already
        self.exhausted = False

    def __iter__(self) -> "_LookaheadIterator":
        return self

    def _fetch(self) -> FetchedBatch:
        if self.exhausted:
            raise StopIteration
        state = copy.deepcopy(self.loader.state_dict()) if self.stateful else None
        try:
            raw = next(self.inner)
        except StopIteration:
            self.exhausted = True
            raise
        fetched = FetchedBatch(raw)
        self.untrained.append((fetched, state))
        return fetched

    def __next__(self) -> FetchedBatch:
        if self.delivered < len(self.untrained):
            fetched = self.untrained[self.delivered][0]
        else:
            fetched = self._fetch()
        self.delivered += 1
        return fetched

    def peek(self) -> Optional[FetchedBatch]:
        """The batch Lightning will train next after the current one, or ``None`` at the end of the data."""
        if self.untrained:  # fetched already (by Lightning's prefetching or an earlier peek)
            return self.untrained[0][0]
        try:
            return self._fetch()
        except StopIteration:
            return None

    def started(self, fetched: FetchedBatch) -> None:
        """Lightning's loop took ``fetched`` for a training step: it no longer counts as fetched ahead."""
        while self.untrained:
            head, _ = self.untrained.popleft()
            self.delivered -= 1
            if head is fetched:
                return

    def state_before_untrained(self) -> dict:
        for fetched, state in self.untrained:
            if state is not None:
                return state
        return self.loader.state_dict()


def transfer_early(fetched: FetchedBatch, transfer: Callable[[Any], Any]) -> Any:
    """Run ``transfer`` (the hooks, in Lightning's order) on a peeked batch once; returns the transferred batch."""
    if not fetched.ready:
        fetched.transferred = transfer(fetched.raw)
        fetched.ready = True
    return fetched.transferred
