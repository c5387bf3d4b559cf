"""One `dbt run` of one llm_batch model, step by step (DESIGN.md, "One run of one model").

Called from the code the `llm_batch` materialization generates, inside dbt-duckdb's Python job,
with the job's DuckDB connection. Returns a summary dict; the run log gets one line per model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from dbt_llm_batch import harvest, merge, planner, submit
from dbt_llm_batch.config import ModelConfig, parse_config
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.providers.base import UNRESOLVED

INPUT = "__llm_input"


@dataclass
class RunSummary:
    model: str
    submitted: int = 0
    batches: int = 0
    pending: int = 0
    merged: int = 0
    failed: int = 0
    harvested_batches: int = 0
    rejected_prompts: int = 0

    def line(self) -> str:
        return (f"{self.model}: submitted {self.submitted} request(s) in {self.batches} batch(es); "
                f"harvested {self.harvested_batches} batch(es); merged {self.merged} row(s) "
                f"({self.failed} failed); pending {self.pending}")


def logger():
    try:
        from dbt.adapters.events.logging import AdapterLogger
        return AdapterLogger("llm_batch")
    except ImportError:  # outside dbt (unit tests, scripts)
        import logging
        return logging.getLogger("dbt_llm_batch")


def load_input(con, sql: str | None, df) -> None:
    """Materialise the model's rows once as a connection-local temp table."""
    if sql is not None:
        con.execute(f"create or replace temp table {INPUT} as {sql}")
        return
    import duckdb
    if isinstance(df, duckdb.DuckDBPyRelation):
        df.create_view("__llm_input_view", replace=True)
    else:  # pandas / arrow frames returned by a Python model
        con.register("__llm_input_view", df)
    con.execute(f"create or replace temp table {INPUT} as select * from __llm_input_view")
    con.execute("drop view if exists __llm_input_view")


def run_model(con, *, schema: str, identifier: str, target: str, raw_config: dict,
              sql: str | None = None, df=None, full_refresh: bool = False) -> RunSummary:
    """Run one model: validate, harvest, plan, submit, (optionally wait), merge. See module doc."""
    config = parse_config(raw_config)  # first: a bad config fails before anything is touched
    provider_cls = get_provider(config.provider)
    summary = RunSummary(model=f"{schema}.{identifier}")
    # The input first: a Python model's relation cannot be read once other results are pending here.
    load_input(con, sql, df)
    ledger = Ledger(con, config.ledger_schema or schema, summary.model)
    ledger.migrate()
    input_columns = planner.check_input(con, INPUT, config)
    if not full_refresh and merge.relation_exists(con, schema, identifier):
        merge.check_existing_table(con, target, merge.table_columns(input_columns, config))
    planner.build_desired(con, INPUT, input_columns, config)

    provider = None

    def get_provider_checked():
        nonlocal provider
        if provider is None:
            provider = provider_cls(config)
            provider.check_credentials()
        return provider

    deadline = time.monotonic() + config.wait_seconds
    _harvest_open(ledger, get_provider_checked, config, summary)
    summary.rejected_prompts = planner.reject_empty_prompts(ledger)
    while True:
        if not full_refresh:  # a full refresh rebuilds from the ledger and pays for nothing
            _plan_and_submit(ledger, get_provider_checked, config, summary)
        if config.wait_seconds <= 0 or not ledger.open_jobs():
            break
        _wait(ledger, get_provider_checked, config, summary, deadline)
        if time.monotonic() >= deadline:
            break

    written, failed = merge.merge(ledger, config, target, input_columns, full_refresh)
    summary.merged, summary.failed = written, failed
    summary.pending = ledger.pending_count()
    for name in (INPUT, planner.DESIRED, planner.PLAN):
        con.execute(f"drop table if exists {name}")
    logger().info(summary.line())
    return summary


def _harvest_open(ledger: Ledger, get_provider, config: ModelConfig, summary: RunSummary) -> None:
    jobs = ledger.open_jobs()
    if not jobs:
        return
    provider = get_provider()
    for job in [j for j in jobs if j["status"] == "intent"]:
        _reconcile(ledger, provider, job)
    submitted = [j for j in ledger.open_jobs() if j["batch_id"]]
    stats = harvest.poll_and_harvest(ledger, provider, config, submitted)
    summary.harvested_batches += stats["harvested_jobs"]


def _reconcile(ledger: Ledger, provider, job: dict) -> None:
    """An intent without a batch id: the run died around `create`. Adopt the batch, void the intent
    if it never reached the provider, or leave it (and its requests) alone until that can be told."""
    custom_ids = {r[0] for r in ledger.con.execute(
        f"select custom_id from {ledger.table('llm_batch_requests')} where job_id = ?", [job["job_id"]]).fetchall()}
    found = provider.find_submission(job["job_id"], job["created_at"].timestamp(), custom_ids)
    if found == UNRESOLVED:
        logger().warning(f"{ledger.model}: submission {job['job_id']} was interrupted and cannot be matched to a "
                         f"provider batch yet; its {len(custom_ids)} request(s) are held, not resent")
    elif found:
        ledger.record_submission(job["job_id"], found.batch_id, found.input_file_id, found.status)
        logger().info(f"llm_batch {ledger.model}: adopted batch {found.batch_id} submitted by an interrupted run")
    else:
        ledger.void_job(job["job_id"], "submission interrupted before reaching the provider")
        ledger.update_job(job["job_id"], status="voided")


def _plan_and_submit(ledger: Ledger, get_provider, config: ModelConfig, summary: RunSummary) -> None:
    n = planner.build_plan(ledger, config)
    if n == 0:
        return
    provider = get_provider()
    _warn_if_prefix_too_short(ledger, provider, config)
    n_chunks = planner.assign_chunks(ledger.con, provider.request_line_sql(),
                                     provider.max_requests_per_batch, provider.max_bytes_per_batch)
    batch_ids = submit.submit_plan(ledger, provider, n_chunks)
    summary.submitted += n
    summary.batches += len(batch_ids)


def _warn_if_prefix_too_short(ledger: Ledger, provider, config: ModelConfig) -> None:
    """Say plainly when llm_cache_prefix cannot save anything, instead of promising a saving."""
    if not config.cache_prefix:
        return
    estimate = provider.prefix_tokens_estimate()
    if estimate < provider.min_cacheable_tokens:
        logger().warning(
            f"{ledger.model}: llm_cache_prefix is on, but the system prompt and examples are about {estimate} "
            f"tokens, below the {provider.min_cacheable_tokens}-token minimum {provider.name} caches for "
            f"{config.model}: no cache reads will happen")


def _wait(ledger: Ledger, get_provider, config: ModelConfig, summary: RunSummary, deadline: float) -> None:
    """Poll with back-off until every open job ended or the deadline passed (llm_wait_seconds)."""
    delay = 0.5
    while time.monotonic() < deadline:
        _harvest_open(ledger, get_provider, config, summary)
        if not ledger.open_jobs():
            return
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 30.0)


def summary_dict(summary: RunSummary) -> dict:
    return asdict(summary)
