"""A failure of one stage under ``AsyncPipelineStrategy``: reported to the other stages at once (through the
engine's board), before Lightning's exception handling runs, and SIGTERM checked locally instead of Lightning's
per-step broadcast (a barrier across all stages). A mixin, as ``state.py``'s hooks are; see
docs/design/checkpoints.md, "Faults".

What the processes print: the failing process prints its error and traceback when it happens, first and once;
every other process, stopped by it (a lost connection, the board's report), prints one line saying so when the
error leaves its script, instead of a traceback of the connection its peer closed.
"""
from __future__ import annotations

import io
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp.pipeline.comm import FailureBoard, PipelineFailure, is_lost_connection

#: Set on an exception whose uncaught report this process replaces: a callable giving what to print instead of
#: its traceback (``None``: nothing; the traceback was printed when it happened).
_AT_EXIT = "_lightning_async_pp_at_exit"
_PRINTED = "_lightning_async_pp_printed"  # set on this process's own failure, printed when it was raised
_HOOKED = [False]  # sys.excepthook wrapped once per process


class FailureReporting:
    """Mixed into ``AsyncPipelineStrategy`` (before ``DDPStrategy``, whose ``on_exception`` this extends)."""

    def _check_sigterm_locally(self) -> None:
        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            if self.engine is not None:
                self.engine.board.report(f"stage {self.topology.stage} (rank {self.global_rank}) received SIGTERM")
            raise SIGTERMException()

    @contextmanager
    def _reporting_failures(self) -> Iterator[None]:
        """Report a failure of this stage at once, before Lightning's exception handling (whose callbacks may
        wait for the other stages) runs."""
        try:
            yield
        except BaseException as err:
            self._report_failure(err)
            raise

    def _report_failure(self, err: BaseException) -> None:
        if err is self._reported:
            return  # reported where it was raised; on_exception sees it again
        self._reported = err
        if not self.is_multiprocess or self.engine is None:
            return
        who = f"stage {self.topology.stage} (rank {self.global_rank})"
        board = self.engine.board
        if is_lost_connection(err):
            # Another process's failure (a collective whose peer died, the board's report), which that process
            # prints: reporting it would name this survivor as the stage that failed.
            replace_uncaught_report(err, lambda: f"lightning_async_pp: {who} stopped because {_cause(err, board)}")
            return
        message = f"{who} failed: {type(err).__name__}: {err}"
        if isinstance(err, (KeyboardInterrupt, SIGTERMException)):  # a stop, often of every process: no traceback
            print(f"lightning_async_pp: {message}", file=sys.stderr, flush=True)
            board.report(message)
            return
        # Printed here, before the others learn of it (Lightning's launcher may stop this process once they do),
        # and not again when it leaves the script.
        print(f"lightning_async_pp: {who} failed:\n{''.join(traceback.format_exception(err))}", end="",
              file=sys.stderr, flush=True)
        replace_uncaught_report(err, lambda: None)
        with suppress(AttributeError):
            setattr(err, _PRINTED, True)
        board.report(message, summary=f"{who} failed with {type(err).__name__} (its error is printed by that "
                                      f"process)")

    def on_exception(self, exception: BaseException) -> None:
        self._report_failure(exception)
        self.finish_pending_save(failing=True)
        super().on_exception(exception)


@contextmanager
def not_raised_over_a_failure(module: Any) -> Iterator[None]:
    """Within (the strategy's teardown, which Lightning runs inside its exception handler when the call fails): an
    error while the call is failing is printed on one line instead of raised, since raised it would replace the
    call's own error ("Cannot copy out of meta tensor" over a refusal at setup). Raised as usual otherwise."""
    try:
        failing = module is not None and bool(module.trainer.interrupted)
    except RuntimeError:  # a module that is not attached to a trainer
        failing = False
    try:
        yield
    except Exception as err:
        if not failing:
            raise
        print(f"lightning_async_pp: tearing down after the failure also raised {type(err).__name__}: "
              f"{' '.join(str(err).split())}; the failure is the call's error", file=sys.stderr, flush=True)


def _cause(err: BaseException, board: FailureBoard) -> str:
    """Why this process stopped, on one line: the failing stage's summary where it posted one, else what is known."""
    failure = err if isinstance(err, PipelineFailure) else None
    if failure is None or failure.summary is None:
        try:
            board.check()  # a raw lost connection (a tensor-parallel collective's): the board may name the stage
        except PipelineFailure as posted:
            failure = posted
    if failure is not None and failure.summary is not None:
        return failure.summary
    text = " ".join(str(failure if failure is not None else err).split())
    return text if failure is not None else f"another process failed or died ({type(err).__name__}: {text})"


def printed_when_raised(err: BaseException) -> bool:
    """Whether this process printed ``err`` with its traceback when it was raised (the failing stage's error):
    whoever reports errors later (the console script) need not repeat it."""
    return getattr(err, _PRINTED, False)


def replace_uncaught_report(err: BaseException, line: Callable[[], Optional[str]]) -> None:
    """If ``err`` leaves the script uncaught, print ``line()`` (if not None) instead of its traceback. The hook
    that was in place (torch's, which prefixes each line with the rank, and any other: an error reporter) still
    runs, its printing discarded; other exceptions are left to it."""
    try:
        setattr(err, _AT_EXIT, line)
    except AttributeError:  # an exception type without attributes: reported as usual
        return
    if not _HOOKED[0]:
        _HOOKED[0] = True
        sys.excepthook = _replacing_reports(sys.excepthook)


def _replacing_reports(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        line = getattr(exc, _AT_EXIT, None)
        if line is None:
            previous(exc_type, exc, tb)
            return
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            previous(exc_type, exc, tb)
        finally:
            sys.stderr = stderr
        text = line()
        if text is not None:
            print(text, file=sys.stderr, flush=True)

    return hook
