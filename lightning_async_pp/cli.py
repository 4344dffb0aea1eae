"""The ``lightning-async-pp`` console script: a ``LightningCLI`` with ``fit``, ``validate`` and ``test``.

    lightning-async-pp fit --config configs/demo.yaml
"""
from __future__ import annotations

import os
from typing import Any, Optional
from unittest import mock

# Importing the package first registers the "async_pipeline" strategy name with Lightning.
import lightning_async_pp  # noqa: F401
import lightning.pytorch.cli
from lightning.pytorch.cli import ArgsType, LightningCLI, ReduceLROnPlateau, instantiate_class
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_async_pp.data import TextDataModule
from lightning_async_pp.module import PipelineModule

#: TensorBoard is the default logger; a ``trainer.logger`` in the config replaces it.
TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "lightning_logs", "name": ""},
    },
}


class AsyncPipelineCLI(LightningCLI):
    """``LightningCLI`` for ``PipelineModule`` models and ``TextDataModule`` data.

    Differences from the stock CLI: an ``optimizer:`` given in the config is built when training starts, from
    the ``named_parameters()`` the model has then (each pipeline stage only its own; a hybrid optimizer can route
    them by name); an ``lr_scheduler:`` steps every optimizer step; ``fit`` says where its TensorBoard logs go.
    """

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", PipelineModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", TextDataModule)
        kwargs.setdefault("trainer_defaults", TRAINER_DEFAULTS)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(args=args, **kwargs)

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        # LightningCLI builds the `optimizer:` (and `lr_scheduler:`) here, from every parameter of the model.
        # Under pipeline parallelism a stage may only optimize its own layers, which are known only after the
        # strategy's setup, so record the configuration now and build them in `configure_optimizers`.
        with mock.patch.object(lightning.pytorch.cli, "instantiate_class", _Deferred):
            super()._add_configure_optimizers_method_to_model(subcommand)

    @staticmethod
    def configure_optimizers(lightning_module: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        """Build the configured optimizer from the module's named parameters (so a hybrid optimizer such as
        ``optim.Muon`` can route them by name) and step the scheduler every optimizer step, not every epoch."""
        if isinstance(optimizer, _Deferred):
            optimizer = instantiate_class(lightning_module.named_parameters(), optimizer.init)
        if isinstance(lr_scheduler, _Deferred):
            lr_scheduler = instantiate_class(optimizer, lr_scheduler.init)
        if lr_scheduler is None:
            return optimizer
        scheduler: dict[str, Any] = {"scheduler": lr_scheduler, "interval": "step"}
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            scheduler["monitor"] = lr_scheduler.monitor
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def before_fit(self) -> None:
        _print_tensorboard_hint(self.trainer, "Training")

    def after_fit(self) -> None:
        _print_tensorboard_hint(self.trainer, "Finished")


@rank_zero_only
def _print_tensorboard_hint(trainer: Any, what: str) -> None:
    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    for lg in loggers:
        print(f"{what}: TensorBoard logs in {os.path.abspath(lg.log_dir)}\n"
              f"  view them with: tensorboard --logdir {lg.root_dir or lg.save_dir}", flush=True)


class _Deferred:
    """Stands in for an optimizer or scheduler until ``configure_optimizers`` builds it."""

    def __init__(self, args: Any, init: dict[str, Any]) -> None:
        self.init = init


def main(args: ArgsType = None) -> None:
    # Returns nothing: the console script passes the return value to sys.exit().
    AsyncPipelineCLI(args=args)


if __name__ == "__main__":
    main()
