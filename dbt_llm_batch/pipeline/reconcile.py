"""Reconciliation: what earlier runs and operators left behind, settled before a run plans anything.

- A realtime job still open: that run was interrupted; what it stored is settled, the rest is sent again.
- A submission without a batch id (the run died around `create`): adopted from the provider's list
  of batches, voided, or held while a batch that could be it has not ended (submit.reconcile).
- After each harvest: requests an operator's cancel left unanswered are held (`dbt-llm-batch
  cancel`, until `release`), requests whose job row is missing are reported, and the files of stored
  batches are deleted at the provider (`llm_delete_provider_files`, on by default).
"""

from __future__ import annotations

from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import database_path
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, PRE_SUBMISSION, JobStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import realtime, report, submit
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.providers import BatchProvider, get_provider
from dbt_llm_batch.providers.calls import ProviderUnavailable

# Job statuses of a submission whose batch id is not known (submit.py).
INTERRUPTED = PRE_SUBMISSION


def reconcile_open(ledger: Ledger, pool: Pool, jobs: list[dict], run_started) -> None:
    """Settle the interrupted realtime jobs and submissions among the model's open jobs, each through
    the provider and model it was sent with (the pool's clients and prices)."""
    for job in [j for j in jobs if j["status"] == JobStatus.REALTIME]:
        # Its lines are in the format of the provider that ran it, which the model may have changed
        # since: parsing them needs no key, so a client without a credentials check reads them.
        job_config = pool.config_for_job(job)
        realtime.settle_interrupted(
            ledger, get_provider(job_config.provider)(job_config), job["job_id"], pool.price_for_job(job)
        )
        report.interrupted_realtime(ledger.model)
    for job in [j for j in jobs if j["status"] in INTERRUPTED]:
        try:
            # Adopt the batch, void the intent if no batch can be it, or hold it while one that could be it has not ended.
            submit.reconcile(ledger, lambda job=job: pool.client_for_job(job), job, run_started)
        except ProviderUnavailable:
            break  # left as it is; the run's provider_unavailable() reports it
        except ConfigError as exc:  # its provider's key is not set: left as it is, the run goes on
            report.unreachable(ledger.model, job["provider"], exc)


def after_harvest(ledger: Ledger, client_for, delete_files: bool) -> None:
    """Hold what an operator's cancel left unanswered; delete stored batches' files at the provider."""
    hold_cancelled(ledger)
    warn_missing_jobs(ledger)
    delete_provider_files(ledger, client_for, delete_files)


def hold_cancelled(ledger: Ledger) -> int:
    """Requests an operator-cancelled batch ended without answering become 'held' (run after harvest)."""
    return ledger.hold_cancelled()


def warn_missing_jobs(ledger: Ledger) -> int:
    """Warn about in-flight requests whose job row is gone (deleted by hand?): no run polls or resends
    them. Returns how many."""
    jobs = ledger.table("llm_batch_jobs")
    n = ledger.con.execute(
        f"""select count(*) from {ledger.table("llm_batch_requests")}
            where model = ? and status in {IN_FLIGHT_SQL} and job_id not in (select job_id from {jobs})""",
        [ledger.model],
    ).fetchall()[0][0]
    if n:
        log.warning(
            f"{ledger.model}: {n} request(s) are in flight under a job missing from llm_batch_jobs (was its row "
            f"deleted?): no run polls them or sends them again. If their batch never ran (or you accept paying "
            f"again), send them with `dbt-llm-batch release --database {database_path(ledger.con)} --schema "
            f"{ledger.schema} --model {ledger.model}`"
        )
    return n


def delete_provider_files(ledger: Ledger, client_for, enabled: bool) -> None:
    """After results are stored: delete each harvested batch's input and result files at the provider.
    Recorded on the job; a failure is logged (and retried next run) and never fails the run.
    `client_for(job)` gives the provider the job was submitted through (the model may have switched
    provider since): called only when there is something to delete."""
    if not enabled:
        return
    # Harvested batches; and voided submissions that uploaded a file but never made a batch with it.
    jobs = ledger.con.execute(
        f"""select job_id, batch_id, provider, llm_model, provider_options, input_file_id, output_file_id, error_file_id
            from {ledger.table("llm_batch_jobs")}
            where model = ? and files_deleted_at is null
              and ((harvested_at is not null and batch_id is not null)
                   or (status = {sql(JobStatus.VOIDED)} and batch_id is null and input_file_id is not null))""",
        [ledger.model],
    ).fetchall()
    for job_id, batch_id, provider_name, llm_model, options, *file_ids in jobs:
        try:  # the job's provider may need a key this run does not have (the model switched provider)
            provider = client_for({"provider": provider_name, "llm_model": llm_model, "provider_options": options})
            if isinstance(provider, BatchProvider):  # a provider without a batch API keeps no files
                provider.delete_files(batch_id, [f for f in file_ids if f])
        except Exception as exc:
            what = f"batch {batch_id}" if batch_id else f"interrupted submission {job_id}"
            log.warning(
                f"{ledger.model}: could not delete the files of {what} at {provider_name} "
                f"({type(exc).__name__}: {exc}); the results are stored, the next run tries again"
            )
            ledger.update_job(job_id, files_delete_error=f"{type(exc).__name__}: {exc}"[:1000])
            continue
        ledger.update_job(job_id, files_deleted_at=_now(ledger.con), files_delete_error=None)


def _now(con):
    return con.execute("select now()").fetchall()[0][0]
