"""The package's one logger. Every module logs to `dbt_llm_batch`; inside dbt the dbt glue forwards
it to dbt's own log (logs/dbt.log and the console, see dbt_llm_batch/dbt/log.py); elsewhere (the CLI,
scripts, unit tests) it is ordinary Python logging."""

from __future__ import annotations

import logging

log = logging.getLogger("dbt_llm_batch")

# Set on a record that dbt should treat as one of its own warnings (turned into an error by --warn-error).
USER_WARNING = "dbt_llm_batch_user_warning"


def warn_user(message: str) -> None:
    """A warning the user must act on: inside dbt, a dbt warning (see dbt_llm_batch/dbt/log.py)."""
    log.warning(message, extra={USER_WARNING: True})
