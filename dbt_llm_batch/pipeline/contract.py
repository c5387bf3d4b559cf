"""Enforced model contracts (`contract: {enforced: true}`), checked before anything is sent.

dbt enforces a contract in its own table and view materializations only; an llm_batch model's table
is built here, so the check is too. The declared columns are compared with the table the model makes:
every selected column and every output column must be declared with its type; of the llm_* columns
dbt-llm-batch adds to every table, only those the contract declares are checked (docs/table.md, "Errors, contracts, a check before running, docs and lineage").
Types are compared as DuckDB names them (a declared `int` is INTEGER, `text` is VARCHAR), which is
how dbt's own check compares them on DuckDB.
"""

from __future__ import annotations

import duckdb

from dbt_llm_batch.config import STATUS_COLUMNS
from dbt_llm_batch.errors import ConfigError, ContractError
from dbt_llm_batch.sql import ident


def enforce(con, contract: dict | None, table_columns: list[tuple[str, str]]) -> None:
    """Raise ContractError when an enforced contract disagrees with `table_columns` (name, type)."""
    if not contract or not contract.get("enforced"):
        return
    declared_columns = contract.get("columns") or []
    if not declared_columns:
        raise ContractError("This model has an enforced contract, and its 'columns' specification is missing", [], [])
    untyped = [c["name"] for c in declared_columns if not c.get("data_type")]
    if untyped:
        raise ConfigError(
            f"this model has an enforced contract, so every column it declares needs a data_type; "
            f"add one for: {', '.join(untyped)}"
        )
    declared = [_column(c["name"], _duckdb_type(con, c["name"], c["data_type"])) for c in declared_columns]
    declared_names = {c["name"].lower() for c in declared}
    optional = {name.lower() for name, _ in STATUS_COLUMNS}
    produced = [
        _column(name, typ)
        for name, typ in table_columns
        if name.lower() not in optional or name.lower() in declared_names
    ]
    if sorted(c["formatted"] for c in declared) != sorted(c["formatted"] for c in produced):
        # Names as the table has them, so that dbt's table of mismatches pairs them up.
        spelled = {c["name"].lower(): c["name"] for c in produced}
        for column in declared:
            column["name"] = spelled.get(column["name"].lower(), column["name"])
        raise ContractError("the model's enforced contract disagrees with its table", declared, produced)


def _column(name: str, data_type: str) -> dict:
    """A column as dbt's contract check formats it (dbt's format_column macro)."""
    return {"name": name, "data_type": data_type, "formatted": f"{name.lower()} {data_type}"}


def _duckdb_type(con, name: str, data_type: str) -> str:
    """The declared type as DuckDB names it (what a NULL cast to it describes as)."""
    try:
        return con.execute(f"describe select cast(null as {data_type}) as {ident(name)}").fetchall()[0][1]
    except duckdb.Error as exc:
        raise ConfigError(
            f"the contract declares column '{name}' with data_type '{data_type}', which is not a DuckDB type "
            f"({str(exc).splitlines()[0]})"
        ) from None
