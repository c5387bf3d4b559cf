"""Harvest: poll a model's open batches, store their result lines, and settle each request
(pipeline/outcomes.py).

Order matters for "nothing paid for is lost": raw result lines are stored in `llm_batch_results`
(one transaction for all the batches that ended) before any request changes status, and a job is
marked harvested only in the same transaction that settles its requests. A run that dies in between downloads nothing twice:
the next run finds the stored lines and settles from them.
"""

from __future__ import annotations

import dataclasses
import os
import time

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import JobStatus
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import arrow_tables, crashpoints, outcomes, tempdirs
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers.base import BatchProvider, BatchState
from dbt_llm_batch.providers.calls import ProviderUnavailable, status_of

RETENTION_ENDED = "results no longer retrievable at the provider (retention ended); resubmitted"
# A batch the provider says does not exist is taken as deleted only once it must have ended (24 h)
# plus an hour: a younger one means a key for another organisation or workspace, not a lost batch.
GONE_AFTER_SECONDS = 25 * 3600


def poll_and_harvest(
    ledger: Ledger, provider: BatchProvider, config: ModelConfig, jobs: list[dict], price: dict | None
) -> dict:
    """Poll each open job once; store the results of those that ended, then settle them together.
    Returns counts for the run summary."""
    stats = {"harvested_jobs": 0, "still_pending_jobs": 0, "unknown_results": 0}
    with tempdirs.private_dir() as directory:
        fetched = fetch(ledger.model, provider, jobs, directory, lambda job_id: is_stored(ledger, job_id))
        for job_id, status in fetched.pending:
            ledger.record_provider_status(job_id, status)
        stats["still_pending_jobs"] = len(fetched.pending) + fetched.not_polled
        crashpoints.reach("after_download")
        store_lines(ledger, fetched.downloads)
        crashpoints.reach("after_store")
    if fetched.ended:
        stats["unknown_results"] = outcomes.settle(ledger, provider, config, fetched.ended, price)
        stats["harvested_jobs"] = len(fetched.ended)
    return stats


@dataclasses.dataclass
class Fetched:
    """What polling a model's open jobs found: the ended ones with their state, their downloaded
    result files [(job id, source, path)], the status word of those still running, and how many
    were not polled (pending without a word, or skipped once the provider stayed unavailable)."""

    ended: list[tuple[str, BatchState]] = dataclasses.field(default_factory=list)
    downloads: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    pending: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pending_done: int = 0  # requests the provider finished in the batches still running (progress)
    not_polled: int = 0
    unavailable: bool = False


def fetch(model: str, provider: BatchProvider, jobs: list[dict], directory: str, stored) -> Fetched:
    """The network half of a harvest, which writes nothing to the ledger: poll each job once and
    download the results of those that ended into `directory` (unless `stored(job_id)`: an
    interrupted harvest stored them already). The poller runs it without holding the database file."""
    fetched = Fetched()
    for i, job in enumerate(jobs):
        try:
            state = _poll(model, provider, job)
            if state is None or not state.ended:
                if state is None:
                    fetched.not_polled += 1
                else:
                    fetched.pending.append((job["job_id"], state.status))
                    fetched.pending_done += state.requests_done or 0
                continue
            if not stored(job["job_id"]):
                files = provider.download_results(state, job["batch_id"], directory)
                fetched.downloads += [(job["job_id"], source, path) for source, path in files]
        except ProviderUnavailable:
            # The retry budget is spent: this job and the rest stay pending (the caller says so).
            fetched.unavailable = True
            fetched.not_polled += len(jobs) - i
            break
        if state.results_gone:
            state.error = RETENTION_ENDED
            log.warning(f"{model}: batch {job['batch_id']}: {RETENTION_ENDED} (results already stored are kept)")
        fetched.ended.append((job["job_id"], state))
    return fetched


def _poll(model: str, provider: BatchProvider, job: dict) -> BatchState | None:
    """The job's state; for a batch the provider no longer knows, an ended state without results
    once it must have ended (GONE_AFTER_SECONDS), else None (left pending, with a warning)."""
    try:
        return provider.poll(job["batch_id"])
    except Exception as exc:
        if status_of(exc) != 404:
            raise
    if time.time() - job["created_at"].timestamp() > GONE_AFTER_SECONDS:
        return BatchState(status=JobStatus.GONE, ended=True, results_gone=True)
    log.warning(
        f"{model}: the provider says batch {job['batch_id']} does not exist; it was created less than a "
        f"day ago, so it is left pending: check that {provider.key_env_var} is the key of the organisation or "
        "workspace that created it"
    )
    return None


def is_stored(ledger: Ledger, job_id: str) -> bool:
    """Whether the job's result lines are stored (an interrupted harvest, or another process, stored them)."""
    return (
        ledger.con.execute(
            f"select count(*) from {ledger.table('llm_batch_results')} where job_id = ?", [job_id]
        ).fetchall()[0][0]
        > 0
    )


def store_lines(ledger: Ledger, downloads: list[tuple[str, str, str]]) -> None:
    """Store downloaded result files [(job id, source, path)] in one transaction: a cut-off
    download stores nothing (and is fetched again next run); one large append is written straight
    to the database file rather than through DuckDB's log."""
    con = ledger.con
    results = ledger.table("llm_batch_results")
    files = arrow_tables.from_lists(
        con,
        {
            "path": ("varchar", [p for _, _, p in downloads]),
            "job_id": ("varchar", [j for j, _, _ in downloads]),
            "source": ("varchar", [s for _, s, _ in downloads]),
            "has_lines": ("boolean", [os.path.getsize(p) > 0 for _, _, p in downloads]),
        },
    )

    def write():  # one statement for all files, which DuckDB reads in parallel
        con.register(Scratch.downloads, files)
        try:
            with transaction(con):
                ledger.store_result_files(Scratch.downloads, files.column("path").to_pylist())
                # Lines are matched to their file by the name DuckDB reports; a file whose lines all went
                # unmatched would look like a batch without results: refuse, and store nothing.
                lost = con.execute(f"""select path from {Scratch.downloads} d where has_lines and not exists
                                       (select 1 from {results} r where r.job_id = d.job_id and r.source = d.source)""").fetchall()
                if lost:
                    raise RuntimeError(
                        f"dbt-llm-batch bug: the result lines of {lost[0][0]} could not be matched to "
                        f"their batch; nothing was stored, and the next run downloads them again"
                    )
        finally:
            con.unregister(Scratch.downloads)

    if downloads:
        retry_on_conflict(write)
