"""Added output fields: a row holding an answer to some of the fields asked now is asked only the others.

A request's fingerprint covers its output schema as a whole, so adding a field to `llm_output` (or
changing one field's own schema: an enum, a type, which makes it another field) gives every row a new
fingerprint. Yet a row whose answer was asked with a schema S whose fields are a subset of the fields
asked now (each with the same own schema; the rest of the fingerprint the same:
config.fingerprint_prefix_asking) holds those fields already. Such a row is asked only the missing
fields: one request per row (dedup as usual), with the *delta* schema (the current schema restricted
to the missing fields; strict-mode valid, nested fields a top-level unit), whose fingerprint is the one
the config gives with that schema (`delta_config`). Its job records the delta schema, so its answer is
checked against it (outcomes.settle) and a failed attempt retries only the delta.

A row's answer is then *combined*: a list of *parts*, the live requests of its prompt asked with a
recorded schema (its first answer, each delta since), each holding the fields of its schema that are
current. A row holds the union of its parts' fields, each field from the newest part holding it (a
succeeded one before one in flight), so fields added one after another, or an old field whose enum
changed after a delta, are each asked once. The row answer under the current fingerprint is its
newest part's, naming the earlier ones, oldest first, in `base_custom_ids` (ledger v27). The merge
reads each field from the newest part holding it and the row's cost is the sum of its share of each
part (merge._parts_sql). The parts' other row answers stay where they were, so each request answers
as many rows as before and its cost is split as before.

Each run, per pass, before planning (`prepare`), for the selected rows without a live answer under
their current fingerprint and with some parts:
- a row whose parts hold every field, the earlier ones succeeded (the newest may be in flight), gets
  its combined row answer: the newest part's row answer moves to the current fingerprint (so a run
  that waits for its batch fills the column in that run; `attach` is run again after sending), and
  a removed field (its parts hold more) asks nothing;
- a row with a part in flight and fields missing waits: nothing is asked (the part merges first, then
  the missing fields are asked). Only for a part this model's run harvests (its own request, or one its
  row answer is mapped to: shared.harvest_shared): another model's request in flight that no row answer
  of the key names is that model's to harvest, maybe never, or after this run planned, so it is not a
  part and the row is asked as usual;
- a row whose parts succeeded and miss some fields needs them: it is in the rows of an added-fields
  pass (a `Pass` with `delta`, its config the delta config, its variant the row's), planned, sent (its
  own batch: a job records one schema) and realtime-routed like any other.
A part superseded later (a prompt edit) is under another prompt: the row is asked everything again
(the normal path). A row's parts are found as the plan's dedup finds a prompt's requests: its key's
row answers', and with llm_dedup on the model's requests of that prompt (with 'ledger', any model's:
rows the other model's request answered before they were mapped to it hold its fields too). A part
of another row's costs this row nothing, as a reused answer does; the row answer combined is one of
its key's own (the newest): a row whose parts are all other rows' is asked as usual.

Not for llm_output_format = 'json', free text, embeddings, or a model with few-shot examples (their
outputs show every field): those rows are asked again for every field, as before.
"""

from __future__ import annotations

import dataclasses

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import IN_FLIGHT, RequestStatus, sql, sql_in
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import plan
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import literal

ADDED, ADDED_ROWS, DESIRED = Scratch.added, Scratch.added_rows, Scratch.desired


def applies(config: ModelConfig) -> bool:
    """Whether a row of `config` can be asked only its missing fields (the module's docstring)."""
    return (
        config.structured
        and not config.embeds
        and config.output_format != "json"
        and not config.examples
        and len(config.output_columns) > 1
    )


def subset_schemas(ledger: Ledger, config: ModelConfig) -> list[dict]:
    """The recorded schemas (llm_batch_jobs.output_schema, this model's; with llm_dedup = 'ledger' any
    model's) of the same form as `config`'s that hold some of its fields (the same name with the same
    schema) but not all of them; those holding the most first."""
    current = config.output_json_schema()
    if current is None or not applies(config):
        return []
    found = [
        schema
        for schema in ledger.recorded_output_schemas(every_model=config.dedup == "ledger")
        if _same_form(schema, current) and 0 < len(held_fields(config, schema)) < len(current["properties"])
    ]
    return sorted(found, key=lambda s: -len(held_fields(config, s)))


def _same_form(schema: dict, current: dict) -> bool:
    return isinstance(schema.get("properties"), dict) and {
        k: v for k, v in schema.items() if k not in ("properties", "required")
    } == {k: v for k, v in current.items() if k not in ("properties", "required")}


def held_fields(config: ModelConfig, base: dict) -> set[str]:
    """The current fields an answer asked with `base` holds: the same name with the same schema (a
    field whose enum or type changed is another field, not held)."""
    return {c.name for c in config.output_columns if base["properties"].get(c.name) == c.json_schema}


def delta_config(config: ModelConfig, missing: tuple[str, ...]) -> ModelConfig:
    """`config` asking only the output fields `missing` (its schema: the current one restricted to
    them; its fingerprint prefix: the config's with that schema)."""
    assert config.output is not None
    return dataclasses.replace(
        config,
        output={name: spec for name, spec in config.output.items() if name in missing},
        output_columns=tuple(c for c in config.output_columns if c.name in missing),
    )


def prepare(ledger: Ledger, config: ModelConfig, dry: bool = False, again: bool = False) -> list[tuple[str, ...]]:
    """For the pass's selected rows (Scratch.desired) that hold a subset of the current fields: attach
    the combined answers of rows holding every field, hold rows with a part in flight, and list in
    Scratch.added_rows the rows asked a delta now (`asked`) and those waiting. Returns each distinct set of
    missing fields asked (one added-fields pass each). `dry`: the ledger is not written. `again`: after
    the run sent its added-fields passes (their answers are attached; what was said is not said again)."""
    schemas = subset_schemas(ledger, config)
    if not schemas:
        return []
    con = ledger.con
    answers, requests = ledger.table("llm_batch_row_answers"), ledger.table("llm_batch_requests")
    live = sql_in((RequestStatus.SUCCEEDED, *IN_FLIGHT))
    # The rows without a live answer under their current fingerprint: answer_id (the row answer
    # build_desired read the fingerprint from) NULL, or its request failed, voided or waiting (few).
    unanswered = f"""d.has_prompt and (d.answer_id is null or d.answer_id in
                     (select custom_id from {requests} where status not in {live} and custom_id is not null))"""
    if not con.execute(f"select exists (select 1 from {DESIRED} d where {unanswered})").fetchall()[0][0]:
        return []  # every selected row is answered or in flight under its fingerprint (a run with nothing new)
    text = plan.fingerprinted_text_sql(config, "i.")
    options = [{"held": sorted(held_fields(config, s)), "prefix": config.fingerprint_prefix_asking(s)} for s in schemas]
    current = sorted(c.name for c in config.output_columns)
    # The rows' parts: the live requests of their prompt asked with one of those schemas (the
    # fingerprint the config gives with that schema), each holding that schema's fields: those of
    # their key's row answers and, as the plan's dedup reuses them (plan.build_plan), the model's
    # (llm_dedup on) or any model's (llm_dedup = 'ledger') requests of that fingerprint. Each current
    # field is held by the newest part holding it (a succeeded one over one in flight); the row's parts
    # are those holding a field, its missing fields the current ones none holds.
    if config.dedup is None:  # only the key's own: a key with no row answer (a new row) has none
        scope, keys = (
            "a.custom_id is not null",
            f"and d.key in (select key from {answers} where model = $model and variant = $variant)",
        )
    else:
        scope, keys = ("true" if config.dedup == "ledger" else "(a.custom_id is not null or r.model = $model)"), ""
    con.execute(
        f"""create or replace temp table {ADDED} as
            with c as (
                select d.key, d.fingerprint, d.prompt_hash, o.held, md5(o.prefix || {text}) as part_fp
                from (select * from {DESIRED} d
                      where {unanswered} {keys}) d
                     join {Scratch.input} i on i.rowid = d.row_id,
                     (select unnest($options) as o)),
            parts as (
                select c.key, c.fingerprint, c.prompt_hash, c.held, r.custom_id,
                       r.status = {sql(RequestStatus.SUCCEEDED)} as answered, r.queued_at,
                       a.custom_id is not null as owned
                from c join {requests} r on r.fingerprint = c.part_fp
                       left join {answers} a on a.model = $model and a.variant = $variant and a.key = c.key
                                            and a.custom_id = r.custom_id
                where r.status in {live} and {scope}
                  -- a part in flight is waited for only if this model's run harvests it: its own
                  -- request, or one its row answer is mapped to (shared.harvest_shared); another
                  -- model's request in flight that no row answer of this key names is left to that
                  -- model's run (maybe never, or after this run planned): not a part, the row is
                  -- asked as usual rather than wait a run (or forever) for it
                  and (r.status = {sql(RequestStatus.SUCCEEDED)} or r.model = $model or a.custom_id is not null)
                  and not exists (select 1 from {answers} x join {requests} y using (custom_id)
                                  where x.model = $model and x.variant = $variant and x.key = c.key
                                    and x.fingerprint = c.fingerprint and y.status in {live})),
            holders as (
                select key, field, arg_max({{'custom_id': custom_id, 'answered': answered, 'queued_at': queued_at,
                                              'fingerprint': fingerprint, 'prompt_hash': prompt_hash,
                                              'owned': owned}},
                                            (answered, queued_at)) as p
                from (select *, unnest(held) as field from parts) group by key, field),
            rows as (
                select key, any_value(p.fingerprint) as fingerprint, any_value(p.prompt_hash) as prompt_hash,
                       -- the row answer combined: of the newest part this key holds a row answer of
                       list(field) as held, arg_max(p.custom_id, (p.owned, p.queued_at, p.custom_id)) as own_id,
                       arg_max(p.answered, (p.owned, p.queued_at, p.custom_id)) as own_answered,
                       bool_or(p.owned) as own_owned,
                       count(distinct p.custom_id) filter (where not p.answered) as unfinished,
                       list(distinct {{'queued_at': p.queued_at, 'custom_id': p.custom_id}}) as part_ids
                from holders group by key),
            missed as (
                select r.*,
                       (select coalesce(list(f order by f), []::varchar[]) from (select unnest($current) as f) m
                        where not list_contains(r.held, m.f)) as missing,
                       -- the other parts, oldest first (the merge reads each field from the newest holding it)
                       (select list(t.p.custom_id order by t.p.queued_at, t.p.custom_id)
                        from (select unnest(r.part_ids) as p) t where t.p.custom_id <> r.own_id) as base_ids
                from rows r)
            select key, fingerprint, prompt_hash, own_id, missing, base_ids,
                   -- every field held, the earlier parts answered (the own one may be in flight): combined now
                   len(missing) = 0 and unfinished = case when own_answered then 0 else 1 end as ready,
                   -- some fields missing and every part answered: asked them alone
                   len(missing) > 0 and unfinished = 0 as asked
            from missed
            -- every field held by parts of other rows only (no row answer of this key to combine under
            -- the current fingerprint): left to the normal path
            where not (len(missing) = 0 and not own_owned)""",
        {"options": options, "current": current, "model": ledger.model, "variant": ledger.variant},
    )
    try:
        attached = _attach(ledger, dry)
        # The other rows are not asked every field by their own pass: they wait for their parts in
        # flight, or are asked the missing fields by an added-fields pass. Their newest part blocks
        # replanning (plan.build_plan).
        con.execute(f"update {DESIRED} d set answer_id = a.own_id from {ADDED} a where d.key = a.key and not a.ready")
        waiting = con.execute(f"select count(*) from {ADDED} where not ready and not asked").fetchall()[0][0]
        con.execute(
            f"""insert into {ADDED_ROWS} select $variant, key, missing, asked from {ADDED} where not ready""",
            {"variant": ledger.variant},
        )
        asked = [
            tuple(m)
            for (m,) in con.execute(
                f"select distinct missing from {ADDED_ROWS} where variant = ? and asked order by 1", [ledger.variant]
            ).fetchall()
        ]
    finally:
        con.execute(f"drop table if exists {ADDED}")
    if attached and not dry:
        log.info(
            f"{ledger.model}: {attached} row(s) combine the answer they held with the answer to the fields "
            "added since (only those were asked)"
        )
    if waiting and not again:
        log.info(
            f"{ledger.model}: {waiting} row(s) wait for their batch in flight (asked before output fields were "
            "added): it is merged first, then only the added fields are asked"
        )
    return asked


def _attach(ledger: Ledger, dry: bool) -> int:
    """Give each row holding every field (Scratch.added `ready`) its combined row answer: its newest
    part's row answer moves to the row's current fingerprint, naming the earlier parts."""
    con = ledger.con
    answers = ledger.table("llm_batch_row_answers")
    ready = f"(select * from {ADDED} where ready)"
    if dry:
        moved = con.execute(f"select count(*) from {ready}").fetchall()[0][0]
    else:

        def write() -> int:
            with transaction(con):
                return con.execute(
                    f"""update {answers} a set fingerprint = w.fingerprint, prompt_hash = w.prompt_hash,
                            base_custom_ids = w.base_ids,
                            -- a part shown before under another fingerprint is written again by the merge
                            emitted = case when a.emitted = 'merged' then 'superseded' else a.emitted end
                        from {ready} w
                        where a.model = ? and a.variant = ? and a.key = w.key and a.custom_id = w.own_id""",
                    [ledger.model, ledger.variant],
                ).fetchall()[0][0]

        moved = retry_on_conflict(write)
    con.execute(f"update {DESIRED} d set answer_id = w.own_id from {ready} w where d.key = w.key")
    return moved


def start(con) -> None:
    """An empty Scratch.added_rows: the rows each added-fields pass of the run asks (`asked`), by
    variant and missing fields, and the rows waiting for their base in flight (filled by `prepare`)."""
    con.execute(
        f"create or replace temp table {ADDED_ROWS} (variant varchar, key varchar, missing varchar[], asked boolean)"
    )


def keep_rows(con, variant: str, missing: tuple[str, ...]) -> None:
    """Keep in Scratch.desired (an added-fields pass's, built with its delta config) only the rows that
    pass asks (Scratch.added_rows)."""
    con.execute(
        f"""delete from {DESIRED} where key not in
            (select key from {ADDED_ROWS} where variant = $variant and missing = $missing and asked)""",
        {"variant": variant, "missing": list(missing)},
    )


def not_held(variant: str) -> str:
    """SQL: the pass's selected rows (Scratch.desired) other than those `prepare` gave to an
    added-fields pass or keeps waiting for their base in flight (Ledger.unmap_superseded must not take
    their base's row answer away: it answers the fields they hold)."""
    return f"""(select * from {DESIRED}
                where key not in (select key from {ADDED_ROWS} where variant = {literal(variant)}))"""
