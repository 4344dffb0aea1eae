"""A failure of one stage under ``AsyncPipelineStrategy``: reported to the other stages at once (through the
engine's board), before Lightning's exception handling runs, and SIGTERM checked locally instead of Lightning's
per-step broadcast (a barrier across all stages). A mixin, as ``state.py``'s hooks are; see
docs/design/checkpoints.md, "Faults".
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp.pipeline.comm import is_lost_connection


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
        # A lost connection (a collective whose peer died, say) is another process's failure: reporting it would
        # name this survivor as the stage that failed.
        if self.is_multiprocess and self.engine is not None and not is_lost_connection(err):
            message = f"stage {self.topology.stage} (rank {self.global_rank}) failed: {type(err).__name__}: {err}"
            self.engine.board.report(message)
            # Said here too: Lightning's launcher may stop the other processes before they can repeat it.
            print(f"lightning_async_pp: {message}", file=sys.stderr, flush=True)

    def on_exception(self, exception: BaseException) -> None:
        self._report_failure(exception)
        self.finish_pending_save(failing=True)
        super().on_exception(exception)
