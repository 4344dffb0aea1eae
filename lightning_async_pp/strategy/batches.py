"""The training batches under ``AsyncPipelineStrategy``: the training loader wrapped in a ``LookaheadLoader``
(lookahead.py) so that 2BW can peek the next batch while every Lightning hook still sees each batch once, the
transfer hooks run on it in Lightning's order, a shuffling sampler's seed shared by the stages of a pipeline, and
the step boundary where Lightning hands the next batch over (a background save put in place, SLURM's requeue).
A mixin, as ``state.py``'s hooks are; see docs/design/lightning.md, "The Lightning seam".
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_async_pp.pipeline.microbatch import check_splittable
from lightning_async_pp.strategy import _lightning
from lightning_async_pp.strategy.lookahead import FetchedBatch, LookaheadLoader, transfer_early


class TrainingBatches:
    """Mixed into ``AsyncPipelineStrategy`` (before ``DDPStrategy``, whose ``process_dataloader`` and
    ``batch_to_device`` these replace)."""

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not trainer.training:
            return dataloader
        # Known here, before the first step: a batch the microbatches cannot split would stop training at once.
        batch_size = loader_batch_size(dataloader)
        if batch_size is not None:
            check_splittable(batch_size, self.num_microbatches, "The training dataloader's batch_size={size}")
        on_epoch_start = None
        sampler = getattr(dataloader, "sampler", None)
        if (self.is_multiprocess and self.data_parallel_size == 1
                and isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None):
            on_epoch_start = lambda: self._share_sampler_seed(sampler)  # noqa: E731
        # Wrapped always: besides 2BW's lookahead, the wrapper keeps the data position of a stateful loader right
        # when Lightning's fetcher has read a batch ahead (it does for unsized loaders).
        self._train_loader = LookaheadLoader.wrap(dataloader, on_epoch_start)
        return self._train_loader

    def _share_sampler_seed(self, sampler: torch.utils.data.RandomSampler) -> None:
        """A shuffling sampler without a generator draws each epoch's seed from its process's own RNG, so the
        stages would shuffle differently. Rank 0 draws it exactly as the sampler would (so a seeded run shuffles
        as on one device) and every stage uses it."""
        seed = int(torch.empty((), dtype=torch.int64).random_().item()) if self.is_global_zero else 0
        sampler.generator = torch.Generator().manual_seed(self.broadcast(seed, src=0))

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        if not isinstance(batch, FetchedBatch):
            return super().batch_to_device(batch, device, dataloader_idx)
        # Lightning's loop reached a batch from the lookahead loader: transfer it unless the lookahead already did.
        assert self._train_loader is not None and self._train_loader.iterator is not None
        if self._pending_save is not None and self._pending_save.future.done():
            self.finish_pending_save()  # written in the background meanwhile: put it in place now
        if self._requeue is not None and self.engine is not None:
            # A step boundary: the previous batch is complete, this one not started (the data position is before it).
            self._requeue.at_step_boundary(self.engine.stats.batch_index)
        self._train_loader.iterator.started(batch)
        return transfer_early(batch, self._transfer)

    def _transfer(self, raw: Any) -> Any:
        """What Lightning's training loop does to a fetched batch, in its order: precision input conversion, then
        ``on_before_batch_transfer``, the transfer to the device and ``on_after_batch_transfer``."""
        module = self.lightning_module
        batch = module.trainer.precision_plugin.convert_input(raw)
        batch = _lightning.before_batch_transfer(module, batch)
        return super().batch_to_device(batch, dataloader_idx=0)

    def _next_batch(self, batch_idx: Optional[int]) -> Any:
        """The next training batch, transferred, for 2BW's lookahead; ``None`` when this step is the last one."""
        engine, loader = self.engine, self._train_loader
        if engine is None or loader is None or loader.iterator is None or not engine.uses_lookahead():
            return None
        trainer = self.lightning_module.trainer
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return None
        if batch_idx is None or batch_idx + 1 >= trainer.num_training_batches:
            return None  # the epoch ends after this batch; the next one starts a new pass
        fetched = loader.iterator.peek()
        return None if fetched is None else transfer_early(fetched, self._transfer)


def loader_batch_size(dataloader: object) -> Optional[int]:
    """The batch size a training loader yields, where it says (a ``DataLoader``'s ``batch_size``, or its batch
    sampler's); ``None`` for loaders that do not (an iterable of ready batches, a custom batch sampler)."""
    size = getattr(dataloader, "batch_size", None)
    if size is None:
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

