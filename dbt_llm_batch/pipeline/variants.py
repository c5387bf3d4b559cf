"""Evaluation variants (`llm_variants`, docs/guides/evaluate.md, "Evaluation runs: the details"): one model asks each selected row of
several configs in the same run, and its table holds one row per (unique_key, variant).

A variant is not a model of its own: the ledger knows one model, and a *row answer* is (model, key,
variant), pointing at the request that answers it. The default variant (the model's own keys, named
by `llm_default_variant`) is stored as variant '' (so adding variants to a model keeps every answer it
has), the others under their names. The run (runner.py) harvests once for the whole model (each batch
through the provider it went to), then plans one pass per variant with that variant's config: its
selected rows and fingerprints (`Scratch.desired`), its plan and its realtime rows. Every pass is
planned before anything is sent: the passes' batch requests are kept in the run's tables (`stash_pass`)
and written, each line rendered with its own variant's config, into one set of request files per
*sender* (provider and model: an OpenAI batch input file holds one model's requests, and a job is
priced by its model), so two variants on the same provider and model share one batch. The budget is
checked once for the whole run, then each sender's files are submitted, then each variant's realtime
rows are sent through its provider; then each variant's rows are merged. A variant's fingerprint
is its own answer-defining fields, so editing one variant re-asks only its rows, and two variants that
would send identical requests share them (llm_dedup).
"""

from __future__ import annotations

from decimal import Decimal

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.pipeline import plan
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import in_list, literal

DESIRED = Scratch.desired
RUN_PLAN, RUN_REALTIME, RUN_MEMBERS, RUN_SENT = (
    Scratch.run_plan,
    Scratch.run_realtime,
    Scratch.run_members,
    Scratch.run_sent,
)

# A key's place in [0, 1): the first 32 bits of the md5 of its ledger key (the JSON list of the key
# columns as text), the same on every run, machine and DuckDB version, unlike DuckDB's hash().
_KEY_POSITION = "cast(('0x' || substr(md5(key), 1, 8)) as ubigint) / 4294967296.0"


def sample_condition(fraction: float) -> str:
    """SQL over a relation with the ledger's `key`: true for the keys a variant sampled at `fraction`
    answers. The same keys for every variant of that fraction, so sampled challengers are compared on
    the same rows, and a larger fraction answers a superset of a smaller one's keys."""
    return f"({_KEY_POSITION}) < {float(fraction)!r}"


def sample_desired(con, config: ModelConfig) -> None:
    """Keep in the selected rows of this pass only the keys a sampled variant answers."""
    if config.variant_sample is not None and config.variant_sample < 1:
        con.execute(f"delete from {DESIRED} where not ({sample_condition(config.variant_sample)})")


def label(model: str, config: ModelConfig) -> str:
    """How the run log names a model's variant pass: the model, and the variant if it has variants."""
    return model if config.variant_name is None else f"{model} (variant {config.variant_name})"


def drop_removed(ledger: Ledger, config: ModelConfig, target: str) -> int:
    """Rows of variants the model no longer has leave the table (in one transaction); the
    ledger keeps their answers (paid for once) and marks them no longer shown, so a variant added back
    is merged again from the ledger without asking anything. Returns how many rows were removed."""
    names = [c.variant_name for c in config.all_variants() if c.variant_name is not None]
    if not names:
        return 0
    stored = [c.variant for c in config.all_variants()]
    nothing = "(select null::varchar as key, null::varchar as custom_id where false)"
    con = ledger.con

    def write() -> int:
        with transaction(con):
            removed = con.execute(
                f"delete from {target} where llm_variant is null or llm_variant not in {in_list(names)}"
            ).fetchall()[0][0]
            # A variant with no row in the table (the default variant renamed by llm_default_variant):
            # its answers are merged again from the ledger, under its name now.
            shown = {row[0] for row in con.execute(f"select distinct llm_variant from {target}").fetchall()}
            absent = [c.variant for c in config.all_variants() if c.variant_name not in shown]
            scope = f"emitted = 'merged' and variant not in {in_list(stored)}"
            if absent:
                scope += f" or emitted = 'merged' and variant in {in_list(absent)}"
            ledger.mark_emitted(nothing, scope)
            return removed

    return retry_on_conflict(write)


# --- one run's passes, planned before anything is sent ------------------------------------------------


def stash_pass(con, index: int, variant: str) -> None:
    """Keep pass `index`'s plan for the run's senders: its batch requests (Scratch.plan), its realtime
    requests (Scratch.realtime_plan) and the rows that requests planned this run answer besides their
    own (Scratch.plan_members), each with the pass and its variant (the plans carry theirs from
    plan.build_plan). The first pass's batch plan becomes the run's by a rename, not a copy: a model
    without variants (one pass) pays nothing for keeping its plan of up to millions of requests."""
    if index == 0:
        con.execute(f"drop table if exists {RUN_PLAN}")
        con.execute(f"alter table {Scratch.plan} rename to {RUN_PLAN}")
    else:
        con.execute(f"insert into {RUN_PLAN} by name select * from {Scratch.plan}")
    for source, target, where, columns in (
        (Scratch.realtime_plan, RUN_REALTIME, "", ""),
        (
            Scratch.plan_members,
            RUN_MEMBERS,
            "where duplicate",
            f", {int(index)} as pass_index, {literal(variant)} as variant",
        ),
    ):
        rows = f"select *{columns} from {source} {where}"
        if index == 0:
            con.execute(f"create or replace temp table {target} as {rows}")
        else:
            con.execute(f"insert into {target} by name {rows}")


def share_planned(con) -> int:
    """With llm_dedup, in a pass after the first: requests an earlier pass of this run planned already
    (two variants asking the same thing) are not planned again; this pass's rows become rows that
    request answers, written with its intent, so each request is sent once, in one batch. Returns how
    many requests were left to the earlier pass."""
    earlier = f"""(select fingerprint, any_value(custom_id) as custom_id
                   from (select fingerprint, custom_id from {RUN_PLAN}
                         union all select fingerprint, custom_id from {RUN_REALTIME})
                   group by fingerprint)"""
    con.execute(
        f"""update {Scratch.plan_members} m set custom_id = e.custom_id from {earlier} e
            where m.duplicate and m.fingerprint = e.fingerprint"""
    )
    con.execute(
        f"""insert into {Scratch.plan_members} (row_id, key, fingerprint, custom_id, reused, duplicate, prompt_hash)
            select p.row_id, p.key, p.fingerprint, e.custom_id, false, true, p.prompt_hash
            from {Scratch.plan} p join {earlier} e using (fingerprint) where p.row_id is not null"""
    )
    # (A deferred request of a key no longer selected, asked by an earlier pass too, is that request.)
    return con.execute(
        f"delete from {Scratch.plan} where fingerprint in (select fingerprint from {earlier})"
    ).fetchall()[0][0]


def _sent_by(sender: int) -> str:
    return f"(select plan_row, chunk, line from {RUN_SENT} where sender = {int(sender)})"


def pass_rows(config: ModelConfig, columns, index: int, table: str = RUN_PLAN, sender: int | None = None) -> str:
    """Pass `index`'s requests of the run's plan (or its realtime ones) with their prompt and row
    (plan.plan_rows): `plan_row` is unique across the passes. `sender`: only those written to that
    sender's files, with their file (`chunk`) and `line`, joined before the input (plan.plan_rows' `sent`)."""
    sent = None if sender is None else _sent_by(sender)
    return plan.plan_rows(config, columns, plan=table, where=f"p.pass_index = {int(index)}", sent=sent)


def written_plan(passes, sender: int) -> str:
    """The requests of `passes` (indexes) written to `sender`'s files (plan.written_rows), without
    prompt or row: what a row answer records."""
    indexes = ", ".join(str(int(i)) for i in passes)
    return f"(select * from {plan.written_rows(RUN_PLAN, _sent_by(sender))} w where w.pass_index in ({indexes}))"


def member_rows(columns) -> str:
    """Every pass's rows answered by another row's request planned this run, with their variant
    (plan.member_rows, for Ledger.write_intents with per_row_variant)."""
    return f"""(select m.key, m.fingerprint, m.custom_id, m.reused, m.duplicate, m.prompt_hash, m.variant,
                       {plan.row_json_sql(columns, "i.")} as row_json
                from {RUN_MEMBERS} m join {Scratch.input} i on i.rowid = m.row_id)"""


def start_sent(con) -> None:
    con.execute(
        f"create or replace temp table {RUN_SENT} (plan_row bigint, chunk integer, line integer, sender integer)"
    )


def record_sent(con, sender: int) -> None:
    """The rows request_files wrote for `sender` (Scratch.sent), kept for the run."""
    con.execute(f"insert into {RUN_SENT} select plan_row, chunk, line, {int(sender)} from {Scratch.sent}")


def keep_submitted(con, sender: int, first_unsent: int) -> None:
    """Forget `sender`'s files from `first_unsent` on (never attempted, submit.Submitted): RUN_SENT then
    holds what a job holds, sent or left to reconciliation; the rest of the plan waits as deferred."""
    con.execute(f"delete from {RUN_SENT} where sender = {int(sender)} and chunk >= {int(first_unsent)}")


def unsent_rows(rows: str) -> str:
    """`rows` of a pass not in a submitted file: they wait in the ledger (Ledger.defer)."""
    return f"(select p.* from {rows} p where p.plan_row not in (select plan_row from {RUN_SENT}))"


def written(con) -> dict[int, tuple[int, Decimal | None, int]]:
    """Per pass: (requests in request files, their estimated cost or None, files they are in)."""
    rows = con.execute(
        f"""select p.pass_index, count(*), sum(p.estimated_cost_usd), count(distinct (s.sender, s.chunk))
            from {RUN_PLAN} p join {RUN_SENT} s on s.plan_row = p.rowid group by p.pass_index"""
    ).fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def shares(con, sender: int | None = None) -> dict[str, int]:
    """Requests per stored variant in the request files (of one sender, or all)."""
    where = "" if sender is None else f"where s.sender = {int(sender)}"
    rows = con.execute(
        f"""select p.variant, count(*) from {RUN_PLAN} p join {RUN_SENT} s on s.plan_row = p.rowid {where}
            group by p.variant"""
    ).fetchall()
    return dict(rows)


def labels(config: ModelConfig, counts: dict[str, int]) -> str:
    """'variant a 60, variant b 60': each variant's share, in the model's order of variants."""
    return ", ".join(
        f"variant {c.variant_name} {counts[c.variant]}" for c in config.all_variants() if counts.get(c.variant)
    )
