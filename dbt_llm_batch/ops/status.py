"""`dbt-llm-batch status`: what is in flight, how complete each model's table is, and what it cost,
from the ledger's views (ledger/store.py VIEWS).

Three shapes of the same sections: the default fits a 100-column terminal (the columns an operator
reads first; rows and requests apart; the variant column only when a model has variants), `--wide`
every column of the views, `--json` every column as one JSON object (for scripts). Without
`--database` the DuckDB file and schema are the dbt profile's (ops/profile.py), as dbt reads them.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass

from dbt_llm_batch.ledger.reads import LedgerNotReadable, open_ledger
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, PRE_SUBMISSION, RequestStatus, sql, sql_in

WIDTH = 100  # the default output's widest line


@dataclass(frozen=True)
class Section:
    key: str  # its name in --json
    title: str  # one line, under 100 characters (tests and scripts find a section by it)
    brief: str  # the columns shown by default (a SELECT list over `source`)
    source: str  # the rows, every column (--wide, --json); {s} is the ledger schema
    shown_if_empty: bool = True  # the operator's exceptions are printed only when there are some
    note: str = ""  # what the columns mean, or what to do: printed under the title, wrapped


SECTIONS = (
    Section(
        "in_flight",
        "In-flight batches",
        "model, variant, status, request_count as requests, age, batch_id",
        "select * exclude (submitted_at) from {s}.llm_batch_in_flight order by submitted_at",
    ),
    Section(
        "models",
        "Provider, model and money in flight per model",
        "model, variant, provider, llm_model, requests_pending as req_in_flight, "
        "committed_not_billed_usd as in_flight_usd, oldest_pending_age as oldest",
        """select model, variant, provider, llm_model, requests_pending, committed_not_billed_usd, oldest_pending_age
           from {s}.llm_batch_progress order by model, variant""",
        note="(in flight: the estimated cost of the requests sent and not answered yet, committed, not billed)",
    ),
    Section(
        "progress",
        "Progress per model",
        "model, variant, keys_succeeded as rows_ok, keys_failed as rows_failed, rows_pending, "
        "requests_pending as req_pending, cost_usd",
        "select * from {s}.llm_batch_progress order by model, variant",
        note="(rows: the table's keys; req: the requests sent for them)",
    ),
    Section(
        "held",
        "Held after `dbt-llm-batch cancel` (sent again after `dbt-llm-batch release`)",
        "model, requests_held",
        f"""select model, count(*) as requests_held from {{s}}.llm_batch_requests
            where status = {sql(RequestStatus.HELD)} group by model order by model""",
        shown_if_empty=False,
    ),
    Section(
        "interrupted",
        "Interrupted submissions held by reconciliation",
        "model, job_id, status, requests, age",
        f"""select model, job_id, status, request_count as requests,
                   date_trunc('second', now() - created_at) as age, error
            from {{s}}.llm_batch_jobs where batch_id is null and harvested_at is null
              and status in {sql_in(PRE_SUBMISSION)} order by created_at""",
        shown_if_empty=False,
        note="(not resent while a provider batch may be theirs; `dbt-llm-batch release` sends them again, "
        "paid twice if such a batch was theirs)",
    ),
    Section(
        "orphans",
        "In-flight requests whose job is missing from llm_batch_jobs",
        "model, requests",
        f"""select model, count(*) as requests from {{s}}.llm_batch_requests
            where status in {IN_FLIGHT_SQL} and job_id not in (select job_id from {{s}}.llm_batch_jobs)
            group by model order by model""",
        shown_if_empty=False,
        note="(never polled nor resent; `dbt-llm-batch release` sends them again)",
    ),
    Section(
        "costs",
        "Cost per model, day and route",
        "model, variant, day, route, rows_succeeded as rows_ok, requests_succeeded as req_ok, cost_usd, "
        "savings_usd as saved_usd",
        "select * from {s}.llm_batch_costs order by model, variant, day, route",
        note="(per variant too; rows: keys answered; req: requests; saved: the same tokens at realtime prices)",
    ),
)


def status(database: str, schema: str, shape: str = "brief") -> int:
    """Print the sections (`shape`: 'brief', 'wide' or 'json'); 0, 1 without a ledger, 2 unreadable."""
    try:
        con = open_ledger(database, "dbt-llm-batch status")
    except LedgerNotReadable as exc:
        print(exc, file=sys.stderr)
        return 2
    exists = con.execute(
        "select count(*) from information_schema.tables where table_schema = ? and table_name = 'llm_batch_progress'",
        [schema],
    ).fetchall()[0][0]
    if not exists:
        print(f"no dbt-llm-batch ledger in schema {schema} of {database}")
        return 1
    s = '"' + schema.replace('"', '""') + '"'
    if shape == "json":
        out = {}
        for section in SECTIONS:
            rel = con.sql(section.source.format(s=s))
            out[section.key] = [dict(zip(rel.columns, row, strict=True)) for row in rel.fetchall()]
        print(json.dumps({"database": database, "schema": schema, **out}, default=str, indent=2))
        return 0
    for section in SECTIONS:
        rel = con.sql(section.source.format(s=s))
        if not section.shown_if_empty and not rel.fetchall():
            continue
        if shape == "brief":
            rel = rel.project(_without_empty_variant(rel, section.brief))
        print(f"{section.title}:")
        if section.note:
            print(textwrap.fill(section.note, WIDTH) if shape == "brief" else section.note)
        rel.show(max_width=WIDTH if shape == "brief" else 100_000, max_col_width=40 if shape == "brief" else None)
    return 0


def _without_empty_variant(rel, columns: str) -> str:
    """The brief columns, without `variant` when no row has one (a project without evaluation variants)."""
    if "variant" not in rel.columns or "variant" not in columns:
        return columns
    if any(v for (v,) in rel.select("variant").fetchall()):
        return columns
    return ", ".join(c for c in columns.split(", ") if c != "variant")
