"""The run log users read: dbt's own log (logs/dbt.log and the console) inside dbt, else Python logging."""

from __future__ import annotations


def logger():
    try:
        from dbt.adapters.events.logging import AdapterLogger
        return AdapterLogger("llm_batch")
    except ImportError:  # outside dbt (unit tests, scripts)
        import logging
        return logging.getLogger("dbt_llm_batch")
