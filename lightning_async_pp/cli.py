"""The ``lightning-async-pp`` console script: a ``LightningCLI`` with ``fit``, ``validate`` and ``test``.

    lightning-async-pp fit --config configs/demo.yaml
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import linecache
import os
import re
import sys
import textwrap
from argparse import ArgumentError
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

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # partition="balanced" costs the layers on one microbatch shaped as the data module's (shapes only).
        model, data = getattr(self, "model", None), getattr(self, "datamodule", None)
        if (isinstance(model, PipelineModule) and model.pipeline_example_batch is None
                and callable(getattr(data, "example_batch", None))):
            rows = 1
            strategy = getattr(self, "trainer", None) and self.trainer.strategy
            batch_size = getattr(data, "batch_size", None)
            try:  # the strategy's count, its default (max(4, stages)) included
                microbatches = getattr(strategy, "num_microbatches", None)
            except ValueError:  # a layout the strategy refuses at setup, with its own message
                microbatches = None
            if isinstance(batch_size, int) and isinstance(microbatches, int) and batch_size % microbatches == 0:
                rows = batch_size // microbatches
            model.pipeline_example_batch = data.example_batch(rows)

    def add_arguments_to_parser(self, parser: Any) -> None:
        # --model.help comes with the model's subclass mode; the data module's options are the data: keys themselves.
        # In the data's subclass mode LightningCLI adds --data.help itself; without a data module there is none.
        if self.datamodule_class is not None and not self.subclass_mode_data:
            parser.add_argument("--data.help", action=_DataHelp, data_class=self.datamodule_class)

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


class _DataHelp(argparse.Action):
    """``--data.help``: the data module's options (the ``data:`` keys), as ``--model.help`` shows the model's."""

    def __init__(self, option_strings: Any, dest: str, data_class: Any = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help=f"Show the help for the data module ({data_class.__name__}) and exit.")
        self.data_class = data_class

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        help_parser = type(parser)(prog=parser.prog, description=f"Help for --data ({self.data_class.__module__}."
                                               f"{self.data_class.__qualname__}): the keys under data:")
        help_parser.add_class_arguments(self.data_class, "data")
        help_parser.print_help()
        parser.exit()


class _Deferred:
    """Stands in for an optimizer or scheduler until ``configure_optimizers`` builds it."""

    def __init__(self, args: Any, init: dict[str, Any]) -> None:
        self.init = init


class ConfigurationError(Exception):
    """A configuration the console script could not parse or instantiate; the message is its reason, one line."""


class _ConsoleCLI(AsyncPipelineCLI):
    """The console script's CLI: a configuration that cannot be parsed or whose classes refuse their arguments
    raises :class:`ConfigurationError` with the reason on one line, instead of ending in the usage text or in a
    chained traceback where jsonargparse's union errors bury it. Errors while training keep their traceback."""

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"exit_on_error": False})  # parse errors raise instead of printing usage
        super().__init__(args=args, **kwargs)

    def parse_arguments(self, parser: Any, args: ArgsType) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            reason = one_line_reason(str(err))
            raise ConfigurationError(reason + _did_you_mean_key(reason, parser)) from err

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except _REFUSALS as err:
            raise ConfigurationError(one_line_reason(str(err))) from err


#: What a class raises when it refuses its configuration (a bad value, a missing file, a class_path not found).
_REFUSALS = (ValueError, TypeError, OSError, ImportError)


def one_line_reason(message: str) -> str:
    """The reason in a jsonargparse error message, on one line.

    jsonargparse nests its messages: ``Parser key "k":`` over an indented message, a union's "Does not validate
    against any of the Union subtypes" listing each alternative's error (one is usually only "Expected a <class
    'str'>": the value was not the other type), ``Problem with given class_path 'C':`` over the class's own error.
    This keeps the keys and the class, and the one error that is not a type mismatch (with a "did you mean" for an
    option the class does not take); anything else is joined into one line."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return message
    head, body = lines[0].strip(), textwrap.dedent("\n".join(lines[1:]))
    key = re.fullmatch(r'Parser key "([^"]+)":', head)
    if key:
        return f"{key.group(1)}: {one_line_reason(body)}"
    class_path = re.fullmatch(r"Problem with given class_path '([^']+)':", head)
    if class_path:
        reason = one_line_reason(body)
        option = re.fullmatch(r"Option '([^']+)' is not accepted", reason)
        if option:
            reason = f"{option.group(1)!r} is not one of its options{_did_you_mean(option.group(1), class_path.group(1))}"
        return f"{class_path.group(1).rsplit('.', 1)[-1]}: {reason}"
    if head.startswith("Does not validate against any of the Union subtypes") and "Errors:" in message:
        return _union_reason(lines)
    return " ".join(line.strip() for line in lines)


def _union_reason(lines: list[str]) -> str:
    start = next(i for i, line in enumerate(lines) if line.strip() == "Errors:") + 1
    indent = len(lines[start]) - len(lines[start].lstrip())
    errors: list[list[str]] = []
    given = ""
    for line in lines[start:]:
        depth = len(line) - len(line.lstrip())
        if depth < indent:  # past the list: "Given value type", "Given value"
            if line.strip().startswith("Given value:"):
                given = line.strip()[len("Given value:"):].strip()
            continue
        if depth == indent and line.lstrip().startswith("- "):
            errors.append([line.lstrip()[2:]])
        elif errors:
            errors[-1].append(line)
    mismatch = re.compile(r"Expected a <class '([^']+)'>(\. Got value: .*)?")
    real = [e for e in errors if not mismatch.fullmatch(e[0].strip())]
    if real:
        return one_line_reason("\n".join([real[0][0], *real[0][1:]]))
    expected = [mismatch.fullmatch(e[0].strip()).group(1) for e in errors]  # type: ignore[union-attr]
    return f"expected {' or '.join(expected)}, got {given!r}" if given else f"expected {' or '.join(expected)}"


def _did_you_mean(option: str, class_path: str) -> str:
    try:
        module, name = class_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        options = list(inspect.signature(cls).parameters)
    except (ImportError, AttributeError, ValueError, TypeError):
        return ""
    close = difflib.get_close_matches(option, options, 1)
    if close or cls is not PipelineModule:
        return f" (did you mean {close[0]!r}?)" if close else ""
    # The model's class was not known where the option was read (it came before --model=<class> or the config's
    # class_path): the close option among the package's models', and the order that takes it.
    import lightning_async_pp.models as models

    takes: dict[str, list[str]] = {}
    for model in (models.Llama, models.GPT, models.HuggingFaceCausalLM, models.LitGPT):
        for known in inspect.signature(model).parameters:
            takes.setdefault(known, []).append(model.__name__)
    close = difflib.get_close_matches(option, list(takes), 1)
    meant = f"did you mean {close[0]!r}? " if close and close[0] != option else ""
    owners = f"{close[0]!r} is an option of {', '.join(takes[close[0]])}; " if close else ""
    return (f" ({meant}{owners}the model's options come after its class: --model=<class> or a --config with "
            f"model: class_path, given first)")


def own_refusal(err: BaseException) -> bool:
    """Whether ``err`` is one of this package's checks refusing a value: a ``ValueError`` or ``TypeError`` that a
    ``raise`` statement in ``lightning_async_pp`` raised. One that torch or Lightning raised, or that Python raised
    inside this package (a bug), is not: it keeps its traceback."""
    if not isinstance(err, (ValueError, TypeError)) or err.__traceback__ is None:
        return False
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    package = os.path.dirname(os.path.abspath(lightning_async_pp.__file__))
    return (filename.startswith(package + os.sep)
            and linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise "))


def _did_you_mean_key(reason: str, parser: Any) -> str:
    """A "did you mean" for a key no subcommand takes (``data.documnet_mask``, from a config file or the command
    line), from the keys the subcommands' parsers hold."""
    unknown = (re.fullmatch(r"Subcommand '\w+' does not accept option '([^']+)'", reason)
               or re.fullmatch(r"unrecognized arguments: --([^\s=]+).*", reason))
    subcommands = getattr(parser, "_subcommands_action", None)
    if unknown is None or subcommands is None:
        return ""
    keys = {action.dest for sub in subcommands._name_parser_map.values() for action in sub._actions}
    close = difflib.get_close_matches(unknown.group(1), sorted(keys), 1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def main(args: ArgsType = None) -> None:
    """The ``lightning-async-pp`` console script. A refused configuration ends with its reason as the last line
    (exit status 2, as argparse's), and so does a value one of this package's checks refuses once the run started
    (exit status 1; other errors keep their traceback); ``JSONARGPARSE_DEBUG=true`` raises both with the traceback
    instead."""
    # Returns nothing: the console script passes the return value to sys.exit().
    if os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true":  # as jsonargparse reads it (it refuses "1")
        AsyncPipelineCLI(args=args)
        return
    try:
        _ConsoleCLI(args=args)
    except ConfigurationError as err:
        print("lightning-async-pp: the configuration was refused (--help lists the options; JSONARGPARSE_DEBUG=true "
              "shows the traceback)", file=sys.stderr)
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (ValueError, TypeError) as err:
        if not own_refusal(err):
            raise
        from lightning_async_pp.strategy.failures import printed_when_raised

        if not printed_when_raised(err):  # a failing stage of several printed it, with its traceback, at once
            print(f"lightning-async-pp: the run was stopped by a check ({type(err).__name__}; JSONARGPARSE_DEBUG="
                  f"true shows the traceback)", file=sys.stderr)
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
