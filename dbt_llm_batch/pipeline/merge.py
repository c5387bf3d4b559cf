"""Merge: write final outcomes from the ledger into the model table.

The table holds, per key, the ledger's *winner*: among the key's final requests (succeeded, or failed
with attempts used up), the one queued last. The columns the request was made of (the prompt column)
come from the row as it was when that request was planned (stored as JSON in the ledger), so a row
shows the prompt its answer belongs to; the other selected columns come from the current selection
for every key it selects, refreshed on every run without asking anything again (`refresh_sql`). So the
table is a pure function of the ledger and the selection: an incremental run and a full refresh give
the same rows for the selected keys. Keys no longer selected keep their rows, unless
llm_on_unselected = 'delete' (the ledger keeps their answers either way).
"""

from __future__ import annotations

import json
from typing import NamedTuple

from dbt_llm_batch import embeddings, output_schema, registry
from dbt_llm_batch.config import STATUS_COLUMNS, ModelConfig
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import crashpoints
from dbt_llm_batch.pipeline.plan import key_sql
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sql import ident, in_list, joins_as_written, literal

DESIRED, INPUT, EMIT, EMIT_ROWS = Scratch.desired, Scratch.input, Scratch.emit, Scratch.emit_rows
# EMIT_ROWS' columns: the input row, the key, whether the stored row is read; per selected column,
# whether the stored row's value is taken and that value; the other columns' values (the outputs', the
# status columns').
ROW, KEY, NEEDS_STORED = "_llm_row", "_llm_key", "_llm_needs_stored"
# Whether the row's answer (or final failure) is new since the last merge, and whether it failed: what
# the run line counts (Merged).
NEW, FAILED = "_llm_new", "_llm_failed"
TAKE, STORED, VALUE = "_llm_take_", "_llm_stored_", "_llm_value_"


class RowSelects(NamedTuple):
    """The statements writing a merge's rows (_row_selects), run in this order."""

    narrow: str  # SELECT: EMIT_ROWS, without the stored rows' values
    add_stored: list[str]  # ALTERs of EMIT_ROWS adding the stored rows' columns, when some row needs them
    stored: str  # UPDATE of EMIT_ROWS: the stored rows' values, for its rows that need them
    widen: str  # SELECT: the rows to insert, once `stored` ran
    widen_current: str  # SELECT: the rows to insert when no row needs its stored row (every one is current)
    current: str  # SELECT: `narrow` joined to the current rows, those that need no stored row only (in one)


def table_columns(input_columns, config: ModelConfig) -> list[tuple[str, str]]:
    """The model table's columns: selected, then outputs, then status columns (and, for a model with
    evaluation variants, llm_variant)."""
    return list(input_columns) + config.table_outputs() + STATUS_COLUMNS + variant_columns(config)


VARIANT_COLUMN = ("llm_variant", "VARCHAR")


def variant_columns(config: ModelConfig) -> list[tuple[str, str]]:
    """llm_variant for a model with evaluation variants (pipeline/variants.py); none without."""
    return [VARIANT_COLUMN] if config.variant_name is not None else []


def relation_exists(con, schema: str, name: str) -> bool:
    return (
        con.execute(
            "select count(*) from information_schema.tables where table_schema = ? and table_name = ?", [schema, name]
        ).fetchall()[0][0]
        > 0
    )


# Types DuckDB's JSON reader cannot read back: stored as their text and cast (planner.row_json_sql).
TEXT_ROUND_TRIP = ("BIT",)


def _row_selects(ledger: Ledger, config: ModelConfig, input_columns, emit: str = EMIT) -> RowSelects:
    """The table's rows for the winners in EMIT, with named columns (inserted by name), in three
    statements: `narrow`, every column but the selected ones, for EMIT_ROWS; `stored`, the stored
    rows' values of the winners that need them (an UPDATE of EMIT_ROWS, run only if some do, after
    `add_stored` adds their columns); `widen`, EMIT_ROWS with the selected columns (the input's, or the
    stored row's), the rows to insert (`widen_current` when no winner needs its stored row). Selected
    columns come from the request's stored row, read back with json_transform, which keeps every
    value exact (a DECIMAL(38,9) included); a column the stored row lacks (the SELECT gained it
    since) comes from the key's current row. Incremental runs and full refreshes use the same rule.

    A selected key whose current row asks the winner's fingerprint (md5 of the prompt) has the
    stored row's prompt and key already: the whole row is the current one, and the stored JSON is
    parsed only for the other winners (parsing every stored row was most of a large merge).

    `emit`: the winners (EMIT, or a relation of the same columns: _first_harvest)."""
    structure = json.dumps({name: "VARCHAR" if typ in TEXT_ROUND_TRIP else typ for name, typ in input_columns})
    # The fingerprint hashes the prompt as text: equal for the same VARCHAR prompt (an empty or NULL
    # one, and other types' text forms, are read from the stored row as before).
    same_row = "false"
    if dict(input_columns).get(config.prompt_column, "").upper() == "VARCHAR":
        same_row = "d.has_prompt and d.fingerprint = r.fingerprint"
    selected, current_only, from_stored, stored_columns, add_stored = [], [], [], [], []
    for n, (name, typ) in enumerate(input_columns):
        stored = f"x.stored.{ident(name)}"
        if typ in TEXT_ROUND_TRIP:
            stored = f"cast({stored} as {typ})"
        # A column the request was not made of shows the current selection's value for a selected key.
        current = "" if name in request_columns(config) else "x.desired_row is null and "
        # A stored NULL is the stored row's value only if the row has the column (json_transform gives
        # NULL for both): the JSON is read again for those alone, not parsed a second time for every row.
        path = literal("$." + json.dumps(name))
        take = f"{current}({stored} is not null or json_exists(x.stored_json, {path}))"
        from_stored += [f"{take} as {TAKE}{n}", f"{stored} as {STORED}{n}"]
        stored_columns += [f"{TAKE}{n}", f"{STORED}{n}"]
        add_stored += [
            f"alter table {EMIT_ROWS} add column {TAKE}{n} boolean",
            f"alter table {EMIT_ROWS} add column {STORED}{n} {typ}",
        ]  # typed as `stored`
        current_value = f"i.{ident(name)}"
        if name in config.unique_key:
            # A key column the stored row lacks (unique_key changed to a new column) of a key with no
            # current row (out of a sampled variant's sample): its value is in the ledger's key, as text.
            position = config.unique_key.index(name)
            current_value = f"coalesce({current_value}, cast(json_extract_string(n.{KEY}, '$[{position}]') as {typ}))"
        selected.append(f"case when n.{TAKE}{n} then n.{STORED}{n} else {current_value} end as {ident(name)}")
        current_only.append(f"i.{ident(name)}")
    outputs = []
    for name, value in _output_values(config):
        outputs.append((f"case when w.status = {sql(RequestStatus.SUCCEEDED)} then {value} end", name))
    model_literal = literal(config.model)
    status_values = [
        "w.status",
        "w.error",
        finish_reason_sql(),
        "w.input_tokens + coalesce(w.base_input_tokens, 0)",
        "w.output_tokens + coalesce(w.base_output_tokens, 0)",
        f"coalesce(j.llm_model, {model_literal})",
        "j.batch_id",
        "w.fingerprint",
        "w.completed_at",
        "w.cached_tokens",
        "w.cache_write_tokens",
        _combined_share("cost_usd"),
        _combined_share("realtime_cost_usd"),
        "case when w.reused then 'reused' when w.job_id is not null then coalesce(w.route, 'batch') end",
    ]
    status = [(value, name) for value, (name, _) in zip(status_values, STATUS_COLUMNS, strict=True)]
    if config.variant_name is not None:
        status.append((literal(config.variant_name), VARIANT_COLUMN[0]))
    # EMIT_ROWS names them by position: an output column may have any name (one of EMIT_ROWS' own).
    narrow_values = [f"{value} as {VALUE}{n}" for n, (value, _) in enumerate(outputs + status)]
    widen_values = [f"n.{VALUE}{n} as {ident(name)}" for n, (_, name) in enumerate(outputs + status)]
    requests = ledger.table("llm_batch_requests")
    # The stored rows (wide JSON) are read, parsed and joined only for the winners that need them: a
    # wide column carried through the joins of every winner was most of a large merge. They are read
    # by a second statement, only when some winner needs them: read inside this one, from the same
    # joins, the joins' result was used twice, which DuckDB materializes (every winner's columns: at
    # ten million rows 5.7 GB spilled, and the statement grew 47x from a million), even when no winner
    # needs its stored row (a run merging new answers).
    narrow = f"""
        with {_parts_sql(requests, emit)},
        w as (
            select r.* exclude (key, row_json, answer), e.key, e.reused, e.sharing, e.share_rank,
                   e.emitted is null as is_new,
                   d.row_id as desired_row, coalesce({same_row}, false) as same_row,
                   -- a combined answer (added_fields.py): each field from the newest of its parts holding it
                   case when b.key is null then r.answer else f.answer end as answer,
                   b.base_cost_usd, b.base_realtime_cost_usd, b.base_input_tokens, b.base_output_tokens
            -- the requests first: the probe side when the joins run as written (_first_harvest)
            from {requests} r join {emit} e on r.custom_id = e.custom_id and r.is_final
                 left join based b on b.key = e.key
                 left join fields f on f.key = e.key
                 left join {DESIRED} d on d.key = e.key)
        select w.desired_row as {ROW}, w.key as {KEY}, not w.same_row as {NEEDS_STORED}, w.is_new as {NEW},
               w.status = {sql(RequestStatus.FAILED)} as {FAILED},
               {", ".join(narrow_values)}
        from w left join {ledger.table("llm_batch_jobs")} j on j.job_id = w.job_id"""
    stored = f"""
        update {EMIT_ROWS} n set {", ".join(f"{c} = s.{c}" for c in stored_columns)}
        from (select x.key, {", ".join(from_stored)}
              from (select e.key, m.{ROW} as desired_row, coalesce(e.row_json, r.row_json) as stored_json,
                           json_transform(coalesce(e.row_json, r.row_json), {literal(structure)}) as stored
                    from {EMIT_ROWS} m join {EMIT} e on e.key = m.{KEY}
                         join {requests} r on r.custom_id = e.custom_id and r.is_final
                    where m.{NEEDS_STORED}) x) s
        where n.{KEY} = s.key"""
    # The selected columns are joined last, to the finished narrow rows (EMIT_ROWS), which are the
    # join's build side: the input, prompts and all, streams through (sql.joins_as_written). Joined inside one
    # statement with the ledger's rows, the input was the build side, a hash table of every prompt.
    # Without a row that needs its stored row (a first harvest of an unchanged selection), the stored
    # rows' columns are never added: two per selected column, all NULL, carried by every row of the
    # join's build side (a sixth of it at ten million rows).
    joined = f"from {INPUT} i right join {EMIT_ROWS} n on i.rowid = n.{ROW}"
    widen = f"select {', '.join(selected + widen_values)} {joined}"
    widen_current = f"select {', '.join(current_only + widen_values)} {joined}"
    current = f"""select {", ".join(current_only + widen_values)}
                  from {INPUT} i join ({narrow}) n on i.rowid = n.{ROW} where not n.{NEEDS_STORED}"""
    return RowSelects(narrow, add_stored, stored, widen, widen_current, current)


def finish_reason_sql() -> str:
    """SQL: the finish reason the table shows, the same word for the same outcome whatever the provider
    (Provider.finish_reasons), from the provider's own word the ledger keeps."""
    whens = []
    for name in registry.provider_names():
        try:
            mapping = get_provider(name).finish_reasons
        except ConfigError:  # a registration that cannot load: its words are shown as written
            continue
        whens += [
            f"when j.provider = {literal(name)} and w.finish_reason = {literal(raw)} then {literal(word)}"
            for raw, word in sorted(mapping.items())
            if raw != word
        ]
    return f"case {' '.join(whens)} else w.finish_reason end" if whens else "w.finish_reason"


def request_columns(config: ModelConfig) -> set[str]:
    """The selected columns a request is made of (its prompt) and the key: shown as stored with the
    answer. Every other selected column follows the current selection."""
    return {config.prompt_column, *config.unique_key}


def refresh_sql(config: ModelConfig, target: str, input_columns) -> str | None:
    """SQL: set the columns that are not part of the request to the current selection's values, for
    the selected keys whose row in the table shows other values (an incremental run; a full refresh
    writes them so already). None when every selected column is part of the request."""
    columns = [name for name, _ in input_columns if name not in request_columns(config)]
    if not columns:
        return None
    key = "cast(to_json([" + ", ".join(f"cast(t.{ident(k)} as varchar)" for k in config.unique_key) + "]) as varchar)"
    changed = " or ".join(f"t.{ident(c)} is distinct from i.{ident(c)}" for c in columns)
    return f"""update {target} t set {", ".join(f"{ident(c)} = i.{ident(c)}" for c in columns)}
               from {DESIRED} d join {INPUT} i on i.rowid = d.row_id
               where {key} = d.key and ({changed})"""


def _output_values(config: ModelConfig) -> list[tuple[str, str]]:
    """(column, SQL value over the stored answer `w.answer`, or vector `w.vector`) per output column."""
    if config.embeds:
        return [(embeddings.COLUMN, embeddings.value_sql(config.embedding_size or 0, "w.vector"))]
    if not config.structured:
        return [(config.output_columns[0].name, "w.answer")]
    if config.output_format == "json":
        return [("llm_output", "cast(w.answer as JSON)")]
    return [(col.name, output_schema.value_sql(col.name, col.json_schema, "w.answer")) for col in config.output_columns]


def _share(column: str, sharing: str = "w.sharing", rank: str = "w.share_rank", reused: str = "w.reused") -> str:
    """A row's part of its request's cost: a request's cost is split equally among the rows it
    answered when it was harvested (the first `remainder` rows take one billionth of a dollar more,
    so the parts add up to the cost exactly); a reused row (answered later from the ledger) costs $0."""
    units = f"cast({column} * 1000000000 as hugeint)"
    part = f"({units} // {sharing} + case when {rank} <= {units} % {sharing} then 1 else 0 end)"
    # A request answering one row (most of them) is that row's cost as is: no division to make.
    return (
        f"case when {reused} then 0 when {sharing} = 1 then {column} "
        f"else cast({part} / 1000000000 as decimal(18, 9)) end"
    )


def _combined_share(column: str) -> str:
    """A row's part of its request's cost `column`, plus, for a combined answer (added_fields.py), its
    parts of the earlier requests' (_parts_sql)."""
    return f"({_share(f'w.{column}')} + coalesce(w.base_{column}, 0))"


def _parts_sql(requests: str, emit: str = EMIT) -> str:
    """SQL CTEs over EMIT's combined answers (added_fields.py: a row answer naming the earlier requests
    it is made of besides its own request, `base_parts`): `based`, per key,
    the sum of the row's shares of the earlier requests' costs (each shared among the rows it answered,
    as before the fields were added; nothing for a part the row reused from the ledger) and their
    tokens; `fields`, per key, the combined answer: each top-level field from the newest part (queued
    last) holding it (a field whose own schema changed since is asked again: the newer part holds the
    current one)."""
    share = {
        c: _share(f"r.{c}", "p.part.sharing", "p.part.share_rank", "p.part.reused")
        for c in ("cost_usd", "realtime_cost_usd")
    }
    return f"""
        parts as (
            select e.key, unnest(e.base_parts) as part, generate_subscripts(e.base_parts, 1) as n
            from {emit} e where e.base_parts is not null),
        based as (
            select p.key, sum({share["cost_usd"]}) as base_cost_usd,
                   sum({share["realtime_cost_usd"]}) as base_realtime_cost_usd,
                   sum(r.input_tokens) as base_input_tokens, sum(r.output_tokens) as base_output_tokens
            from parts p join {requests} r on r.custom_id = p.part.custom_id group by p.key),
        fields as (
            select key, cast(json_group_object(k, v) as varchar) as answer
            from (select x.key, f.k, arg_max(json_extract(x.answer, '$.' || to_json(f.k)), (x.queued_at, x.custom_id)) as v
                  from (select p.key, r.custom_id, r.queued_at, r.answer
                        from parts p join {requests} r on r.custom_id = p.part.custom_id
                        union all
                        select e.key, r.custom_id, r.queued_at, r.answer
                        from {emit} e join {requests} r on r.custom_id = e.custom_id
                        where e.base_parts is not null) x,
                       unnest(json_keys(x.answer)) f(k)
                  group by x.key, f.k)
            group by key)"""


def _winners(
    ledger: Ledger, keys_sql: str, variant: str = "", own_answer: str | None = None, variants: list[str] | None = None
) -> str:
    """Per key in `keys_sql`, the row answer whose request's row belongs in the table: among the key's
    answers by a final request, one for the fingerprint the model selects now if there is one, else
    the one queued last. With how many rows share the request's cost, and this row's rank among them.
    Only the row answers of `variant` (an evaluation variant; '' the default, and a model without).
    `own_answer`: an SQL condition on a row answer that, when each key has one row answer, holds
    for exactly the answers of the keys of `keys_sql` (read in place of the keys). `variants`: the
    stored names of the variants the model has now; a request's cost is split among the rows the
    tables show, so the row answers of a removed (or renamed) variant of this model take no part."""
    # Narrow columns only: the wide ones (row_json, answer) are read once, by the insert (_row_select),
    # so a million-row merge neither sorts nor copies a million stored rows. Aggregates, not windows:
    # the winner is each key's arg_max (NULLs ranked lowest, as `desc nulls last` did), and only the
    # requests answering several rows are ranked (a request answering one row: its whole cost, rank 1).
    # The aggregate carries the winning row answer's rowid, read back by one join: a struct of its
    # columns in every aggregate state cost twice as much.
    answers, requests = ledger.table("llm_batch_row_answers"), ledger.table("llm_batch_requests")
    model = literal(ledger.model)
    rank = (
        "coalesce(cast(a.fingerprint = d.fingerprint as integer), -1), coalesce(r.queued_at, '-infinity'::timestamptz), "
        "coalesce(r.seq, -2147483648), coalesce(a.created_at, '-infinity'::timestamptz)"
    )
    # A key with one row answer (of this model and variant) has no other to rank it against: when no
    # key has two (a first harvest; no prompt ever changed), each key's winner is its answer if that
    # answer's request is final. Counting the keys costs a tenth of ranking them (a 1M-row merge).
    # No candidate at all (a run with nothing new): nothing to rank, and the keys are not counted.
    single = (
        own_answer == "false"
        or ledger.con.execute(
            f"select count(*) = count(distinct key) from {answers} where model = {model} and variant = ?", [variant]
        ).fetchall()[0][0]
    )
    if single:
        won = f"""select key, custom_id, variant, emitted, reused, row_json, base_custom_ids from {answers}
                  where model = {model} and variant = {literal(variant)} and ({own_answer or f"key in ({keys_sql})"})
                    and custom_id in (select custom_id from {requests} where is_final)"""
    else:
        won = f"""select x.key, x.custom_id, x.variant, x.emitted, x.reused, x.row_json, x.base_custom_ids
                  from (select a.key, arg_max(a.rowid, ({rank})) as won
                        from {answers} a join {requests} r using (custom_id) left join {DESIRED} d on d.key = a.key
                        where a.model = {model} and a.variant = {literal(variant)} and r.is_final and a.key in ({keys_sql})
                        group by a.key) k
                       join {answers} x on x.rowid = k.won"""
    sharing = "not reused"
    if variants is not None:
        sharing += f" and (model <> {model} or variant in {in_list(variants)})"
    return f"""
        with w as ({won}),
        shared as (
            select custom_id, count(*) as sharing from {answers}
            where {sharing} and (custom_id in (select custom_id from w)
                                 or custom_id in (select unnest(base_custom_ids) from w))
            group by custom_id having count(*) > 1),
        ranked as (
            select x.custom_id, x.model, x.key, x.variant, s.sharing,
                   row_number() over (partition by x.custom_id order by x.model, x.key, x.variant) as share_rank
            from (select * from {answers} where {sharing}) x join shared s using (custom_id)),
        -- a combined answer's earlier parts (added_fields.py), in order: each request's cost shared as
        -- before; a part answered from the ledger (reused, or another row's request) cost this row nothing
        part as (
            select key, variant, unnest(base_custom_ids) as custom_id, generate_subscripts(base_custom_ids, 1) as n
            from w where base_custom_ids is not null),
        parts as (
            select p.key, p.variant,
                   list({{'custom_id': p.custom_id, 'sharing': coalesce(b.sharing, 1),
                          -- a part of another row's (llm_dedup: no row answer of this key) was reused too
                          'share_rank': coalesce(b.share_rank, 1), 'reused': coalesce(ba.reused, true)}}
                        order by p.n) as base_parts
            from part p
                 left join ranked b on b.custom_id = p.custom_id and b.model = {model} and b.key = p.key
                                       and b.variant = p.variant
                 left join (select custom_id, key, variant, bool_or(reused) as reused from {answers}
                            where model = {model} and custom_id in (select custom_id from part) group by all) ba
                           on ba.custom_id = p.custom_id and ba.key = p.key and ba.variant = p.variant
            group by p.key, p.variant)
        select w.custom_id, w.key, w.variant, w.emitted, w.reused, w.row_json,
               coalesce(k.sharing, 1) as sharing, coalesce(k.share_rank, 1) as share_rank, p.base_parts
        from w left join ranked k on k.custom_id = w.custom_id and k.model = {model} and k.key = w.key
                                     and k.variant = w.variant
               left join parts p on p.key = w.key and p.variant = w.variant"""


def _compression(name: str, typ: str, config: ModelConfig) -> str:
    """The prompt column is long text written in bulk: ZSTD writes it about 3x faster than DuckDB's
    default (dictionary/FSST analysis), and reads it as fast. llm_fingerprint is short, all different
    and written a million at a time: uncompressed, as the ledger stores fingerprints (the default's
    analysis finds nothing to gain and was a fifth of writing the table). Other columns keep the default."""
    if name == config.prompt_column and typ == "VARCHAR":
        return " using compression zstd"
    return " using compression uncompressed" if name == "llm_fingerprint" else ""


def table_ddl(columns, config: ModelConfig) -> str:
    """The model table's column definitions (names, types, compression) for `create table`."""
    return ", ".join(f"{ident(n)} {t}{_compression(n, t, config)}" for n, t in columns)


def create_empty(con, target: str, input_columns, config: ModelConfig) -> None:
    """The model's table with no row: what a dry run of a model that never ran leaves, so the dbt
    tests `dbt build` runs next find the table (and its columns) instead of failing on a missing one."""
    con.execute(f"create table if not exists {target} ({table_ddl(table_columns(input_columns, config), config)})")


class Merged(NamedTuple):
    """What a merge wrote: rows whose request newly became final (of which failed), and rows written
    again from answers merged before (a rebuild from the ledger; a reverted prompt's answer shown again)."""

    new: int
    failed: int
    rewritten: int


class _General(Exception):
    """_first_harvest's conditions are unmet, or it wrote fewer rows than the model has row answers:
    rolled back, the general merge writes the table."""


# The winners of a first harvest whose every row answer is its own request's only one (_first_harvest),
# with the columns _winners gives EMIT.
_OWN_ANSWERS = """(select key, custom_id, variant, emitted, reused, row_json, 1 as sharing, 1 as share_rank,
                         null::struct(custom_id varchar, sharing bigint, share_rank bigint, reused boolean)[] as base_parts
                  from {answers} where model = {model} and variant = '')"""


def _first_harvest(ledger: Ledger, config: ModelConfig, target: str, input_columns) -> Merged | None:
    """The common first harvest in one insert: the model's table is empty and each of its row answers
    is new, its key's only one, its request's only one (no row shares a request: no cost to split)
    and made of no earlier answers, so each winner is its own row answer. When each also has a final
    request and the key's current row asks it (no stored row to read: `_row_selects`' `current`), the
    table is every row answer's row, written by one insert whose build side is the row answers
    joined with their requests, as the design's floor writes it (benchmarks/scale.py). Returns what
    it wrote, or None (nothing written) for the general merge: any condition unmet, or a row not
    written (rolled back). The general merge writes the same rows (tests/test_first_harvest.py); it
    builds EMIT and EMIT_ROWS first, which was over a third of a 10M-row harvest."""
    if config.variant_name is not None or config.variants:
        return None
    con, model, answers = ledger.con, literal(ledger.model), ledger.table("llm_batch_row_answers")
    # Only this model's run writes its table (under its lock): read before any transaction, so a run
    # whose table has rows (every run after the first harvest) opens none and builds no SQL here.
    if con.execute(f"select exists (select 1 from {target})").fetchall()[0][0]:
        return None
    rows = _row_selects(ledger, config, input_columns, emit=_OWN_ANSWERS.format(answers=answers, model=model))

    def write() -> Merged:
        # Checked inside the transaction: another model's run (dbt's threads) may map a row to one of
        # these requests meanwhile (llm_dedup = 'ledger'), and its cost is then shared.
        with transaction(con):
            new, own, single, n = con.execute(
                f"""select count(*) filter (where emitted is not null) = 0,
                           count(*) filter (where reused or row_json is not null or base_custom_ids is not null) = 0,
                           count(*) = count(distinct key), count(*)
                    from {answers} where model = {model} and variant = ''"""
            ).fetchall()[0]
            if not (n and new and own and single):
                raise _General
            # Another model's row answer of one of these requests (llm_dedup = 'ledger').
            if con.execute(
                f"""select exists (select 1 from {answers} where model <> {model} and not reused
                                   and custom_id in (select custom_id from {answers} where model = {model}))"""
            ).fetchall()[0][0]:
                raise _General
            # Every join as written: the requests stream through the row answers' and the desired
            # rows' hash tables, and the rows' values are the build side of the join with the prompts.
            # Ordered by DuckDB, the requests (answers and all) were a hash table held with the other
            # two: at ten million rows it spilled 3.75 GB under a 4 GB memory_limit.
            with joins_as_written(con, order=True):
                (written,) = con.execute(f"insert into {target} by name {rows.current}").fetchall()[0]
            if written != n:
                raise _General
            (failed,) = con.execute(
                f"select count(*) from {target} where llm_status = {sql(RequestStatus.FAILED)}"
            ).fetchall()[0]
            mine = f"(select key, custom_id from {answers} where model = {model} and variant = '')"
            ledger.mark_emitted(mine, "variant = ''", n)
        return Merged(n, failed, 0)

    try:
        return retry_on_conflict(write)
    except _General:
        return None


def merge(
    ledger: Ledger,
    config: ModelConfig,
    target: str,
    input_columns,
    rebuild: bool,
    create: bool = True,
    variants: list[str] | None = None,
) -> Merged:
    """Bring the model table up to date with the ledger; returns what it wrote (Merged).

    Incremental: only keys with a request that became final since the last merge, or whose selected
    fingerprint has an answer the table does not show (a prompt changed back), are rewritten. A full
    refresh (`rebuild`; also used when the table does not exist) rebuilds it from the ledger for the
    selected keys.

    A model with evaluation variants is merged once per variant (`config` is the variant's): only
    that variant's row answers and table rows (llm_variant) are read and written; a rebuild creates
    the table for the first variant only (`create`), the others add their rows to it. `variants`:
    the stored names of the model's variants now (_winners: a request's cost is split among them).
    """
    con = ledger.con
    if not rebuild:
        first = _first_harvest(ledger, config, target, input_columns)
        if first is not None:
            return first
    variant = literal(config.variant)
    shown = "true" if config.variant_name is None else f"llm_variant = {literal(config.variant_name)}"
    columns = table_columns(input_columns, config)
    requests = ledger.table("llm_batch_requests")
    model = literal(ledger.model)
    ddl = table_ddl(columns, config)
    target_key = key_sql(config)

    def choose() -> tuple[str, int | None, bool]:
        """EMIT, the rows to write, and the scope of the row answers to mark: inside write()'s
        transaction, so the rows chosen and the row answers marked are read from one snapshot. Chosen
        before it, a request another model's run (dbt's threads) settled in between was final to the
        marking but not in EMIT: its rows were marked 'superseded', neither merged nor pending."""
        if rebuild:
            con.execute(
                f"create or replace temp table {EMIT} as {_winners(ledger, f'select key from {DESIRED}', config.variant, variants=variants)}"
            )
        else:
            # Keys whose winner may have changed: a request became final since the last merge, or the key
            # is selected and has a final answer the table does not show (a prompt changed back, or a
            # full refresh left the key out). Their winner is written only if it is not shown already.
            answers = ledger.table("llm_batch_row_answers")
            final = f"custom_id in (select custom_id from {requests} where is_final)"
            # Each part only when it has rows to look at: a run with nothing new has no row answer that is
            # not merged yet and none superseded, and would otherwise join every final request for none.
            unmerged, superseded, answers_count = con.execute(
                f"""select count(*) filter (where emitted is null), count(*) filter (where emitted = 'superseded'), count(*)
                    from {answers} where model = {model} and variant = {variant}"""
            ).fetchall()[0]
            parts, own = [], []  # the candidate keys; the same as a condition on a key's only answer
            if unmerged:
                parts.append(
                    f"select key from {answers} where model = {model} and variant = {variant} and emitted is null and {final}"
                )
                own.append("emitted is null")
            if superseded:
                parts.append(f"""select a.key from {answers} a semi join {DESIRED} d on a.key = d.key
                                 where a.model = {model} and a.variant = {variant} and a.emitted = 'superseded' and {final}""")
                own.append(f"(emitted = 'superseded' and key in (select key from {DESIRED}))")
            candidates = " union ".join(parts) or "select null::varchar as key"
            own_answer = " or ".join(own) or "false"
            con.execute(f"""create or replace temp table {EMIT} as
                            select * from ({_winners(ledger, candidates, config.variant, own_answer, variants)})
                            where emitted is distinct from 'merged' {"" if parts else "and false"}""")
        # Which final requests the table now shows ('merged') and which it does not ('superseded'), so
        # the next run only looks at requests that became final after this one.
        scope = f"variant = {variant} and " + (
            "true" if rebuild else f"(emitted is null or key in (select key from {EMIT}))"
        )
        # Every row answer of the variant not merged yet (a first harvest): the scope is all of them, already
        # counted, so marking them neither counts them again nor joins them with EMIT (2 s at 10M rows).
        in_scope = None
        if not rebuild and unmerged == answers_count:
            scope, in_scope = f"variant = {variant}", answers_count

        # Nothing to write (a run with nothing new): the delete would still compute every row's key.
        emitting = con.execute(f"select count(*) > 0 from {EMIT}").fetchall()[0][0]
        return scope, in_scope, emitting

    removed = [0]  # rows of keys no longer selected, deleted (llm_on_unselected = 'delete')
    counts = [0, 0, 0]  # Merged's: read from EMIT_ROWS (no row is written when nothing is new)

    def write():
        with transaction(con):
            scope, in_scope, emitting = choose()
            if rebuild and create:
                con.execute(f"create or replace table {target} ({ddl})")
            elif rebuild:  # a later variant of a rebuilt table
                con.execute(f"delete from {target} where {shown}")
            elif emitting:
                con.execute(f"delete from {target} where {shown} and {target_key} in (select key from {EMIT})")
            every_selected_written = False
            if emitting or rebuild:
                rows = _row_selects(ledger, config, input_columns)
                con.execute(f"create or replace temp table {EMIT_ROWS} as {rows.narrow}")
                needs_stored, selected_written, new, failed, again = con.execute(
                    f"""select count(*) filter (where {NEEDS_STORED}) > 0, count({ROW}), count(*) filter (where {NEW}),
                               count(*) filter (where {NEW} and {FAILED}), count(*) filter (where not {NEW})
                        from {EMIT_ROWS}"""
                ).fetchall()[0]
                counts[:] = [new, failed, again]
                if needs_stored:
                    for statement in rows.add_stored:
                        con.execute(statement)
                    con.execute(rows.stored)
                    crashpoints.reach("before_merge_insert")  # the scratch table widened, the insert not run
                with joins_as_written(con):
                    con.execute(f"insert into {target} by name {rows.widen if needs_stored else rows.widen_current}")
                con.execute(f"drop table {EMIT_ROWS}")
                # The rows of selected keys are written from the current selection (_row_selects): when
                # every selected key's was (a first harvest), there is no other row to refresh. EMIT and
                # DESIRED hold each key once, so equal counts mean every selected key. Not with
                # variants: DESIRED is this variant's sample, and the refresh (refresh_sql) updates
                # every variant's rows, a sampled variant's rows of keys that left its sample too.
                every_selected_written = (
                    config.variant_name is None
                    and selected_written == con.execute(f"select count(*) from {DESIRED}").fetchall()[0][0]
                )
            refresh = None if rebuild or every_selected_written else refresh_sql(config, target, input_columns)
            if refresh:
                con.execute(refresh)
            ledger.mark_emitted(EMIT, scope, in_scope)
            removed[0] = 0
            if config.on_unselected == "delete" and not rebuild:  # a rebuild writes only selected keys
                removed[0] = con.execute(
                    f"delete from {target} where {shown} and {target_key} not in (select key from {DESIRED})"
                ).fetchall()[0][0]
                # Their answers are no longer shown: a run that selects them again merges them again.
                nothing = "(select null::varchar as key, null::varchar as custom_id where false)"
                ledger.mark_emitted(
                    nothing, f"variant = {variant} and emitted = 'merged' and key not in (select key from {DESIRED})"
                )
            null_filter = " or ".join(f"{ident(k)} is null" for k in config.unique_key)
            null_keys = con.execute(f"select count(*) from {target} where {null_filter}").fetchall()[0][0]
            if null_keys:
                raise ConfigError(
                    f"{null_keys} row(s) of {target} would have a NULL unique_key: the stored rows "
                    f"lack the key column(s); nothing was changed"
                )

    retry_on_conflict(write)
    if removed[0]:
        log.info(
            f"{ledger.model}: removed {removed[0]} row(s) of keys the model no longer selects "
            f"(llm_on_unselected='delete'; the ledger keeps their answers)"
        )
    # What the run line says "merged" (counts, from EMIT_ROWS): rows whose answer (or final failure) is
    # new since the last merge (emitted NULL before this one); the rest were written again (a rebuild,
    # an answer shown again).
    new, failed, again = counts
    con.execute(f"drop table if exists {EMIT}")
    return Merged(new, failed, again)
