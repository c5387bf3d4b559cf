"""What a run tells the user: the run-log line (RunSummary), the dry-run report, and the notices and
warnings the run's steps log. Text only: the steps decide, these say it (runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.errors import ProviderError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.log import log, warn_user
from dbt_llm_batch.pipeline import costs
from dbt_llm_batch.pipeline.realtime import RealtimeOutcome
from dbt_llm_batch.providers import get_provider


@dataclass
class RunSummary:
    model: str
    submitted: int = 0
    batches: int = 0
    pending: int = 0
    merged: int = 0  # rows whose request became final since the last merge
    failed: int = 0  # of those, failed
    rewritten: int = 0  # rows written again from answers merged before (a rebuild from the ledger)
    harvested_batches: int = 0
    rejected_prompts: int = 0
    deferred: int = 0  # over an in-flight cap, or not sent after Ctrl-C: waiting in the ledger for a later run
    interrupted: bool = False  # Ctrl-C stopped the submission: the deferred requests wait for that reason
    # of `deferred`: too few for the provider's minimum per batch (Bedrock): they wait for more rows
    under_minimum: int = 0
    backed_off: int = 0  # waiting for a back-off (token limit, failed batch) before they are sent again
    held: int = 0  # held after a cancel, until `dbt-llm-batch release`
    estimated_usd: Decimal | int | None = None  # estimate of what this run submitted, None without a price
    expected_usd: Decimal | int | None = None  # of that: the expected figure (the model's own answer lengths)
    ceiling_usd: Decimal | int | None = None  # and the most it can cost (every answer at llm_max_tokens)
    realtime_route_usd: Decimal | None = None  # what this run's realtime rows cost (list prices)
    cost_usd: Decimal | None = None  # actual cost of what this run harvested, at batch prices
    realtime_usd: Decimal | None = None  # the same tokens at realtime prices
    realtime: RealtimeOutcome | None = None  # rows sent in realtime this run
    shared: int = 0  # rows planned this run that ask the same request as another row (sent once)
    reused: int = 0  # rows pointed at a request answered or in flight already: no request of their own
    # llm_dedup = 'ledger': {another model: this model's rows its requests in flight answer}; pending too
    pending_elsewhere: dict[str, int] = field(default_factory=dict)
    # rows another model's run answered after this run merged (llm_dedup = 'ledger', dbt's threads)
    landed_elsewhere: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        saved = (
            f", saved {costs.fmt_usd(self.realtime_usd - self.cost_usd)} vs realtime"
            if self.cost_usd is not None and self.realtime_usd is not None
            else ""
        )
        estimated = costs.fmt_usd(self.estimated_usd) if self.submitted else "$0"
        if self.submitted and self.expected_usd is not None and self.ceiling_usd is not None:
            estimated = f"{costs.fmt_usd(self.expected_usd)}, at most {costs.fmt_usd(self.ceiling_usd)}"
        return (
            f"{self.model}: submitted {self.submitted} request(s) in {self.batches} batch(es) "
            f"(estimated {estimated}); harvested {self.harvested_batches} batch(es) "
            f"(cost {costs.fmt_usd(self.cost_usd)}{saved}); merged {self.merged} row(s) ({self.failed} failed)"
            + (f", {self.rewritten} rewritten from the ledger" if self.rewritten else "")
            + "; "
            f"pending {self.pending}"
            + self.elsewhere_part()
            + self.landed_part()
            + (f"; deferred {self.deferred} ({self.deferred_reason()})" if self.deferred else "")
            + (f"; waiting {self.backed_off} (back-off)" if self.backed_off else "")
            + (f"; held {self.held} (release with `dbt-llm-batch release`)" if self.held else "")
            + (self.realtime_part() if self.realtime else "")
            + (self.dedup_part() if self.shared or self.reused else "")
        )

    def deferred_reason(self) -> str:
        if self.interrupted:
            return "the run was interrupted: they wait for the next run"
        capped = self.deferred - min(self.under_minimum, self.deferred)
        if not self.under_minimum:
            return "in-flight cap"
        fewer = "too few for a batch: waiting for more rows"
        return f"{self.deferred - capped} {fewer}, {capped} in-flight cap" if capped else fewer

    def elsewhere_part(self) -> str:
        """'; 8 row(s) wait for requests of main.other in flight': rows whose request is another model's.
        Apart from `pending` (this model's requests in flight): rows and requests are not one unit (a
        request answers several rows when they share it), and counting this model's own pending rows
        would join every row answer with the requests in flight on every run."""
        if not self.pending_elsewhere:
            return ""
        models = ", ".join(self.pending_elsewhere)
        return f"; {sum(self.pending_elsewhere.values())} row(s) wait for requests of {models} in flight"

    def landed_part(self) -> str:
        """'; 20 row(s) answered by main.other's run after this run merged: the next run merges them'."""
        if not self.landed_elsewhere:
            return ""
        models = ", ".join(self.landed_elsewhere)
        return (
            f"; {sum(self.landed_elsewhere.values())} row(s) answered by {models}'s run after this run "
            "merged: the next run merges them"
        )

    def dedup_part(self) -> str:
        return (
            f"; deduplicated {self.shared + self.reused} row(s): {self.shared} sharing a request sent "
            f"this run, {self.reused} answered (or being answered) by a stored request"
        )

    def realtime_part(self) -> str:
        r = self.realtime
        if r is None:
            return ""
        left = f", {r.unsent} left for the next run (llm_realtime_budget_seconds)" if r.unsent else ""
        lost = f", {r.lost_replies} reply(ies) lost after sending (possibly billed)" if r.lost_replies else ""
        cost = f" (cost {costs.fmt_usd(self.realtime_route_usd)})" if self.realtime_route_usd is not None else ""
        return (
            f"; realtime {r.requests} request(s) in {r.seconds:.1f} s{cost}: {r.succeeded} succeeded, "
            f"{r.failed} failed{left}" + (f", {r.retries} retried" if r.retries else "") + lost
        )


def dry_run(
    model: str,
    planned: int,
    batch: int,
    files: int,
    n_realtime: int,
    unsendable: int,
    estimate: Decimal | int | None,
    committed: Decimal | int,
    figures: tuple | None = None,
    shared: int = 0,
    reused: int = 0,
) -> None:
    """The dry run's one line: what a real run would send, what it would cost, what would wait, and
    how many rows would need no request of their own (llm_dedup).
    `figures`: (expected, ceiling, costs.OutputEstimate), when priced."""
    realtime_part = f" and {n_realtime} in realtime" if n_realtime else ""
    waiting = planned - n_realtime - batch
    waiting_part = f"; {waiting} would wait for the in-flight caps" if waiting else ""
    if unsendable:
        waiting_part += f"; {unsendable} would fail without being sent (prompt not sendable)"
    shown = estimate if planned else 0
    ceiling_part = ""
    if figures is not None:
        expected, ceiling, output = figures
        shown = expected
        source = (
            f"expected output {output.expected} token(s) a request, from this model's last {output.history} answer(s)"
            if output.history
            else f"no answers yet: every answer counted at {output.ceiling} output tokens"
        )
        ceiling_part = f" ({source}; at most {costs.fmt_usd(ceiling)} at {output.ceiling} output tokens a request)"
    if shared or reused:
        waiting_part += (
            f"; {shared} row(s) duplicate another row's request and {reused} a stored answer or a request "
            "in flight (no request of their own)"
        )
    log.info(
        f"{model}: DRY RUN: would submit {batch} request(s) in {files} "
        f"batch(es){realtime_part}, estimated {costs.fmt_usd(shown)} at batch prices"
        f"{' (realtime at list prices)' if n_realtime else ''}{ceiling_part}{waiting_part}; "
        f"{costs.fmt_usd(committed)} already committed in flight; nothing was sent"
    )


def finish_summary(
    s: RunSummary, ledger: Ledger, config: ModelConfig, priced: bool, started, elsewhere: dict[str, int] | None
) -> None:
    """The run's figures read back from the ledger once it merged: what is pending, waiting, held or
    deferred, and what the run's harvests cost (batch rows and realtime rows apart, each under its own
    name in the line). `priced`: the model's own pass has a price (nothing harvested is then $0, not
    unknown); `elsewhere`: rows answered by another model's request in flight (llm_dedup = 'ledger')."""
    s.pending = ledger.pending_count()
    if elsewhere is not None:
        s.pending_elsewhere = elsewhere
    s.backed_off, s.held = ledger.waiting_counts()
    s.deferred = ledger.deferred_count()
    cost, realtime_cost, realtime_route = ledger.con.execute(
        f"""select sum(cost_usd) filter (where route is distinct from 'realtime'),
                   sum(realtime_cost_usd) filter (where route is distinct from 'realtime'),
                   sum(cost_usd) filter (where route = 'realtime')
            from {ledger.table("llm_batch_requests")}
            where model = ? and completed_at >= ?""",
        [ledger.model, started],
    ).fetchall()[0]
    s.realtime_route_usd = realtime_route
    if cost is None and priced:
        cost = realtime_cost = Decimal(0)  # nothing harvested this run
    if get_provider(config.provider).self_hosted:
        realtime_cost = None  # no realtime counterfactual for a self-hosted engine
    s.cost_usd, s.realtime_usd = cost, realtime_cost


def unavailable_message(model: str, config: ModelConfig, error: str, submitted: int, waiting: int) -> str:
    """The provider stayed down for the retry budget: what was (not) sent, and what happens next."""
    sent = f"only {submitted} request(s) were submitted" if submitted else "nothing was sent"
    return (
        f"{model}: the provider kept failing for llm_retry_budget_seconds="
        f"{config.retry_budget_seconds:g} ({error}); {sent} this run, open "
        f"batches stay pending, and the next run carries on ({waiting} request(s) pending or waiting)"
    )


def unavailable(ledger: Ledger, config: ModelConfig, error: str | None, submitted: int) -> None:
    """After the merge: say plainly that the provider stayed down (a dbt warning, which a nightly
    job sees in its summary and --warn-error turns into a failure), or fail the run if asked."""
    if not error:
        return
    waiting = ledger.pending_count() + ledger.deferred_count()
    message = unavailable_message(ledger.model, config, error, submitted, waiting)
    if config.on_unavailable == "error":
        raise ProviderError(message + ". (llm_on_unavailable='error' makes this fail the run.)")
    warn_user(message)


def unreachable(model: str, provider_name: str, exc: Exception, count: int = 1) -> None:
    """A batch sent through a provider this run has no key for (its key was unset, or the model switched
    provider since): a dbt warning, counted in dbt's summary, since nothing is harvested until it is set."""
    warn_user(
        f"{model}: {count} batch(es) or submission(s) sent through {provider_name} "
        f"are still open and cannot be checked: {exc}. They stay pending; nothing is resent."
    )


def interrupted_realtime(model: str) -> None:
    log.warning(
        f"{model}: a realtime run was interrupted; its stored answers are kept and "
        f"the requests it had not finished are sent again"
    )


def no_price(model: str, provider_name: str, llm_model: str) -> None:
    log.warning(
        f"{model}: no price known for {provider_name} model "
        f"'{llm_model}': cost is recorded as unknown (NULL). Add it with llm_price_table."
    )


def backed_off(model: str, held: int, until: object) -> None:
    """`until`: a timestamp (the last back-off's end)."""
    log.info(
        f"{model}: {held} request(s) wait for a back-off (token limit, or a failed "
        f"batch) and will be resubmitted after {until:%Y-%m-%d %H:%M:%S %Z}"
    )


def deferred(model: str, waiting: int, config: ModelConfig, tokens_cap: int | None, shares: str = "") -> None:
    """`shares`: with evaluation variants, each variant's part of them (the caps are the model's)."""
    log.info(
        f"{model}: {waiting} request(s) wait in the ledger for a later run: the "
        f"in-flight caps are reached (llm_max_batches_in_flight={config.max_batches_in_flight}, "
        f"llm_max_tokens_in_flight={tokens_cap}){f' ({shares})' if shares else ''}"
    )


def dropped_removed_variants(model: str, dropped: dict[str, int]) -> None:
    """Deferred requests of removed variants, dropped before they were sent (said by the run that drops them)."""
    if dropped:
        log.info(
            f"{model}: {sum(dropped.values())} request(s) of removed variant(s) {', '.join(sorted(dropped))} "
            "were waiting for the in-flight caps; dropped, never sent (nothing was paid for them)"
        )


def realtime_round(model: str, outcome: RealtimeOutcome, lost: int, config: ModelConfig) -> None:
    """After a realtime round: replies lost after sending (possibly billed), requests left unsent."""
    if lost:
        log.warning(
            f"{model}: {lost} realtime reply(ies) were lost after the "
            f"request was sent (last: {outcome.last_transient}); the provider may have billed "
            f"them without an answer: see possibly_billed in llm_batch_costs"
        )
    if outcome.unsent:
        log.warning(
            f"{model}: {outcome.unsent} realtime request(s) were not sent within "
            f"llm_realtime_budget_seconds={config.realtime_budget_seconds:g}"
            + (f" (last error: {outcome.last_transient})" if outcome.last_transient else "")
            + "; the next run sends them"
        )


def prefix_too_short(model: str, config: ModelConfig, provider) -> None:
    """Say plainly when llm_cache_prefix cannot save anything, instead of promising a saving."""
    if not config.cache_prefix:
        return
    estimate = provider.prefix_tokens_estimate()
    if estimate < provider.min_cacheable_tokens:
        log.warning(
            f"{model}: llm_cache_prefix is on, but the system prompt and examples are about "
            f"{estimate} tokens, below the {provider.min_cacheable_tokens}-token minimum {provider.name} "
            f"caches for {config.model}: no cache reads will happen"
        )


def waiting(model: str, jobs: int, pending: int, seconds_left: int) -> None:
    log.info(
        f"{model}: waiting for {jobs} batch(es), {pending} request(s) pending, "
        f"{seconds_left} s left of llm_wait_seconds"
    )
