"""`dbt-llm-batch` command line: the local sandbox, and the ledger's status."""

from __future__ import annotations

import argparse
import sys

import duckdb


def status(database: str, schema: str) -> int:
    """Print in-flight batches (with age) and, per model, requests by status."""
    try:
        con = duckdb.connect(database, read_only=True)
    except duckdb.ConnectionException:
        # This process already has the file open read-write (a notebook, or dbt in-process): share it.
        con = duckdb.connect(database)
    except duckdb.IOException as exc:
        print(f"cannot open {database}: {exc}\n(is a dbt run holding it? DuckDB allows one writer process)",
              file=sys.stderr)
        return 2
    s = f'"{schema}"'
    exists = con.execute("select count(*) from information_schema.tables where table_schema = ? "
                         "and table_name = 'llm_batch_progress'", [schema]).fetchall()[0][0]
    if not exists:
        print(f"no dbt-llm-batch ledger in schema {schema} of {database}")
        return 1
    print("In-flight batches:")
    con.sql(f"select * exclude (submitted_at) from {s}.llm_batch_in_flight order by submitted_at").show(max_width=200)
    print("Progress per model:")
    con.sql(f"select * from {s}.llm_batch_progress order by model").show(max_width=200)
    print("Cost per model and day (savings = realtime cost - batch cost):")
    con.sql(f"""select model, provider, day, rows_succeeded, rows_failed, cost_usd, realtime_cost_usd, savings_usd,
                       committed_not_billed_usd from {s}.llm_batch_costs order by model, day""").show(max_width=200)
    return 0


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
    args = parser.parse_args(argv)
    return status(args.database, args.schema)


if __name__ == "__main__":
    sys.exit(main())
