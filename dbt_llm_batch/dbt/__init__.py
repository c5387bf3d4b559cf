"""The dbt glue: the entry point the llm_batch materialization calls, the dbt-duckdb plugin, and the
bridge from the package's log to dbt's. The only part of the package that imports dbt."""
