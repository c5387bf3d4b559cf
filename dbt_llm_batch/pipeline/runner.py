"""One `dbt run` of one llm_batch model, step by step (README.md, "What a run does").

Called from the code the `llm_batch` materialization generates, inside dbt-duckdb's Python job,
with the job's DuckDB connection. Returns a RunSummary; the run log gets one line per model.

The story of a run (`_run`, then `ModelRun.execute`):
  validate   the config, the input's columns, the existing table           (config, plan, merge)
  lock       one writer per model                                           (ledger.locks)
  reconcile  what earlier runs and operators left: interrupted submissions,
             cancelled batches, files to delete at the provider             (reconcile)
  harvest    finished batches: results stored, requests settled             (harvest)
  validate   rows that cannot be sent fail alone                            (validate)
  plan       what this run must send                                        (plan)
  files      the batch requests as provider-sized request files             (request_files)
  budget     refuse a plan that would go over a budget, before any upload   (budget)
  submit     intents in the ledger, then upload and create                  (submit)
  realtime   the rows the plan routes to realtime                           (realtime)
  (wait)     with llm_wait_seconds: poll, harvest and plan again
  merge      final outcomes from the ledger into the model's table          (merge)
  report     the run-log line and warnings                                  (report)
Every temporary table the run makes is dropped when it ends, however it ends (scratch).
"""

from __future__ import annotations

import contextlib
import os
import time
from decimal import Decimal

from dbt_llm_batch.config import ModelConfig, parse_config, settle_snapshot
from dbt_llm_batch.errors import BudgetError, ConfigError, InputError, ProviderError
from dbt_llm_batch.ledger import Ledger, locks
from dbt_llm_batch.log import log, warn_user
from dbt_llm_batch.pipeline import (
    budget,
    contract,
    costs,
    crashpoints,
    docs,
    harvest,
    identity,
    interrupt,
    merge,
    plan,
    progress,
    realtime,
    reconcile,
    report,
    request_files,
    shared,
    submit,
    tempdirs,
    validate,
    variants,
)
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.pipeline.report import RunSummary
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers import BatchProvider, get_provider

__all__ = ["ModelRun", "RunSummary", "load_input", "run_model"]


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
    # The input first: a Python model's relation cannot be read once other results are pending here.
    work_con, rows = input_connection(con, df)
    scratch = Scratch(work_con)
    try:
        precomputed = load_input(work_con, sql, rows, config)
        return _run(work_con, schema, identifier, target, config, full_refresh, project, contract, precomputed)
    finally:
        scratch.drop_all()  # success, error or interrupt: no scratch table is left on dbt's connection
        if work_con is not con:  # a connection input_connection opened for a Python model's rows
            work_con.close()


def input_connection(con, df):
    """The connection the run works on, and the rows to load.

    A Python model's relation lives on dbt's own connection, which a pre-hook may have left inside
    a transaction (and with an unfinished result): its rows are streamed as Arrow into a connection
    of our own, so ledger writes autocommit whatever dbt's transaction does.
    """
    import duckdb

    if isinstance(df, duckdb.DuckDBPyRelation):
        if hasattr(con, "complete"):
            con.complete()
        return con.cursor(), df.to_arrow_reader(100_000)
    return con, df


def load_input(con, sql: str | None, df, config: ModelConfig | None = None) -> bool:
    """Materialise the model's rows once as a temp table: a SQL model's query, or a Python model's
    rows (an Arrow reader, Arrow table or pandas frame). With a SQL model's `config`, each row's key,
    prompt hash and prompt length (plan.PRECOMPUTED) are computed in the same pass, so the prompts are
    read once, not again by plan.build_desired; returns whether they were."""
    if sql is not None:
        import duckdb

        facts = _row_facts(con, sql, config) if config is not None else None
        if facts is not None:
            try:
                con.execute(
                    f"create or replace temp table {Scratch.input} as select *, {facts} from (\n{sql}\n) model_sql"
                )
                return True
            except duckdb.InterruptException:  # Ctrl-C (dbt cancels the query): stop, don't copy again
                raise
            except duckdb.Error:
                pass  # copied as it is below: the user's SQL fails there as it would have, or check_input says why
        try:
            con.execute(f"create or replace temp table {Scratch.input} as {sql}")
        except duckdb.InterruptException:
            raise
        except duckdb.Error as exc:  # the user's SQL: DuckDB's message is the one to show, as dbt would
            raise InputError(f"the model's SQL failed, nothing was sent: {exc}") from None
        return False
    con.register(Scratch.input_view, df)
    con.execute(f"create or replace temp table {Scratch.input} as select * from {Scratch.input_view}")
    con.unregister(Scratch.input_view)
    return False


def _row_facts(con, sql: str, config: ModelConfig) -> str | None:
    """plan.PRECOMPUTED as SQL over the model's query, when its columns (bound, not run) have the key
    and prompt columns, distinct names and none of PRECOMPUTED's; else None (the rows are copied as
    they are, and plan.check_input says what is wrong, if anything)."""
    import duckdb

    try:
        columns = [(r[0], r[1]) for r in con.execute(f"describe (\n{sql}\n)").fetchall()]
    except duckdb.InterruptException:
        raise
    except duckdb.Error:
        return None
    names = [c[0].lower() for c in columns]
    needed = [k.lower() for k in (*config.unique_key, config.prompt_column)]
    if len(set(names)) < len(names) or not set(needed) <= set(names) or set(names) & set(plan.PRECOMPUTED):
        return None
    return ", ".join(
        f"{value} as {name}" for value, name in zip(plan.row_facts_sql(config, columns), plan.PRECOMPUTED, strict=True)
    )


def _run(
    con, schema, identifier, target, config, full_refresh, project, model_contract=None, precomputed=False
) -> RunSummary:
    """The run itself, on the connection that holds the model's rows (see run_model); `precomputed`:
    they carry plan.PRECOMPUTED for `config` (load_input)."""
    run = ModelRun(con, config, schema, identity.ledger_identity(config, schema, identifier), project)
    run.precomputed = precomputed
    # Validate: the selected columns against the config, and against the table an earlier run made.
    input_columns = run.input_columns = plan.check_input(con, Scratch.input, config, precomputed)
    for other in config.variants:  # each variant's prompt column
        plan.check_input(con, Scratch.input, other, precomputed)
    contract.enforce(con, model_contract, merge.table_columns(input_columns, config))
    exists = merge.relation_exists(con, schema, identifier)
    if not full_refresh and exists:
        merge.check_existing_table(
            con,
            target,
            merge.table_columns(input_columns, config),
            alter=not run.dry_run,
            default_variant=config.variant_name,
        )
    if run.dry_run:
        plan.build_desired(con, Scratch.input, input_columns, config, run.ledger, precomputed)
        if config.variants:  # every variant planned, then each sender's batches: as a real run would
            run.plan_and_submit_variants(dry=True)
        else:
            run.dry_run_report()
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
        crashpoints.reach("before_merge")
        run.summary.merged, run.summary.failed = run.merge(target, rebuild=full_refresh or not exists)
        docs.comment_columns(con, target, config)  # what `dbt docs` shows for the llm_* columns
    finally:
        lock.release()

    # Report.
    run.finish_summary()
    log.info(run.summary.line())
    try:
        run.report_unavailable()
    except ProviderError as down:
        if refused is None:
            raise
        refused = budget.also_unavailable(refused, down)
    if refused is not None:
        raise budget.refused_after_merge(refused, run.summary.merged)
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
        # The run's clients, prices and provider availability (benchmarks pass a client that stays offline).
        self.pool = Pool(con, config, provider)
        self.price = self.pool.price_of_config(config)
        # Evaluation variants (pipeline/variants.py): `config` is the variant whose pass is running;
        # the model's own (the default variant) is `default`.
        self.default = config
        # One realtime budget for the whole run, however many rounds llm_wait_seconds makes.
        self.realtime_deadline = time.monotonic() + config.realtime_budget_seconds
        self.unavailable_error: str | None = None  # set once a provider stayed down for the retry budget
        self.lock: locks.ModelLock | None = None  # held while the run writes (set by _run)
        self.input_columns: list[tuple[str, str]] = []  # the model's selected columns, set by run_model
        self.precomputed = False  # the input carries plan.PRECOMPUTED for the model's own config (load_input)
        self.output: costs.OutputEstimate | None = None  # output tokens per request, set by plan()
        self.said_dedup_off = False  # the run log says once that llm_temperature turned dedup off

    # --- the steps ------------------------------------------------------------------------------

    def execute(self, full_refresh: bool) -> None:
        deadline = time.monotonic() + self.config.wait_seconds
        self.harvest_open()  # reconcile, then harvest
        self.after_harvest()
        self.ledger.finalize_exhausted(self.config.max_attempts)
        stored = [variant.variant for variant in self.default.all_variants()]
        report.dropped_removed_variants(self.ledger.model, self.ledger.drop_deferred_of_removed_variants(stored))
        several = len(self.default.all_variants()) > 1
        if not several:
            self.reject_unsendable()
        while True:
            if self.provider_unavailable():
                return
            # Each variant's pass through its own provider. Its rows that cannot be sent are rejected
            # in the pass: they are marked in the pass's own Scratch.desired, which the plan reads.
            if several and not full_refresh:  # every variant planned, then one batch per sender
                self.plan_and_submit_variants()
            for variant in self.default.all_variants() if not several or full_refresh else ():
                with self.using(variant):
                    if several:
                        self.reject_unsendable()
                    if not full_refresh:  # a full refresh rebuilds from the ledger and pays for nothing
                        self.plan_and_submit()
            if self.config.wait_seconds <= 0 or not self.open_work():
                self.provider_unavailable()  # notes whether a call of this run gave up
                return
            self.wait(deadline)
            if time.monotonic() >= deadline:
                return

    def reject_unsendable(self) -> None:
        """Rows of this pass that can never be sent fail alone (empty, over the context window, ...)."""
        self.summary.rejected_prompts += plan.reject_empty_prompts(self.ledger, Scratch.input, self.input_columns)
        self.summary.rejected_prompts += validate.reject_unsendable(self.ledger, self.config, self.input_columns)
        self.summary.rejected_prompts += validate.reject_deferred_without_prompt(self.ledger, self.config)

    # --- evaluation variants ------------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self, variant: ModelConfig):
        """Run the block as `variant`'s pass (pipeline/variants.py): its config, price, provider, its
        row answers in the ledger, and its selected rows and fingerprints in Scratch.desired; the
        default variant's again afterwards, however the block ends. A model without variants has
        only its own config: nothing changes."""
        if variant is self.config:
            yield
            return
        self._switch(variant)
        try:
            yield
        finally:
            self._switch(self.default)

    def _switch(self, variant: ModelConfig, desired: bool = True) -> None:
        self.config = variant
        self.ledger.variant = variant.variant
        self.price = self.pool.price_of_config(variant)
        if desired:
            precomputed = self.precomputed and variant is self.default  # computed for the model's own config
            plan.build_desired(self.con, Scratch.input, self.input_columns, variant, self.ledger, precomputed)
            variants.sample_desired(self.con, variant)

    @contextlib.contextmanager
    def acting_as(self, variant: ModelConfig):
        """`variant`'s config, price, provider and ledger variant for the block, without building its
        selected rows (Scratch.desired is left as it is): for the steps after every pass was planned."""
        if variant is self.config:
            yield
            return
        previous = self.config
        self._switch(variant, desired=False)
        try:
            yield
        finally:
            self._switch(previous, desired=False)

    def plan_and_submit_variants(self, dry: bool = False) -> None:
        """Evaluation variants: every variant's pass is planned first (variants.stash_pass); then the
        passes' batch requests are written into one set of request files per sender (provider and
        model), each line rendered with its own variant's config; the budget is checked once, for the
        whole run, before anything is sent; each sender's files are submitted; what did not fit
        waits, each variant's own; then each variant's realtime rows. `dry`: plan and report only."""
        held, until = self.ledger.backed_off()
        if held and not dry:  # the model's, all variants together: said once
            report.backed_off(self.ledger.model, held, until)
        passes = self.default.all_variants()
        planned: list[int] = []
        realtime_plans: list[tuple[int, Decimal | None]] = []
        outputs: list[costs.OutputEstimate | None] = []
        unsendable: list[int] = []
        counts: list[tuple[int, int]] = []
        for i, variant in enumerate(passes):
            with self.using(variant):
                if dry:  # rows a real run would fail before sending are kept out of the plan, not recorded
                    unsendable.append(
                        validate.reject_unsendable(self.ledger, self.config, self.input_columns, record=False)
                    )
                else:
                    self.reject_unsendable()
                    if self.config.dedup is not None:  # rows that stopped asking a request in flight
                        self.ledger.unmap_superseded(Scratch.desired)
                n = self.plan()
                if n and i and self.config.dedup is not None:  # asked by an earlier variant already
                    n -= variants.share_planned(self.con)
                counts.append(plan.dedup_counts(self.con))
                if not dry:
                    self.map_answered()
                planned.append(n)
                realtime_plans.append(self.split_realtime())
                outputs.append(self.output)
                variants.stash_pass(self.con, i, variant.variant)
        # One set of request files per sender, in the order the passes first name it.
        senders: dict[tuple[str, str], list[int]] = {}
        for i, variant in enumerate(passes):
            if planned[i] > realtime_plans[i][0] and issubclass(get_provider(variant.provider), BatchProvider):
                senders.setdefault((variant.provider, variant.model), []).append(i)
        variants.start_sent(self.con)
        with contextlib.ExitStack() as stack:
            directory = None if dry else stack.enter_context(tempdirs.private_dir())
            files = self.write_sender_files(passes, senders, directory)
            written = variants.written(self.con)
            estimates: list[Decimal | None] = []
            for i, variant in enumerate(passes):
                batch_cost = written.get(i, (0, None, 0))[1] if i in written else Decimal(0)
                priced = self.pool.price_of_config(variant) is not None
                estimates.append(None if not priced or batch_cost is None else batch_cost + (realtime_plans[i][1] or 0))
            if dry:
                self.report_dry_variants(
                    passes, planned, realtime_plans, outputs, unsendable, counts, estimates, written
                )
                self.report_senders(senders, files)
                return
            # Before anything is sent: every sending pass's provider key, then the budget for them all.
            self.pool.check([variant for i, variant in enumerate(passes) if planned[i]])
            self.check_run_budget(passes, realtime_plans, estimates, written, outputs)
            for sender, (provider_name, llm_model) in enumerate(senders):
                if files[sender]:
                    self.submit_sender(sender, passes, senders[(provider_name, llm_model)], files[sender])
        submitted = variants.written(self.con)  # what went in a submitted batch, per pass
        for i, variant in enumerate(passes):
            with self.acting_as(variant):
                if planned[i] or self.ledger.has_deferred():
                    unsent = variants.unsent_rows(variants.pass_rows(variant, self.input_columns, i))
                    n_unsent = self.con.execute(f"select count(*) from {unsent}").fetchall()[0][0]
                    self.ledger.defer(unsent if n_unsent else None)
                n_sent, sent_cost, _ = submitted.get(i, (0, None, 0))
                output = outputs[i]
                if n_sent and sent_cost is not None and self.price is not None and output is not None:
                    self.summary.estimated_usd = (self.summary.estimated_usd or 0) + sent_cost
                    expected, ceiling = costs.estimate_range(self.price, output, sent_cost, n_sent)
                    self.summary.expected_usd = (self.summary.expected_usd or 0) + expected
                    self.summary.ceiling_usd = (self.summary.ceiling_usd or 0) + ceiling
        waiting = self.ledger.deferred_count()
        self.summary.deferred = waiting
        if waiting:
            report.deferred(self.ledger.model, waiting, self.config, self.tokens_cap(), shares=self.deferred_shares())
        for i, variant in enumerate(passes):
            if realtime_plans[i][0]:
                with self.acting_as(variant):
                    self.con.execute(
                        f"create or replace temp table {Scratch.realtime_plan} as "
                        f"select * exclude (pass_index) from {Scratch.run_realtime} where pass_index = {i}"
                    )
                    self.send_realtime(members=variants.member_rows(self.input_columns), per_row_variant=True)

    def write_sender_files(
        self, passes, senders: dict[tuple[str, str], list[int]], directory: str | None
    ) -> list[list[request_files.RequestFile]]:
        """Each sender's request files, of every pass sending through it (one rendered line per request,
        with its own variant's config), as many as the in-flight caps leave: the model's caps hold for
        all its variants together, so each sender's files take what the earlier ones left."""
        out: list[list[request_files.RequestFile]] = []
        taken = (0, 0, 0)  # batches, requests, estimated input tokens written for earlier senders
        for sender, ((provider_name, _), indexes) in enumerate(senders.items()):
            provider_cls = get_provider(provider_name)
            assert issubclass(provider_cls, BatchProvider)  # senders are batch providers only
            rows = self.sender_rows(passes, indexes, lines=True)
            path = None
            if directory is not None:
                path = os.path.join(directory, f"sender-{sender}")
                os.mkdir(path, 0o700)
            files = request_files.write_request_files(
                self.con,
                "line_text",
                rows,
                path,
                provider_cls.max_requests_per_batch,
                provider_cls.max_bytes_per_batch,
                self.room(provider_name, taken),
            )
            variants.record_sent(self.con, sender)
            taken = (
                taken[0] + len(files),
                taken[1] + sum(f.requests for f in files),
                taken[2] + sum(f.tokens for f in files),
            )
            out.append(files)
        return out

    def sender_rows(self, passes, indexes: list[int], lines: bool = False) -> str:
        """The run's plan rows of the passes `indexes` (variants.pass_rows); with `lines`, each with its
        request line (`line_text`), rendered by its own variant's provider config."""
        parts = []
        for i in indexes:
            variant = passes[i]
            rows = variants.pass_rows(variant, self.input_columns, i)
            if lines:
                line = get_provider(variant.provider)(variant).request_line_sql()  # type: ignore[attr-defined]
                rows = f"(select *, {line} as line_text from {rows})"
            parts.append(f"select * from {rows}")
        return "(" + " union all ".join(parts) + ")"

    def check_run_budget(self, passes, realtime_plans, estimates, written, outputs) -> None:
        """The budget gate, once for the whole run (every variant's batch and realtime requests),
        before anything is sent; the refusal names the variants that would have sent."""
        sending = [i for i in range(len(passes)) if written.get(i, (0, None, 0))[0] + realtime_plans[i][0]]
        if not sending:
            return
        label = self.ledger.model + (
            f" (variant {passes[sending[0]].variant_name})"
            if len(sending) == 1
            else f" (variants {', '.join(str(passes[i].variant_name) for i in sending)})"
        )
        unpriced = [i for i in sending if estimates[i] is None]
        n = sum(written.get(i, (0, None, 0))[0] + realtime_plans[i][0] for i in sending)
        first = unpriced[0] if unpriced else sending[0]
        total = None if unpriced else sum((estimates[i] for i in sending), Decimal(0))
        with self.acting_as(passes[first]):
            try:
                budget.check_budget(self.ledger, self.config, self.project_max_cost, n, total, outputs[first])
            except BudgetError as exc:
                raise BudgetError(str(exc).replace(f"{self.ledger.model}:", f"{label}:", 1)) from None

    def submit_sender(self, sender: int, passes, indexes: list[int], files) -> None:
        """Submit one sender's request files (several variants' requests in each batch), through the
        first of its variants' clients (a client depends only on the provider and model)."""
        first = passes[indexes[0]]
        provider = self.pool.client(first)
        for i in indexes:
            report.prefix_too_short(
                variants.label(self.ledger.model, passes[i]), passes[i], get_provider(passes[i].provider)(passes[i])
            )
        rows = self.sender_rows(passes, indexes)
        submitted = submit.submit_chunks(
            self.ledger,
            provider,
            files,
            variants.sent_rows(rows, sender),
            members=variants.member_rows(self.input_columns),
            per_row_variant=True,
        )
        batch_ids = submitted.batch_ids
        # A file uploaded for a create that was refused is not left at the provider.
        reconcile.delete_provider_files(self.ledger, self.provider_for, self.config.delete_provider_files)
        # A failed create or upload stops this sender: its file stays in its job (reconciliation
        # decides), the files after it wait as deferred.
        variants.keep_submitted(self.con, sender, submitted.first_unsent)
        sent = sum(f.requests for f in files[: len(batch_ids)])
        self.summary.submitted += sent
        self.summary.batches += len(batch_ids)
        if batch_ids:  # the run line adds up the variants: each batch's share of them
            log.info(
                f"{self.ledger.model}: submitted {sent} request(s) in {len(batch_ids)} batch(es) to "
                f"{first.provider} ({first.model}): "
                f"{variants.labels(self.default, variants.shares(self.con, sender))}"
            )

    def report_senders(self, senders, files) -> None:
        """The dry run: each sender's batches, with every variant's share of them."""
        for sender, (provider_name, llm_model) in enumerate(senders):
            if files[sender]:
                log.info(
                    f"{self.ledger.model}: DRY RUN: {provider_name} ({llm_model}) would get "
                    f"{sum(f.requests for f in files[sender])} request(s) in {len(files[sender])} batch(es): "
                    f"{variants.labels(self.default, variants.shares(self.con, sender))}"
                )

    def report_dry_variants(self, passes, planned, realtime_plans, outputs, unsendable, counts, estimates, written):
        """The dry run's line per variant: its requests, what they would cost, what would wait."""
        committed = budget.committed(self.ledger)
        total: Decimal | None = Decimal(0)
        for i, variant in enumerate(passes):
            n, (n_realtime, _) = planned[i], realtime_plans[i]
            batch, _, n_files = written.get(i, (0, None, 0))
            estimate = estimates[i]
            this = estimate if n else 0
            total = None if total is None or this is None else total + this
            price = self.pool.price_of_config(variant)
            figures = None
            if estimate is not None and price is not None and outputs[i] is not None and n:
                figures = (*costs.estimate_range(price, outputs[i], estimate, batch, n_realtime), outputs[i])
            report.dry_run(
                variants.label(self.ledger.model, variant),
                n,
                batch,
                n_files,
                n_realtime,
                unsendable[i],
                estimate,
                committed,
                figures,
                *counts[i],
            )
        self.summary.estimated_usd = total

    def deferred_shares(self) -> str:
        """Each variant's deferred requests, as the run log names them."""
        return variants.labels(self.default, self.ledger.deferred_by_variant())

    @property
    def label(self) -> str:
        """The model, and the variant whose pass is running, as the run log names them."""
        return variants.label(self.ledger.model, self.config)

    def merge(self, target: str, rebuild: bool) -> tuple[int, int]:
        """Each variant's final outcomes into the table (one row per key and variant); returns
        (rows written, of which failed), all variants together."""
        stored = [variant.variant for variant in self.default.all_variants()]  # the rows shown share costs
        if self.default.variant_name is None:
            return merge.merge(self.ledger, self.config, target, self.input_columns, rebuild=rebuild, variants=stored)
        if not rebuild:  # rows of removed variants go before the variants' rows are merged
            variants.drop_removed(self.ledger, self.default, target)
        written = failed = 0
        for i, variant in enumerate(self.default.all_variants()):
            with self.using(variant):
                w, f = merge.merge(
                    self.ledger, variant, target, self.input_columns, rebuild=rebuild, create=i == 0, variants=stored
                )
            written, failed = written + w, failed + f
        if rebuild:
            variants.drop_removed(self.ledger, self.default, target)
        return written, failed

    def harvest_open(self) -> None:
        """Reconcile what earlier runs left open, then poll and harvest every submitted batch, each
        through the provider and model it was submitted with; then, with llm_dedup = 'ledger', the
        other models' batches this model's rows wait on (shared.py)."""
        if self.default.dedup == "ledger" and not self.provider_unavailable():
            self.summary.harvested_batches += shared.harvest_shared(self.ledger, self.default)
        jobs = self.ledger.open_jobs()
        if not jobs:
            return
        reconcile.reconcile_open(self.ledger, self.pool, jobs, self.started)
        by_sender: dict[tuple[str, str], list[dict]] = {}
        for job in [j for j in self.ledger.open_jobs() if j["batch_id"]]:
            by_sender.setdefault((job["provider"], job["llm_model"] or self.config.model), []).append(job)
        for (provider_name, llm_model), jobs in by_sender.items():
            if self.provider_unavailable():
                break
            try:
                provider = self.provider_for(jobs[0])
            except ConfigError as exc:  # its provider's key is not set: pending, the run goes on to merge
                self.warn_unreachable(jobs[0], exc, len(jobs))
                continue
            price = self.pool.price_for_job(jobs[0])
            stats = harvest.poll_and_harvest(self.ledger, provider, provider.config, jobs, price)
            self.summary.harvested_batches += stats["harvested_jobs"]
            if stats["harvested_jobs"] and price is None:
                report.no_price(self.ledger.model, provider_name, llm_model)

    def after_harvest(self) -> None:
        """Hold what an operator's cancel left unanswered; delete stored batches' files at the provider."""
        reconcile.after_harvest(self.ledger, self.provider_for, self.config.delete_provider_files)

    def plan_and_submit(self) -> None:
        held, until = self.ledger.backed_off()
        if held and self.config is self.default:  # the model's, all variants together: said once
            report.backed_off(self.ledger.model, held, until)
        if self.config.dedup is not None:  # rows that stopped asking a request in flight stop sharing its cost
            self.ledger.unmap_superseded(Scratch.desired)
        planned = self.plan()
        self.map_answered()
        if planned == 0:
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
            if n:  # batch and realtime together, before anything is sent
                self.check_budget(n, estimate)
            first_unsent = len(files)
            if files:
                provider = self.provider
                report.prefix_too_short(self.label, self.config, provider)
                submitted = submit.submit_chunks(
                    self.ledger,
                    provider,
                    files,
                    plan.plan_rows(self.config, self.input_columns, sent=Scratch.sent),
                    members=self.duplicates,
                )
                batch_ids = submitted.batch_ids
                # A file uploaded for a create that was refused is not left at the provider.
                reconcile.delete_provider_files(self.ledger, self.provider_for, self.config.delete_provider_files)
                sent = files[: len(batch_ids)]  # a failed create stops the run's submissions (submit.py)
                self.summary.submitted += sum(f.requests for f in sent)
                self.summary.batches += len(batch_ids)
                if self.default.variant_name is not None:  # the run line adds up the variants: each one's part
                    log.info(
                        f"{self.label}: submitted {sum(f.requests for f in sent)} request(s) in "
                        f"{len(batch_ids)} batch(es) to {self.config.provider} ({self.config.model})"
                    )
                if estimate is not None and self.price is not None and self.output is not None:
                    sent_cost = sum(f.cost or 0 for f in sent)
                    self.summary.estimated_usd = (self.summary.estimated_usd or 0) + sent_cost
                    expected, ceiling = costs.estimate_range(
                        self.price, self.output, sent_cost, sum(f.requests for f in sent)
                    )
                    self.summary.expected_usd = (self.summary.expected_usd or 0) + expected
                    self.summary.ceiling_usd = (self.summary.ceiling_usd or 0) + ceiling
                first_unsent = submitted.first_unsent  # a failed file is voided or held; the later ones wait
        self.ledger.defer(request_files.unsent_rows(self.rows, first_unsent) if self.unsent(first_unsent) else None)
        waiting = self.ledger.deferred_count()
        self.summary.deferred = waiting
        if waiting:
            report.deferred(self.label, waiting, self.config, self.tokens_cap())
        if n_realtime:
            self.send_realtime()

    def check_budget(self, n: int, estimate) -> None:
        """The budget gate for this run's plan (a model with several variants is checked once for all
        of them, check_run_budget); a model named as its only variant is named so in the refusal."""
        try:
            budget.check_budget(self.ledger, self.config, self.project_max_cost, n, estimate, self.output)
        except BudgetError as exc:
            if self.default.variant_name is None:
                raise
            raise BudgetError(str(exc).replace(f"{self.ledger.model}:", f"{self.label}:", 1)) from None

    def plan(self) -> int:
        """Build the plan, each request with its estimated input tokens (and cost, when priced)."""
        self.output = costs.output_estimate(self.ledger, self.config)  # what build_plan's estimate counts
        if self.config.dedup_defaulted_off and not self.said_dedup_off:
            self.said_dedup_off = True
            log.info(
                f"{self.ledger.model}: llm_temperature is above 0, so identical requests are sent once per row "
                "(llm_dedup is off by default for sampling); set llm_dedup = true to send each distinct request once"
            )
        return plan.build_plan(self.ledger, self.config, Scratch.input, self.input_columns, self.price)

    @property
    def duplicates(self) -> str:
        """The plan's rows that ask the same request as another selected row (plan.build_plan)."""
        return plan.member_rows(self.input_columns, "m.duplicate")

    def map_answered(self) -> None:
        """Rows whose request is answered or in flight already (plan.build_plan) point at it now: the
        answered ones are merged this run, with no provider call."""
        shared, reused = plan.dedup_counts(self.con)
        if reused:
            self.ledger.map_rows(plan.member_rows(self.input_columns, "not m.duplicate"))
        self.summary.reused += reused
        self.summary.shared += shared

    def split_realtime(self) -> tuple[int, Decimal | None]:
        """Move the plan's realtime rows (llm_realtime_when, llm_fallback, a self-hosted engine) out of
        the plan into their own table; returns (count, estimated cost or None)."""
        self.con.execute(
            f"create or replace temp table {Scratch.realtime_plan} as "
            f"select * from {Scratch.plan} where route = 'realtime'"
        )
        self.con.execute(f"delete from {Scratch.plan} where route = 'realtime'")
        count, estimate = self.con.execute(
            f"select count(*), sum(estimated_cost_usd) from {Scratch.realtime_plan}"
        ).fetchall()[0]
        return count, estimate

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

    def send_realtime(self, members: str | None = None, per_row_variant: bool = False) -> None:
        """The realtime part of the plan (`members`: the rows its requests answer besides their own,
        default this pass's; `per_row_variant`: rows and members carry their variant, variants.py)."""
        rows = plan.plan_rows(self.config, self.input_columns, plan=Scratch.realtime_plan)
        lock = self.lock
        heartbeat = (lambda ledger: locks.ModelLock(ledger, owner=lock.owner).heartbeat()) if lock else None
        outcome = realtime.run_realtime(
            self.ledger,
            self.provider,
            rows,
            self.price,
            self.realtime_deadline,
            heartbeat,
            members=self.duplicates if members is None else members,
            per_row_variant=per_row_variant,
        )
        lost = outcome.lost_replies  # this round's
        previous = self.summary.realtime
        if previous:  # a second round (llm_wait_seconds): add up
            for name in ("requests", "answered", "succeeded", "failed", "retries", "lost_replies", "given_up"):
                setattr(outcome, name, getattr(outcome, name) + getattr(previous, name))
            outcome.seconds += previous.seconds
        self.summary.realtime = outcome
        report.realtime_round(self.ledger.model, outcome, lost, self.config)

    def wait(self, deadline: float) -> None:
        """Poll with back-off until every open job ended or the deadline passed (llm_wait_seconds)."""
        delay = 0.5
        total = self.ledger.pending_count()
        waiting = progress.Progress(f"{self.ledger.model}: waiting for batches", total, "requests answered")
        while time.monotonic() < deadline and not self.provider_unavailable():
            if self.lock:
                self.lock.heartbeat()
            self.harvest_open()
            self.after_harvest()
            open_jobs = self.ledger.open_jobs()
            waiting.update(max(0, total - self.ledger.pending_count()))
            if not self.open_work():
                waiting.finish()
                return
            seconds_left = max(0, int(deadline - time.monotonic()))
            report.waiting(self.ledger.model, len(open_jobs), self.ledger.pending_count(), seconds_left)
            interrupt.sleep(min(delay, max(0.0, deadline - time.monotonic())))  # Ctrl-C ends it at once
            delay = min(delay * 2, 30.0)

    def open_work(self) -> bool:
        """Whether batches this run's rows wait on are open: its own, or (llm_dedup = 'ledger') another
        model's holding requests that answer its rows (shared.py)."""
        if self.ledger.open_jobs():
            return True
        return self.default.dedup == "ledger" and bool(shared.waiting_elsewhere(self.ledger))

    def finish_summary(self) -> None:
        s = self.summary
        s.pending = self.ledger.pending_count()
        if self.default.dedup == "ledger":  # rows answered by another model's request in flight
            s.pending_elsewhere = shared.waiting_elsewhere(self.ledger)
        s.backed_off, s.held = self.ledger.waiting_counts()
        s.deferred = self.ledger.deferred_count()
        # Harvested batches' rows and realtime rows apart: each figure under its own name in the line.
        cost, realtime_cost, realtime_route = self.con.execute(
            f"""select sum(cost_usd) filter (where route is distinct from 'realtime'),
                       sum(realtime_cost_usd) filter (where route is distinct from 'realtime'),
                       sum(cost_usd) filter (where route = 'realtime')
                from {self.ledger.table("llm_batch_requests")}
                where model = ? and completed_at >= ?""",
            [self.ledger.model, self.started],
        ).fetchall()[0]
        s.realtime_route_usd = realtime_route
        if cost is None and self.price is not None:
            cost = realtime_cost = Decimal(0)  # nothing harvested this run
        if get_provider(self.config.provider).self_hosted:
            realtime_cost = None  # no realtime counterfactual for a self-hosted engine
        s.cost_usd, s.realtime_usd = cost, realtime_cost

    def report_unavailable(self) -> None:
        """After the merge: say plainly that the provider stayed down (a dbt warning, which a nightly
        job sees in its summary and --warn-error turns into a failure), or fail the run if asked."""
        if not self.unavailable_error:
            return
        waiting = self.ledger.pending_count() + self.ledger.deferred_count()
        message = report.unavailable_message(
            self.ledger.model, self.config, self.unavailable_error, self.summary.submitted, waiting
        )
        if self.config.on_unavailable == "error":
            raise ProviderError(message + ". (llm_on_unavailable='error' makes this fail the run.)")
        warn_user(message)

    def dry_run_report(self) -> None:
        """Plan and estimate only: no provider call, no ledger row, no table change."""
        # Rows a real run would fail before sending (validate.py) are kept out of the plan, not recorded.
        unsendable = validate.reject_unsendable(self.ledger, self.config, self.input_columns, record=False)
        n = self.plan()
        n_realtime, realtime_estimate = self.split_realtime() if n else (0, None)
        files = self.write_request_files(None) if n > n_realtime else []
        estimate = None
        if self.price is not None:
            estimate = sum(f.cost or 0 for f in files) + (realtime_estimate or 0)
        this = estimate if n else 0
        if self.config is self.default:
            self.summary.estimated_usd = this
        elif this is None or self.summary.estimated_usd is None:  # a variant without a price: no total
            self.summary.estimated_usd = None
        else:
            self.summary.estimated_usd += this
        batch = sum(f.requests for f in files)
        committed = budget.committed(self.ledger)
        figures = None
        if estimate is not None and self.price is not None and self.output is not None and n:
            figures = (*costs.estimate_range(self.price, self.output, estimate, batch, n_realtime), self.output)
        shared, reused = plan.dedup_counts(self.con)
        report.dry_run(
            self.label,
            n,
            batch,
            len(files),
            n_realtime,
            unsendable,
            estimate,
            committed,
            figures,
            shared,
            reused,
        )

    # --- what the steps share -------------------------------------------------------------------

    @property
    def rows(self) -> str:
        """The plan with each request's prompt and row, read from the input (plan.plan_rows)."""
        return plan.plan_rows(self.config, self.input_columns)

    @property
    def provider(self):
        """This pass's client: created on first use, so a run with nothing to do needs no key and makes no call."""
        return self.pool.client(self.config)

    def provider_for(self, job: dict):
        """The client a job was submitted through, with the model it was submitted for (Pool.client_for_job)."""
        return self.pool.client_for_job(job)

    def warn_unreachable(self, job: dict, exc: ConfigError, count: int = 1) -> None:
        """A batch sent through a provider this run has no key for: it stays pending, and the run still
        merges what is final (a dbt warning: the key must be set again for it to be harvested)."""
        report.unreachable(self.ledger.model, job["provider"], exc, count)

    def provider_unavailable(self) -> bool:
        """True once the provider kept failing for llm_retry_budget_seconds: the run then stops asking
        it (open batches stay pending, nothing new is submitted); the run ends with a dbt warning, or
        fails with llm_on_unavailable='error' (report_unavailable)."""
        error = self.pool.unavailable()
        if error is None:
            return False
        self.unavailable_error = self.unavailable_error or error
        return True

    def room(self, provider: str | None = None, taken: tuple[int, int, int] = (0, 0, 0)) -> request_files.Room:
        """What the in-flight caps leave for this run: llm_max_batches_in_flight, the token cap (the
        model's llm_max_tokens_in_flight, else the provider's default) and the provider's request cap.
        The caps are the model's, all variants together: `taken` (batches, requests, tokens) is what this
        run's earlier senders' files took (variants.py), `provider` the sender's (default: this pass's)."""
        name = provider or self.config.provider
        tokens_cap, requests_cap = self.tokens_cap(name), get_provider(name).max_requests_in_flight
        batches, requests, tokens = (a + b for a, b in zip(self.ledger.in_flight(), taken, strict=True))
        return request_files.Room(
            batches=max(0, self.config.max_batches_in_flight - batches),
            requests=None if requests_cap is None else max(0, requests_cap - requests),
            tokens=None if tokens_cap is None else max(0, tokens_cap - tokens),
            nothing_in_flight=batches == 0,
        )

    def tokens_cap(self, provider: str | None = None) -> int | None:
        """Most estimated input tokens in flight: the model's setting, else the provider's default."""
        return (
            self.config.max_tokens_in_flight
            or get_provider(provider or self.config.provider).default_max_tokens_in_flight
        )

    def unsent(self, first_unsent: int) -> int:
        """Batch requests of the plan not in a file submitted this run (request_files.unsent_rows)."""
        return self.con.execute(
            f"""select (select count(*) from {Scratch.plan})
                       - (select count(*) from {Scratch.sent} where chunk < {int(first_unsent)})"""
        ).fetchall()[0][0]
