"""`dbt-llm-batch poll` and `dbt_llm_batch.poll()`: harvest the batches that ended, without a dbt run.

A run leaves pending what has not ended; without the poller it reaches the model table only at the
model's next `dbt run`. The poller polls every open batch of the ledgers in a DuckDB file, stores and
settles the ended ones exactly as a run's harvest does (pipeline/harvest.py: result lines stored before
any status changes, under the model's lock), and says per model what became final and what is
pending. It does not merge: the next `dbt run` of the model merges from the ledger at once, with no
provider call for what the poller stored (`--then` can start that run: ops/then_command.py).

It needs no dbt project: each run stores the settle-relevant part of its model's config in
`llm_batch_models.config_snapshot` (config.settle_snapshot), from which the poller rebuilds the
config; keys come from the same environment variables. A model it cannot poll (a key not set, a
snapshot missing or unreadable) is reported as such, and the poll exits 2 (poll_report.py): a cron job
must not read it as "still waiting".

This module is the loop (rounds with back-off, progress, the --then command); one round, and how the
DuckDB file is shared with a dbt run, is poll_round.py; what a poll found and its exit code, poll_report.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from dbt_llm_batch.errors import PollError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.log import log
from dbt_llm_batch.ops import then_command
from dbt_llm_batch.ops.poll_report import (
    EXIT_CANNOT_POLL,
    EXIT_DONE,
    EXIT_PENDING,
    EXIT_THEN_FAILED,
    EXIT_UNAVAILABLE,
    ModelPoll,
    PollResult,
)
from dbt_llm_batch.ops.poll_round import FILE_WAIT_SECONDS, open_shared, poll_once
from dbt_llm_batch.pipeline import tempdirs
from dbt_llm_batch.pipeline.progress import Progress

__all__ = [
    "EXIT_CANNOT_POLL",
    "EXIT_DONE",
    "EXIT_PENDING",
    "EXIT_THEN_FAILED",
    "EXIT_UNAVAILABLE",
    "ModelPoll",
    "PollError",
    "PollResult",
    "poll",
]

RETRY_BUDGET_SECONDS = 30.0  # least time failing provider calls are retried in one round
MAX_POLL_DELAY = 60.0  # longest pause between two polls of --wait
FIRST_POLL_DELAY_ENV = "DBT_LLM_BATCH_POLL_FIRST_DELAY"  # the first pause (default 1 s); tests shorten it
_SUMMED = ("harvested_batches", "succeeded", "failed", "retrying", "shared_rows")  # added up over rounds


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
    store and settle the ended ones; with `wait`, go on polling with exponential back-off until
    nothing is open or `wait` seconds have passed. With `then`, run that shell command once for the
    models with new results and those an earlier `then` failed for (then_command.py), and record how
    it went. `on_line` receives each model's report line (the CLI prints them). Raises PollError when
    the poll cannot be done at all (no such file, an unknown model, a `then` it cannot expand)."""
    if then is not None:
        then_command.check(then)  # refused before anything is polled
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
        polled, unavailable, pending_before = poll_once(
            database, schema, model, file_until, retry_budget, owe_then=then is not None
        )
        for m in polled:
            seen = by_model.setdefault((m.schema, m.model), dataclasses.replace(m, **dict.fromkeys(_SUMMED, 0)))
            for name in _SUMMED:
                setattr(seen, name, getattr(seen, name) + getattr(m, name))
            for name in ("open_batches", "unreconciled", "pending_requests", "oldest_pending_seconds", "skipped"):
                setattr(seen, name, getattr(m, name))
            for name in ("cannot_poll", "dbt_name", "then_owed"):  # a report of shared rows only says less
                setattr(seen, name, getattr(m, name) or getattr(seen, name))
            seen.answered_in_open = m.answered_in_open
        result.models = list(by_model.values())
        result.unavailable = unavailable
        if wait and progress is None:
            progress = Progress("poll: waiting for batches", pending_before, "requests answered")
        if progress is not None:
            pending = sum(m.pending_requests - m.answered_in_open for m in result.models)
            progress.update(max(0, progress.total - pending))
        now = time.monotonic()
        # Stop as soon as polling again cannot change the answer: nothing open, a provider that stays
        # down, a model that needs a fix, or only submissions left that the model's next run reconciles.
        if result.done or unavailable or result.cannot_poll or not result.open_batches or now >= deadline:
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
    if then is not None and result.then_models:
        _run_then(database, result, then)
    return result


def _run_then(database: str, result: PollResult, template: str) -> None:
    """Run the --then command for result.then_models (owed since their results were stored:
    poll_round._owe_then); record in each model's ledger whether it succeeded (nothing owed) or failed
    (still owed: the next poll with --then runs it again)."""
    command = then_command.expand(template, result.then_models)
    log.info(f"poll: running --then for {' '.join(result.then_models)}: {command}")
    result.then_command, result.then_returncode = command, then_command.run(command)
    ran_for = [m for m in result.models if m.new_results or m.then_owed]
    con = open_shared(database, time.monotonic() + FILE_WAIT_SECONDS)
    try:
        for schema in sorted({m.schema for m in ran_for}):
            ledger = Ledger(con, schema, "")
            ledger.migrate()
            models = {m.model: m.selector_name for m in ran_for if m.schema == schema}
            if result.then_returncode:
                ledger.record_then_failed(models, command, result.then_returncode)
            else:
                ledger.record_then_succeeded(list(models))
    finally:
        con.close()
