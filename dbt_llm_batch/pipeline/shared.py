"""Rows answered by another model's request (llm_dedup = 'ledger'): how many wait on one in flight, and
harvesting those requests in this model's own run.

Under llm_dedup = 'ledger' the planner maps a row whose request another model of the ledger has in
flight to that request (plan.build_plan): the row's answer is the other model's job. Its rows are this
model's pending rows (the run log, `llm_batch_progress.rows_pending`), and this model's run harvests
that job once it ended, as the other model's run would: through the provider and model it was sent
with, settled with the other model's stored settle snapshot (config.settle_snapshot, as the poller
reads it; this model's config with the job's provider and model if there is none), under the other
model's lock, taken as a brief holder (locks.BRIEF: a run of that model starting meanwhile waits for
it rather than fails). So the rows land without the other model running again, or ever (it may have
been deleted from the project). A run of the other model holding its lock (another dbt thread,
another process) is harvesting it itself: the batch is left to it, never waited for.
"""

from __future__ import annotations

import json
import time

from dbt_llm_batch.config import ModelConfig, parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import LockHeldError, ModelLock, brief_owner
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, JobStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import costs, harvest, pool, report
from dbt_llm_batch.providers import BatchProvider, get_provider
from dbt_llm_batch.sql import in_list

# How often a run waiting for another model's realtime answers (wait_for_realtime_elsewhere) looks again.
REALTIME_POLL_SECONDS = 0.25


def waiting_elsewhere(ledger: Ledger) -> dict[str, int]:
    """{another model: this model's rows (every variant) whose answer is that model's request in flight}."""
    rows = ledger.con.execute(
        f"""select r.model, count(distinct (a.variant, a.key)) from {ledger.table("llm_batch_row_answers")} a
                join {ledger.table("llm_batch_requests")} r using (custom_id)
            where a.model = ? and r.model <> ? and r.status in {IN_FLIGHT_SQL}
            group by r.model order by r.model""",
        [ledger.model, ledger.model],
    ).fetchall()
    return dict(rows)


def landed_unmerged(ledger: Ledger, variants: list[str]) -> dict[str, int]:
    """{another model: this model's rows (of `variants`, the stored names of its variants now) answered
    by that model's request, final and not merged}: under dbt's threads, that model's run (or a
    harvest of it) settled the request while this model's run was merging."""
    rows = ledger.con.execute(
        f"""select r.model, count(distinct (a.variant, a.key)) from {ledger.table("llm_batch_row_answers")} a
                join {ledger.table("llm_batch_requests")} r using (custom_id)
            where a.model = ? and a.emitted is null and a.variant in {in_list(variants)} and r.is_final
              and r.model <> ?
            group by r.model order by r.model""",
        [ledger.model, ledger.model],
    ).fetchall()
    return dict(rows)


def wait_for_realtime_elsewhere(ledger: Ledger, deadline: float) -> tuple[int, float]:
    """Wait until no row of this model waits on another model's realtime request that its run is
    sending now (dbt's threads: both models' urgent rows asked one request, and the other model
    claimed it first), so this run merges them as it would its own urgent rows: answered in the run
    they were asked in. Gives up at `deadline` (this run's realtime budget), or when the other model's
    run has ended (its lock released: what it did not answer waits for a later run). Returns how many
    rows still wait and the seconds waited."""
    started = time.monotonic()
    # Other models' realtime jobs being sent now (the jobs are few): most runs have none, and look no further.
    sending = f"""select job_id from {ledger.table("llm_batch_jobs")}
                  where status = {sql(JobStatus.REALTIME)} and model <> ?
                    and model in (select model from {ledger.table("llm_batch_locks")})"""
    while True:
        if not ledger.con.execute(f"select count(*) from ({sending})", [ledger.model]).fetchall()[0][0]:
            return 0, time.monotonic() - started
        (waiting,) = ledger.con.execute(
            f"""select count(distinct (a.variant, a.key)) from {ledger.table("llm_batch_row_answers")} a
                    join {ledger.table("llm_batch_requests")} r using (custom_id)
                where a.model = ? and r.status in {IN_FLIGHT_SQL} and r.job_id in ({sending})""",
            [ledger.model, ledger.model],
        ).fetchall()[0]
        if not waiting or time.monotonic() >= deadline:
            return waiting, time.monotonic() - started
        time.sleep(REALTIME_POLL_SECONDS)


def harvest_shared(ledger: Ledger, config: ModelConfig) -> int:
    """Poll the other models' batches that hold requests this model's rows wait on, and harvest those
    that ended (results stored, requests settled), each under its model's lock; returns how many
    batches were harvested. A batch whose provider key is not set here, or whose model's run holds its
    lock, stays pending (said in the log)."""
    harvested = 0
    for other in waiting_elsewhere(ledger):
        theirs = Ledger(ledger.con, ledger.schema, other)
        # Brief: a run of that model starting meanwhile (another dbt thread) waits for it, not fails.
        lock = ModelLock(theirs, owner=brief_owner())
        try:
            lock.acquire()
        except LockHeldError:  # that model's run (or another harvest of it) holds it: it harvests
            continue
        try:
            harvested += _harvest_model(ledger, theirs, config)
        finally:
            lock.release()
    return harvested


def _harvest_model(ours: Ledger, theirs: Ledger, config: ModelConfig) -> int:
    """Under `theirs`'s lock: harvest its open batches holding requests `ours`'s rows wait on."""
    holding = {
        r[0]
        for r in ours.con.execute(
            f"""select distinct r.job_id from {ours.table("llm_batch_row_answers")} a
                    join {ours.table("llm_batch_requests")} r using (custom_id)
                where a.model = ? and r.model = ? and r.status in {IN_FLIGHT_SQL}""",
            [ours.model, theirs.model],
        ).fetchall()
    }
    jobs = [j for j in theirs.open_jobs() if j["batch_id"] and j["job_id"] in holding]
    owner = _settle_config(theirs) or config
    by_sender: dict[tuple[str, str, str | None], list[dict]] = {}
    for job in jobs:
        by_sender.setdefault(pool.sender(job, owner.model), []).append(job)
    harvested = 0
    for (provider_name, _, _), sent in by_sender.items():
        try:
            provider = get_provider(provider_name)(pool.sent_with(owner, sent[0]))
            provider.check_credentials()
        except ConfigError as exc:  # its key is not set here: pending, the run goes on
            report.unreachable(ours.model, provider_name, exc, len(sent))
            continue
        if not isinstance(provider, BatchProvider):  # only a batch API gives batch ids
            continue
        price = costs.price_of(ours.con, *type(provider).price_key(provider.config))
        stats = harvest.poll_and_harvest(theirs, provider, provider.config, sent, price)
        if stats["harvested_jobs"]:
            log.info(
                f"{ours.model}: harvested {stats['harvested_jobs']} batch(es) of {theirs.model} that answer "
                "rows of this model (llm_dedup = 'ledger')"
            )
        harvested += stats["harvested_jobs"]
    return harvested


def _settle_config(ledger: Ledger) -> ModelConfig | None:
    """The model's config as its last run stored it for settling (None: none stored, or not parseable)."""
    row = ledger.con.execute(
        f"select config_snapshot from {ledger.table('llm_batch_models')} where model = ?", [ledger.model]
    ).fetchall()
    if not row or row[0][0] is None:
        return None
    try:
        return parse_config(json.loads(row[0][0])["config"])
    except (ConfigError, ValueError, KeyError):
        return None
