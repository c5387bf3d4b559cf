"""The entry point the llm_batch materialization calls (macros/materializations/llm_batch.sql)."""

from __future__ import annotations

from dbt_llm_batch.dbt.log import forward_to_dbt
from dbt_llm_batch.pipeline import runner


def run_model(con, **payload):
    """Run one llm_batch model; everything the package logs reaches dbt's log."""
    forward_to_dbt()
    return runner.run_model(con, **payload)
