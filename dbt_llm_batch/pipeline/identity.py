"""A model's identity in the ledger: the name its requests are recorded under, and its key columns.

The ledger records requests under the model's `schema.name`, or under `llm_ledger_identity` when the
model sets one (to keep a model's answers across a rename of its file). Each request's key is the
value of `unique_key`, so changing `unique_key` would otherwise strand every stored answer under a
key the model no longer produces: every row would be asked again, and batches in flight would merge
rows under the old key next to the new ones. Here, before anything is planned:
- the stored requests are re-keyed to the new key: from their stored row when it has the new key's
  columns, else by their old key when the SELECT still has its columns (the same row), else by their
  fingerprint (the same prompt and settings as a selected row); rows answered by another row's
  request likewise, each to a key of its own;
- requests that match no selected row are set aside under `<identity> (unique_key <old columns>)`:
  still harvested and costed, not merged, until a selected row with no answer asks their fingerprint:
  they are then taken back under its key (a row out of the selection during the change, back).
It also renames fingerprints stored the way earlier versions computed them (config.legacy_prefix),
and stores the prompt_hash of row answers that lack it (plan.build_desired).
"""

from __future__ import annotations

import dataclasses
import json

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import IN_FLIGHT, Ledger
from dbt_llm_batch.ledger.status import RequestStatus, sql, sql_in
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import plan
from dbt_llm_batch.pipeline.plan import key_sql
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import ident, in_list, list_literal, literal

DESIRED, INPUT, REKEY = Scratch.desired, Scratch.input, Scratch.rekey


def ledger_identity(config: ModelConfig, schema: str, identifier: str) -> str:
    return config.ledger_identity or f"{schema}.{identifier}"


def prepare_ledger(ledger: Ledger, config: ModelConfig, input_columns) -> bool:
    """Before planning: when the model's key columns changed since its last run, re-key the ledger;
    when its fingerprints may have been stored the way earlier versions computed them, rename them
    (plan.adopt_legacy_fingerprints). Both are recorded in `llm_batch_models`, so a run with
    nothing new does neither. Returns whether the model's row answers changed key or fingerprint:
    the selected rows' desired rows (their `answer_id`, plan.build_desired) are then built again."""
    con, models = ledger.con, ledger.table("llm_batch_models")
    current, prefix = json.dumps(list(config.unique_key)), config.fingerprint_prefix()
    row = con.execute(
        f"select key_columns, fingerprint_prefix from {models} where model = ?", [ledger.model]
    ).fetchall()
    stored, adopted = row[0] if row else (None, None)
    if stored == current and adopted == prefix:
        _remember_prompt_hashes(ledger)
        return _take_back_aside(ledger, config)
    requests = ledger.table("llm_batch_requests")
    n = con.execute(f"select count(*) from {requests} where model = ?", [ledger.model]).fetchall()[0][0]
    if stored is None and not n:
        _warn_if_renamed(ledger, config)
    changed = False
    # A model whose rows are all answered by other models' requests (llm_dedup = 'ledger') has no
    # request of its own, but its row answers carry the old key all the same.
    if stored is not None and stored != current and (n or _has_row_answers(ledger)):
        _rekey(ledger, config, input_columns, json.loads(stored))
        changed = True
    if n and adopted != prefix:  # after the re-key: it matches on the current key
        changed = plan.adopt_legacy_fingerprints(ledger, config) > 0 or changed
    ledger.record_model_identity(current, prefix)
    _remember_prompt_hashes(ledger)
    return _take_back_aside(ledger, config) or changed


def _take_back_aside(ledger: Ledger, config: ModelConfig) -> bool:
    """Requests an earlier unique_key change kept aside (their row was not selected then, and their
    stored row lacks the new key's columns: no key to give them) whose prompt and settings a selected
    row asks now, with no answer of its own for them: taken back under that row's key, their answer
    merged (or their batch awaited) instead of the row being asked, and paid, again. Returns whether
    any were. Looked for by name: a model without requests kept aside costs one scan of the names."""
    con, requests = ledger.con, ledger.table("llm_batch_requests")
    answers = ledger.table("llm_batch_row_answers")
    aside = [
        m
        for (m,) in con.execute(
            f"select distinct model from {requests} where starts_with(model, ?)", [f"{ledger.model} (unique_key "]
        ).fetchall()
    ]
    if not aside:
        return False
    # One request per fingerprint (an answered one first, then the newest), one key per fingerprint
    # (_key_by_fingerprint), and only for a key with no row answer of this model for that fingerprint.
    con.execute(
        f"""create or replace temp table {REKEY} as
            select k.taken.custom_id, k.new_key, k.taken.model
            from (select arg_max({{'custom_id': r.custom_id, 'model': r.model}},
                                 (r.status = {sql(RequestStatus.SUCCEEDED)}, r.queued_at, r.custom_id)) as taken,
                         any_value(d.key) as new_key, r.fingerprint
                  from {requests} r join ({_key_by_fingerprint(config)}) d using (fingerprint)
                  where r.model in {in_list(aside)}
                  group by r.fingerprint) k
            where not exists (select 1 from {answers} a
                              where a.model = ? and a.key = k.new_key and a.fingerprint = k.fingerprint)""",
        [ledger.model],
    )
    (n,) = con.execute(f"select count(*) from {REKEY}").fetchall()[0]
    try:
        if n:
            ledger.take_back(Scratch.rekey)
            log.info(
                f"{ledger.model}: {n} request(s) kept aside by an earlier unique_key change ask what selected "
                "rows ask now: they answer those rows (nothing is asked again for them)"
            )
    finally:
        con.execute(f"drop table if exists {REKEY}")
    return n > 0


def _has_row_answers(ledger: Ledger) -> bool:
    answers = ledger.table("llm_batch_row_answers")
    return ledger.con.execute(f"select count(*) > 0 from {answers} where model = ?", [ledger.model]).fetchall()[0][0]


def _remember_prompt_hashes(ledger: Ledger) -> None:
    """Rows whose fingerprint md5 computed (plan.build_desired) give their prompt_hash to their row
    answers (an upgraded ledger's, or after DuckDB changed its hash), so the next run skips md5."""
    if ledger.con.execute(f"select count(*) from {DESIRED} where not fingerprint_stored").fetchall()[0][0]:
        ledger.remember_prompt_hashes(DESIRED)


def _rekey(ledger: Ledger, config: ModelConfig, input_columns, old_key: list[str]) -> None:
    con, requests = ledger.con, ledger.table("llm_batch_requests")
    types = dict(input_columns)
    structure = literal(json.dumps({k: types[k] for k in config.unique_key}))
    names = list_literal(config.unique_key)
    from_row = (
        "cast(to_json([" + ", ".join(f"cast(s.{ident(k)} as varchar)" for k in config.unique_key) + "]) as varchar)"
    )
    # A stored row lacking the new key's columns (a computed key) is found among the selected rows by
    # its old key, when the SELECT still has the old key's columns: the same row, under its new key.
    by_old_key = "(select null::varchar as old_key, null::varchar as key where false)"
    if all(k in types for k in old_key):
        old = key_sql(dataclasses.replace(config, unique_key=tuple(old_key)), input_columns)
        by_old_key = f"""(select i.old_key, d.key from (select rowid as row_id, {old} as old_key from {INPUT}) i
                          join {DESIRED} d using (row_id))"""
    # Else by its fingerprint (the same prompt and settings as a selected row).
    con.execute(
        f"""create or replace temp table {REKEY} as
            select r.custom_id, r.status,
                   coalesce(case when list_has_all(json_keys(r.row_json), {names})
                                 then {from_row} end, o.key, d.key) as new_key
            from (select *, json_transform(row_json, {structure}) as s from {requests} where model = ?) r
                 left join {by_old_key} o on o.old_key = r.key
                 left join ({_key_by_fingerprint(config)}) d using (fingerprint)""",
        [ledger.model],
    )
    # Row answers that carry a row of their own (rows answered by another row's request): re-keyed from
    # that row, or by their old key; else each takes a selected key of its fingerprint that no request
    # and no other such row answer takes (they share the fingerprint with their request's own row, whose
    # key they would otherwise take: two row answers of one key for one request, the key shown twice).
    # One left without a key goes (ledger.rekey): a later run maps a row asking its prompt to the
    # request again (llm_dedup). One that lands on its own request's key goes too: the request's own
    # row answer answers that key.
    con.execute(
        f"""create or replace temp table {Scratch.rekey_rows} as
            with found as (
                select a.custom_id, a.key as old_key, a.fingerprint,
                       coalesce(case when list_has_all(json_keys(a.row_json), {names}) then {from_row} end, o.key)
                         as new_key
                from (select *, json_transform(row_json, {structure}) as s
                      from {ledger.table("llm_batch_row_answers")} where model = ? and row_json is not null) a
                     left join {by_old_key} o on o.old_key = a.key),
            taken as (select new_key from {REKEY} union all select new_key from found),
            free as (select fingerprint, key as new_key, row_number() over (partition by fingerprint order by key) as n
                     from {DESIRED} where key not in (select new_key from taken where new_key is not null)),
            loose as (select custom_id, old_key, fingerprint,
                             row_number() over (partition by fingerprint order by old_key) as n
                      from found where new_key is null),
            keyed as (select custom_id, old_key, new_key from found where new_key is not null
                      union all
                      select l.custom_id, l.old_key, f.new_key from loose l left join free f using (fingerprint, n))
            select k.custom_id, k.old_key, case when k.new_key is distinct from r.new_key then k.new_key end as new_key
            from keyed k left join {REKEY} r using (custom_id)""",
        [ledger.model],
    )
    rekeyed, aside = con.execute(f"select count(new_key), count(*) - count(new_key) from {REKEY}").fetchall()[0]
    aside_model = f"{ledger.model} (unique_key {', '.join(old_key)})"

    try:
        # Never sent: nothing to keep. The rest keep their history (and in-flight ones are still
        # harvested through their job), under a name the merge never reads.
        ledger.rekey(Scratch.rekey, aside_model, Scratch.rekey_rows)
    finally:
        con.execute(f"drop table if exists {REKEY}")
        con.execute(f"drop table if exists {Scratch.rekey_rows}")
    message = (
        f"{ledger.model}: unique_key changed from ({', '.join(old_key)}) to ({', '.join(config.unique_key)}): "
        f"{rekeyed} stored request(s) now carry the new key (nothing is asked again for them)"
    )
    if aside:
        log.warning(
            message + f"; {aside} match no selected row and are kept aside as model '{aside_model}' "
            "(harvested and costed, never merged). Selected rows without an answer are "
            "sent now."
        )
    else:
        log.info(message)


def _key_by_fingerprint(config: ModelConfig) -> str:
    """A selected key for each fingerprint the model asks now (rows with the same fingerprint sent the
    same request, so its answer fits any of them): the default variant's (DESIRED holds its rows), each
    evaluation variant's (its own prompt and settings: its requests' fingerprints differ), and the
    fingerprint earlier versions computed for the same request (config.legacy_prefix)."""
    current = f"select fingerprint, any_value(key) as key from {DESIRED} group by fingerprint"
    others = [(variant.fingerprint_prefix(), variant) for variant in config.variants]
    if config.legacy_prefix:
        others.append((config.legacy_prefix, config))
    if not others:
        return current
    computed = " union all ".join(
        # prefixes are hex digits only
        f"select md5('{prefix}' || {plan.fingerprinted_text_sql(asking, 'i.')}) as fingerprint, d.key "
        f"from {DESIRED} d join {INPUT} i on i.rowid = d.row_id"
        for prefix, asking in others
    )
    # One key per fingerprint: two variants asking the same request give it twice.
    return f"select fingerprint, any_value(key) as key from ({current} union all {computed}) group by fingerprint"


def _warn_if_renamed(ledger: Ledger, config: ModelConfig) -> None:
    """A model's first run: say so before paying when another model of this ledger already has the
    answers (the same prompts and settings), which is what renaming a model's file looks like."""
    if config.ledger_identity or config.dedup == "ledger":
        return  # chosen explicitly, or the other model's answers are shared (llm_dedup = 'ledger')
    # Answered and in flight apart: a request still in flight has no answer yet, but is paid for.
    others = ledger.con.execute(
        f"""select model, count(distinct fingerprint) filter (where status = {sql(RequestStatus.SUCCEEDED)}),
                   count(distinct fingerprint) filter (where status in {sql_in(IN_FLIGHT)})
            from {ledger.table("llm_batch_requests")}
            where model <> ? and status in {sql_in((RequestStatus.SUCCEEDED, *IN_FLIGHT))}
              and fingerprint in (select fingerprint from {DESIRED})
            group by model order by count(distinct fingerprint) desc limit 1""",
        [ledger.model],
    ).fetchall()
    if others:
        other, answered, in_flight = others[0]
        log.warning(
            f"{ledger.model}: first run of this model, and {answered + in_flight} of its requests were already "
            f"asked for model '{other}' ({answered} answered, {in_flight} still in flight; the same prompts and "
            f"settings): they are sent and paid again now. If you renamed the "
            f"model, set llm_ledger_identity = '{other}' in its config to keep that model's answers and batches "
            f"in flight (set it to '{ledger.model}' to silence this)."
        )
