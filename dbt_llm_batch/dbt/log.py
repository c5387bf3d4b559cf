"""Forwards the package's log (dbt_llm_batch.log) to dbt's: logs/dbt.log and the console.

A record marked USER_WARNING becomes dbt's JinjaLogWarning (what `exceptions.warn` fires), which dbt
shows as [WARNING] and turns into an error under `--warn-error` / `warn_error_options`; the exception
that raises then propagates out of the logging call, so the run fails as dbt says it should.
"""

from __future__ import annotations

import logging

from dbt.adapters.events.logging import AdapterLogger
from dbt.events.types import JinjaLogWarning
from dbt_common.events.functions import warn_or_error

from dbt_llm_batch.log import USER_WARNING, log


class DbtLogHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.adapter_log = AdapterLogger("llm_batch")

    def emit(self, record: logging.LogRecord) -> None:  # no try/except: a --warn-error failure must propagate
        message = record.getMessage()
        if getattr(record, USER_WARNING, False):
            warn_or_error(JinjaLogWarning(msg=message))
        elif record.levelno >= logging.ERROR:
            self.adapter_log.error(message)
        elif record.levelno >= logging.WARNING:
            self.adapter_log.warning(message)
        elif record.levelno >= logging.INFO:
            self.adapter_log.info(message)
        else:
            self.adapter_log.debug(message)


def forward_to_dbt() -> None:
    """Attach the handler once per process (dbt runs models on threads of one process)."""
    if not any(isinstance(h, DbtLogHandler) for h in log.handlers):
        log.addHandler(DbtLogHandler())
    # dbt's event tracker (snowplow_tracker) calls logging.basicConfig() on import: a root handler that
    # would print every line a second time on stderr. Inside dbt, dbt's log is the one destination.
    log.propagate = False
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


def debug_to_dbt(message: str) -> None:
    """A debug line straight to dbt's log (logs/dbt.log, and the console with --debug); the package's
    logger stops at INFO, so that its debug chatter stays out of dbt's log."""
    AdapterLogger("llm_batch").debug(message)
