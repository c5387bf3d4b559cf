"""Outcomes: an ended job's stored result lines become its requests' statuses, usage and cost.

Both routes settle here: harvest.py for a batch that ended (its lines downloaded and stored first),
realtime.py for the replies it stored within the run, the poller between runs. Each 'ok' answer is
checked before it counts (output_schema.py's checks: the schema it was asked with, and what its
columns can hold); one that fails is a failed attempt with the reason. The statuses change in one
transaction with the jobs marked harvested, so a run that dies in between settles nothing twice.
"""

from __future__ import annotations

import json

from dbt_llm_batch import embeddings, output_schema
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import arrow_tables, batch_failures, costs, packing
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers.base import BatchState, Provider
from dbt_llm_batch.sql import in_list, literal


def answer_checks_sql(config: ModelConfig) -> tuple[list[str], str]:
    """(SELECT lists adding the facts the checks read, in order; SQL giving why an 'ok' answer is
    unusable, or NULL): cut off, or (output_schema's checks) not a JSON object, or a flat column's value
    its column cannot hold. A cut-off answer is final at once (settle): the same request would be cut
    off again."""
    if config.max_tokens is None:
        limit, fix = "the model''s output limit", "Set llm_max_tokens higher (that asks again), or shorten the prompt"
    else:
        limit, fix = f"llm_max_tokens={config.max_tokens}", "Raise llm_max_tokens (that asks again)"
    if config.embeds:
        return [], embeddings.answer_problem_sql(config.embedding_size or 0)
    checks = [
        (
            "truncated",
            f"'answer was cut off at {limit} (finish reason ' || finish_reason || '); not retried: the same "
            f"request would be cut off again. {fix}'",
        )
    ]
    facts = []
    if config.structured:
        columns = {c.name: c.json_schema for c in config.output_columns}
        facts = output_schema.answer_facts_sql(columns)
        checks += output_schema.answer_problems_sql(columns)
    cases = " ".join(f"when {cond} then {why}" for cond, why in checks)
    return facts, f"case {cases} end"


def schema_problems(con, config: ModelConfig, table: str, skip_jobs=()) -> int:
    """Check each 'ok' answer in `table` (an outcomes table) that the bulk SQL checks passed against
    the output schema with `jsonschema` (output_schema.answer_validator), when the schema has more
    than flat columns (objects, lists, patterns, ...): a failing answer gets the validator's message as its `problem`
    (the field's path and the rule), and is a failed attempt like any other. Answers of `skip_jobs`
    are left alone. Returns how many failed."""
    schema = config.output_json_schema()
    if schema is None or all(output_schema.is_flat(c.json_schema) for c in config.output_columns):
        return 0
    return _validate(con, table, schema, f"job_id not in {in_list(skip_jobs)}" if skip_jobs else "true")


def _validate(con, table: str, schema: dict, where: str) -> int:
    """schema_problems against `schema`, for the answers of `table` that `where` (SQL) selects."""
    validator = output_schema.answer_validator(schema)
    failed: dict[str, list] = {"custom_id": [], "job_id": [], "problem": []}
    # Streamed in chunks (the answers are never all in memory); the table is updated once it is read.
    reader = con.sql(
        f"select custom_id, job_id, answer from {table} where outcome = 'ok' and problem is null and ({where})"
    ).to_arrow_reader(10_000)
    for chunk in reader:
        for custom_id, job_id, answer in zip(*(chunk.column(i).to_pylist() for i in range(3)), strict=True):
            problem = output_schema.answer_problem(validator, answer)
            if problem:
                failed["custom_id"].append(custom_id)
                failed["job_id"].append(job_id)
                failed["problem"].append(problem)
    if failed["custom_id"]:
        failures = arrow_tables.from_lists(con, {name: ("varchar", values) for name, values in failed.items()})
        con.register(Scratch.schema_failures, failures)
        try:
            con.execute(
                f"""update {table} t set problem = f.problem from {Scratch.schema_failures} f
                    where t.custom_id = f.custom_id and t.job_id = f.job_id"""
            )
        finally:
            con.unregister(Scratch.schema_failures)
    return len(failed["custom_id"])


def asked_earlier(ledger: Ledger, config: ModelConfig) -> dict[str, dict | None]:
    """{job id: its llm_output schema} of the ended jobs (Scratch.ended) asked with another schema than
    `config`'s: llm_output changed while they were in flight (jobs written before schemas were
    recorded count as asked with the current one)."""
    rows = ledger.con.execute(
        f"""select job_id, output_schema from {ledger.table("llm_batch_jobs")}
            where job_id in (select job_id from {Scratch.ended}) and output_schema is distinct from ?
              and output_schema is not null""",
        [output_schema.recorded(config.output_json_schema())],
    ).fetchall()
    return {job_id: json.loads(schema) for job_id, schema in rows}


def recheck(con, config: ModelConfig, table: str, job_id: str, schema: dict | None) -> None:
    """The answers of a job asked with an earlier llm_output (`schema`) are answers to that request
    (its fingerprint), checked against that schema: the current one's field checks would fail a good
    answer for lacking a field it was never asked for, as a billed attempt, and a change back would
    ask it again. It is kept, and shown only until the current request's answer is final (merge). What
    no schema changes is kept: a cut-off answer, and with structured output a JSON object."""
    structured = "coalesce(json_valid(answer), false) and json_type(answer) = 'OBJECT'" if config.structured else "true"
    con.execute(
        f"""update {table} set problem = null
            where job_id = ? and outcome = 'ok' and problem is not null and not coalesce(truncated, false)
              and {structured}""",
        [job_id],
    )
    if schema is not None:
        _validate(con, table, schema, f"job_id = {literal(job_id)}")


def settle(
    ledger: Ledger,
    provider: Provider,
    config: ModelConfig,
    jobs: list[tuple[str, BatchState]],
    price: dict | None,
    source: str | None = None,
) -> int:
    """Turn ended jobs' stored lines into request statuses, usage and cost, atomically with marking the
    jobs harvested (one transaction for all of them: the ledger is rewritten once, not once per job).
    Returns the number of result lines for custom_ids their job never sent (ignored, never merged).

    With `source`, only that group of a running realtime job's lines is settled: the job stays open
    and its other requests untouched (see realtime.py)."""
    con = ledger.con
    requests, results = ledger.table("llm_batch_requests"), ledger.table("llm_batch_results")
    reasons, backoffs = batch_failures.void_details(ledger, jobs)
    ended = arrow_tables.from_lists(
        con,
        {
            "job_id": ("varchar", [j for j, _ in jobs]),
            "status": ("varchar", [s.status for _, s in jobs]),
            "error": ("varchar", [s.error for _, s in jobs]),
            "plain_failure": ("boolean", [batch_failures.is_plain_failure(s) for _, s in jobs]),
            "line_errors": ("boolean", [bool(s.line_errors) for _, s in jobs]),
            "output_file_id": ("varchar", [s.output_file_id for _, s in jobs]),
            "error_file_id": ("varchar", [s.error_file_id for _, s in jobs]),
            "void_reason": ("varchar", reasons),
            "backoff_seconds": ("bigint", backoffs),
            "run_cost_usd": ("double", [s.run_cost_usd for _, s in jobs]),
        },
    )
    line_errors = batch_failures.line_errors_table(con, jobs)
    con.register(Scratch.ended, ended)
    con.register(Scratch.line_errors, line_errors)
    scope = f"job_id in (select job_id from {Scratch.ended}) {'and source = ?' if source else ''}"
    # A duplicated line must not settle a request twice (prefer a success). Duplicates are rare and
    # cheap to rule out on the stored custom_ids; ranking every line is not. Distinct custom_ids alone
    # rule them out faster than (job, custom_id) pairs; ranking a line that has no twin changes nothing.
    lines, duplicated = con.execute(
        f"select count(*), count(*) > count(distinct custom_id) from {results} where {scope}",
        [source] if source else [],
    ).fetchall()[0]
    one_per_id = "select * from lines"
    if duplicated:
        one_per_id += (
            " qualify row_number() over (partition by job_id, custom_id order by (outcome = 'ok') desc, source) = 1"
        )
    # Earlier failed attempts of the same (key, fingerprint) count towards llm_max_attempts. A model
    # with no failed request has none: its lines are not joined to their requests here (a third of
    # this statement on a million lines); settle_outcomes matches each to its queued request.
    failed_before = con.execute(
        f"select exists (select 1 from {requests} where model = ? and status = {sql(RequestStatus.FAILED)})",
        [ledger.model],
    ).fetchall()[0][0]
    outcomes = "\n            select *, 0 as earlier_failures from checked"
    if failed_before:
        outcomes = f""",
            settling as (
                select key, fingerprint, custom_id, job_id from {requests}
                where job_id in (select job_id from {Scratch.ended}) and status in {IN_FLIGHT_SQL}),
            failures as (  -- earlier failed attempts of the same (key, fingerprint)
                select p.key, p.fingerprint, count(*) as n from {requests} p
                where p.model = ? and p.status = {sql(RequestStatus.FAILED)} and (p.key, p.fingerprint) in
                      (select (key, fingerprint) from settling)
                group by all)
            select s.custom_id, s.job_id, c.* exclude (custom_id, job_id), coalesce(f.n, 0) as earlier_failures
            from settling s join checked c using (custom_id, job_id)
                 left join failures f using (key, fingerprint)"""
    # An embedding line answers every request packed into it (packing.py), each with its vector; any
    # other line its own, with none.
    line_rows = (
        packing.members_sql("line_outcomes", requests)
        if config.embeds
        else "select *, null::float[] as vector from line_outcomes"
    )
    facts, problem = answer_checks_sql(config)
    # The checks' facts (output_schema.answer_facts_sql), one CTE each, dropped once checked.
    facts_ctes = "".join(
        f"facts{n} as (select *, {select} from {'one_per_id' if n == 0 else f'facts{n - 1}'}),\n            "
        for n, select in enumerate(facts)
    )
    checking = f"facts{len(facts) - 1}" if facts else "one_per_id"
    fact_columns = (output_schema.ANSWER_VALID, output_schema.ANSWER_TYPES, output_schema.ANSWER_TEXTS)
    unchecked = f"* exclude ({', '.join(fact_columns)})" if facts else "*"
    con.execute(
        f"""create or replace temp table {Scratch.outcomes} as
            with parsed as (
                select json_transform(raw, '{json.dumps(provider.result_structure)}') as r, source, job_id
                from {results} where {scope}),
            line_outcomes as (select {provider.outcomes_sql("r")}, source, job_id from parsed),
            lines as ({line_rows}),
            one_per_id as ({one_per_id}),
            {facts_ctes}checked as (
                select {unchecked}, case when outcome = 'ok' then {problem} end as problem,
                       -- the same request would fail the same way: final at once, never planned again.
                       -- Not JSON / off-schema answers are not among them: sampled again (temperature,
                       -- provider nondeterminism) they usually parse, so they keep llm_max_attempts.
                       coalesce((outcome = 'ok' and truncated) or (outcome = 'error' and not_retried is not null),
                                false) as permanent
                from {checking}){outcomes}""",
        ([source] if source else []) + ([ledger.model] if failed_before else []),
    )
    earlier = asked_earlier(ledger, config)
    schema_problems(con, config, Scratch.outcomes, skip_jobs=list(earlier))
    for job_id, schema in earlier.items():
        recheck(con, config, Scratch.outcomes, job_id, schema)
    # Without a price, cost stays NULL: unknown, never $0. Unbilled outcomes (errors, expiries) have no usage: $0.
    cost = costs.cost_columns_sql(price, provider.self_hosted, "r.route", "o.") if price is not None else ""

    settled = [0]

    def write():
        with transaction(con):
            settled[0] = ledger.settle_outcomes(Scratch.outcomes, config.max_attempts, cost, vectors=config.embeds)
            if source:
                return
            batch_failures.fail_named_lines(ledger)
            batch_failures.settle_batch_failures(ledger, price is not None)
            if any(state.run_cost_usd is not None for _, state in jobs):  # a Ray job priced per GPU-hour
                ledger.spread_run_costs(Scratch.ended)
            # Requests a batch ended without answering (batch-level failure, lost lines) were never
            # settled by the provider: they go back to the queue without using up an attempt.
            ledger.void_unanswered(Scratch.ended, priced=price is not None)
            ledger.mark_harvested(Scratch.ended)

    try:
        retry_on_conflict(write)
        # Every line settling a queued request of its job (as many settled as lines, none duplicated)
        # leaves no unknown line: the anti-join over all lines is only needed when the counts differ.
        # Not for embeddings: a packed line settles several requests, so equal counts prove nothing.
        unknown = (
            0
            if source or (not config.embeds and not duplicated and settled[0] == lines)
            else con.execute(
                f"""select count(distinct custom_id) from {results} l
                where job_id in (select job_id from {Scratch.ended}) and not exists
                      (select 1 from {requests} r where r.custom_id = l.custom_id and r.job_id = l.job_id)"""
            ).fetchall()[0][0]
        )
    finally:
        con.unregister(Scratch.ended)
        con.unregister(Scratch.line_errors)
        con.execute(f"drop table if exists {Scratch.outcomes}")
    batch_failures.log_backoffs(ledger, jobs)
    if unknown:
        log.warning(f"{ledger.model}: {unknown} result line(s) for custom_ids their batch never sent were ignored")
    return unknown
