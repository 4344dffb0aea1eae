"""Every place where lightning-async-pp relies on a Lightning behaviour that has no public API.

Each touch is a small function or name here, with the Lightning behaviour it relies on, and a test in
``tests/test_lightning_private.py`` that fails loudly when a Lightning release changes it. The tested range is
pinned in ``pyproject.toml``. Elsewhere the package uses only underscore-named parts that Lightning's own
strategies and CLI subclasses use as extension points: ``Strategy._configure_launcher``, the optimizer device
helpers of ``lightning.fabric.utilities.optimizer``, ``LightningCLI._add_configure_optimizers_method_to_model``
(cli.py) and the loop's ``_batches_that_stepped`` counter (callbacks/figures.py).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager

import lightning as L

#: The LightningModule method through which every loop runs ``on_before_batch_transfer`` on a fetched batch
#: (training, evaluation and prediction loops call ``trainer.lightning_module._on_before_batch_transfer``).
BEFORE_BATCH_TRANSFER = "_on_before_batch_transfer"


class PassesFetchedBatches:
    """Mixed into ``PipelineModule``: a batch fetched for 2BW's lookahead (a ``FetchedBatch``) passes the loops'
    ``on_before_batch_transfer`` call untouched, because the strategy's ``batch_to_device`` runs the hooks on it
    exactly once (lightning_async_pp/strategy/lookahead.py). Relies on: every loop calling :data:`BEFORE_BATCH_TRANSFER`
    on the module before ``strategy.batch_to_device``."""

    def _on_before_batch_transfer(self, batch: Any, dataloader_idx: int = 0) -> Any:
        from lightning_async_pp.strategy.lookahead import FetchedBatch

        if isinstance(batch, FetchedBatch):
            return batch
        return super()._on_before_batch_transfer(batch, dataloader_idx)  # type: ignore[misc]


def before_batch_transfer(module: Any, batch: Any) -> Any:
    """Run ``on_before_batch_transfer`` on a training batch as Lightning's loop does (bypassing the pass-through)."""
    return L.LightningModule._on_before_batch_transfer(module, batch, dataloader_idx=0)


def keep_user_sampler(trainer: Any) -> None:
    """Stop Lightning from replacing the loaders' samplers with a ``DistributedSampler``.

    Relies on: ``_DataConnector._requires_distributed_sampler`` reading
    ``trainer._accelerator_connector.use_distributed_sampler`` when each loader is prepared. With one pipeline
    the stages must see the batches one device sees, so the user's sampler stays (the public
    ``Trainer(use_distributed_sampler=...)`` is the user's choice, fixed before the strategy is set up).
    """
    trainer._accelerator_connector.use_distributed_sampler = False


def replace_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> None:
    """Replace the per-step SIGTERM broadcast from rank 0 with ``check``.

    Relies on: ``_TrainingEpochLoop.advance`` calling ``self._broadcast_sigterm_tensor()`` at the start of every
    training step when ``torch.distributed`` is initialized. That broadcast is a barrier
    across all stages, which would put a bubble back into 2BW.
    """
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check


def configure_optimizers(module: Any) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns, in Lightning's order, whatever form it returns
    them in (one optimizer, a list, a dict, lists with schedulers).

    Relies on: ``lightning.pytorch.core.optimizer._init_optimizers_and_lr_schedulers(module)`` returning
    ``(optimizers, scheduler_configs)``, as the trainer's own setup uses it."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return list(_init_optimizers_and_lr_schedulers(module)[0])


def batches_trained(checkpoint: dict) -> int:
    """How many training batches had run when a Lightning checkpoint was saved: the engine's update count (one
    update per batch, whatever the number of optimizers).

    Relies on: the fit loop's checkpoint state holding the epoch loop's batch progress under
    ``checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]``. Neither ``global_step``
    (every optimizer's steps) nor ``_batches_that_stepped`` (counted after ``on_train_batch_end``, where
    ModelCheckpoint saves) is that number."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"])
    except (KeyError, TypeError):
        return int(checkpoint.get("global_step", 0))


def replace_requeue_handler(trainer: Any, handler: Callable[[Any, Any], None]) -> None:
    """Make Lightning register ``handler`` for SLURM's requeue signal instead of its own, which saves the hpc
    checkpoint inside the signal handler.

    Relies on: ``_SignalConnector.register_signal_handlers`` (run by the trainer after ``strategy.setup``) looking
    up ``self._slurm_sigusr_handler_fn`` when it registers the requeue signal's handlers under
    ``SLURMEnvironment(auto_requeue=True)``."""
    trainer._signal_connector._slurm_sigusr_handler_fn = handler


def hpc_save_path(trainer: Any) -> str:
    """Where Lightning's SLURM handler saves its hpc checkpoint (``hpc_ckpt_<n+1>.ckpt`` in ``default_root_dir``),
    which a requeued job's ``fit`` resumes from.

    Relies on: ``trainer._checkpoint_connector.hpc_save_path(folder)``."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def undo_whole_model_compile(module: Any) -> bool:
    """If the Trainer was given ``torch.compile(module)``, put the module's own methods back; returns whether it was.

    Relies on: the Trainer unwrapping an ``OptimizedModule`` with ``from_compiled`` (``_maybe_unwrap_optimized``),
    which compiles ``forward`` and the ``*_step`` methods of the original module and records them in its
    ``_compiler_ctx`` (``None`` otherwise). Compiled ``*_step`` methods would trace into the pipeline engine
    (graph breaks at every send, receive and Python-side schedule step); the public ``to_uncompiled`` undoes
    them."""
    if getattr(module, "_compiler_ctx", None) is None:
        return False
    from lightning.pytorch.utilities.compile import to_uncompiled

    to_uncompiled(module)
    return True


def summarize_within(trainer: Any, context: Callable[[], ContextManager[Any]]) -> None:
    """Make Lightning's model summary callbacks (``ModelSummary``, ``RichModelSummary``) take their summary inside
    ``context()``: across processes, the whole model assembled (other stages' layers as shapes without memory), so
    the summary counts the whole model's parameters instead of rank 0's stage.

    Relies on: ``ModelSummary.on_fit_start`` computing the summary of the module as it is then (after
    ``strategy.setup``, before anything else trains it). The class's own hook is wrapped each time, so a later
    ``fit`` replaces the wrapper instead of nesting it."""
    from lightning.pytorch.callbacks import ModelSummary

    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            hook = type(callback).on_fit_start

            def on_fit_start(trainer: Any, pl_module: Any, callback: Any = callback, hook: Any = hook) -> None:
                with context():
                    hook(callback, trainer, pl_module)

            callback.on_fit_start = on_fit_start


def epoch_title_without_epoch_limit(trainer: Any) -> None:
    """Make ``RichProgressBar`` title the training bar ``Epoch 3`` when training has no epoch limit, instead of
    ``Epoch 3/-2``: Lightning sets ``max_epochs=-1`` when only ``max_steps`` is given and the bar prints
    ``max_epochs - 1`` as the last epoch (plain Lightning shows the same title).

    Relies on: ``RichProgressBar._get_train_description(current_epoch)`` making the title, padded to the
    validation bar's, from ``trainer.max_epochs``. The instance's method is replaced, so a later ``fit`` replaces
    it instead of nesting it."""
    from lightning.pytorch.callbacks import RichProgressBar

    for callback in trainer.callbacks:
        if isinstance(callback, RichProgressBar):
            describe = type(callback)._get_train_description

            def title(current_epoch: int, callback: Any = callback, describe: Any = describe) -> str:
                text = describe(callback, current_epoch)
                if callback.trainer.max_epochs == -1:
                    text = text.replace(f"Epoch {current_epoch}/-2", f"Epoch {current_epoch}", 1).ljust(len(text))
                return text

            callback._get_train_description = title


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``mesh`` the module's ``device_mesh`` (what ``configure_model`` reads), as Lightning's
    ``ModelParallelStrategy.setup_environment`` does. Relies on: ``LightningModule.device_mesh`` returning the
    ``_device_mesh`` attribute (there is no public setter)."""
    module._device_mesh = mesh
