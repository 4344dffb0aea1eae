"""The ``lightning-async-pp`` console script: a ``LightningCLI`` with ``fit``, ``validate`` and ``test``.

    lightning-async-pp fit --config configs/demo.yaml
"""
from __future__ import annotations

import os
from typing import Any, Optional

# Importing the package first registers the "async_pipeline" strategy name with Lightning.
import lightning_async_pp  # noqa: F401
from lightning.pytorch.cli import ArgsType, LightningCLI
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

    Differences from the stock CLI: an ``optimizer:`` given in the config is built from the model's
    ``named_parameters()`` (so a hybrid optimizer can route parameters by name), and ``fit`` says where its
    TensorBoard logs go.
    """

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", PipelineModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", TextDataModule)
        kwargs.setdefault("trainer_defaults", TRAINER_DEFAULTS)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(args=args, **kwargs)

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        # LightningCLI instantiates the `optimizer:` class with `self.model.parameters()`. Hand it the named
        # parameters instead (torch optimizers accept (name, tensor) pairs) for the duration of that call.
        model = self.model
        model.parameters = model.named_parameters  # type: ignore[method-assign]
        try:
            super()._add_configure_optimizers_method_to_model(subcommand)
        finally:
            del model.parameters

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


def main(args: ArgsType = None) -> None:
    # Returns nothing: the console script passes the return value to sys.exit().
    AsyncPipelineCLI(args=args)


if __name__ == "__main__":
    main()
