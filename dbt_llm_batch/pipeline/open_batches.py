"""The batches a model's rows wait on (ARCHITECTURE.md, "The run"): its own, which earlier runs left
open, and with llm_dedup = 'ledger' other models' holding requests that answer its rows (shared.py).
A run reconciles and harvests them before it plans, and with llm_wait_seconds again while it waits."""

from __future__ import annotations

import time

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import harvest, interrupt, progress, reconcile, report, shared
from dbt_llm_batch.pipeline import pool as pool_module
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.pipeline.report import RunSummary


def harvest_open(ledger: Ledger, pool: Pool, config: ModelConfig, summary: RunSummary, run_started) -> None:
    """Reconcile what earlier runs left open, then poll and harvest every submitted batch, each through
    the provider and model it was submitted with; first, with llm_dedup = 'ledger', the other models'
    batches this model's rows wait on. A provider that stayed down (Pool.unavailable) is asked no more."""
    if config.dedup == "ledger" and pool.unavailable() is None:
        summary.harvested_batches += shared.harvest_shared(ledger, config)
    jobs = ledger.open_jobs()
    if not jobs:
        return
    reconcile.reconcile_open(ledger, pool, jobs, run_started)
    by_sender: dict[tuple[str, str, str | None], list[dict]] = {}
    for job in [j for j in ledger.open_jobs() if j["batch_id"]]:
        by_sender.setdefault(pool_module.sender(job, config.model), []).append(job)
    for (provider_name, llm_model, _), jobs in by_sender.items():
        if pool.unavailable() is not None:
            break
        try:
            provider = pool.client_for_job(jobs[0])
        except ConfigError as exc:  # its provider's key is not set: pending, the run goes on to merge
            report.unreachable(ledger.model, jobs[0]["provider"], exc, len(jobs))
            continue
        price = pool.price_for_job(jobs[0])
        stats = harvest.poll_and_harvest(ledger, provider, provider.config, jobs, price)
        summary.harvested_batches += stats["harvested_jobs"]
        if stats["harvested_jobs"] and price is None:
            report.no_price(ledger.model, provider_name, llm_model)


def open_work(ledger: Ledger, config: ModelConfig) -> bool:
    """Whether batches the model's rows wait on are open: its own, or (llm_dedup = 'ledger') another
    model's holding requests that answer its rows."""
    if ledger.open_jobs():
        return True
    return config.dedup == "ledger" and bool(shared.waiting_elsewhere(ledger))


def after_harvest(ledger: Ledger, pool: Pool, config: ModelConfig) -> None:
    """Hold what an operator's cancel left unanswered; delete stored batches' files at the provider."""
    reconcile.after_harvest(ledger, pool.client_for_job, config.delete_provider_files)


def wait(
    ledger: Ledger, pool: Pool, config: ModelConfig, summary: RunSummary, run_started, lock, deadline: float
) -> None:
    """Poll and harvest with back-off until every batch the rows wait on ended, the deadline passed
    (llm_wait_seconds) or a provider stayed down (Pool.unavailable); `lock`: the model's, kept alive."""
    delay = 0.5
    total = ledger.pending_count()
    waiting = progress.Progress(f"{ledger.model}: waiting for batches", total, "requests answered")
    while time.monotonic() < deadline and pool.unavailable() is None:
        if lock:
            lock.heartbeat()
        harvest_open(ledger, pool, config, summary, run_started)
        after_harvest(ledger, pool, config)
        open_jobs = ledger.open_jobs()
        waiting.update(max(0, total - ledger.pending_count()))
        if not open_work(ledger, config):
            waiting.finish()
            return
        seconds_left = max(0, int(deadline - time.monotonic()))
        report.waiting(ledger.model, len(open_jobs), ledger.pending_count(), seconds_left)
        interrupt.sleep(min(delay, max(0.0, deadline - time.monotonic())))  # Ctrl-C ends it at once
        delay = min(delay * 2, 30.0)
