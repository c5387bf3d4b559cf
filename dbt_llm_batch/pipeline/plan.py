"""Planning: from the model's selected rows to the requests this run must send.

Everything here is set-based SQL in DuckDB: keys, fingerprints and custom_ids are computed for all
rows at once, and the set difference against the ledger is a join, not a Python loop.
"""

from __future__ import annotations

import json

import duckdb

from dbt_llm_batch.config import STATUS_COLUMNS, ModelConfig
from dbt_llm_batch.errors import ConfigError, InputError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.status import BLOCKS_REPLANNING, IN_FLIGHT, IN_FLIGHT_SQL, RequestStatus, sql, sql_in
from dbt_llm_batch.pipeline import costs, sharing
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sql import ident, literal

# Temp tables (connection-local): the model's rows as selected this run (model_input.load_input), and
# the two this module creates.
INPUT, DESIRED, PLAN = Scratch.input, Scratch.desired, Scratch.plan


def describe(con, relation: str) -> list[tuple[str, str]]:
    """(name, type) of each column of a relation, in order."""
    return [(r[0], r[1]) for r in con.execute(f"describe {relation}").fetchall()]


def check_input(con, input_rel: str, config: ModelConfig, precomputed: bool = False) -> list[tuple[str, str]]:
    """Validate the selected rows before anything is sent; returns the selected columns (without
    PRECOMPUTED, when the input carries them: `precomputed`).

    Raises ConfigError for a missing or clashing column and InputError for NULL or duplicate keys,
    naming a few offending keys so the user can find them.
    """
    columns = [c for c in describe(con, input_rel) if not (precomputed and c[0] in PRECOMPUTED)]
    names = [c[0] for c in columns]
    lowered = {n.lower() for n in names}
    problems = []
    for key in config.unique_key:
        if key not in names:
            problems.append(f"unique_key column '{key}' is not selected by the model (columns: {', '.join(names)})")
    if config.prompt_column not in names:
        problems.append(
            f"prompt column '{config.prompt_column}' is not selected by the model; select a "
            f"column named '{config.prompt_column}' or set llm_prompt_column"
        )
    added = [name for name, _ in config.table_outputs()] + [c[0] for c in STATUS_COLUMNS]
    if config.variant_name is not None:  # a model with evaluation variants adds llm_variant too
        added.append("llm_variant")
    if "rowid" in lowered:  # it would hide DuckDB's own row id, which the plan joins on
        problems.append("a selected column is named 'rowid', which dbt-llm-batch needs; rename it in the model's SQL")
    for clash in [a for a in added if a.lower() in lowered]:
        problems.append(
            f"selected column '{clash}' clashes with a column dbt-llm-batch adds; rename it in "
            f"the model's SQL{' or in llm_output' if clash in dict(config.output or {}) else ''}"
        )
    if problems:
        raise ConfigError("invalid llm_batch model:\n  - " + "\n  - ".join(problems))

    keys = ", ".join(ident(k) for k in config.unique_key)
    null_filter = " or ".join(f"{ident(k)} is null" for k in config.unique_key)
    nulls = con.execute(f"select count(*) from {input_rel} where {null_filter}").fetchall()[0][0]
    if nulls:
        # A row is named by its key where the key has a value, else by the start of its prompt: a
        # one-column key that is NULL names nothing ("None, None, None").
        prompt = f"left(cast({ident(config.prompt_column)} as varchar), 40)"
        sample = con.execute(f"select {keys}, {prompt} from {input_rel} where {null_filter} limit 3").fetchall()
        raise InputError(
            f"{nulls} selected row(s) have a NULL in unique_key ({', '.join(config.unique_key)}), "
            f"for example {_null_key_examples(sample)}; nothing was sent. Filter them out in the model's SQL."
        )
    # Usually none. With one key column, counting its distinct values says so a little faster than
    # grouping (a sixth, at a million integer keys); with several, grouping is the faster.
    unique = (
        len(config.unique_key) == 1
        and not con.execute(f"select count(*) - count(distinct {keys}) from {input_rel}").fetchall()[0][0]
    )
    dupes = (
        []
        if unique
        else con.execute(
            f"select {keys}, count(*) from {input_rel} group by all having count(*) > 1 order by count(*) desc limit 5"
        ).fetchall()
    )
    if dupes:
        total = con.execute(
            f"select count(*) from (select 1 from {input_rel} group by all having count(*) > 1)".replace(
                "group by all", f"group by {keys}"
            )
        ).fetchall()[0][0]
        examples = ", ".join(f"{_fmt([d[:-1]])} ({d[-1]} rows)" for d in dupes)
        raise InputError(
            f"{total} unique_key value(s) are duplicated, for example {examples}; nothing was "
            f"sent. Make ({', '.join(config.unique_key)}) unique in the model's SQL."
        )
    return columns


def _null_key_examples(rows) -> str:
    """Rows of (key values..., the prompt's start): the key where it has a value, else the prompt."""
    examples = []
    for *key, prompt in rows:
        if any(v is not None for v in key):
            examples.append("(" + ", ".join("NULL" if v is None else repr(v) for v in key) + ")")
        else:
            examples.append(f"the row whose {'prompt is NULL' if prompt is None else f'prompt starts {prompt!r}'}")
    return ", ".join(examples)


def _fmt(rows) -> str:
    return ", ".join("(" + ", ".join(repr(v) for v in r) + ")" if len(r) > 1 else repr(r[0]) for r in rows)


# Column types whose text (a cast to VARCHAR) is digits and an optional '-': nothing JSON escapes.
INTEGER_TYPES = frozenset(
    ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "UHUGEINT")
)


def key_sql(config: ModelConfig, columns=None) -> str:
    """The ledger's key: a JSON list of the key columns as text (composite keys stay unambiguous).
    VARCHAR, as the ledger stores it: compared with a JSON value, each stored key would be cast to
    JSON (parsed) in every join with the ledger.

    With the selected `columns` (name, type) and key columns all of integer types, the same text is
    concatenated instead of built by to_json (a tenth of a no-op run's key building at a million rows):
    an integer's text needs no escaping, so '["' || k || '"]' is byte for byte what to_json gives
    (tests/unit/test_planner.py compares both over each type's extremes). Keys are never NULL here
    (plan.check_input rejects them), where to_json would give 'null' and the concatenation NULL."""
    types = dict(columns or ())
    if columns is not None and all(types.get(k, "").upper() in INTEGER_TYPES for k in config.unique_key):
        return (
            "('[\"' || "
            + " || '\",\"' || ".join(f"cast({ident(k)} as varchar)" for k in config.unique_key)
            + " || '\"]')"
        )
    return "cast(to_json([" + ", ".join(f"cast({ident(k)} as varchar)" for k in config.unique_key) + "]) as varchar)"


def row_json_sql(columns, alias: str = "") -> str:
    """The selected row as JSON: stored with each request, so the table can be rebuilt from the ledger."""
    return "to_json(struct_pack(" + ", ".join(f"{ident(c)} := {alias}{ident(c)}" for c, _ in columns) + "))"


# Columns model_input.load_input adds to the model's rows as it copies them, for the model's own config
# (row_facts_sql): the prompts are read once, not once more by build_desired. check_input leaves them
# out of the selected columns. (Columns, not scratch tables: named here; a selected column of one of
# these names gets none of them, runner._row_facts.)
PRECOMPUTED = ("_llm_key", "_llm_prompt_hash", "_llm_has_prompt", "_llm_prompt_chars")


def row_facts_sql(config: ModelConfig, columns) -> list[str]:
    """SQL over the input's columns, in PRECOMPUTED's order: the row's key, its prompt_hash (DuckDB's
    hash() of the fingerprint's prefix and the prompt, Identity in ARCHITECTURE.md), whether it has
    a prompt, and its prompt's length in characters (for the token estimate)."""
    prompt_chars = prompt_text_sql(config, columns)
    if prompt_is_blob(config, columns):  # not-UTF-8 BLOBs fail later, alone (bad_input.reject_unsendable)
        prompt_chars = f"try({prompt_chars})"
    text = fingerprinted_text_sql(config)
    prefix = literal(config.fingerprint_prefix())
    return [
        key_sql(config, columns),
        f"hash(cast({prefix} as varchar), {text})",
        f"{text} <> ''",
        f"length({prompt_chars})",
    ]


def build_desired(
    con, input_rel: str, columns, config: ModelConfig, ledger: Ledger | None = None, precomputed: bool = False
) -> None:
    """One row per selected key: its input row id, key, fingerprint, whether it has a prompt, its
    length and whether it goes to the realtime path. No copy of the prompt or the row: those are read from the
    input when a row is actually sent. `precomputed`: the input carries PRECOMPUTED for `config`
    (model_input.load_input), read instead of computed.

    The fingerprint is md5 over the prompt (stable across versions of everything). With a `ledger`, a
    fast hash of the same text (`prompt_hash`, DuckDB's hash()) is looked up first among the model's
    row answers for the same key: where it matches, their stored fingerprint is taken and md5 is not
    computed, so a run with nothing new hashes its prompts cheaply. A hash DuckDB computes differently
    (another version) only matches nothing: md5 then gives the same fingerprint as before, and
    Ledger.remember_prompt_hashes stores the new hash.

    `answer_id`: the custom_id of the row answer (of the ledger's variant, the pass's) the fingerprint
    was read from, else NULL. build_plan reads it so the same join also finds the rows already
    answered or in flight: built under the model's lock (runner._run), that row answer keeps its key,
    fingerprint and custom_id for the rest of the run (only a re-key or a fingerprint rename changes
    them, and the run builds these rows again after one: identity.prepare_ledger), so whether it
    still blocks replanning is its request's status at planning time."""
    if not get_provider(config.provider).has_batch_api:
        realtime = "true"
    elif config.realtime_when:
        # On lines of its own: a `--` comment in the expression must not swallow the rest of the query.
        realtime = f"coalesce(cast((\n{config.realtime_when}\n) as boolean), false)"
    else:
        realtime = "false"
    text = fingerprinted_text_sql(config)
    key, prompt_hash, has_prompt, prompt_chars = PRECOMPUTED if precomputed else row_facts_sql(config, columns)
    stored, fingerprint, known, answer_id = "", "md5($prefix || b.prompt_text)", "false", "null::varchar"
    params: dict = {"prefix": config.fingerprint_prefix()}
    hashed = ledger.prompt_hash_count() if ledger is not None else 0
    selected, distinct = 0, True
    # Looking the hashes up reads all of the model's row answers: worth it unless the selection is a
    # small part of them (md5 over a few rows is cheaper), or empty.
    if (
        ledger is not None
        and hashed
        and 10 * (selected := con.execute(f"select count(*) from {input_rel}").fetchall()[0][0]) >= hashed
    ):
        # A key has several row answers of one prompt when its request was tried again (an attempt
        # is a request and a row answer): then they are grouped to one per (key, prompt_hash) before
        # the join. Without retries they are usually one already, and grouping a million of them is
        # a fifth of a run with nothing new: joined as they are, and grouped only if the join did
        # give a row twice (the count below).
        distinct = ledger.has_retries()
        stored = "left join ({}) s on s.key = b.key and s.prompt_hash = b.prompt_hash"
        # CASE evaluates md5 only for the rows whose hash found no stored fingerprint. With the
        # facts precomputed, the prompts are not read here at all: md5 fills in the rows not found
        # afterwards (usually none), reading only their prompts.
        fingerprint = (
            "s.fingerprint"
            if precomputed
            else "case when s.fingerprint is null then md5($prefix || b.prompt_text) else s.fingerprint end"
        )
        known = "s.fingerprint is not null"
        answer_id = "s.answer_id"
        params["model"], params["variant"] = ledger.model, ledger.variant
    prompt_text = "" if stored and precomputed else f", {text} as prompt_text"

    def create(lookup: str) -> None:
        query = f"""create or replace temp table {DESIRED} as
                select b.row_id, b.key,
                       -- md5: change detection, not security, and twice as fast as sha256 over long prompts
                       {fingerprint} as fingerprint,
                       b.has_prompt, b.prompt_chars, b.realtime, b.prompt_hash, {known} as fingerprint_stored,
                       {answer_id} as answer_id
                from (select rowid as row_id, {key} as key{prompt_text},
                             {prompt_hash} as prompt_hash,
                             {has_prompt} as has_prompt,
                             {prompt_chars} as prompt_chars,  -- for the token estimate, read in this one scan
                             {realtime} as realtime
                      from {input_rel}) b {lookup}"""
        con.execute(query, {name: value for name, value in params.items() if f"${name}" in query})

    try:
        if not stored:
            create("")
            return
        create(stored.format(ledger.prompt_fingerprints(distinct)))  # type: ignore[union-attr]
        # Every selected row is in DESIRED at least once: as many rows as selected means none twice.
        if not distinct and con.execute(f"select count(*) from {DESIRED}").fetchall()[0][0] != selected:
            create(stored.format(ledger.prompt_fingerprints(True)))  # type: ignore[union-attr]
    except duckdb.Error as exc:
        if not config.realtime_when:
            raise
        raise ConfigError(
            f"llm_realtime_when = {config.realtime_when!r} is not a boolean SQL expression over "
            f"the model's columns ({', '.join(c for c, _ in columns)}): {exc}; nothing was sent"
        ) from None
    if (
        prompt_text
        or not con.execute(f"select exists (select 1 from {DESIRED} where fingerprint is null)").fetchall()[0][0]
    ):
        return
    con.execute(
        f"""update {DESIRED} d set fingerprint = md5($prefix || {fingerprinted_text_sql(config, "i.")})
            from {input_rel} i where i.rowid = d.row_id and d.fingerprint is null""",
        {"prefix": config.fingerprint_prefix()},
    )


def adopt_legacy_fingerprints(ledger: Ledger, config: ModelConfig) -> int:
    """Rename this model's ledger fingerprints computed the way earlier versions did (the output
    schema's `required` list and dict examples in the order dbt's parse gave: config.legacy_prefix)
    to the canonical ones, for the keys selected now; returns how many requests and row answers were
    renamed. The request sent was the same apart from that order, so its answer stands and nothing is
    asked again."""
    if not config.legacy_prefix:
        return 0
    prompt = fingerprinted_text_sql(config)
    return ledger.rename_fingerprints(
        f"""(select d.key, d.fingerprint, md5(? || {prompt}) as legacy
             from {DESIRED} d join {INPUT} i on i.rowid = d.row_id)""",
        [config.legacy_prefix],
    )


def reject_empty_prompts(ledger: Ledger, input_rel: str, columns) -> int:
    """Rows with a NULL or empty prompt fail alone, without a request: record them as final failures."""
    # Usually none: recording them looks every selected key up among the ledger's requests.
    if not ledger.con.execute(f"select exists (select 1 from {DESIRED} where not has_prompt)").fetchall()[0][0]:
        return 0
    return ledger.record_never_sent(
        f"""(select d.key, d.fingerprint, 'prompt is NULL or empty: nothing was sent' as error,
                    {row_json_sql(columns, "i.")} as row_json
             from {DESIRED} d join {input_rel} i on i.rowid = d.row_id
             where not d.has_prompt)""",
        only_without_live_request=False,
    )


def build_plan(
    ledger: Ledger, config: ModelConfig, input_rel: str, columns, price: dict | None = None, pass_index: int = 0
) -> int:
    """Requests to send now: desired rows minus those succeeded or in flight for the same key and
    fingerprint, and minus those whose failures reached llm_max_attempts; plus requests deferred by an
    earlier run (in-flight caps) for keys this run does not select. Returns the count.

    With llm_dedup on, rows are grouped by their request (the fingerprint: everything that reaches the
    provider, the key excluded): each group is one request, for the key that asked it first, and the
    group's other rows are its members (Scratch.plan_members, with the custom_id and their row). A
    group whose request is answered or in flight already (this model's, or with llm_dedup = 'ledger'
    any model's of the ledger) is not sent: its rows become members of that request (`reused` when it
    is answered). Attempts, back-offs and holds are then counted per request, not per key.

    Each request carries its estimated input tokens and, with a `price`, its estimated cost, computed
    here from the prompt's length in the same statement (no second pass over the prompts), and its
    pass (`pass_index`) and stored variant, so that the run keeps the plan as it is (variants.stash_pass)."""
    con = ledger.con
    requests = ledger.table("llm_batch_requests")
    answers = ledger.table("llm_batch_row_answers")
    dedup = config.dedup is not None
    # Deferred requests of keys selected now are planned afresh from the current rows; the others keep
    # their stored prompt and row. They stay in the ledger until sent (write_intents) or re-deferred (defer).
    # With dedup, one whose request a selected row asks is planned afresh too (in that row's group).
    stored_prompt = "json_extract_string(row_json, ?)"
    if prompt_is_blob(config, columns):  # stored as DuckDB's escaped text
        stored_prompt = f"decode(cast({stored_prompt} as blob))"
    path = "$." + json.dumps(config.prompt_column)
    asked_now = f"and fingerprint not in (select fingerprint from {DESIRED})" if dedup else ""
    if not ledger.has_deferred():  # the usual case: no NOT IN over the selected rows to build
        asked_now += " and false"
    con.execute(  # one whose stored row lacks the prompt column cannot be sent (bad_input.reject_deferred_without_prompt)
        f"""create or replace temp table {Scratch.deferred} as
            select * from (select key, fingerprint, seq, custom_id, row_json,
                                  {stored_prompt} as prompt, length({stored_prompt}) as prompt_chars from {requests}
                           where model = ? and status = {sql(RequestStatus.DEFERRED)} and key not in (select key from {DESIRED})
                           and variant = ?  -- an evaluation variant's deferred requests wait for its own pass
                           {asked_now})
            where prompt is not null""",
        [path, path, ledger.model, ledger.variant],
    )
    estimated_cost = "null::decimal(18, 9)"
    if price is not None:
        output_tokens = costs.output_estimate(ledger, config).basis  # from the model's own answers, if asked
        estimated_cost = costs.estimated_cost_sql(
            config, price, route_sql="route", chars_sql="prompt_chars", output_tokens=output_tokens
        )
    # A request's identity: per key without dedup (the custom_id of earlier versions, unchanged), per
    # content with it (custom_ids stay unique per model: the same request of two models is two ids).
    if dedup:
        group, in_candidates = "fingerprint", f"fingerprint in (select fingerprint from {Scratch.candidates})"
        # Attempts of the request: distinct attempt numbers (ledgers before dedup hold one per key).
        failed = f"count(distinct seq) filter (where status = {sql(RequestStatus.FAILED)})"
        next_seq = "coalesce(h.max_seq + 1, 0)"
        # Each group of candidates asking the same request is one request, for its first row (the key an
        # earlier attempt was sent for, else the lowest key). The rows are grouped before anything else
        # (an aggregate: no window, no sort, no join back), so history, filters and custom_id are
        # per group; the group's rows share the prompt, so its length and hash are any row's, and it is
        # urgent if one of its rows is. Its other rows become members after (from the plan's custom_ids).
        custom_id = "'r_' || substr(sha256($model || fingerprint || seq), 1, 40)"
        source = f"""(select fingerprint, arg_min(row_id, key) as row_id, min(key) as key, bool_or(realtime) as realtime,
                             any_value(prompt_chars) as prompt_chars, any_value(prompt_hash) as prompt_hash,
                             count(*) as group_rows
                      from {Scratch.candidates} group by fingerprint) d
                     left join {Scratch.history} h using (fingerprint)"""
        leader, rows, no_rows = "d.row_id, d.key", ", group_rows", ", null"
    else:
        group, in_candidates = "key, fingerprint", f"key in (select key from {Scratch.candidates})"
        failed = f"count(*) filter (where status = {sql(RequestStatus.FAILED)})"
        next_seq = "coalesce(h.n_requests, 0)"
        custom_id = "'r_' || substr(sha256($model || key || fingerprint || seq), 1, 40)"
        source = f"{Scratch.candidates} d left join {Scratch.history} h using ({group})"
        leader, rows, no_rows = "d.row_id, d.key", "", ""
        if config.variant_name is not None:
            # Evaluation variants without dedup: each variant's rows are its own requests, even when two
            # variants ask the same thing (sampling at llm_temperature > 0 wants a sample per variant),
            # so a variant's history is its own and a non-default variant's ids carry its name.
            in_candidates += f" and variant = {literal(ledger.variant)}"
            if ledger.variant:
                custom_id = (
                    f"'r_' || substr(sha256($model || key || fingerprint || seq || {literal(ledger.variant)}), 1, 40)"
                )
    member = urgent = "false"
    not_answered = ""
    # Selected rows with no answer, request in flight or hold for their prompt: no row answer of theirs
    # points at a request in BLOCKS_REPLANNING. Every row answer's request exists (requests are deleted
    # only while deferred, and a deferred request answers no row), so that is: none points outside the
    # requests NOT in it, which are few.
    not_blocking = f"""(select custom_id from {requests}
                        where status not in {sql_in(BLOCKS_REPLANNING)} and custom_id is not null)"""
    # A row whose fingerprint build_desired read from a row answer of this variant (answer_id) whose
    # request blocks replanning is no candidate: decided from the row alone, with no join (a run with
    # nothing new decides every row so). Only the others are looked up among the row answers.
    undecided = f"(d.answer_id is null or d.answer_id in {not_blocking})"
    if con.execute(f"select exists (select 1 from {DESIRED} d where d.has_prompt and {undecided})").fetchall()[0][0]:
        # One join of those rows with the row answers, not also one of every row answer with every
        # request. An anti join on equal keys and fingerprints (neither is NULL): NOT EXISTS would be
        # planned as a mark join on IS NOT DISTINCT FROM, slower over every row.
        con.execute(
            f"""create or replace temp table {Scratch.candidates} as
                select d.* from {DESIRED} d
                     anti join (select a.key, a.fingerprint from {answers} a
                                where a.model = $model and a.variant = $variant
                                  and a.custom_id not in {not_blocking}) a
                     on a.key = d.key and a.fingerprint = d.fingerprint
                where d.has_prompt and {undecided}""",
            {"model": ledger.model, "variant": ledger.variant},
        )
    else:
        con.execute(f"create or replace temp table {Scratch.candidates} as select * from {DESIRED} where false")
    reuse = ""
    if dedup:
        # Requests that answer (or are answering) a candidate's prompt: succeeded first, then in flight.
        scope = "" if config.dedup == "ledger" else "and model = $model"
        # An urgent row (llm_realtime_when) follows its own model's route: another model's request still
        # in a batch (up to 24 h) does not answer it; it is sent in realtime as its own request.
        urgent_waits = f"""and not (model <> $model and coalesce(route, 'batch') <> 'realtime'
                                    and status in {IN_FLIGHT_SQL}
                                    and fingerprint in (select fingerprint from {Scratch.candidates} where realtime))"""
        con.execute(
            f"""create or replace temp table {Scratch.answered} as
                select fingerprint,
                       arg_max(custom_id, (status = {sql(RequestStatus.SUCCEEDED)}, queued_at)) as custom_id,
                       bool_or(status = {sql(RequestStatus.SUCCEEDED)}) as answered
                from {requests}
                where status in {sql_in((RequestStatus.SUCCEEDED, *IN_FLIGHT))} {scope}
                  and fingerprint in (select fingerprint from {Scratch.candidates})
                  {urgent_waits if config.dedup == "ledger" else ""}
                group by fingerprint""",
            {"model": ledger.model} if scope or config.dedup == "ledger" else {},
        )
        # (Each part below is read only when its requests exist: a plan of new rows joins nothing.)
        answered_any = con.execute(f"select count(*) > 0 from {Scratch.answered}").fetchall()[0][0]
        if answered_any:
            not_answered = f"and d.fingerprint not in (select fingerprint from {Scratch.answered})"
        reuse = (
            ""
            if not answered_any
            else f"""union all
                  select c.row_id, c.key, c.fingerprint, a.custom_id, a.answered, false, c.prompt_hash
                  from {Scratch.candidates} c join {Scratch.answered} a using (fingerprint)
                  where not exists (select 1 from {answers} x
                                    where x.model = $model and x.key = c.key and x.custom_id = a.custom_id
                                      and x.variant = $variant)"""
        )
    # The candidates' requests so far, by request: a run of new rows (or with nothing new) aggregates nothing.
    con.execute(
        f"""create or replace temp table {Scratch.history} as
            select {group}, count(*) as n_requests, max(seq) as max_seq,
                   arg_max(key, queued_at) as prior_key,  -- the key an earlier attempt was sent for
                   count(*) filter (where status in {IN_FLIGHT_SQL}) as in_flight,
                   count(*) filter (where status = {sql(RequestStatus.SUCCEEDED)}) as succeeded,
                   {failed} as failed,
                   count(*) filter (where route = 'realtime' and status <> {sql(RequestStatus.VOIDED)}) as realtime_tried,
                   max(not_before) as not_before,  -- a back-off (token limit) holds the key until then
                   count(*) filter (where status = {sql(RequestStatus.HELD)}) as held,  -- cancelled by an operator (operator.py)
                   -- failed in a way no retry changes (batch_failures.py): not sent again for this fingerprint
                   count(*) filter (where status = {sql(RequestStatus.FAILED)} and failure_kind in ('deterministic', 'gave_up'))
                       as final_failed
            from {requests}
            where model = $model and status <> {sql(RequestStatus.DEFERRED)} and {in_candidates}
            group by {group}""",
        {"model": ledger.model},
    )
    if dedup and con.execute(f"select count(*) > 0 from {Scratch.history}").fetchall()[0][0]:
        # A request tried before stays with the key of its earlier attempt, if that row is still a
        # candidate (read only when there is history: new rows have none).
        source += f"""
                     left join (select c.fingerprint, c.row_id, c.key
                                from {Scratch.candidates} c join {Scratch.history} h on h.fingerprint = c.fingerprint and h.prior_key = c.key
                               ) p using (fingerprint)"""
        leader = "coalesce(p.row_id, d.row_id) as row_id, coalesce(p.key, d.key) as key"
    con.execute(
        f"""create or replace temp table {PLAN} as
            with fresh as (
                select {leader}, d.fingerprint, d.prompt_chars, d.prompt_hash, {next_seq} as seq, h.prior_key,
                       case when d.realtime or coalesce(h.failed, 0) >= $max_attempts then 'realtime' else 'batch' end as route{rows}
                from {source}
                where coalesce(h.in_flight, 0) = 0 and coalesce(h.succeeded, 0) = 0 and coalesce(h.held, 0) = 0
                  and coalesce(h.final_failed, 0) = 0
                  and (coalesce(h.failed, 0) < $max_attempts
                       -- llm_fallback = 'realtime': batch attempts used up, one more try in realtime
                       or ($fallback_realtime and coalesce(h.realtime_tried, 0) = 0))
                  and coalesce(h.not_before <= now(), true)
                  {not_answered})
            select *, {costs.estimated_input_tokens_sql(config, chars_sql="prompt_chars")} as estimated_input_tokens,
                   {estimated_cost} as estimated_cost_usd, {int(pass_index)} as pass_index, $variant as variant
            from (select row_id, key, fingerprint, seq, {custom_id} as custom_id,
                         null::varchar as deferred_prompt, null::varchar as deferred_row_json, route, prompt_chars,
                         {member} as member, {urgent} as urgent, prompt_hash{rows}
                  from fresh
                  union all
                  select null, key, fingerprint, seq, custom_id, prompt, row_json, $deferred_route, prompt_chars,
                         false, false, null::ubigint{no_rows}
                  from {Scratch.deferred})""",
        {
            "model": ledger.model,
            "variant": ledger.variant,
            "max_attempts": config.max_attempts,
            "fallback_realtime": config.fallback == "realtime",
            # deferred requests are sent the way the provider can take them
            "deferred_route": "batch" if get_provider(config.provider).has_batch_api else "realtime",
        },
    )
    con.execute(f"drop table {Scratch.deferred}")
    # The members: rows asking a request planned now for another row, or answered / in flight already,
    # or (with dedup) whose request failed for good: they show that failure, as its first rows do.
    final_failed = f"model = $model and status = {sql(RequestStatus.FAILED)} and is_final"
    if (
        dedup
        and con.execute(
            f"select exists (select 1 from {requests} where {final_failed})", {"model": ledger.model}
        ).fetchall()[0][0]
    ):
        reuse += f"""
                  union all
                  select c.row_id, c.key, c.fingerprint, f.custom_id, true, false, c.prompt_hash
                  from {Scratch.candidates} c
                       join (select fingerprint, arg_max(custom_id, queued_at) as custom_id from {requests}
                             where {final_failed} and fingerprint in (select fingerprint from {Scratch.candidates})
                             group by fingerprint) f using (fingerprint)
                  where c.fingerprint not in (select fingerprint from {PLAN})
                    and c.fingerprint not in (select fingerprint from {Scratch.answered})
                    and not exists (select 1 from {answers} x
                                    where x.model = $model and x.key = c.key and x.custom_id = f.custom_id
                                      and x.variant = $variant)"""
    # Their rows (row_json) are read from the input when their row answers are written (member_rows).
    # With dedup, each request's other rows: the candidates of its group (read only for groups of more
    # than one row) other than the one it is planned for.
    duplicates = (
        f"""select c.row_id, c.key, c.fingerprint, p.custom_id, false as reused, true as duplicate, c.prompt_hash
            from {Scratch.candidates} c
                 join (select fingerprint, row_id, custom_id from {PLAN} where group_rows > 1) p
                 on p.fingerprint = c.fingerprint and p.row_id <> c.row_id"""
        if dedup
        else f"""select row_id, key, fingerprint, custom_id, false as reused, true as duplicate, prompt_hash
            from {PLAN} where member"""
    )
    con.execute(
        f"""create or replace temp table {Scratch.plan_members} as
            {duplicates}
            {reuse}""",
        {"model": ledger.model, "variant": ledger.variant} if "$model" in reuse else {},
    )
    if dedup:  # the plan keeps the columns it has without dedup
        con.execute(f"alter table {PLAN} drop column group_rows")
        con.execute(f"drop table {Scratch.answered}")
    else:
        con.execute(f"delete from {PLAN} where member")
    con.execute(f"drop table {Scratch.candidates}")
    con.execute(f"drop table {Scratch.history}")
    if config.dedup == "ledger" and ledger.owner is not None:  # a run that sends (not a dry run)
        sharing.claim_shared(ledger)
    return con.execute(f"select count(*) from {PLAN}").fetchall()[0][0]


def member_rows(columns, where: str) -> str:
    """The plan's members matching `where` (duplicate / not duplicate), each with its row as JSON
    (row_json), read from the input: key, fingerprint, custom_id, reused, duplicate, prompt_hash, row_json."""
    return f"""(select m.key, m.fingerprint, m.custom_id, m.reused, m.duplicate, m.prompt_hash,
                       {row_json_sql(columns, "i.")} as row_json
                from {Scratch.plan_members} m join {INPUT} i on i.rowid = m.row_id where {where})"""


def dedup_counts(con) -> tuple[int, int]:
    """Of the plan's members: (rows asking the same request as another selected row, rows whose
    request is answered or in flight already)."""
    row = con.execute(
        f"""select count(*) filter (where duplicate), count(*) filter (where not duplicate)
            from {Scratch.plan_members}"""
    ).fetchall()[0]
    return row[0], row[1]


def prompt_is_blob(config: ModelConfig, columns) -> bool:
    return dict(columns).get(config.prompt_column, "").upper() == "BLOB"


def fingerprinted_text_sql(config: ModelConfig, alias: str = "") -> str:
    """The prompt as the fingerprint and the prompt hash read it: its text, '' for NULL."""
    return f"coalesce(cast({alias}{ident(config.prompt_column)} as varchar), '')"


def prompt_text_sql(config: ModelConfig, columns, alias: str = "") -> str:
    """The prompt as the text sent. A BLOB prompt column is decoded as UTF-8 (rows whose bytes are
    not UTF-8 fail before planning, bad_input.reject_unsendable); a cast would send escapes like \\xC3."""
    column = f"{alias}{ident(config.prompt_column)}"
    if prompt_is_blob(config, columns):
        return f"decode({column})"
    return f"cast({column} as varchar)"


def written_rows(plan: str, sent: str) -> str:
    """The rows of `plan` written to request files (`sent`: plan_row, chunk, line), with their
    `plan_row`, file (`chunk`) and `line`; no prompt or row (no join with the input)."""
    return f"(select p.*, p.rowid as plan_row, s.chunk, s.line from {plan} p join {sent} s on s.plan_row = p.rowid)"


def plan_rows(config: ModelConfig, columns, plan: str = PLAN, where: str | None = None, sent: str | None = None) -> str:
    """The plan joined back to the input: every PLAN column plus `plan_row` (the plan's row id),
    `prompt` and `row_json` (a deferred request brings its own from the ledger). A subquery, so rows are read, not copied.
    `where`: only the plan rows it selects (over `p`: one variant's rows of the run's plan, variants.py).
    `sent`: only the rows written to request files (request_files.SENT), with their file (`chunk`) and
    `line`: joined to the plan before the input, so the rows' JSON is built after the last join, not
    carried through one (about a tenth of the intents' request insert at a million rows). The input is
    the join's probe side when run under sql.joins_as_written (Ledger.write_intents' insert of the requests is)."""
    rows = f"{plan} p"
    plan_row = "p.rowid as plan_row, "
    if sent is not None:
        rows = f"{written_rows(plan, sent)} p"
        plan_row = ""
    return f"""(select p.*, {plan_row}coalesce(p.deferred_prompt, {prompt_text_sql(config, columns, "i.")}) as prompt,
                       coalesce(p.deferred_row_json, {row_json_sql(columns, "i.")}) as row_json
                from {INPUT} i right join {rows} on i.rowid = p.row_id{f" where {where}" if where else ""})"""
