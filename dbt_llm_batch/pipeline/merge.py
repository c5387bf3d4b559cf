"""Merge: write final outcomes from the ledger into the model table.

The table holds, per key, the ledger's *winner*: among the key's final requests (succeeded, or failed
with attempts used up), the one queued last. Selected columns come from the row as it was when that
request was planned (stored as JSON in the ledger), so the table is a pure function of the ledger:
an incremental run and a full refresh on the same ledger give the same rows for the selected keys.
"""

from __future__ import annotations

import json

from dbt_llm_batch.config import STATUS_COLUMNS, ModelConfig
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import RequestStatus, sql
from dbt_llm_batch.pipeline.plan import describe, key_sql
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import ident, literal

DESIRED, INPUT, EMIT = Scratch.desired, Scratch.input, Scratch.emit


def table_columns(input_columns, config: ModelConfig) -> list[tuple[str, str]]:
    """The model table's columns: selected, then outputs, then status columns."""
    outputs = [(c.name, c.duckdb_type) for c in config.output_columns]
    return list(input_columns) + outputs + STATUS_COLUMNS


def relation_exists(con, schema: str, name: str) -> bool:
    return (
        con.execute(
            "select count(*) from information_schema.tables where table_schema = ? and table_name = ?", [schema, name]
        ).fetchall()[0][0]
        > 0
    )


def check_existing_table(con, target: str, expected, alter: bool = True) -> None:
    """An incremental run writes rows of the same columns; a changed set of columns needs a full refresh.

    Columns are compared as a set: the table's own order wins (rows are inserted by name), so the
    order a parse produced for llm_output, or a reordered SELECT, never asks for a rebuild. Status
    columns added by a newer dbt-llm-batch are appended to an existing table (NULL for old rows).
    """
    actual = describe(con, target)
    have = {c.lower() for c, _ in actual}
    missing = [(n, t) for n, t in expected if n.lower() not in have]
    if missing and alter and all(col in STATUS_COLUMNS for col in missing):
        for name, typ in missing:
            con.execute(f"alter table {target} add column {ident(name)} {typ}")
        actual = describe(con, target)
    table, model = {(n.lower(), t) for n, t in actual}, {(n.lower(), t) for n, t in expected}
    if table != model:
        fmt = lambda cols: ", ".join(f"{n} {t}" for n, t in sorted(cols)) or "none"  # noqa: E731
        raise ConfigError(
            f"the columns of {target} changed (the model's SELECT, unique_key or llm_output changed):\n"
            f"  only in the table: {fmt(table - model)}\n"
            f"  only in the model: {fmt(model - table)}\n"
            f"Run `dbt run --full-refresh -s <model>`: it rebuilds the table from the ledger and sends nothing."
        )


# Types DuckDB's JSON reader cannot read back: stored as their text and cast (planner.row_json_sql).
TEXT_ROUND_TRIP = ("BIT",)


def _row_select(ledger: Ledger, config: ModelConfig, input_columns) -> str:
    """The table's rows for the winners in EMIT, with named columns (inserted by name). Selected
    columns come from the request's stored row, read back with json_transform, which keeps every
    value exact (a DECIMAL(38,9) included); a column the stored row lacks (the SELECT gained it
    since) comes from the key's current row. Incremental runs and full refreshes use the same rule."""
    structure = json.dumps({name: "VARCHAR" if typ in TEXT_ROUND_TRIP else typ for name, typ in input_columns})
    selected = []
    for name, typ in input_columns:
        stored = f"w.stored.{ident(name)}"
        if typ in TEXT_ROUND_TRIP:
            stored = f"cast({stored} as {typ})"
        selected.append(
            f"case when list_contains(w.stored_keys, {literal(name)}) then {stored} else i.{ident(name)} end as {ident(name)}"
        )
    outputs = []
    for col in config.output_columns:
        if config.structured:
            value = f"try_cast(json_extract_string(w.answer, '$.{col.name}') as {col.duckdb_type})"
        else:
            value = "w.answer"
        outputs.append(f"case when w.status = {sql(RequestStatus.SUCCEEDED)} then {value} end as {ident(col.name)}")
    model_literal = literal(config.model)
    status_values = [
        "w.status",
        "w.error",
        "w.finish_reason",
        "w.input_tokens",
        "w.output_tokens",
        f"coalesce(j.llm_model, {model_literal})",
        "j.batch_id",
        "w.fingerprint",
        "w.completed_at",
        "w.cached_tokens",
        "w.cache_write_tokens",
        _share("w.cost_usd"),
        _share("w.realtime_cost_usd"),
        "case when w.reused then 'reused' when w.job_id is not null then coalesce(w.route, 'batch') end",
    ]
    status = [f"{value} as {ident(name)}" for value, (name, _) in zip(status_values, STATUS_COLUMNS, strict=True)]
    return f"""
        select {", ".join(selected + outputs + status)}
        from (select r.* exclude (key, row_json), e.key, e.reused, e.sharing, e.share_rank,
                     json_transform(coalesce(e.row_json, r.row_json), {literal(structure)}) as stored,
                     json_keys(coalesce(e.row_json, r.row_json)) as stored_keys
              from {EMIT} e join {ledger.table("llm_batch_requests")} r on r.custom_id = e.custom_id and r.is_final) w
             left join {ledger.table("llm_batch_jobs")} j on j.job_id = w.job_id
             left join {DESIRED} d on d.key = w.key left join {INPUT} i on i.rowid = d.row_id"""


def _share(column: str) -> str:
    """A row's part of its request's cost: a request's cost is split equally among the rows it
    answered when it was harvested (the first `remainder` rows take one billionth of a dollar more,
    so the parts add up to the cost exactly); a reused row (answered later from the ledger) costs $0."""
    units = f"cast({column} * 1000000000 as hugeint)"
    part = f"({units} // w.sharing + case when w.share_rank <= {units} % w.sharing then 1 else 0 end)"
    return f"case when w.reused then 0 else cast({part} / 1000000000 as decimal(18, 9)) end"


def _winners(ledger: Ledger, keys_sql: str) -> str:
    """Per key in `keys_sql`, the row answer whose request's row belongs in the table: among the key's
    answers by a final request, one for the fingerprint the model selects now if there is one, else
    the one queued last. With how many rows share the request's cost, and this row's rank among them."""
    # Narrow columns only: the wide ones (row_json, answer) are read once, by the insert (_row_select),
    # so a million-row merge neither sorts nor copies a million stored rows.
    answers = ledger.table("llm_batch_row_answers")
    return f"""
        select w.*, coalesce(s.sharing, 1) as sharing, coalesce(s.share_rank, 1) as share_rank
        from (select a.custom_id, a.key, a.variant, r.status, a.emitted, a.reused, a.row_json
              from {answers} a join {ledger.table("llm_batch_requests")} r using (custom_id)
                   left join {DESIRED} d on d.key = a.key
              where a.model = {literal(ledger.model)} and r.is_final and a.key in ({keys_sql})
              qualify row_number() over (partition by a.key
                                         order by (a.fingerprint = d.fingerprint) desc nulls last, r.queued_at desc,
                                                  r.seq desc, a.created_at desc) = 1) w
             left join (select custom_id, model, key, variant, count(*) over (partition by custom_id) as sharing,
                               row_number() over (partition by custom_id order by model, key, variant) as share_rank
                        from {answers} where not reused
                          and custom_id in (select custom_id from {answers} where model = {literal(ledger.model)}
                                            and key in ({keys_sql}))) s
                  on s.custom_id = w.custom_id and s.model = {literal(ledger.model)} and s.key = w.key
                     and s.variant = w.variant"""


def _compression(name: str, typ: str, config: ModelConfig) -> str:
    """The prompt column is long text written in bulk: ZSTD writes it about 3x faster than DuckDB's
    default (dictionary/FSST analysis), and reads it as fast. Other columns keep the default."""
    return " using compression zstd" if name == config.prompt_column and typ == "VARCHAR" else ""


def merge(ledger: Ledger, config: ModelConfig, target: str, input_columns, rebuild: bool) -> tuple[int, int]:
    """Bring the model table up to date with the ledger; returns (rows written, of which failed).

    Incremental: only keys with a request that became final since the last merge, or whose selected
    fingerprint has an answer the table does not show (a prompt changed back), are rewritten. A full
    refresh (`rebuild`; also used when the table does not exist) rebuilds it from the ledger for the
    selected keys.
    """
    con = ledger.con
    columns = table_columns(input_columns, config)
    requests = ledger.table("llm_batch_requests")
    model = literal(ledger.model)
    if rebuild:
        con.execute(f"create or replace temp table {EMIT} as {_winners(ledger, f'select key from {DESIRED}')}")
    else:
        # Keys whose winner may have changed: a request became final since the last merge, or the key
        # is selected and has a final answer the table does not show (a prompt changed back, or a
        # full refresh left the key out). Their winner is written only if it is not shown already.
        answers = ledger.table("llm_batch_row_answers")
        final = f"custom_id in (select custom_id from {requests} where is_final)"
        candidates = f"""
            select key from {answers} where model = {model} and emitted is null and {final}
            union
            select a.key from {answers} a semi join {DESIRED} d on a.key = d.key
            where a.model = {model} and a.emitted = 'superseded' and {final}"""
        con.execute(f"""create or replace temp table {EMIT} as
                        select * from ({_winners(ledger, candidates)}) where emitted is distinct from 'merged'""")
    ddl = ", ".join(f"{ident(n)} {t}{_compression(n, t, config)}" for n, t in columns)
    target_key = key_sql(config)
    # Which final requests the table now shows ('merged') and which it does not ('superseded'), so
    # the next run only looks at requests that became final after this one.
    scope = "true" if rebuild else f"emitted is null or key in (select key from {EMIT})"

    def write():
        with transaction(con):
            if rebuild:
                con.execute(f"create or replace table {target} ({ddl})")
            else:
                con.execute(f"delete from {target} where {target_key} in (select key from {EMIT})")
            con.execute(f"insert into {target} by name {_row_select(ledger, config, input_columns)}")
            ledger.mark_emitted(EMIT, scope)
            null_filter = " or ".join(f"{ident(k)} is null" for k in config.unique_key)
            null_keys = con.execute(f"select count(*) from {target} where {null_filter}").fetchall()[0][0]
            if null_keys:
                raise ConfigError(
                    f"{null_keys} row(s) of {target} would have a NULL unique_key: the stored rows "
                    f"lack the key column(s); nothing was changed"
                )

    retry_on_conflict(write)
    written, failed = con.execute(
        f"select count(*), count(*) filter (where status = {sql(RequestStatus.FAILED)}) from {EMIT}"
    ).fetchall()[0]
    con.execute(f"drop table if exists {EMIT}")
    return written, failed
