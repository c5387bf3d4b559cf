"""Answers asked with a wider output schema: a removed output field pays nothing.

A request's fingerprint covers its output schema (`llm_output`) as a whole, so removing one field
gives every row a new fingerprint. Yet a request asked with a schema whose fields include every field
the model asks now, each with the same schema, already holds a full answer for it: the merge reads
each current field from the stored answer (merge._output_values) and ignores the others; it was
checked against the schema it was asked with (outcomes.settle reads the job's recorded schema).

So before planning, each selected row without an answer under its current fingerprint takes the
row answer its own key holds under such a schema (its request succeeded or in flight, with the
fingerprint the model's config gives with that schema in place of the current one): the row answer
is moved to the current fingerprint and prompt hash, pointing at the same request, and marked
superseded if it was merged, so the merge writes the row again (a column added back is filled from the
stored answer; the run line counts it as rewritten from the ledger, not as new).
Moved, not copied: the request answers as many rows as before, so a row's cost stays its request's
(merge._share). Adding the field back finds the same request again (its fingerprint is then the
current one): nothing is asked.

The schemas looked at are those this model's jobs were asked with (llm_batch_jobs.output_schema,
recorded per job since ledger version 18; with llm_dedup = 'ledger' any model's). A field whose own
schema changed (an enum, a type) is another field: such a schema does not hold it, and the rows are
asked that field alone, as are rows whose schema gained a field (added_fields.py). Not for llm_output_format =
'json' (the table would show the removed field inside the whole answer), free text or embeddings.
"""

from __future__ import annotations

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import IN_FLIGHT, RequestStatus, sql_in
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import plan
from dbt_llm_batch.pipeline.scratch import Scratch


def wider_prefixes(ledger: Ledger, config: ModelConfig) -> list[str]:
    """The fingerprint prefixes `config` would have with each recorded schema that holds every field
    it asks now (same name, same schema) and more; [] when none (the usual case: one query over the
    jobs, which are few)."""
    current = config.output_json_schema()
    if current is None or config.embeds or config.output_format == "json":
        return []
    return [
        config.fingerprint_prefix_asking(schema)
        for schema in ledger.recorded_output_schemas(every_model=config.dedup == "ledger")
        if holds_every_field(schema, current)
    ]


def holds_every_field(schema: dict, current: dict) -> bool:
    """Whether an answer asked with `schema` holds every field of `current`: an object schema of the
    same form whose properties include each of current's, each the same (current itself included:
    a row answer moved away by an earlier run goes back when the removed field is added back)."""
    if not isinstance(schema.get("properties"), dict):
        return False
    held, needed = schema["properties"], current["properties"]
    same_form = {k: v for k, v in schema.items() if k not in ("properties", "required")} == {
        k: v for k, v in current.items() if k not in ("properties", "required")
    }
    return same_form and all(held.get(name) == spec for name, spec in needed.items())


def adopt(ledger: Ledger, config: ModelConfig, dry: bool = False) -> int:
    """Move to their current fingerprint the row answers (of the pass's variant) that answer selected
    rows with a schema holding every field asked now (the module's docstring); returns how many.
    Scratch.desired holds the pass's rows: the moved rows' answer_id is set there, so the plan
    takes them as answered. `dry` (a dry run): only that, the ledger is not written."""
    prefixes = wider_prefixes(ledger, config)
    if not prefixes:
        return 0
    con = ledger.con
    if not con.execute(
        f"select exists (select 1 from {Scratch.desired} where has_prompt and answer_id is null)"
    ).fetchall()[0][0]:
        return 0  # every selected row's answer was found under its current fingerprint (a run with nothing new)
    answers, requests = ledger.table("llm_batch_row_answers"), ledger.table("llm_batch_requests")
    live = sql_in((RequestStatus.SUCCEEDED, *IN_FLIGHT))
    text = plan.fingerprinted_text_sql(config, "i.")
    # Rows whose answer build_desired found under the current fingerprint (answer_id) are left out
    # unread, and so are keys with no row answer at all (new rows); the others are looked up under
    # each such schema's fingerprint of their prompt.
    con.execute(
        f"""create or replace temp table {Scratch.wider} as
            select c.key, c.fingerprint, c.prompt_hash, arg_max(a.custom_id, r.queued_at) as custom_id
            from (select d.key, d.fingerprint, d.prompt_hash, md5(w.prefix || {text}) as wider
                  from (select * from {Scratch.desired} d
                        where d.has_prompt and d.answer_id is null
                          and d.key in (select key from {answers} where model = $model and variant = $variant)) d
                       join {Scratch.input} i on i.rowid = d.row_id,
                       (select unnest($prefixes) as prefix) w) c
                 join {answers} a on a.model = $model and a.variant = $variant and a.key = c.key
                 join {requests} r on r.custom_id = a.custom_id and r.fingerprint = c.wider
            where r.status in {live}
              and not exists (select 1 from {answers} x join {requests} y using (custom_id)
                              where x.model = $model and x.variant = $variant and x.key = c.key
                                and x.fingerprint = c.fingerprint and y.status in {live})
            group by c.key, c.fingerprint, c.prompt_hash""",
        {"prefixes": prefixes, "model": ledger.model, "variant": ledger.variant},
    )

    def write() -> int:
        with transaction(con):
            return con.execute(
                f"""update {answers} a set fingerprint = w.fingerprint, prompt_hash = w.prompt_hash,
                        -- shown once: written again by the merge, as 'rewritten from the ledger', not new
                        emitted = case when a.emitted = 'merged' then 'superseded' else a.emitted end
                    from {Scratch.wider} w
                    where a.model = ? and a.variant = ? and a.key = w.key and a.custom_id = w.custom_id""",
                [ledger.model, ledger.variant],
            ).fetchall()[0][0]

    try:
        moved = (
            con.execute(f"select count(*) from {Scratch.wider}").fetchall()[0][0] if dry else retry_on_conflict(write)
        )
        con.execute(
            f"update {Scratch.desired} d set answer_id = w.custom_id from {Scratch.wider} w where d.key = w.key"
        )
    finally:
        con.execute(f"drop table if exists {Scratch.wider}")
    if moved and not dry:
        log.info(
            f"{ledger.model}: {moved} row(s) keep the answer they hold from an earlier llm_output (it has "
            "every field asked now): nothing is asked again for them"
        )
    return moved
