"""The dbt-duckdb plugin under the name profiles.yml gives it (`module: dbt_llm_batch.duckdb_plugin`)."""

from dbt_llm_batch.dbt.plugin import Plugin

__all__ = ["Plugin"]
