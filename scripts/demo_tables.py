"""The demo's tables as a reader wants them on a terminal: per model table, the key, the answer columns
and llm_status (the prompt and the other status columns left out, so nothing is hidden
behind '…'), then the cost per model and route. Usage: demo_tables.py DUCKDB_FILE TABLE..."""

from __future__ import annotations

import sys

import duckdb

from dbt_llm_batch.config import STATUS_COLUMNS

# Selected columns that are the model's input, not its answer.
INPUT_COLUMNS = {"prompt", "subject", "body", "review", "priority"}


def shown_columns(con, table: str) -> list[str]:
    names = [r[0] for r in con.execute(f"describe main.{table}").fetchall()]
    bookkeeping = {name for name, _ in STATUS_COLUMNS} - {"llm_status"}
    return [n for n in names if n not in INPUT_COLUMNS and n not in bookkeeping]


def main(database: str, tables: list[str]) -> None:
    con = duckdb.connect(database, read_only=True)
    for table in tables:
        columns = ", ".join(f'"{c}"' for c in shown_columns(con, table))
        print(f"\n== main.{table}")
        con.sql(f"select {columns} from main.{table} order by all").show(max_width=10_000, max_col_width=60)
    print("\n== main.llm_batch_costs")
    con.sql(
        "select model, route, rows_succeeded, cost_usd, realtime_cost_usd, savings_usd "
        "from main.llm_batch_costs order by model"
    ).show(max_width=10_000)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
