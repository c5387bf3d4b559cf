"""What a poll found, per model and in all: the lines it prints, the selector `--then` gets, its exit code.

Exit codes of `dbt-llm-batch poll` (docs/operations.md, "Polling between runs"), most urgent first when several hold:
2 the poll cannot do its job without a fix (no such file, an unknown model, a key not set, a config it
cannot read): a cron job must not take that for "still waiting"; 1 the --then command failed; 4 the
provider stayed unavailable; 3 work is still open (batches not ended, submissions not reconciled);
0 nothing is open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

EXIT_DONE = 0  # nothing open: every request sent has an outcome in the ledger
EXIT_THEN_FAILED = 1  # the --then command exited non-zero (recorded; the next poll with --then runs it again)
EXIT_CANNOT_POLL = 2  # no such file / unreadable, unknown model, a key not set, a config it cannot read
EXIT_PENDING = 3  # still open: batches not ended (or --wait ran out), submissions not reconciled yet
EXIT_UNAVAILABLE = 4  # the provider kept failing (throttled, 5xx, unreachable) for the retry budget


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
    shared_rows: int = 0  # its rows answered by other models' requests this poll settled (llm_dedup)
    open_batches: int = 0
    unreconciled: int = 0  # submissions whose intent was written but whose batch id was not
    pending_requests: int = 0
    oldest_pending_seconds: float | None = None
    skipped: str | None = None  # why it was not polled or stored this time, when that passes by itself
    cannot_poll: str | None = None  # why it cannot be polled until someone acts, and how to fix it
    answered_in_open: int = 0  # requests the provider finished in batches that are still running
    then_owed: dict | None = None  # the --then command owed it: failed, or not finished (ledger/then_commands.py)

    @property
    def new_results(self) -> int:
        return self.succeeded + self.failed + self.shared_rows

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
        if self.shared_rows:
            parts.append(f"{self.shared_rows} row(s) answered by shared requests of other models")
        if self.open_batches:
            age = f", oldest {timedelta(seconds=int(self.oldest_pending_seconds or 0))}"
            parts.append(f"{self.pending_requests} request(s) pending in {self.open_batches} open batch(es){age}")
        else:
            parts.append("no batch open")
        if self.unreconciled:
            parts.append(
                f"{self.unreconciled} interrupted submission(s) not reconciled yet (their batch id was never "
                "recorded): the model's next dbt run matches them to the provider's batches"
            )
        if self.then_owed and self.then_owed["attempts"]:
            owed = self.then_owed
            parts.append(f"--then failed for it {owed['attempts']} time(s), last with exit status {owed['exit_code']}")
        elif self.then_owed:
            parts.append("--then owed for results stored earlier (no --then has finished for them)")
        for why in (self.skipped, self.cannot_poll):
            if why:
                parts.append(why)
        return f"{self.model}: " + "; ".join(parts)


@dataclass
class PollResult:
    """What `poll()` did: an orchestrator's sensor reads `models_with_new_results` and `done`."""

    models: list[ModelPoll] = field(default_factory=list)
    unavailable: str | None = None  # the provider's last error, if it stayed unavailable
    then_command: str | None = None  # the --then command as run (placeholder substituted), if it ran
    then_returncode: int | None = None  # its exit status
    seconds: float = 0.0

    @property
    def models_with_new_results(self) -> list[str]:
        """The dbt names of the models with rows a `dbt run` would merge now (their own requests, or
        other models' shared requests answering their rows)."""
        return sorted({m.selector_name for m in self.models if m.new_results})

    @property
    def then_models(self) -> list[str]:
        """The dbt names `--then` runs for: models with new results, and those an earlier --then failed for."""
        return sorted({m.selector_name for m in self.models if m.new_results or m.then_owed})

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
    def cannot_poll(self) -> list[str]:
        """One line per model that cannot be polled until someone acts: what and how to fix it."""
        return [f"{m.model}: {m.cannot_poll}" for m in self.models if m.cannot_poll]

    @property
    def oldest_pending_age(self) -> timedelta | None:
        ages = [m.oldest_pending_seconds for m in self.models if m.oldest_pending_seconds is not None]
        return timedelta(seconds=int(max(ages))) if ages else None

    @property
    def done(self) -> bool:
        """Nothing is open: every request sent has an outcome in the ledger (no batch open, no
        submission whose batch is unknown)."""
        return self.open_batches == 0 and not any(m.unreconciled for m in self.models)

    @property
    def exit_code(self) -> int:
        if self.cannot_poll:
            return EXIT_CANNOT_POLL
        if self.then_returncode:
            return EXIT_THEN_FAILED
        if self.done:
            return EXIT_DONE
        return EXIT_UNAVAILABLE if self.unavailable else EXIT_PENDING
