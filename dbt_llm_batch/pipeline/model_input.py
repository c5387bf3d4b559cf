"""The model's selected rows, loaded once per run as a temp table (Scratch.input): a SQL model's query
with each row's key, prompt hash and prompt length computed in the same pass (plan.PRECOMPUTED), or a
Python model's rows streamed from dbt's connection."""

from __future__ import annotations

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.errors import InputError
from dbt_llm_batch.pipeline import plan
from dbt_llm_batch.pipeline.scratch import Scratch


def input_connection(con, df):
    """The connection the run works on, and the rows to load.

    A Python model's relation lives on dbt's own connection, which a pre-hook may have left inside
    a transaction (and with an unfinished result): its rows are streamed as Arrow into a connection
    of our own, so ledger writes autocommit whatever dbt's transaction does.
    """
    import duckdb

    if isinstance(df, duckdb.DuckDBPyRelation):
        if hasattr(con, "complete"):
            con.complete()
        return con.cursor(), df.to_arrow_reader(100_000)
    return con, df


def load_input(con, sql: str | None, df, config: ModelConfig | None = None) -> bool:
    """Materialise the model's rows once as a temp table: a SQL model's query, or a Python model's
    rows (an Arrow reader, Arrow table or pandas frame). With a SQL model's `config`, each row's key,
    prompt hash and prompt length (plan.PRECOMPUTED) are computed in the same pass, so the prompts are
    read once, not again by plan.build_desired; returns whether they were."""
    if sql is not None:
        import duckdb

        facts = _row_facts(con, sql, config) if config is not None else None
        if facts is not None:
            try:
                con.execute(
                    f"create or replace temp table {Scratch.input} as select *, {facts} from (\n{sql}\n) model_sql"
                )
                return True
            except duckdb.InterruptException:  # Ctrl-C (dbt cancels the query): stop, don't copy again
                raise
            except duckdb.Error:
                pass  # copied as it is below: the user's SQL fails there as it would have, or check_input says why
        try:
            con.execute(f"create or replace temp table {Scratch.input} as {sql}")
        except duckdb.InterruptException:
            raise
        except duckdb.Error as exc:  # the user's SQL: DuckDB's message is the one to show, as dbt would
            raise InputError(f"the model's SQL failed, nothing was sent: {exc}") from None
        return False
    con.register(Scratch.input_view, df)
    con.execute(f"create or replace temp table {Scratch.input} as select * from {Scratch.input_view}")
    con.unregister(Scratch.input_view)
    return False


def _row_facts(con, sql: str, config: ModelConfig) -> str | None:
    """plan.PRECOMPUTED as SQL over the model's query, when its columns (bound, not run) have the key
    and prompt columns, distinct names and none of PRECOMPUTED's; else None (the rows are copied as
    they are, and plan.check_input says what is wrong, if anything)."""
    import duckdb

    try:
        columns = [(r[0], r[1]) for r in con.execute(f"describe (\n{sql}\n)").fetchall()]
    except duckdb.InterruptException:
        raise
    except duckdb.Error:
        return None
    names = [c[0].lower() for c in columns]
    needed = [k.lower() for k in (*config.unique_key, config.prompt_column)]
    if len(set(names)) < len(names) or not set(needed) <= set(names) or set(names) & set(plan.PRECOMPUTED):
        return None
    return ", ".join(
        f"{value} as {name}" for value, name in zip(plan.row_facts_sql(config, columns), plan.PRECOMPUTED, strict=True)
    )
