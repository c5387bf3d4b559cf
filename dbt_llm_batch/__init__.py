"""dbt-llm-batch: enrich warehouse tables with LLMs at batch prices, from dbt."""

# The one place the version is written for Python (pyproject.toml reads it). The dbt package's
# dbt_project.yml and the materialization macro carry the same string: the macro passes it to
# dbt_llm_batch.dbt.entry, which refuses to run when the two halves were released apart.
__version__ = "0.2.0"


def __getattr__(name: str):
    """`dbt_llm_batch.poll(database=...)` and its PollResult (ops/poller.py), for orchestrators'
    sensors; imported on first use, so importing the package stays light."""
    if name in ("poll", "PollResult"):
        from dbt_llm_batch.ops import poller

        return getattr(poller, name)
    raise AttributeError(f"module 'dbt_llm_batch' has no attribute {name!r}")
