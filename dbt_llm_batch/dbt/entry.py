"""The entry point the llm_batch materialization calls (macros/materializations/llm_batch.sql)."""

from __future__ import annotations

from dbt_llm_batch.pipeline.runner import run_model

__all__ = ["run_model"]
