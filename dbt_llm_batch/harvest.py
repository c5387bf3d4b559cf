"""Harvest: poll a model's open batches, store their result lines, and settle each request.

Order matters for "nothing paid for is lost": raw result lines are stored in `llm_batch_results`
(one transaction per job) before any request changes status, and a job is marked harvested only in
the same transaction that settles its requests. A run that dies in between downloads nothing twice:
the next run finds the stored lines and settles from them.
"""

from __future__ import annotations

import json
import logging
import tempfile

from dbt_llm_batch import costs
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.providers.base import BatchProvider, BatchState

log = logging.getLogger("dbt_llm_batch")


def answer_problem_sql(config: ModelConfig) -> str:
    """SQL giving why an 'ok' answer is unusable (or NULL): cut off, not JSON, wrong field types."""
    checks = [("truncated",
               f"'answer was cut off at llm_max_tokens={config.max_tokens} (finish reason ' || finish_reason || ')'")]
    if config.structured:
        checks += [("not coalesce(json_valid(answer), false)", "'answer is not valid JSON'"),
                   ("json_type(answer) <> 'OBJECT'", "'answer is not a JSON object'")]
        for col in config.output_columns:
            path = "'$." + col.name + "'"
            jtype = f"json_type(answer, {path})"
            if col.enum:
                allowed = ", ".join("'" + v.replace("'", "''") + "'" for v in col.enum)
                cond = f"{jtype} is distinct from 'VARCHAR' or json_extract_string(answer, {path}) not in ({allowed})"
                why = f"field '{col.name}' is not one of {list(col.enum)}"
            else:
                expected = {"VARCHAR": "('VARCHAR')", "BIGINT": "('BIGINT', 'UBIGINT')",
                            "DOUBLE": "('BIGINT', 'UBIGINT', 'DOUBLE')", "BOOLEAN": "('BOOLEAN')"}[col.duckdb_type]
                cond = f"coalesce({jtype}, 'NULL') not in {expected}"
                why = f"field '{col.name}' is missing or not of type {col.json_schema['type']}"
            checks.append((cond, "'" + why.replace("'", "''") + "'"))
    cases = " ".join(f"when {cond} then {why}" for cond, why in checks)
    return f"case {cases} end"


def poll_and_harvest(ledger: Ledger, provider: BatchProvider, config: ModelConfig, jobs: list[dict],
                     price: dict | None) -> dict:
    """Poll each open job once; harvest those that ended. Returns counts for the run summary."""
    stats = {"harvested_jobs": 0, "still_pending_jobs": 0, "unknown_results": 0}
    for job in jobs:
        state = provider.poll(job["batch_id"])
        if not state.ended:
            ledger.update_job(job["job_id"], status=state.status)
            stats["still_pending_jobs"] += 1
            continue
        stats["unknown_results"] += harvest_job(ledger, provider, config, job, state, price)
        stats["harvested_jobs"] += 1
    return stats


def harvest_job(ledger: Ledger, provider: BatchProvider, config: ModelConfig, job: dict, state: BatchState,
                price: dict | None) -> int:
    """Store and settle one ended job. Returns the number of result lines for unknown custom_ids."""
    job_id = job["job_id"]
    stored = ledger.con.execute(f"select count(*) from {ledger.table('llm_batch_results')} where job_id = ?",
                                [job_id]).fetchall()[0][0]
    if not stored:
        with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_") as directory:
            files = provider.download_results(state, job["batch_id"], directory)
            store_lines(ledger, job_id, files)
    unknown = settle(ledger, provider, config, job_id, state, price)
    if unknown:
        log.warning("batch %s returned %d result line(s) for custom_ids this job never sent; ignored",
                    job["batch_id"], unknown)
    return unknown


def store_lines(ledger: Ledger, job_id: str, files: list[tuple[str, str]]) -> None:
    """All of a job's result lines in one transaction: a cut-off download stores nothing."""
    con = ledger.con
    def write():
        with transaction(con):
            for source, path in files:
                con.execute(
                    f"""insert into {ledger.table('llm_batch_results')}
                        select json ->> 'custom_id', ?, ?, ?, json, now()
                        from read_ndjson_objects(?)""",
                    [ledger.model, job_id, source, path])
    retry_on_conflict(write)


def settle(ledger: Ledger, provider: BatchProvider, config: ModelConfig, job_id: str, state: BatchState,
            price: dict | None) -> int:
    """Turn a job's stored lines into request statuses, atomically with marking the job harvested."""
    con = ledger.con
    requests = ledger.table("llm_batch_requests")
    con.execute(
        f"""create or replace temp table __llm_outcomes as
            with parsed as (
                select json_transform(raw, '{json.dumps(provider.result_structure)}') as r, source
                from {ledger.table('llm_batch_results')} where job_id = ?),
            lines as (select {provider.outcomes_sql('r')}, source from parsed),
            one_per_id as (  -- a duplicated line must not settle a request twice; prefer a success
                select * from lines
                qualify row_number() over (partition by custom_id order by (outcome = 'ok') desc, source) = 1),
            checked as (
                select *, case when outcome = 'ok' then {answer_problem_sql(config)} end as problem
                from one_per_id)
            select r.custom_id, r.key, r.fingerprint, c.* exclude (custom_id),
                   (select count(*) from {requests} p where p.model = r.model and p.key = r.key
                      and p.fingerprint = r.fingerprint and p.status = 'failed') as earlier_failures
            from {requests} r join checked c using (custom_id)
            where r.job_id = ? and r.status in ('queued', 'submitted')""",
        [job_id, job_id])
    unknown = con.execute(
        f"""select count(distinct custom_id) from {ledger.table('llm_batch_results')} l
            where job_id = ? and not exists (select 1 from {requests} r where r.custom_id = l.custom_id
                                             and r.job_id = l.job_id)""", [job_id]).fetchall()[0][0]
    def write():
        with transaction(con):
            con.execute(
                f"""update {requests} r set
                      status = case when o.outcome = 'void' then 'voided'
                                    when o.outcome = 'ok' and o.problem is null then 'succeeded' else 'failed' end,
                      is_final = case when o.outcome = 'void' then false
                                      when o.outcome = 'ok' and o.problem is null then true
                                      else o.earlier_failures + 1 >= ? end,
                      error = case when o.outcome = 'ok' then o.problem else o.error end,
                      finish_reason = o.finish_reason, answer = o.answer,
                      input_tokens = o.input_tokens, output_tokens = o.output_tokens, cached_tokens = o.cached_tokens,
                      cache_write_tokens = o.cache_write_tokens,
                      completed_at = now()
                    from __llm_outcomes o where r.custom_id = o.custom_id and r.job_id = ?""",
                [config.max_attempts, job_id])
            # Requests the batch ended without answering (batch-level failure, lost lines) were never
            # settled by the provider: they go back to the queue without using up an attempt.
            reason = state.error or f"batch ended ({state.status}) without a result for this request"
            con.execute(
                f"""update {requests} set status = 'voided', error = ?, completed_at = now()
                    where job_id = ? and status in ('queued', 'submitted')""", [reason, job_id])
            if price is not None:  # without a price, cost stays NULL: unknown, never $0
                con.execute(f"""update {requests} set cost_usd = {costs.batch_cost_sql(price)},
                                       realtime_cost_usd = {costs.realtime_cost_sql(price)}
                                where job_id = ? and status in ('succeeded', 'failed', 'voided')""", [job_id])
            con.execute(
                f"""update {ledger.table('llm_batch_jobs')} set status = ?, error = ?, output_file_id = ?,
                      error_file_id = ?, ended_at = coalesce(ended_at, now()), harvested_at = now(), updated_at = now()
                    where job_id = ?""",
                [state.status, state.error, state.output_file_id, state.error_file_id, job_id])
    retry_on_conflict(write)
    con.execute("drop table if exists __llm_outcomes")
    return unknown

