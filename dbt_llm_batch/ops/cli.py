"""`dbt-llm-batch` command line: the local sandbox, the ledger's status, and operator actions."""

from __future__ import annotations

import argparse
import sys

import duckdb


def status(database: str, schema: str) -> int:
    """Print in-flight batches (with age) and, per model, requests by status."""
    import os

    if os.path.isdir(database):
        print(f"{database} is a directory: pass the DuckDB file your dbt profile writes (its `path`)", file=sys.stderr)
        return 2
    if not os.path.exists(database):
        print(f"no DuckDB file at {database}: pass the file your dbt profile writes (its `path`)", file=sys.stderr)
        return 2
    try:
        con = duckdb.connect(database, read_only=True)
    except duckdb.ConnectionException:
        # This process already has the file open read-write (a notebook, or dbt in-process): share it.
        con = duckdb.connect(database)
    except duckdb.IOException as exc:
        from dbt_llm_batch.ledger.locks import is_lock_conflict, lock_conflict_message

        why = lock_conflict_message(database, str(exc)) if is_lock_conflict(exc) else str(exc)
        print(f"cannot open {database}: {why}", file=sys.stderr)
        return 2
    from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, PRE_SUBMISSION, RequestStatus, sql, sql_in

    s = f'"{schema}"'
    exists = con.execute(
        "select count(*) from information_schema.tables where table_schema = ? and table_name = 'llm_batch_progress'",
        [schema],
    ).fetchall()[0][0]
    if not exists:
        print(f"no dbt-llm-batch ledger in schema {schema} of {database}")
        return 1
    print("In-flight batches:")
    con.sql(f"select * exclude (submitted_at) from {s}.llm_batch_in_flight order by submitted_at").show(max_width=200)
    print("Progress per model:")
    con.sql(f"select * from {s}.llm_batch_progress order by model").show(max_width=200)
    held = con.sql(f"""select model, count(*) as requests_held from {s}.llm_batch_requests where status = {sql(RequestStatus.HELD)}
                       group by model order by model""")
    if held.fetchall():
        print("Held after `dbt-llm-batch cancel` (sent again after `dbt-llm-batch release`):")
        held.show(max_width=200)
    interrupted = con.sql(f"""select model, job_id, status, request_count as requests,
                                     date_trunc('second', now() - created_at) as age, error
                              from {s}.llm_batch_jobs where batch_id is null and harvested_at is null
                                and status in {sql_in(PRE_SUBMISSION)} order by created_at""")
    if interrupted.fetchall():
        print(
            "Interrupted submissions held by reconciliation (not resent while a provider batch may be theirs; "
            "`dbt-llm-batch release` sends them again, paid twice if such a batch was theirs):"
        )
        interrupted.show(max_width=200)
    orphans = con.sql(f"""select model, count(*) as requests from {s}.llm_batch_requests
                          where status in {IN_FLIGHT_SQL}
                            and job_id not in (select job_id from {s}.llm_batch_jobs)
                          group by model order by model""")
    if orphans.fetchall():
        print(
            "In-flight requests whose job is missing from llm_batch_jobs (never polled nor resent; "
            "`dbt-llm-batch release` sends them again):"
        )
        orphans.show(max_width=200)
    # Ledgers from schema version 14 count rows apart from requests (llm_dedup): rows each request
    # answered, rows answered from the ledger without a request, and what sharing saved.
    dedup = con.execute(
        """select count(*) from information_schema.columns
           where table_schema = ? and table_name = 'llm_batch_costs' and column_name = 'dedup_saved_usd'""",
        [schema],
    ).fetchall()[0][0]
    rows = ", rows_answered, rows_reused, dedup_saved_usd" if dedup else ""
    print(
        "Cost per model and day (savings = realtime cost - batch cost; rows_succeeded and rows_failed count "
        "requests"
        + (
            "; rows_answered: rows they answered, rows_reused: without a request, dedup_saved_usd: saved by it"
            if dedup
            else ""
        )
        + "):"
    )
    con.sql(f"""select model, provider, day, rows_succeeded, rows_failed, cost_usd, realtime_cost_usd, savings_usd,
                       committed_not_billed_usd{rows} from {s}.llm_batch_costs order by model, day""").show(
        max_width=200
    )
    return 0


# Operator actions (dbt_llm_batch/operator.py), each on one model of one ledger.
OPERATOR_COMMANDS = {
    "cancel": "cancel the model's in-flight batches at the provider; their unanswered requests are held",
    "release": "let the next run send the model's held requests (cancelled, or of interrupted submissions)",
    "requeue": "give the model's failed requests a fresh set of attempts, without changing config",
    "unlock": "remove the model's run lock left by a dead process",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sandbox"]:  # the sandbox has its own options (see `dbt-llm-batch sandbox --help`)
        from dbt_llm_batch.sandbox.cli import main as sandbox_main

        return sandbox_main(argv[1:])
    parser = argparse.ArgumentParser(prog="dbt-llm-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sandbox", help="run the local provider emulator (answers are not a model's); see sandbox --help")
    st = sub.add_parser("status", help="show in-flight batches, per-model progress and cost from the ledger")
    st.add_argument("--database", required=True, help="path of the DuckDB file")
    st.add_argument("--schema", default="main", help="schema holding the ledger tables (default: main)")
    for name, text in OPERATOR_COMMANDS.items():
        op = sub.add_parser(name, help=text)
        op.add_argument("--database", required=True, help="path of the DuckDB file")
        op.add_argument("--schema", default="main", help="schema holding the ledger tables (default: main)")
        op.add_argument("--model", required=True, help="the model, as its name or schema.name")
    args = parser.parse_args(argv)
    if args.command in OPERATOR_COMMANDS:
        from dbt_llm_batch.ops.operator import command

        return command(args)
    return status(args.database, args.schema)


if __name__ == "__main__":
    sys.exit(main())
