"""The run's scratch space: every temporary table (and registered Arrow view) a run uses, named in
one place and dropped in one place.

A run works on DuckDB temp tables: the model's rows, the desired requests, the plan, the rows sent,
the harvest's outcomes, the merge's winners... They are connection-local, and for a SQL model the
connection is dbt's, which lives on after the run: so the run drops all of them when it ends,
however it ends (`Scratch.drop_all`, from run_model's `finally`). Each module names its tables
through `Scratch`'s attributes (no other module spells a scratch name), so a table added here is
cleaned up without anyone remembering to.

Some modules also drop their own tables as soon as they are done with them (to free memory during a
long run); dropping again at the end is harmless.
"""

from __future__ import annotations

from dbt_llm_batch.log import log
from dbt_llm_batch.sql import in_list


class Scratch:
    """The scratch tables of one run on one connection; `drop_all` removes every one of them."""

    # Temp tables, by the step that creates them.
    input = "__llm_input"  # the model's rows as selected this run (model_input.load_input)
    prices = "__llm_prices"  # the price list: shipped prices plus llm_price_table (costs.load_prices)
    rekey = "__llm_rekey"  # ledger rows whose key changed with the model's unique_key (identity)
    rekey_rows = "__llm_rekey_rows"  # row answers with a row of their own, re-keyed likewise (identity)
    desired = "__llm_desired"  # one request per input row: key, fingerprint, has_prompt (plan.build_desired)
    unsendable = "__llm_unsendable"  # rows whose prompt cannot be sent (validate)
    deferred = "__llm_deferred"  # requests deferred by an earlier run, still wanted (plan.build_plan)
    history = "__llm_history"  # the candidates' earlier requests, by request (plan.build_plan)
    plan = "__llm_plan"  # what this run sends (plan.build_plan)
    candidates = "__llm_candidates"  # selected rows without an answer or a request in flight (plan.build_plan)
    answered = "__llm_answered"  # with dedup: the stored request answering each candidate's prompt (plan.build_plan)
    plan_members = "__llm_plan_members"  # rows answered by a request of another row (plan.build_plan)
    wider = "__llm_wider"  # row answers asked with a wider output schema, moved to the current one (wider_answers)
    added = "__llm_added"  # rows holding an answer to some of the output fields, and what is added (added_fields)
    added_rows = "__llm_added_rows"  # the rows each added-fields pass asks, by pass (added_fields)
    taken = "__llm_taken"  # with llm_dedup = 'ledger': planned requests another model sends (sharing.claim_shared)
    realtime_plan = "__llm_realtime_plan"  # the plan's realtime rows (runner: ModelRun.split_realtime)
    sent = "__llm_sent"  # which plan rows went into which request file, at which line (request_files)
    outcomes = "__llm_outcomes"  # each harvested request's outcome (outcomes.settle)
    batch_failed = "__llm_batch_failed"  # unanswered requests of failed batches (batch_failures)
    emit = "__llm_emit"  # the ledger rows the merge writes to the model's table (merge)
    emit_rows = "__llm_emit_rows"  # those rows' columns but the selected ones, while they are written (merge)
    # With evaluation variants, every variant's pass is planned before anything is sent (variants.py):
    run_plan = "__llm_run_plan"  # each pass's batch requests, with its pass and variant
    run_realtime = "__llm_run_realtime"  # each pass's realtime requests, likewise
    run_members = "__llm_run_members"  # each pass's rows answered by a request planned this run
    run_sent = "__llm_run_sent"  # which run_plan rows went into which sender's request file, at which line
    TABLES = (
        "input", "prices", "rekey", "desired", "unsendable", "deferred", "plan", "realtime_plan",
        "sent", "outcomes", "batch_failed", "emit", "emit_rows", "rekey_rows", "candidates", "answered", "history", "plan_members",
        "wider", "added", "added_rows", "taken",
        "run_plan", "run_realtime", "run_members", "run_sent",
    )  # fmt: skip

    # Python objects (Arrow tables, readers, pandas frames) registered on the connection as views.
    input_view = "__llm_input_view"  # a Python model's rows, while they are copied (model_input.load_input)
    sent_arrow = "__llm_sent_arrow"  # the rows written to request files, while they are stored (request_files)
    downloads = "__llm_downloads"  # the batch result files downloaded for a harvest (harvest)
    ended = "__llm_ended"  # the jobs a harvest settles (harvest, batch_failures)
    line_errors = "__llm_line_errors"  # request lines a provider's validation named (harvest, batch_failures)
    realtime_lines = "__llm_realtime_lines"  # realtime answers, while they are stored (realtime)
    schema_failures = "__llm_schema_failures"  # answers the output schema refused, while noted (harvest)
    VIEWS = ("input_view", "sent_arrow", "downloads", "ended", "line_errors", "realtime_lines", "schema_failures")

    def __init__(self, con):
        self.con = con

    @classmethod
    def names(cls) -> list[str]:
        """Every scratch name, tables and views."""
        return [getattr(cls, role) for role in (*cls.TABLES, *cls.VIEWS)]

    def drop_all(self) -> None:
        """Drop every scratch table and unregister every scratch view on the run's connection.

        Called from a `finally`: it never raises, so the error that ended the run is the one the user
        sees; a table it could not drop is only logged (it is connection-local and replaced by the next run).
        """
        # Only the views still registered (normally none: each owner unregisters its own in a `finally`).
        # Unregistering drops a Python object, which needs the GIL; after Ctrl-C, dbt's main thread holds
        # the GIL while it interrupts this very connection, so a needless unregister here can deadlock.
        for name in self._registered():
            self._quietly(f"view {name}", self.con.unregister, name)
        for role in self.TABLES:
            name = getattr(self, role)
            self._quietly(f"table {name}", self.con.execute, f"drop table if exists {name}")

    def _registered(self) -> list[str]:
        names = [getattr(self, role) for role in self.VIEWS]
        try:
            rows = self.con.execute(
                f"select view_name from duckdb_views() where temporary and view_name in {in_list(names)}"
            ).fetchall()
        except Exception as exc:  # e.g. the connection is already closed or interrupted
            log.debug(f"could not list the run's scratch views: {type(exc).__name__}: {exc}")
            return []
        return [r[0] for r in rows]

    def _quietly(self, what: str, drop, argument: str) -> None:
        try:
            drop(argument)
        except Exception as exc:  # e.g. the connection is already closed or interrupted
            log.debug(f"could not drop the run's scratch {what}: {type(exc).__name__}: {exc}")
