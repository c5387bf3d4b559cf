"""The entry point's old name, which the materialization of dbt-llm-batch 0.1.0 calls."""

from dbt_llm_batch.dbt.entry import run_model

__all__ = ["run_model"]
