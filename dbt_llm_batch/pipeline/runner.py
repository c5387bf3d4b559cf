"""One `dbt run` of one llm_batch model, step by step (docs/guarantees.md, "What a run does").

Called from the code the `llm_batch` materialization generates, inside dbt-duckdb's Python job,
with the job's DuckDB connection. Returns a RunSummary; the run log gets one line per model.

The story of a run (`_run`, then `ModelRun.execute`); a model without variants is a run with one
pass (pipeline/passes.py), and every model takes the same steps:
  (skip)     with llm_updated_at, a selection as a complete run left it: the run
             ends before its rows are loaded                                (settled)
  validate   the config, the input's columns, the existing table           (config, plan, merge)
  lock       one writer per model                                           (ledger.locks)
  reconcile  what earlier runs and operators left: interrupted submissions,
             cancelled batches, files to delete at the provider            (open_batches, reconcile)
  harvest    finished batches: results stored, requests settled            (open_batches, harvest)
  send       every pass planned; request files per sender; every sending
             pass's key, then the budget; submit; what waits; realtime      (send)
  (wait)     with llm_wait_seconds: poll, harvest and send again          (open_batches)
  merge      final outcomes from the ledger into the model's table          (merge)
  report     the run-log line and warnings                                  (report)
Every temporary table the run makes is dropped when it ends, however it ends (scratch).
"""

from __future__ import annotations

import time

from dbt_llm_batch.config import ModelConfig, parse_config, settle_snapshot
from dbt_llm_batch.errors import BudgetError, ProviderError
from dbt_llm_batch.ledger import Ledger, locks
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import (
    budget,
    contract,
    costs,
    crashpoints,
    docs,
    identity,
    merge,
    model_input,
    open_batches,
    passes,
    plan,
    report,
    schema_change,
    send,
    settled,
    shared,
    tempdirs,
    validate,
    variants,
    wider_answers,
)
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.pipeline.report import RunSummary
from dbt_llm_batch.pipeline.scratch import Scratch

__all__ = ["ModelRun", "RunSummary", "run_model"]


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
    name: str | None = None,
    contract: dict | None = None,
) -> RunSummary:
    """Run one model: validate, reconcile, harvest, plan, (budget-check,) submit, (optionally wait), merge.

    `project` carries project-wide vars: `max_cost_usd` (all models' in-flight estimate plus this
    plan) and `dry_run` (plan, estimate and report; send nothing, change nothing). `name` is the
    model's dbt name (what `dbt-llm-batch poll --then` selects it by).
    """
    project = dict(project or {})
    config = parse_config(raw_config)  # first: a bad config fails before anything is touched
    project["settle_snapshot"] = settle_snapshot(raw_config, name)
    model = identity.ledger_identity(config, schema, identifier)
    # With llm_updated_at, a run with nothing new ends here, before any prompt is read (settled.py).
    project["settled_config"] = settled.config_signature(con, config, sql, raw_config, target, contract)
    if settled.nothing_new(con, config, schema, identifier, model, sql, full_refresh, project):
        return RunSummary(model=model)
    # The input first: a Python model's relation cannot be read once other results are pending here.
    work_con, rows = model_input.input_connection(con, df)
    scratch = Scratch(work_con)
    try:
        precomputed = model_input.load_input(work_con, sql, rows, config)
        return _run(work_con, schema, identifier, target, config, full_refresh, project, contract, precomputed, name)
    finally:
        scratch.drop_all()  # success, error or interrupt: no scratch table is left on dbt's connection
        if work_con is not con:  # a connection input_connection opened for a Python model's rows
            work_con.close()


def _run(
    con, schema, identifier, target, config, full_refresh, project, model_contract=None, precomputed=False, name=None
) -> RunSummary:
    """The run itself, on the connection that holds the model's rows (see run_model); `precomputed`:
    they carry plan.PRECOMPUTED for `config` (load_input); `name`: the model's dbt name, if known."""
    run = ModelRun(con, config, schema, identity.ledger_identity(config, schema, identifier), project)
    run.precomputed = precomputed
    if not run.dry_run:  # this run may change the model: no later run skips on what the ledger says now
        run.ledger.forget_settled()
    # Validate: the selected columns against the config, and against the table an earlier run made.
    input_columns = run.input_columns = plan.check_input(con, Scratch.input, config, precomputed)
    for other in config.variants:  # each variant's prompt column
        plan.check_input(con, Scratch.input, other, precomputed)
    settled.check_column(config, input_columns)
    contract.enforce(con, model_contract, merge.table_columns(input_columns, config))
    exists, rebuild = schema_change.prepare_table(  # on_schema_change, before anything is sent
        con, schema, identifier, target, input_columns, config, full_refresh, name or identifier, run.dry_run
    )
    if run.dry_run:  # every pass planned, then each sender's batches: as a real run would
        plan.build_desired(con, Scratch.input, input_columns, config, run.ledger, precomputed)
        run.dry_run_report()
        if not exists:  # `dbt build`'s tests of a model that never ran read its (empty) table
            merge.create_empty(con, target, input_columns, config)
        return run.summary

    tempdirs.remove_stale()  # prompts and answers a killed run left on disk
    lock = run.lock = locks.ModelLock(run.ledger)
    lock.acquire()  # before anything is harvested, planned or sent; released also on failure
    refused = None
    try:
        # Under the lock: the row answers the desired rows were read from (their answer_id, which
        # the plan reads) stay as they are until the run ends, unless prepare_ledger re-keys them.
        plan.build_desired(con, Scratch.input, input_columns, config, run.ledger, precomputed)
        if identity.prepare_ledger(run.ledger, config, input_columns):
            plan.build_desired(con, Scratch.input, input_columns, config, run.ledger, precomputed)
        if project.get("settle_snapshot"):  # what the poller needs to harvest this model (ops/poller.py)
            run.ledger.record_config_snapshot(project["settle_snapshot"])
        try:
            run.execute(full_refresh)  # reconcile, harvest, plan, request files, budget, submit, realtime
        except BudgetError as exc:
            refused = exc  # what is already final is merged first; the run still fails, saying so
        if config.dedup == "ledger" and not full_refresh:
            _wait_for_realtime_elsewhere(run)
        crashpoints.reach("before_merge")
        # The ledger's marks of what is merged describe the table its last merge wrote: another table
        # (a model renamed back to a name whose table dbt left behind) is rebuilt from the ledger.
        # Named by schema and name (as the ledger's own identity is): the database's name follows the
        # DuckDB file's, which may be moved or copied.
        table, written = f"{schema}.{identifier}", run.ledger.merged_into()
        if exists and not rebuild and written is not None and written != table:
            log.info(
                f"{run.ledger.model}: its last merge wrote {written}, not {table}: {table} is rebuilt from the ledger"
            )
            rebuild = True
        run.summary.merged, run.summary.failed, run.summary.rewritten = run.merge(target, rebuild=rebuild)
        if config.dedup == "ledger" and shared.landed_unmerged(run.ledger, run.stored_variants()):
            # Another model's run settled requests answering this model's rows while this one merged
            # (dbt's threads): they are merged now, not left out of the table until the next run.
            again = run.merge(target, rebuild=False)
            run.summary.merged += again.new
            run.summary.failed += again.failed
            run.summary.rewritten += again.rewritten
        run.ledger.record_merged_into(table)
        docs.comment_columns(con, target, config)  # what `dbt docs` shows for the llm_* columns
        if refused is None:  # left complete: the next run with nothing new may skip (llm_updated_at)
            settled.record_if_complete(run, project.get("settled_config"))
    finally:
        lock.release()

    # Report.
    elsewhere = shared.waiting_elsewhere(run.ledger) if config.dedup == "ledger" else None
    if config.dedup == "ledger":  # settled by another model's run after this one's merge: the next run's
        run.summary.landed_elsewhere = shared.landed_unmerged(run.ledger, run.stored_variants())
    report.finish_summary(run.summary, run.ledger, config, run.passes[0].price is not None, run.started, elsewhere)
    log.info(run.summary.line())
    try:
        report.unavailable(run.ledger, config, run.unavailable_error, run.summary.submitted)
    except ProviderError as down:
        if refused is None:
            raise
        refused = budget.also_unavailable(refused, down)
    if refused is not None:
        raise budget.refused_after_merge(refused, run.summary.merged)
    return run.summary


def _wait_for_realtime_elsewhere(run: ModelRun) -> None:
    """Rows answered by another model's realtime request it is sending now (llm_dedup = 'ledger', dbt's
    threads) are merged in this run, as urgent rows are: wait for them, within this run's realtime budget."""
    waiting, seconds = shared.wait_for_realtime_elsewhere(run.ledger, run.realtime_deadline)
    if seconds >= shared.REALTIME_POLL_SECONDS:
        log.info(
            f"{run.ledger.model}: waited {seconds:.1f} s for another model's realtime requests that answer "
            f"rows of this model (llm_dedup = 'ledger')"
            + (f"; {waiting} row(s) still wait: merged by a later run" if waiting else "")
        )


class ModelRun:
    """The steps of one model's run that talk to providers: reconcile and harvest, send every pass
    (pipeline/send.py), wait, merge and report. A model without variants is a run with one pass."""

    def __init__(self, con, config: ModelConfig, schema: str, model: str, project: dict, provider=None):
        self.con, self.config = con, config  # the model's own config (the default variant's)
        self.summary = RunSummary(model=model)
        self.ledger = Ledger(con, config.ledger_schema or schema, model)
        self.ledger.migrate()
        self.started = con.execute("select now()").fetchall()[0][0]
        self.project_max_cost = project.get("max_cost_usd")
        self.dry_run = config.dry_run or bool(project.get("dry_run"))
        costs.load_prices(con, config.price_table)
        # The run's clients, prices and provider availability (benchmarks pass a client that stays offline).
        self.pool = Pool(con, config, provider)
        self.passes = passes.passes_of(config, self.pool)
        # One realtime budget for the whole run, however many rounds llm_wait_seconds makes.
        self.realtime_deadline = time.monotonic() + config.realtime_budget_seconds
        self.unavailable_error: str | None = None  # set once a provider stayed down for the retry budget
        self.lock: locks.ModelLock | None = None  # held while the run writes (set by _run)
        self.input_columns: list[tuple[str, str]] = []  # the model's selected columns, set by run_model
        self.precomputed = False  # the input carries plan.PRECOMPUTED for the model's own config (load_input)
        self._state: send.RunState | None = None

    @property
    def state(self) -> send.RunState:
        """What the sending steps share (send.RunState), made once the input's columns are known."""
        if self._state is None:
            self._state = send.RunState(
                self.con,
                self.ledger,
                self.pool,
                self.config,
                self.input_columns,
                self.precomputed,
                self.summary,
                self.project_max_cost,
                self.realtime_deadline,
            )
        self._state.lock = self.lock
        return self._state

    # --- the steps ------------------------------------------------------------------------------

    def execute(self, full_refresh: bool) -> None:
        """Reconcile and harvest; drop what removed variants left waiting; send every pass; with
        llm_wait_seconds, wait for the batches and send again what became due."""
        deadline = time.monotonic() + self.config.wait_seconds
        self.harvest_open()  # reconcile, then harvest
        self.after_harvest()
        self.ledger.finalize_exhausted(self.config.max_attempts)
        stored = [p.variant for p in self.passes]
        report.dropped_removed_variants(self.ledger.model, self.ledger.drop_deferred_of_removed_variants(stored))
        self.keep_wider_answers()
        if full_refresh:  # rebuilt from the ledger, nothing paid for: only rows that cannot be sent fail
            self.reject_unsendable()
            return
        while True:
            if self.provider_unavailable():
                return
            send.send(self.state, self.passes)
            if self.config.wait_seconds <= 0 or not open_batches.open_work(self.ledger, self.config):
                self.provider_unavailable()  # notes whether a call of this run gave up
                return
            self.wait(deadline)
            if time.monotonic() >= deadline:
                return

    def dry_run_report(self) -> None:
        """Plan and estimate every pass only: no provider call, no ledger row, no table change."""
        send.send(self.state, self.passes, dry=True)

    def each_pass(self):
        """Each pass entered, its selected rows and ledger variant (passes.each)."""
        return passes.each(self.con, self.ledger, self.passes, self.input_columns, self.precomputed)

    def keep_wider_answers(self) -> None:
        """Each pass's rows answered under a wider output schema keep that answer (wider_answers.py):
        a removed output field is not asked again. Before planning; their answer_id stays NULL, so
        the plan looks them up among the row answers, where they are now."""
        for p in self.each_pass():
            wider_answers.adopt(self.ledger, p.config)

    def reject_unsendable(self) -> None:
        """Each pass's rows that can never be sent fail alone (empty, over the context window, ...)."""
        for p in self.each_pass():
            self.summary.rejected_prompts += plan.reject_empty_prompts(self.ledger, Scratch.input, self.input_columns)
            self.summary.rejected_prompts += validate.reject_unsendable(self.ledger, p.config, self.input_columns)
            self.summary.rejected_prompts += validate.reject_deferred_without_prompt(self.ledger, p.config)

    def harvest_open(self) -> None:
        """Reconcile and harvest what this model's rows wait on (open_batches.harvest_open)."""
        open_batches.harvest_open(self.ledger, self.pool, self.config, self.summary, self.started)

    def after_harvest(self) -> None:
        """Hold what an operator's cancel left unanswered; delete stored batches' files at the provider."""
        open_batches.after_harvest(self.ledger, self.pool, self.config)

    def provider_unavailable(self) -> bool:
        """True once a provider kept failing for llm_retry_budget_seconds: the run then stops asking
        it (open batches stay pending, nothing new is submitted); the run ends with a dbt warning, or
        fails with llm_on_unavailable='error' (report_unavailable)."""
        error = self.pool.unavailable()
        if error is None:
            return False
        self.unavailable_error = self.unavailable_error or error
        return True

    def wait(self, deadline: float) -> None:
        """Poll and harvest with back-off until every open job ended or the deadline passed (llm_wait_seconds)."""
        open_batches.wait(self.ledger, self.pool, self.config, self.summary, self.started, self.lock, deadline)
        self.provider_unavailable()  # notes whether a provider stayed down while it waited

    def stored_variants(self) -> list[str]:
        """The stored names of the model's variants now ('' the default's)."""
        return [p.variant for p in self.passes]

    def merge(self, target: str, rebuild: bool) -> merge.Merged:
        """Each pass's final outcomes into the table (one row per key and variant); returns what was
        written (merge.Merged), all passes together."""
        stored = self.stored_variants()  # the rows shown share a request's cost
        several = self.config.variant_name is not None
        if several and not rebuild:  # rows of removed variants go before the variants' rows are merged
            variants.drop_removed(self.ledger, self.config, target)
        total = merge.Merged(0, 0, 0)
        for p in self.each_pass():
            done = merge.merge(
                self.ledger, p.config, target, self.input_columns, rebuild=rebuild, create=p.index == 0, variants=stored
            )
            total = merge.Merged(*(a + b for a, b in zip(total, done, strict=True)))
        if several and rebuild:
            variants.drop_removed(self.ledger, self.config, target)
        return total
