"""The entry point's old name, which the materialization of dbt-llm-batch 0.1.0 calls.

That macro does not pass its version, so any call here comes from a dbt package older than this
Python package: it fails with the same message as any other mismatch (dbt_llm_batch.dbt.entry).
"""

from dbt_llm_batch.dbt.entry import run_model as _run_model


def run_model(con, **payload):
    return _run_model(con, package_version=None, **payload)


__all__ = ["run_model"]
