"""The run log users read: dbt's own log (logs/dbt.log and the console) inside dbt, else Python logging."""

from __future__ import annotations


def logger():
    try:
        from dbt.adapters.events.logging import AdapterLogger

        return AdapterLogger("llm_batch")
    except ImportError:  # outside dbt (unit tests, scripts)
        import logging

        return logging.getLogger("dbt_llm_batch")


def warn_user(message: str) -> None:
    """A warning dbt treats as one of its own: shown as [WARNING], and turned into an error by
    `--warn-error` or `warn_error_options` (dbt's JinjaLogWarning, as `exceptions.warn` fires it)."""
    try:
        from dbt.events.types import JinjaLogWarning
        from dbt_common.events.functions import warn_or_error
    except ImportError:  # outside dbt
        logger().warning(message)
        return
    warn_or_error(JinjaLogWarning(msg=message))
