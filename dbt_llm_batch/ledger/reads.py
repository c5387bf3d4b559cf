"""Reading a ledger for people: the one query layer behind `dbt-llm-batch status`, `dbt-llm-batch
report` and its FOCUS export. Every figure is read from the reporting views (store.VIEWS), so what
a command shows is what a user querying the views sees; a figure no view holds is added to a view,
not computed here. Each method returns a DuckDB relation (`.show()`, `.fetchall()`, `.pl()`...).

`open_ledger` opens the DuckDB file the way every read-only command does (read-only, or sharing a
connection this process already has open read-write), and says how to fix what stops it.
"""

from __future__ import annotations

import os

import duckdb

from dbt_llm_batch.errors import LlmBatchError
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, PRE_SUBMISSION, RequestStatus, sql, sql_in
from dbt_llm_batch.sql import ident


class LedgerNotReadable(LlmBatchError):
    """The database cannot be opened, or holds no ledger in the schema (the message says which)."""


def open_ledger(database: str, command: str) -> duckdb.DuckDBPyConnection:
    """A connection to `database` for the read-only `command` (named in messages), or LedgerNotReadable."""
    if os.path.isdir(database):
        raise LedgerNotReadable(f"{database} is a directory: pass the DuckDB file your dbt profile writes (its `path`)")
    if not os.path.exists(database):
        raise LedgerNotReadable(f"no DuckDB file at {database}: pass the file your dbt profile writes (its `path`)")
    try:
        return duckdb.connect(database, read_only=True)
    except duckdb.ConnectionException:
        # This process already has the file open read-write (a notebook, or dbt in-process): share it.
        return duckdb.connect(database)
    except duckdb.IOException as exc:
        from dbt_llm_batch.ledger.locks import is_lock_conflict, lock_conflict_message

        blocked = f"`{command}` cannot read it"
        why = lock_conflict_message(database, str(exc), blocked) if is_lock_conflict(exc) else str(exc)
        raise LedgerNotReadable(f"cannot open {database}: {why}") from exc


class LedgerReads:
    """The reporting views of the ledger in `schema`, as the commands show them."""

    def __init__(self, con: duckdb.DuckDBPyConnection, schema: str = "main"):
        self.con, self.schema, self.s = con, schema, ident(schema)

    def _has(self, table: str, column: str | None = None) -> bool:
        where = " and column_name = ?" if column else ""
        return bool(
            self.con.execute(
                f"select count(*) from information_schema.columns where table_schema = ? and table_name = ?{where}",
                [self.schema, table, *([column] if column else [])],
            ).fetchall()[0][0]
        )

    def exists(self) -> bool:
        return self._has("llm_batch_progress")

    def has_dedup(self) -> bool:
        """Ledgers from schema version 14 count rows apart from requests (llm_dedup)."""
        return self._has("llm_batch_costs", "dedup_saved_usd")

    def has_report_views(self) -> bool:
        """Ledgers from schema version 22 have the caching saving, failures by kind and FOCUS views."""
        return self._has("llm_batch_focus")

    # --- work in flight ----------------------------------------------------------------------------

    def in_flight(self) -> duckdb.DuckDBPyRelation:
        """Open jobs (batches and realtime jobs not harvested), oldest first."""
        return self.con.sql(f"select * from {self.s}.llm_batch_in_flight order by submitted_at")

    def open_batches(self) -> duckdb.DuckDBPyRelation:
        """Open batches with their age in hours (against the providers' 24 h completion window)."""
        return self.con.sql(f"""select provider, model, variant, batch_id, status, request_count,
                                       round(epoch(age) / 3600, 2) as age_hours
                                from {self.s}.llm_batch_in_flight where batch_id is not null
                                order by submitted_at""")

    def progress(self) -> duckdb.DuckDBPyRelation:
        return self.con.sql(f"select * from {self.s}.llm_batch_progress order by model, variant")

    def held(self) -> duckdb.DuckDBPyRelation:
        return self.con.sql(f"""select model, count(*) as requests_held from {self.s}.llm_batch_requests
                                where status = {sql(RequestStatus.HELD)} group by model order by model""")

    def interrupted(self) -> duckdb.DuckDBPyRelation:
        """Submissions whose batch id is not known (reconciliation holds them)."""
        return self.con.sql(f"""select model, job_id, status, request_count as requests,
                                       date_trunc('second', now() - created_at) as age, error
                                from {self.s}.llm_batch_jobs where batch_id is null and harvested_at is null
                                  and status in {sql_in(PRE_SUBMISSION)} order by created_at""")

    def orphans(self) -> duckdb.DuckDBPyRelation:
        """In-flight requests whose job row is missing."""
        return self.con.sql(f"""select model, count(*) as requests from {self.s}.llm_batch_requests
                                where status in {IN_FLIGHT_SQL}
                                  and job_id not in (select job_id from {self.s}.llm_batch_jobs)
                                group by model order by model""")

    def failures(self) -> duckdb.DuckDBPyRelation:
        """Failed requests by kind (llm_batch_failures)."""
        return self.con.sql(f"""select failure_kind, sum(requests_final) as requests_final,
                                       sum(requests_retried) as requests_retried
                                from {self.s}.llm_batch_failures group by failure_kind order by failure_kind""")

    # --- money -------------------------------------------------------------------------------------

    def costs(self) -> duckdb.DuckDBPyRelation:
        """llm_batch_costs: per model, provider, day, route and variant."""
        return self.con.sql(f"select * from {self.s}.llm_batch_costs order by model, day, route")

    def spend_by_day(self) -> duckdb.DuckDBPyRelation:
        """Cost against the same answers at realtime prices, per day (priced requests only)."""
        return self.con.sql(f"""select day, sum(cost_usd) as cost_usd,
                                       sum(coalesce(realtime_cost_usd, cost_usd)) as realtime_cost_usd
                                from {self.s}.llm_batch_costs where cost_usd is not null
                                group by day order by day""")

    def spend_by_model(self) -> duckdb.DuckDBPyRelation:
        """The same per dbt model and evaluation variant ('default': the model's own config)."""
        return self.con.sql(f"""select model, coalesce(nullif(variant, ''), 'default') as variant,
                                       sum(cost_usd) as cost_usd,
                                       sum(coalesce(realtime_cost_usd, cost_usd)) as realtime_cost_usd
                                from {self.s}.llm_batch_costs where cost_usd is not null
                                group by all order by model, variant""")

    def savings_by_lever(self) -> duckdb.DuckDBPyRelation:
        """What each lever saved: the batch discount (realtime cost - cost), prompt caching
        (cost without caching - cost) and deduplication (rows answered by a request sent once)."""
        return self.con.sql(f"""select coalesce(sum(savings_usd), 0) as batch_discount_usd,
                                       coalesce(sum(cache_saved_usd), 0) as prompt_caching_usd,
                                       coalesce(sum(dedup_saved_usd), 0) as deduplication_usd
                                from {self.s}.llm_batch_costs""")

    def totals(self) -> duckdb.DuckDBPyRelation:
        """Whole-ledger cost, its realtime counterfactual, and what is committed but not billed yet."""
        return self.con.sql(f"""select coalesce(sum(cost_usd), 0) as cost_usd,
                                       coalesce(sum(coalesce(realtime_cost_usd, cost_usd)), 0) as realtime_cost_usd,
                                       coalesce(sum(committed_not_billed_usd), 0) as committed_not_billed_usd
                                from {self.s}.llm_batch_costs""")

    def focus(self) -> duckdb.DuckDBPyRelation:
        """The FOCUS cost dataset (ledger/focus.py), one row per charge."""
        return self.con.sql(
            f"select * from {self.s}.llm_batch_focus order by ChargePeriodStart, ResourceId, SkuId, ChargeDescription"
        )

    # --- evaluation runs ---------------------------------------------------------------------------

    def evaluation_relations(self) -> list[tuple[str, str, str]]:
        """(schema, table, accuracy column) of each table or view in the database shaped like
        `dbt_llm_batch.variant_report` output: a `variant` and a `cost_usd` column and an
        `<output>_accuracy` column (the first by position, when there are several)."""
        return [
            (schema, table, column)
            for schema, table, column in self.con.execute(
                """select table_schema, table_name, min_by(column_name, ordinal_position)
                   from information_schema.columns c
                   where column_name like '%\\_accuracy' escape '\\'
                     and exists (select 1 from information_schema.columns v where v.table_schema = c.table_schema
                                 and v.table_name = c.table_name and v.column_name = 'variant')
                     and exists (select 1 from information_schema.columns v where v.table_schema = c.table_schema
                                 and v.table_name = c.table_name and v.column_name = 'cost_usd')
                   group by all order by all"""
            ).fetchall()
        ]

    def evaluation(self, schema: str, table: str, accuracy: str) -> duckdb.DuckDBPyRelation:
        """Per variant, its accuracy and cost, as the evaluation table has them (variants not judged
        yet, with no accuracy, left out)."""
        return self.con.sql(f"""select cast(variant as varchar) as variant, cast({ident(accuracy)} as double) as accuracy,
                                       cast(cost_usd as double) as cost_usd
                                from {ident(schema)}.{ident(table)} where {ident(accuracy)} is not null
                                order by variant""")
