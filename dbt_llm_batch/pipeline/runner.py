"""One `dbt run` of one llm_batch model, step by step (README.md, "What a run does").

Called from the code the `llm_batch` materialization generates, inside dbt-duckdb's Python job,
with the job's DuckDB connection. Returns a RunSummary; the run log gets one line per model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from decimal import Decimal

from dbt_llm_batch.config import ModelConfig, parse_config
from dbt_llm_batch.errors import BudgetError, ConfigError, ProviderError
from dbt_llm_batch.ledger import Ledger, locks
from dbt_llm_batch.ledger.status import PRE_SUBMISSION, JobStatus
from dbt_llm_batch.log import log, warn_user
from dbt_llm_batch.ops import operator
from dbt_llm_batch.pipeline import (
    costs,
    crashpoints,
    harvest,
    identity,
    interrupt,
    merge,
    plan,
    realtime,
    request_files,
    submit,
    tempdirs,
    validate,
)
from dbt_llm_batch.pipeline.plan import INPUT
from dbt_llm_batch.providers import BatchProvider, get_provider
from dbt_llm_batch.providers.calls import ProviderUnavailable

REALTIME_PLAN = "__llm_realtime_plan"  # the plan's realtime rows (ModelRun.split_realtime)


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
    deferred: int = 0  # over an in-flight cap: waiting in the ledger for a later run
    backed_off: int = 0  # waiting for a back-off (token limit, failed batch) before they are sent again
    held: int = 0  # held after a cancel, until `dbt-llm-batch release`
    estimated_usd: object = None  # estimate of what this run submitted (Decimal), None without a price
    cost_usd: object = None  # actual cost of what this run harvested, at batch prices
    realtime_usd: object = None  # the same tokens at realtime prices
    realtime: realtime.RealtimeOutcome | None = None  # rows sent in realtime this run

    def line(self) -> str:
        saved = (
            f", saved {costs.fmt_usd(self.realtime_usd - self.cost_usd)} vs realtime"
            if self.cost_usd is not None and self.realtime_usd is not None
            else ""
        )
        estimated = costs.fmt_usd(self.estimated_usd) if self.submitted else "$0"
        return (
            f"{self.model}: submitted {self.submitted} request(s) in {self.batches} batch(es) "
            f"(estimated {estimated}); harvested {self.harvested_batches} batch(es) "
            f"(cost {costs.fmt_usd(self.cost_usd)}{saved}); merged {self.merged} row(s) ({self.failed} failed); "
            f"pending {self.pending}"
            + (f"; deferred {self.deferred} (in-flight cap)" if self.deferred else "")
            + (f"; waiting {self.backed_off} (back-off)" if self.backed_off else "")
            + (f"; held {self.held} (release with `dbt-llm-batch release`)" if self.held else "")
            + (self.realtime_part() if self.realtime else "")
        )

    def realtime_part(self) -> str:
        r = self.realtime
        left = f", {r.unsent} left for the next run (llm_realtime_budget_seconds)" if r.unsent else ""
        lost = f", {r.lost_replies} reply(ies) lost after sending (possibly billed)" if r.lost_replies else ""
        return (
            f"; realtime {r.requests} request(s) in {r.seconds:.1f} s: {r.succeeded} succeeded, "
            f"{r.failed} failed{left}" + (f", {r.retries} retried" if r.retries else "") + lost
        )


def load_input(con, sql: str | None, df):
    """Materialise the model's rows once as a temp table; returns the connection the run works on.

    A Python model's relation lives on dbt's own connection, which a pre-hook may have left inside
    a transaction (and with an unfinished result): its rows are streamed as Arrow into a connection
    of our own, so ledger writes autocommit whatever dbt's transaction does.
    """
    if sql is not None:
        con.execute(f"create or replace temp table {INPUT} as {sql}")
        return con
    import duckdb

    if isinstance(df, duckdb.DuckDBPyRelation):
        if hasattr(con, "complete"):
            con.complete()
        df = df.to_arrow_reader(100_000)
        con = con.cursor()
    con.register("__llm_input_view", df)  # Arrow reader, Arrow table or pandas frame
    con.execute(f"create or replace temp table {INPUT} as select * from __llm_input_view")
    con.unregister("__llm_input_view")
    return con


def run_model(
    con,
    *,
    schema: str,
    identifier: str,
    target: str,
    raw_config: dict,
    sql: str | None = None,
    df=None,
    full_refresh: bool = False,
    project: dict | None = None,
) -> RunSummary:
    """Run one model: validate, harvest, plan, (budget-check,) submit, (optionally wait), merge.

    `project` carries project-wide vars: `max_cost_usd` (all models' in-flight estimate plus this
    plan) and `dry_run` (plan, estimate and report; send nothing, change nothing).
    """
    project = project or {}
    config = parse_config(raw_config)  # first: a bad config fails before anything is touched
    # The input first: a Python model's relation cannot be read once other results are pending here.
    work_con = load_input(con, sql, df)
    try:
        return _run(work_con, schema, identifier, target, config, full_refresh, project)
    finally:
        if work_con is not con:  # a connection load_input opened for a Python model's rows
            work_con.close()


def _run(con, schema, identifier, target, config, full_refresh, project) -> RunSummary:
    """The run itself, on the connection that holds the model's rows (see run_model)."""
    run = ModelRun(con, config, schema, identity.ledger_identity(config, schema, identifier), project)
    input_columns = run.input_columns = plan.check_input(con, INPUT, config)
    exists = merge.relation_exists(con, schema, identifier)
    if not full_refresh and exists:
        merge.check_existing_table(con, target, merge.table_columns(input_columns, config), alter=not run.dry_run)
    plan.build_desired(con, INPUT, input_columns, config)

    if run.dry_run:
        run.dry_run_report()
    else:
        tempdirs.remove_stale()  # prompts and answers a killed run left on disk
        run.lock = locks.ModelLock(run.ledger)
        run.lock.acquire()  # before anything is harvested, planned or sent; released also on failure
        refused = None
        try:
            identity.prepare_ledger(run.ledger, config, input_columns)
            try:
                run.execute(full_refresh)
            except BudgetError as exc:
                refused = exc  # what is already final is merged first; the run still fails, saying so
            crashpoints.reach("before_merge")
            run.summary.merged, run.summary.failed = merge.merge(
                run.ledger, config, target, input_columns, rebuild=full_refresh or not exists
            )
        finally:
            run.lock.release()
        run.finish_summary()
        log.info(run.summary.line())
        try:
            run.report_unavailable()
        except ProviderError as down:
            if refused is None:
                raise
            refused = BudgetError(f"{refused} Also: {down}")  # one failure that says both
        if refused is not None:
            raise BudgetError(f"{refused} (Results that were final are merged: {run.summary.merged} row(s).)")
    for name in (INPUT, plan.DESIRED, plan.PLAN, REALTIME_PLAN, request_files.SENT):
        con.execute(f"drop table if exists {name}")
    return run.summary


class ModelRun:
    """The provider-facing steps of one model's run, sharing its ledger, provider and prices."""

    def __init__(self, con, config: ModelConfig, schema: str, model: str, project: dict, provider=None):
        self.con, self.config = con, config
        self.summary = RunSummary(model=model)
        self.ledger = Ledger(con, config.ledger_schema or schema, model)
        self.ledger.migrate()
        self.started = con.execute("select now()").fetchall()[0][0]
        self.project_max_cost = project.get("max_cost_usd")
        self.dry_run = config.dry_run or bool(project.get("dry_run"))
        costs.load_prices(con, config.price_table)
        self.price = costs.price_of(con, config.provider, config.model)
        self._provider = provider  # None: created on first use (benchmarks pass one that stays offline)
        self._job_providers: dict[tuple[str, str], object] = {}  # (provider, model) of older jobs -> client
        # One realtime budget for the whole run, however many rounds llm_wait_seconds makes.
        self.realtime_deadline = time.monotonic() + config.realtime_budget_seconds
        self.unavailable_error: str | None = None  # set once a provider stayed down for the retry budget
        self.lock = None  # locks.ModelLock, held while the run writes (set by _run)
        self.input_columns: list[tuple[str, str]] = []  # the model's selected columns, set by run_model

    @property
    def rows(self) -> str:
        """The plan with each request's prompt and row, read from the input (plan.plan_rows)."""
        return plan.plan_rows(self.config, self.input_columns)

    @property
    def provider(self):
        """Created on first use, so a run with nothing to do needs no key and makes no call."""
        if self._provider is None:
            self._provider = get_provider(self.config.provider)(self.config)
            self._provider.check_credentials()
        return self._provider

    def provider_for(self, job: dict):
        """The provider a job was submitted through, with the model it was submitted for: a batch in
        flight is polled, harvested, priced and cleaned up there even after the model's llm_provider
        or llm_model changed (a batch asked of the new provider does not exist there)."""
        provider_name, llm_model = job["provider"], job.get("llm_model") or self.config.model
        if (provider_name, llm_model) == (self.config.provider, self.config.model):
            return self.provider
        key = (provider_name, llm_model)
        if key not in self._job_providers:
            config = dataclasses.replace(self.config, provider=provider_name, model=llm_model)
            client = get_provider(provider_name)(config)
            client.check_credentials()
            self._job_providers[key] = client
        return self._job_providers[key]

    def warn_unreachable(self, job: dict, exc: ConfigError, count: int = 1) -> None:
        """A batch sent through a provider this run has no key for (the model switched provider since):
        it stays pending, and the run still merges what is final."""
        log.warning(
            f"{self.ledger.model}: {count} batch(es) or submission(s) sent through {job['provider']} "
            f"are still open and cannot be checked: {exc}. They stay pending; nothing is resent."
        )

    def price_for(self, job: dict) -> dict | None:
        """The price of the provider and model a job was sent with (not the model's current ones)."""
        provider_name, llm_model = job["provider"], job.get("llm_model") or self.config.model
        if (provider_name, llm_model) == (self.config.provider, self.config.model):
            return self.price
        return costs.price_of(self.con, provider_name, llm_model)

    def execute(self, full_refresh: bool) -> None:
        deadline = time.monotonic() + self.config.wait_seconds
        self.harvest_open()
        self.after_harvest()
        self.ledger.finalize_exhausted(self.config.max_attempts)
        self.summary.rejected_prompts = plan.reject_empty_prompts(self.ledger, INPUT, self.input_columns)
        self.summary.rejected_prompts += validate.reject_unsendable(self.ledger, self.config, self.input_columns)
        self.summary.rejected_prompts += validate.reject_deferred_without_prompt(self.ledger, self.config)
        while True:
            if self.provider_unavailable():
                return
            if not full_refresh:  # a full refresh rebuilds from the ledger and pays for nothing
                self.plan_and_submit()
            if self.config.wait_seconds <= 0 or not self.ledger.open_jobs():
                self.provider_unavailable()  # notes whether a call of this run gave up
                return
            self.wait(deadline)
            if time.monotonic() >= deadline:
                return

    def provider_unavailable(self) -> bool:
        """True once the provider kept failing for llm_retry_budget_seconds: the run then stops asking
        it (open batches stay pending, nothing new is submitted); the run ends with a dbt warning, or
        fails with llm_on_unavailable='error' (report_unavailable)."""
        spent = [
            p.calls
            for p in [self._provider, *self._job_providers.values()]
            if p is not None and p.calls is not None and p.calls.spent
        ]
        if not spent:
            return False
        self.unavailable_error = self.unavailable_error or spent[0].last_error
        return True

    def report_unavailable(self) -> None:
        """After the merge: say plainly that the provider stayed down (a dbt warning, which a nightly
        job sees in its summary and --warn-error turns into a failure), or fail the run if asked."""
        if not self.unavailable_error:
            return
        waiting = self.ledger.pending_count() + self.ledger.deferred_count()
        sent = (
            f"only {self.summary.submitted} request(s) were submitted" if self.summary.submitted else "nothing was sent"
        )
        message = (
            f"{self.ledger.model}: the provider kept failing for llm_retry_budget_seconds="
            f"{self.config.retry_budget_seconds:g} ({self.unavailable_error}); {sent} this run, open "
            f"batches stay pending, and the next run carries on ({waiting} request(s) pending or waiting)"
        )
        if self.config.on_unavailable == "error":
            raise ProviderError(message + ". (llm_on_unavailable='error' makes this fail the run.)")
        warn_user(message)

    def harvest_open(self) -> None:
        jobs = self.ledger.open_jobs()
        if not jobs:
            return
        for job in [j for j in jobs if j["status"] == JobStatus.REALTIME]:
            # Its lines are in the format of the provider that ran it, which the model may have changed since.
            job_config = dataclasses.replace(
                self.config, provider=job["provider"], model=job["llm_model"] or self.config.model
            )
            realtime.settle_interrupted(
                self.ledger, get_provider(job["provider"])(job_config), job["job_id"], self.price_for(job)
            )
            log.warning(
                f"{self.ledger.model}: a realtime run was interrupted; its stored answers are kept and "
                f"the requests it had not finished are sent again"
            )
        for job in [j for j in jobs if j["status"] in PRE_SUBMISSION]:
            try:
                self.reconcile(job)
            except ProviderUnavailable:
                break  # left as it is; provider_unavailable() reports it
            except ConfigError as exc:  # its provider's key is not set: left as it is, the run goes on
                self.warn_unreachable(job, exc)
        submitted = [j for j in self.ledger.open_jobs() if j["batch_id"]]
        by_sender: dict[tuple[str, str], list[dict]] = {}
        for job in submitted:  # each through the provider and model it was submitted with
            by_sender.setdefault((job["provider"], job["llm_model"] or self.config.model), []).append(job)
        for (provider_name, llm_model), jobs in by_sender.items():
            if self.provider_unavailable():
                break
            try:
                provider = self.provider_for(jobs[0])
            except ConfigError as exc:  # its provider's key is not set: pending, the run goes on to merge
                self.warn_unreachable(jobs[0], exc, len(jobs))
                continue
            price = self.price_for(jobs[0])
            stats = harvest.poll_and_harvest(self.ledger, provider, provider.config, jobs, price)
            self.summary.harvested_batches += stats["harvested_jobs"]
            if stats["harvested_jobs"] and price is None:
                log.warning(
                    f"{self.ledger.model}: no price known for {provider_name} model "
                    f"'{llm_model}': cost is recorded as unknown (NULL). Add it with llm_price_table."
                )

    def after_harvest(self) -> None:
        """Hold what an operator's cancel left unanswered; delete stored batches' files at the provider."""
        operator.hold_cancelled(self.ledger)
        operator.warn_missing_jobs(self.ledger)
        operator.delete_provider_files(self.ledger, self.provider_for, self.config.delete_provider_files)

    def reconcile(self, job: dict) -> None:
        """An intent without a batch id: the run died around `create` (or it failed). Adopt the batch,
        void the intent if no batch can be it, or hold it while one that could be it has not ended.
        Asked of the provider the job was submitted through (the model may have switched since)."""
        submit.reconcile(self.ledger, lambda: self.provider_for(job), job, self.started)

    def plan(self) -> int:
        """Build the plan, each request with its estimated input tokens (and cost, when priced)."""
        return plan.build_plan(self.ledger, self.config, INPUT, self.input_columns, self.price)

    def room(self) -> request_files.Room:
        """What the in-flight caps leave for this run: llm_max_batches_in_flight, the token cap (the
        model's llm_max_tokens_in_flight, else the provider's default) and the provider's request cap."""
        tokens_cap, requests_cap = self.tokens_cap(), get_provider(self.config.provider).max_requests_in_flight
        batches, requests, tokens = self.ledger.in_flight()
        return request_files.Room(
            batches=max(0, self.config.max_batches_in_flight - batches),
            requests=None if requests_cap is None else max(0, requests_cap - requests),
            tokens=None if tokens_cap is None else max(0, tokens_cap - tokens),
            nothing_in_flight=batches == 0,
        )

    def write_request_files(self, directory: str | None) -> list[request_files.RequestFile]:
        """The plan's batch requests as provider-sized files, as many as the in-flight caps allow
        (directory None: counted, not written)."""
        provider_cls = get_provider(self.config.provider)
        if not issubclass(provider_cls, BatchProvider):  # no batch API: every row went to realtime
            return request_files.nothing_to_write(self.con)
        return request_files.write_request_files(
            self.con,
            provider_cls(self.config).request_line_sql(),
            self.rows,
            directory,
            provider_cls.max_requests_per_batch,
            provider_cls.max_bytes_per_batch,
            self.room(),
        )

    def check_budget(self, n: int, estimate) -> None:
        """Refuse, before any upload, a plan that would take committed spend over a budget."""
        limits = [
            (self.config.max_cost_usd, self.ledger.committed_usd(), "llm_max_cost_usd (this model)"),
            (self.project_max_cost, self.ledger.committed_usd(all_models=True), "var llm_batch_max_cost_usd"),
        ]
        for limit, committed, name in limits:
            if limit is None:
                continue
            if estimate is None:
                raise BudgetError(
                    f"{self.ledger.model}: {name} is set to {costs.fmt_usd(limit)} but there is no price "
                    f"for {self.config.provider} model '{self.config.model}', so the cost of {n} "
                    f"request(s) cannot be estimated; nothing was sent. Add a price with llm_price_table."
                )
            if committed + estimate > Decimal(str(limit)):
                raise BudgetError(
                    f"{self.ledger.model}: refusing to submit {n} request(s): estimated {costs.fmt_usd(estimate)} "
                    f"plus {costs.fmt_usd(committed)} already in flight exceeds {name} = {costs.fmt_usd(limit)}; "
                    f"nothing was sent. Raise the limit, or select fewer rows."
                )

    def split_realtime(self) -> tuple[int, object]:
        """Move the plan's realtime rows (llm_realtime_when, llm_fallback, a self-hosted engine) out of
        the plan into their own table; returns (count, estimated cost or None)."""
        self.con.execute(
            f"create or replace temp table {REALTIME_PLAN} as select * from {plan.PLAN} where route = 'realtime'"
        )
        self.con.execute(f"delete from {plan.PLAN} where route = 'realtime'")
        return tuple(self.con.execute(f"select count(*), sum(estimated_cost_usd) from {REALTIME_PLAN}").fetchall()[0])

    def plan_and_submit(self) -> None:
        held, until = self.ledger.backed_off()
        if held:
            log.info(
                f"{self.ledger.model}: {held} request(s) wait for a back-off (token limit, or a failed "
                f"batch) and will be resubmitted after {until:%Y-%m-%d %H:%M:%S %Z}"
            )
        if self.plan() == 0:
            if self.ledger.has_deferred():  # superseded by answers the model's rows already have
                self.ledger.defer(None)
            return
        n_realtime, realtime_estimate = self.split_realtime()
        with tempdirs.private_dir() as directory:
            files = self.write_request_files(directory)
            n = sum(f.requests for f in files) + n_realtime
            estimate = None
            if self.price is not None:
                estimate = sum(f.cost or 0 for f in files) + (realtime_estimate or 0)
            if n:
                self.check_budget(n, estimate)  # batch and realtime together, before anything is sent
            first_unsent = len(files)
            if files:
                provider = self.provider
                self.warn_if_prefix_too_short(provider)
                batch_ids = submit.submit_chunks(self.ledger, provider, files, request_files.sent_rows(self.rows))
                # A file uploaded for a create that was refused is not left at the provider.
                operator.delete_provider_files(self.ledger, self.provider_for, self.config.delete_provider_files)
                sent = files[: len(batch_ids)]  # a failed create stops the run's submissions (submit.py)
                self.summary.submitted += sum(f.requests for f in sent)
                self.summary.batches += len(batch_ids)
                if estimate is not None:
                    self.summary.estimated_usd = (self.summary.estimated_usd or 0) + sum(f.cost or 0 for f in sent)
                if len(sent) < len(files):  # the failed file is voided or held; the later ones wait
                    first_unsent = len(sent) + 1
        self.ledger.defer(request_files.unsent_rows(self.rows, first_unsent) if self.unsent(first_unsent) else None)
        waiting = self.ledger.deferred_count()
        self.summary.deferred = waiting
        if waiting:
            log.info(
                f"{self.ledger.model}: {waiting} request(s) wait in the ledger for a later run: the "
                f"in-flight caps are reached (llm_max_batches_in_flight={self.config.max_batches_in_flight}, "
                f"llm_max_tokens_in_flight={self.tokens_cap()})"
            )
        if n_realtime:
            self.send_realtime()

    def unsent(self, first_unsent: int) -> int:
        """Batch requests of the plan not in a file submitted this run (request_files.unsent_rows)."""
        return self.con.execute(
            f"""select (select count(*) from {plan.PLAN})
                       - (select count(*) from {request_files.SENT} where chunk < {int(first_unsent)})"""
        ).fetchall()[0][0]

    def tokens_cap(self) -> int | None:
        """Most estimated input tokens in flight: the model's setting, else the provider's default."""
        return self.config.max_tokens_in_flight or get_provider(self.config.provider).default_max_tokens_in_flight

    def send_realtime(self) -> None:
        rows = plan.plan_rows(self.config, self.input_columns, plan=REALTIME_PLAN)
        heartbeat = (lambda ledger: locks.ModelLock(ledger, owner=self.lock.owner).heartbeat()) if self.lock else None
        outcome = realtime.run_realtime(self.ledger, self.provider, rows, self.price, self.realtime_deadline, heartbeat)
        lost = outcome.lost_replies  # this round's
        previous = self.summary.realtime
        if previous:  # a second round (llm_wait_seconds): add up
            for name in ("requests", "answered", "succeeded", "failed", "retries", "lost_replies", "given_up"):
                setattr(outcome, name, getattr(outcome, name) + getattr(previous, name))
            outcome.seconds += previous.seconds
        self.summary.realtime = outcome
        if lost:
            log.warning(
                f"{self.ledger.model}: {lost} realtime reply(ies) were lost after the "
                f"request was sent (last: {outcome.last_transient}); the provider may have billed "
                f"them without an answer: see possibly_billed in llm_batch_costs"
            )
        if outcome.unsent:
            log.warning(
                f"{self.ledger.model}: {outcome.unsent} realtime request(s) were not sent within "
                f"llm_realtime_budget_seconds={self.config.realtime_budget_seconds:g}"
                + (f" (last error: {outcome.last_transient})" if outcome.last_transient else "")
                + "; the next run sends them"
            )

    def dry_run_report(self) -> None:
        """Plan and estimate only: no provider call, no ledger row, no table change."""
        # Rows a real run would fail before sending (validate.py) are kept out of the plan, not recorded.
        unsendable = validate.reject_unsendable(self.ledger, self.config, self.input_columns, record=False)
        n = self.plan()
        n_realtime, realtime_estimate = self.split_realtime() if n else (0, None)
        files = self.write_request_files(None) if n > n_realtime else []
        batch = sum(f.requests for f in files)
        estimate = None
        if self.price is not None:
            estimate = sum(f.cost or 0 for f in files) + (realtime_estimate or 0)
        self.summary.estimated_usd = estimate if n else 0
        realtime_part = f" and {n_realtime} in realtime" if n_realtime else ""
        waiting = n - n_realtime - batch
        waiting_part = f"; {waiting} would wait for the in-flight caps" if waiting else ""
        if unsendable:
            waiting_part += f"; {unsendable} would fail without being sent (prompt not sendable)"
        log.info(
            f"{self.ledger.model}: DRY RUN: would submit {batch} request(s) in {len(files)} "
            f"batch(es){realtime_part}, estimated {costs.fmt_usd(estimate if n else 0)} at batch prices"
            f"{' (realtime at list prices)' if n_realtime else ''}{waiting_part}; "
            f"{costs.fmt_usd(self.ledger.committed_usd())} already committed in flight; nothing was sent"
        )

    def warn_if_prefix_too_short(self, provider) -> None:
        """Say plainly when llm_cache_prefix cannot save anything, instead of promising a saving."""
        if not self.config.cache_prefix:
            return
        estimate = provider.prefix_tokens_estimate()
        if estimate < provider.min_cacheable_tokens:
            log.warning(
                f"{self.ledger.model}: llm_cache_prefix is on, but the system prompt and examples are about "
                f"{estimate} tokens, below the {provider.min_cacheable_tokens}-token minimum {provider.name} "
                f"caches for {self.config.model}: no cache reads will happen"
            )

    def wait(self, deadline: float) -> None:
        """Poll with back-off until every open job ended or the deadline passed (llm_wait_seconds)."""
        delay = 0.5
        while time.monotonic() < deadline and not self.provider_unavailable():
            if self.lock:
                self.lock.heartbeat()
            self.harvest_open()
            self.after_harvest()
            open_jobs = self.ledger.open_jobs()
            if not open_jobs:
                return
            log.info(
                f"{self.ledger.model}: waiting for {len(open_jobs)} batch(es), "
                f"{self.ledger.pending_count()} request(s) pending, "
                f"{max(0, int(deadline - time.monotonic()))} s left of llm_wait_seconds"
            )
            interrupt.sleep(min(delay, max(0.0, deadline - time.monotonic())))  # Ctrl-C ends it at once
            delay = min(delay * 2, 30.0)

    def finish_summary(self) -> None:
        s = self.summary
        s.pending = self.ledger.pending_count()
        s.backed_off, s.held = self.ledger.waiting_counts()
        s.deferred = self.ledger.deferred_count()
        cost, realtime = self.con.execute(
            f"""select sum(cost_usd), sum(realtime_cost_usd) from {self.ledger.table("llm_batch_requests")}
                where model = ? and completed_at >= ?""",
            [self.ledger.model, self.started],
        ).fetchall()[0]
        if cost is None and self.price is not None:
            cost = realtime = Decimal(0)  # nothing harvested this run
        if get_provider(self.config.provider).self_hosted:
            realtime = None  # no realtime counterfactual for a self-hosted engine
        s.cost_usd, s.realtime_usd = cost, realtime
