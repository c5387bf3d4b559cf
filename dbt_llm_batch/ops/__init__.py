"""Operator commands (status, cancel, release, requeue, unlock, ...) and the `dbt-llm-batch` CLI."""
