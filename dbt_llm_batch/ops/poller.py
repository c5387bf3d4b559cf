"""`dbt-llm-batch poll` and `dbt_llm_batch.poll()`: harvest the batches that ended, without a dbt run.

A run leaves pending what has not ended; without the poller it reaches the model table only at the
model's next `dbt run`. The poller polls every open batch of the ledgers in a DuckDB file, stores and
settles the ended ones exactly as a run's harvest does (pipeline/harvest.py: result lines stored before
any status changes, under the model's lock), and says per model what became final and what is
pending. It does not merge: the next `dbt run` of the model merges from the ledger at once, with no
provider call for what the poller stored (`--then` can start that run).

It needs no dbt project: each run stores the settle-relevant part of its model's config in
`llm_batch_models.config_snapshot` (config.settle_snapshot), from which the poller rebuilds the
config; keys come from the same environment variables. A model run only by an older version has no
snapshot yet: it is reported and skipped.

The DuckDB file is shared politely: DuckDB lets one process at a time open a file for writing, and a
`dbt run` holds it for its whole run. The poller opens it only to read the open batches and, later,
to store and settle (seconds); polling and downloading happen with the file closed. While another
process holds the file, the poller waits and retries with back-off (as long as --wait allows, and
at least FILE_WAIT_SECONDS), saying so once. Under the file it re-reads which batches are still open
and which have stored lines, so a batch a `dbt run` harvested meanwhile is neither stored nor settled twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import duckdb

from dbt_llm_batch.config import ModelConfig, parse_config
from dbt_llm_batch.errors import ConfigError, LlmBatchError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import HOLDER, LockHeldError, ModelLock, is_lock_conflict
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, JobStatus, RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import costs, crashpoints, harvest, tempdirs
from dbt_llm_batch.pipeline.progress import Progress
from dbt_llm_batch.providers import BatchProvider, get_provider

# Exit codes of `dbt-llm-batch poll` (README, "Polling between runs").
EXIT_DONE = 0  # no batch is open (any new results are stored)
EXIT_ERROR = 1  # the poll could not be done (no such file, the file stayed held, --then failed, ...)
EXIT_PENDING = 3  # batches are still open: not ended yet, or --wait ran out
EXIT_UNAVAILABLE = 4  # the provider kept failing (throttled, 5xx, unreachable) for the retry budget

FILE_WAIT_SECONDS = 60.0  # least wait for a DuckDB file another process holds (longer with a longer --wait)
RETRY_BUDGET_SECONDS = 30.0  # least time failing provider calls are retried in one round
MAX_POLL_DELAY = 60.0  # longest pause between two polls of --wait
FIRST_POLL_DELAY_ENV = "DBT_LLM_BATCH_POLL_FIRST_DELAY"  # the first pause (default 1 s); tests shorten it
NO_SNAPSHOT = (
    "not polled: its ledger does not yet say what settling it needs (it was last run by an earlier "
    "dbt-llm-batch); run it once with dbt first"
)


class PollError(LlmBatchError):
    """The poll cannot be done; the message says why and what to do."""


@dataclass
class ModelPoll:
    """One model's part of a poll."""

    model: str  # as the ledger records it: schema.name, or its llm_ledger_identity
    schema: str  # the ledger's schema
    dbt_name: str | None = None  # its name in dbt (what a selector names), as its last run said
    harvested_batches: int = 0
    succeeded: int = 0  # requests that became final successes (the next run merges them)
    failed: int = 0  # requests that became final failures (merged as failed rows)
    retrying: int = 0  # failed attempts the next run sends again
    open_batches: int = 0
    pending_requests: int = 0
    oldest_pending_seconds: float | None = None
    skipped: str | None = None  # why it was not polled, if it was not
    answered_in_open: int = 0  # requests the provider finished in batches that are still running

    @property
    def new_results(self) -> int:
        return self.succeeded + self.failed

    @property
    def selector_name(self) -> str:
        return self.dbt_name or self.model.rsplit(".", 1)[-1]

    def line(self) -> str:
        parts = []
        if self.harvested_batches:
            parts.append(
                f"{self.harvested_batches} batch(es) harvested: {self.succeeded} succeeded, {self.failed} failed"
                + (f", {self.retrying} to retry" if self.retrying else "")
            )
        if self.open_batches:
            age = f", oldest {timedelta(seconds=int(self.oldest_pending_seconds or 0))}"
            parts.append(f"{self.pending_requests} request(s) pending in {self.open_batches} open batch(es){age}")
        else:
            parts.append("no batch open")
        if self.skipped:
            parts.append(self.skipped)
        return f"{self.model}: " + "; ".join(parts)


@dataclass
class PollResult:
    """What `poll()` did: an orchestrator's sensor reads `models_with_new_results` and `done`."""

    models: list[ModelPoll] = field(default_factory=list)
    unavailable: str | None = None  # the provider's last error, if it stayed unavailable
    then_returncode: int | None = None  # --then's exit status, if it ran
    seconds: float = 0.0

    @property
    def models_with_new_results(self) -> list[str]:
        """The dbt names of the models with rows a `dbt run` would merge now."""
        return sorted({m.selector_name for m in self.models if m.new_results})

    @property
    def selector(self) -> str:
        return " ".join(self.models_with_new_results)

    @property
    def pending(self) -> dict[str, int]:
        """Requests still in flight, per model (the ledger's name of it)."""
        return {m.model: m.pending_requests for m in self.models if m.pending_requests}

    @property
    def open_batches(self) -> int:
        return sum(m.open_batches for m in self.models)

    @property
    def oldest_pending_age(self) -> timedelta | None:
        ages = [m.oldest_pending_seconds for m in self.models if m.oldest_pending_seconds is not None]
        return timedelta(seconds=int(max(ages))) if ages else None

    @property
    def done(self) -> bool:
        """No batch is open: everything sent has an outcome in the ledger."""
        return self.open_batches == 0

    @property
    def exit_code(self) -> int:
        if self.then_returncode:
            return EXIT_ERROR
        if self.done:
            return EXIT_DONE
        return EXIT_UNAVAILABLE if self.unavailable else EXIT_PENDING


def poll(
    database: str,
    *,
    schema: str | None = None,
    model: str | None = None,
    wait: float = 0.0,
    then: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> PollResult:
    """Poll every open batch of the ledgers in `database` (one `schema`, one `model`, or all),
    store and settle the ended ones; with `wait`, go on polling with exponential back-off until no
    batch is open or `wait` seconds have passed. With `then`, run that shell command once if new
    results were stored, `{models}` replaced by a dbt selector of their models. `on_line` receives
    each model's report line (the CLI prints them). Raises PollError when the poll cannot be done."""
    if not os.path.isfile(database):
        raise PollError(f"no DuckDB file at {database}: pass the file your dbt profile writes (its `path`)")
    tempdirs.remove_stale()  # answers a killed poller downloaded, if any
    started = time.monotonic()
    deadline = started + max(0.0, wait)
    result = PollResult()
    by_model: dict[tuple[str, str], ModelPoll] = {}
    delay = float(os.environ.get(FIRST_POLL_DELAY_ENV) or 1.0)
    progress: Progress | None = None
    while True:
        # A dbt run holds the file for its whole run: wait for it as long as --wait allows, and at
        # least FILE_WAIT_SECONDS (a short --wait still outlasts a short run).
        file_until = max(deadline, time.monotonic() + FILE_WAIT_SECONDS)
        # A provider that keeps failing is retried (honouring its retry-after) for at most the time
        # --wait has left, and at least RETRY_BUDGET_SECONDS; then the poll says it is unavailable.
        retry_budget = max(RETRY_BUDGET_SECONDS, deadline - time.monotonic())
        polled, unavailable, pending_before = _poll_once(database, schema, model, file_until, retry_budget)
        for m in polled:
            seen = by_model.setdefault(
                (m.schema, m.model), dataclasses.replace(m, harvested_batches=0, succeeded=0, failed=0, retrying=0)
            )
            for name in ("harvested_batches", "succeeded", "failed", "retrying"):
                setattr(seen, name, getattr(seen, name) + getattr(m, name))
            seen.open_batches, seen.pending_requests = m.open_batches, m.pending_requests
            seen.oldest_pending_seconds, seen.skipped, seen.dbt_name = m.oldest_pending_seconds, m.skipped, m.dbt_name
            seen.answered_in_open = m.answered_in_open
        result.models = list(by_model.values())
        result.unavailable = unavailable
        if wait and progress is None:
            progress = Progress("poll: waiting for batches", pending_before, "requests answered")
        if progress is not None:
            pending = sum(m.pending_requests - m.answered_in_open for m in result.models)
            progress.update(max(0, progress.total - pending))
        now = time.monotonic()
        if result.done or unavailable or now >= deadline:
            break
        log.info(
            f"poll: {result.open_batches} batch(es) open, {sum(result.pending.values())} request(s) pending; "
            f"polling again in {min(delay, deadline - now):.0f} s"
        )
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, MAX_POLL_DELAY)
    if progress is not None:
        progress.finish()
    result.seconds = time.monotonic() - started
    for m in result.models:
        if on_line:
            on_line(m.line())
    if then and result.models_with_new_results:
        command = expand_then(then, result.models_with_new_results)
        log.info(f"poll: new results for {result.selector}: running {command}")
        result.then_returncode = subprocess.run(command, shell=True).returncode
    return result


def expand_then(command: str, models: list[str]) -> str:
    """`command` with `{models}` replaced by the models' dbt names: the word holding it is repeated
    once per model (`-s {models}+` becomes `-s a+ b+`: a dbt selector unions space-separated words)."""
    words = []
    for word in shlex.split(command):
        if "{models}" in word:
            words += [word.replace("{models}", name) for name in models]
        else:
            words.append(word)
    return shlex.join(words)


# --- one round: read (file), poll and download (no file), store and settle (file) -------------------


@dataclass
class _Target:
    """A model with open batches, as read from its ledger."""

    report: ModelPoll
    config: ModelConfig | None = None
    jobs: list[dict] = field(default_factory=list)
    stored: set[str] = field(default_factory=set)  # job ids with result lines already stored
    fetched: list[tuple[BatchProvider, harvest.Fetched]] = field(default_factory=list)
    # Harvested batches whose files the provider still keeps: (client, job id, batch id, file ids).
    to_delete: list[tuple[BatchProvider, str, str, list[str]]] = field(default_factory=list)


def _poll_once(database: str, schema: str | None, model: str | None, file_until: float, retry_budget: float):
    """One round over every model; returns (model reports, the provider's error if it stayed
    unavailable, requests pending before this round)."""
    con = open_shared(database, file_until)
    try:
        targets = _read(con, schema, model)
    finally:
        con.close()
    pending_before = sum(t.report.pending_requests for t in targets)
    unavailable = None
    with tempdirs.private_dir() as directory:
        for target in targets:
            unavailable = _fetch(target, directory, retry_budget) or unavailable
        crashpoints.reach("after_download")  # the results are on disk only: a kill here stores nothing
        if any(f.ended or f.pending for t in targets for _, f in t.fetched):
            con = open_shared(database, file_until)
            try:
                for target in targets:
                    if target.fetched:
                        _store(con, target)
                for target in targets:
                    _describe(con, target.report)
            finally:
                con.close()
    _delete_files(database, targets, file_until)
    return [t.report for t in targets], unavailable, pending_before


def _delete_files(database: str, targets: list[_Target], file_until: float) -> None:
    """As a run does after its harvest (reconcile.delete_provider_files, llm_delete_provider_files):
    delete the stored batches' files at the provider, with the file closed, then record it, so the
    next run has nothing left to ask the provider. A failure is recorded; the next run tries again."""
    done: list[tuple[_Target, str, str | None]] = []
    for target in targets:
        for client, job_id, batch_id, file_ids in target.to_delete:
            try:
                client.delete_files(batch_id, file_ids)
                done.append((target, job_id, None))
            except Exception as exc:
                log.warning(
                    f"{target.report.model}: could not delete the files of batch {batch_id} "
                    f"({type(exc).__name__}: {exc}); the results are stored, the next run tries again"
                )
                done.append((target, job_id, f"{type(exc).__name__}: {exc}"[:1000]))
    if not done:
        return
    con = open_shared(database, max(file_until, time.monotonic() + FILE_WAIT_SECONDS))
    try:
        now = con.execute("select now()").fetchall()[0][0]
        for target, job_id, error in done:
            ledger = Ledger(con, target.report.schema, target.report.model)
            if error is None:
                ledger.update_job(job_id, files_deleted_at=now, files_delete_error=None)
            else:
                ledger.update_job(job_id, files_delete_error=error)
    finally:
        con.close()


def open_shared(database: str, until: float):
    """A connection to the DuckDB file, waiting (with back-off, until `until`) while another process
    holds it; says once that it waits and for whom."""
    delay, said = 0.2, False
    while True:
        try:
            return duckdb.connect(database)
        except duckdb.IOException as exc:
            if not is_lock_conflict(exc):
                raise
            m = HOLDER.search(str(exc))
            holder = f"{m['program']} (PID {m['pid']})" if m else "another process"
            left = until - time.monotonic()
            if left <= 0:
                raise PollError(
                    f"the DuckDB file {database} stayed in use by {holder} (a dbt run holds it for its whole run); "
                    f"nothing was stored. Poll again once it ends, or give --wait a longer time"
                ) from None
            if not said:
                log.info(f"poll: {database} is in use by {holder}; waiting for it (up to {int(left)} s)")
                said = True
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


def _read(con, schema: str | None, model: str | None) -> list[_Target]:
    schemas = [
        r[0]
        for r in con.execute(
            "select distinct table_schema from information_schema.tables where table_name = 'llm_batch_jobs'"
            + (" and table_schema = ?" if schema else "")
            + " order by 1",
            [schema] if schema else [],
        ).fetchall()
    ]
    if schema and not schemas:
        raise PollError(
            f"no dbt-llm-batch ledger in schema {schema}: pass --schema (the model's schema, or its llm_ledger_schema)"
        )
    targets = []
    for s in schemas:
        ledger = Ledger(con, s, "")
        jobs_table = ledger.table("llm_batch_jobs")
        names = [
            r[0]
            for r in con.execute(
                f"""select distinct model from {jobs_table} where harvested_at is null and batch_id is not null
                    and status <> {sql(JobStatus.VOIDED)} {"and (model = ? or model like ?)" if model else ""}
                    order by 1""",
                [model, "%." + model] if model else [],
            ).fetchall()
        ]
        snapshots = _snapshots(con, ledger)
        for name in names:
            report = ModelPoll(model=name, schema=s)
            target = _Target(report)
            ledger.model = name
            target.jobs = [j for j in ledger.open_jobs() if j["batch_id"]]
            target.stored = {
                r[0]
                for r in con.execute(
                    f"select distinct job_id from {ledger.table('llm_batch_results')} where model = ?", [name]
                ).fetchall()
            }
            _describe(con, report)
            snapshot = snapshots.get(name)
            if snapshot is None:
                report.skipped = NO_SNAPSHOT
            else:
                report.dbt_name = snapshot.get("dbt_name")
                try:
                    target.config = parse_config(snapshot["config"])
                except ConfigError as exc:
                    report.skipped = f"not polled: its stored config does not parse ({exc}); run it with dbt"
            targets.append(target)
    return targets


def _snapshots(con, ledger: Ledger) -> dict[str, dict]:
    """Each model's settle snapshot (config.settle_snapshot), if its ledger has the column."""
    has_column = con.execute(
        """select count(*) from information_schema.columns where table_schema = ? and table_name = 'llm_batch_models'
           and column_name = 'config_snapshot'""",
        [ledger.schema],
    ).fetchall()[0][0]
    if not has_column:
        return {}
    return {
        name: json.loads(text)
        for name, text in con.execute(
            f"select model, config_snapshot from {ledger.table('llm_batch_models')} where config_snapshot is not null"
        ).fetchall()
    }


def _fetch(target: _Target, directory: str, retry_budget: float) -> str | None:
    """Poll the target's jobs (each through the provider and model it was sent with) and download what
    ended; returns the provider's last error if it stayed unavailable."""
    if target.config is None:
        return None
    groups: dict[tuple[str, str], list[dict]] = {}
    for job in target.jobs:
        groups.setdefault((job["provider"], job["llm_model"] or target.config.model), []).append(job)
    unavailable = None
    for (provider_name, llm_model), jobs in groups.items():
        config = dataclasses.replace(
            target.config,
            provider=provider_name,
            model=llm_model,
            retry_budget_seconds=min(target.config.retry_budget_seconds, retry_budget),
        )
        try:
            client = get_provider(provider_name)(config)
            client.check_credentials()
        except ConfigError as exc:  # its key is not set here
            target.report.skipped = f"{len(jobs)} batch(es) of {provider_name} not polled: {exc}"
            continue
        if not isinstance(client, BatchProvider):  # never the case: only a batch API gives batch ids
            continue
        fetched = harvest.fetch(target.report.model, client, jobs, directory, lambda job_id: job_id in target.stored)
        target.fetched.append((client, fetched))
        target.report.answered_in_open += fetched.pending_done
        if fetched.unavailable:
            unavailable = client.calls.last_error
    return unavailable


def _store(con, target: _Target) -> None:
    """Under the file and the model's lock: store the downloaded lines of the batches still open and
    not yet stored (a dbt run may have harvested some meanwhile), then settle them, as a run does."""
    report = target.report
    ledger = Ledger(con, report.schema, report.model)
    ledger.migrate()
    lock = ModelLock(ledger)
    try:
        lock.acquire()
    except LockHeldError as exc:  # a run of this model in this process (dbt threads, a notebook)
        report.skipped = f"not stored: {exc}"
        return
    try:
        open_now = {j["job_id"] for j in ledger.open_jobs()}
        for client, fetched in target.fetched:
            for job_id, status in fetched.pending:
                if job_id in open_now:
                    ledger.record_provider_status(job_id, status)
            ended = [(job_id, state) for job_id, state in fetched.ended if job_id in open_now]
            downloads = [d for d in fetched.downloads if d[0] in open_now and not harvest.is_stored(ledger, d[0])]
            harvest.store_lines(ledger, downloads)
            crashpoints.reach("after_store")
            if not ended:
                continue
            costs.load_prices(con, client.config.price_table)
            price = costs.price_of(con, client.config.provider, client.config.model)
            harvest.settle(ledger, client, client.config, ended, price)
            report.harvested_batches += len(ended)
            succeeded, failed, retrying = con.execute(
                f"""select count(*) filter (where status = {sql(RequestStatus.SUCCEEDED)} and is_final),
                           count(*) filter (where status = {sql(RequestStatus.FAILED)} and is_final),
                           count(*) filter (where status = {sql(RequestStatus.FAILED)} and not is_final)
                    from {ledger.table("llm_batch_requests")} where model = ? and job_id in (select unnest(?))""",
                [report.model, [job_id for job_id, _ in ended]],
            ).fetchall()[0]
            report.succeeded += succeeded
            report.failed += failed
            report.retrying += retrying
            if client.config.delete_provider_files:
                target.to_delete += [
                    (client, job_id, batch_id, [f for f in file_ids if f])
                    for job_id, batch_id, *file_ids in con.execute(
                        f"""select job_id, batch_id, input_file_id, output_file_id, error_file_id
                            from {ledger.table("llm_batch_jobs")} where job_id in (select unnest(?))
                              and harvested_at is not null and files_deleted_at is null""",
                        [[job_id for job_id, _ in ended]],
                    ).fetchall()
                ]
        ledger.hold_cancelled()  # as a run does after its harvest (reconcile.after_harvest)
    finally:
        lock.release()


def _describe(con, report: ModelPoll) -> None:
    """The model's open batches, requests in flight and the age of the oldest."""
    ledger = Ledger(con, report.schema, report.model)
    report.open_batches = len([j for j in ledger.open_jobs() if j["batch_id"]])
    report.pending_requests, report.oldest_pending_seconds = con.execute(
        f"""select count(*), epoch(now() - min(queued_at)) from {ledger.table("llm_batch_requests")}
            where model = ? and status in {IN_FLIGHT_SQL}""",
        [report.model],
    ).fetchall()[0]
