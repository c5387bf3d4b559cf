"""The realtime path: rows sent one request each, concurrently, and answered within the run.

Used for every row of a provider without a batch API (a self-hosted engine), for a batch provider's
urgent rows (llm_realtime_when) and for rows whose batch attempts are used up (llm_fallback).
Ledger order is the batch path's: one job and its 'queued' requests are committed before the first
request goes out. Answers are then kept as they arrive: every FLUSH_SECONDS the replies so far are
stored as result lines (in the provider's batch-result format) and settled, on a connection of their
own in a background thread, so the event loop keeps sending meanwhile. A crash loses only what
was in flight; the next run settles what was stored and sends the rest again (open_batches.harvest_open).

Back-off: 429, 5xx and timeouts are retried after `retry-after` (or an exponential delay) while the
run's llm_realtime_budget_seconds lasts; after that no new request starts, and what is left is
voided (no attempt used) and sent by a later run.

Lost replies: a hosted provider's realtime endpoint takes no idempotency key, so a request whose reply
is lost after it was sent (dropped connection, cut-off body, timeout while waiting) may have been
answered and billed. Each such loss is committed to the request's `possibly_billed` count before
anything else is sent for it; the request is sent at most once more (MAX_LOST_REPLIES), and one that
ends the run without an answer after a lost reply fails (using up an attempt) instead of being voided,
so no run sends it again without counting it. A self-hosted engine bills nothing: its transport
retries such failures like any other.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dbt_llm_batch import output_schema
from dbt_llm_batch.errors import ProviderError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.status import JobStatus, RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import arrow_tables, crashpoints, outcomes, pool
from dbt_llm_batch.pipeline.concurrency import AdaptiveConcurrency, describe
from dbt_llm_batch.pipeline.progress import Progress
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers.base import BatchState, Provider
from dbt_llm_batch.providers.realtime_transport import RETRYABLE, FatalReply, LostReply, TransientError

# Replies that say the server is over capacity (rate limit, unavailable, Anthropic's overloaded): the
# adaptive controller halves its limit on them.
OVERLOAD = {429, 503, 529}

FLUSH_SECONDS = 0.2  # most time between an answer arriving and its commit to the ledger
ENGINE_READ_SECONDS = 1.0  # llm_concurrency='auto': how often the engine's /metrics is read while sending
FETCH_ROWS = 1000  # request bodies read from DuckDB at a time
MAX_RETRY_DELAY = 30.0
REQUEST_GRACE_SECONDS = 30.0  # a request started before the deadline may take this much longer
UNREACHABLE_AFTER = 3  # connection failures, with no connection ever made, before a replica is given up
MAX_LOST_REPLIES = 2  # sends of one request whose reply was lost (each possibly billed) before it fails
GAVE_UP = object()  # _ask's answer for a request given up after a lost reply (failed at the job's end)


@dataclass
class RealtimeOutcome:
    requests: int = 0  # rows routed to realtime this run
    answered: int = 0  # replies stored (success or a final error)
    succeeded: int = 0
    failed: int = 0
    unsent: int = 0  # left for a later run: the time budget ran out
    retries: int = 0
    lost_replies: int = 0  # replies lost after sending (each possibly billed)
    given_up: int = 0  # requests failed after a lost reply, never answered
    last_transient: str | None = None  # the last 429/5xx/timeout seen, for the log
    seconds: float = 0.0


def run_realtime(
    ledger: Ledger,
    provider: Provider,
    rows: str,
    price: dict | None,
    deadline: float,
    heartbeat=None,
    members: str | None = None,
    per_row_variant: bool = False,
) -> RealtimeOutcome:
    """Send every row of `rows` (planner.plan_rows over the realtime part of the plan) in realtime,
    starting no request after `deadline` (time.monotonic(); the run's llm_realtime_budget_seconds).
    `heartbeat(ledger)` keeps the model's lock fresh; it is called with the writer's own ledger.
    `members`: the other rows each request answers (plan.build_plan), recorded with the intents;
    `per_row_variant`: they carry their evaluation variant (Ledger.write_intents)."""
    config = provider.config
    started = time.monotonic()
    job_id = ledger.write_intents(
        provider.name,
        config.model,
        f"(select *, 0 as chunk, null::integer as line from {rows})",
        [0],
        status=JobStatus.REALTIME,
        members=members,
        output_schema=output_schema.recorded(config.output_json_schema()),
        per_row_variant=per_row_variant,
        provider_options=pool.recorded_options(config),
    )[0]  # one job, no request file
    outcome = RealtimeOutcome(
        requests=ledger.con.execute(
            f"select count(*) from {ledger.table('llm_batch_requests')} where job_id = ?", [job_id]
        ).fetchall()[0][0]
    )
    bodies = ledger.con.sql(
        f"select custom_id, {provider.realtime_body_sql()} as body from {rows} order by custom_id"
    ).to_arrow_reader(FETCH_ROWS)
    writer = ResultWriter(ledger, provider, job_id, price, heartbeat)
    fatal = None
    progress = Progress(f"{ledger.model}: realtime", outcome.requests, "answered")
    try:
        asyncio.run(_send_all(provider, bodies, writer, outcome, deadline, progress))
    except FatalReply as exc:
        fatal = exc
    finally:
        bodies.close()  # rows never started leave the reader open, which would block the connection
        writer.close()
    progress.finish()
    fail_possibly_billed(ledger, job_id)
    unsent = outcome.requests - outcome.answered - outcome.given_up
    reason: str | None
    if fatal:
        reason = f"not answered: {fatal}; sent again by the next run"
    else:
        reason = (
            (
                f"no answer within the realtime time budget (llm_realtime_budget_seconds="
                f"{config.realtime_budget_seconds:g}"
                + (f"; last error: {outcome.last_transient}" if outcome.last_transient else "")
                + "); sent again by the next run"
            )
            if unsent
            else None
        )
    # The end of the job: anything unanswered goes back to the queue (no attempt used), job harvested.
    outcomes.settle(
        ledger, provider, config, [(job_id, BatchState(status=JobStatus.COMPLETED, ended=True, error=reason))], price
    )
    if fatal:
        raise ProviderError(
            f"{ledger.model}: {fatal}. {outcome.answered} answer(s) were kept; the "
            f"{unsent} request(s) without one are sent again by the next run (no attempt used)"
            + (
                f"; {outcome.given_up} whose reply was lost after sending (possibly billed) failed as an attempt"
                if outcome.given_up
                else ""
            )
            + "."
        )
    outcome.unsent = unsent
    outcome.succeeded, outcome.failed = ledger.con.execute(
        f"""select count(*) filter (where status = {sql(RequestStatus.SUCCEEDED)}),
                   count(*) filter (where status = {sql(RequestStatus.FAILED)})
            from {ledger.table("llm_batch_requests")} where job_id = ?""",
        [job_id],
    ).fetchall()[0]
    outcome.seconds = time.monotonic() - started
    return outcome


def settle_interrupted(ledger: Ledger, provider: Provider, job_id: str, price: dict | None) -> None:
    # `provider` must be the job's own (its result lines are in that provider's format).
    """A realtime job left open by a run that died: settle the answers it stored; the rest (in flight
    when it died, or never sent) go back to the queue without using up an attempt."""
    state = BatchState(
        status=JobStatus.INTERRUPTED,
        ended=True,
        error="the run sending it in realtime was interrupted before an answer was stored; it is sent again",
    )
    fail_possibly_billed(ledger, job_id)
    outcomes.settle(ledger, provider, provider.config, [(job_id, state)], price)


async def _send_all(
    provider, bodies, writer: ResultWriter, outcome: RealtimeOutcome, deadline: float, progress: Progress | None = None
) -> None:
    transports = provider.realtime_transports()
    batches = iter(bodies)
    queue: list[tuple[str, str]] = []
    stop: list[FatalReply] = []  # set by the first worker that meets a fatal reply

    def next_row():
        """The next (custom_id, body), reading a batch of bodies from DuckDB when the queue is empty."""
        while not queue:
            batch = next(batches, None)
            if batch is None:
                return None
            queue.extend(zip(reversed(batch.column(0).to_pylist()), reversed(batch.column(1).to_pylist()), strict=True))
        return queue.pop()

    # llm_concurrency = 'auto': as many workers as the bound, of which the controller lets `limit` send.
    # It starts where the engine's /metrics says it has room (a hosted API says nothing: at 16, the fixed
    # default of earlier versions, which a hosted API takes), and hears the engine's load while sending.
    loop = asyncio.get_running_loop()
    adaptive = None
    if provider.config.adaptive_concurrency:
        load = await loop.run_in_executor(None, provider.engine_load)
        adaptive = AdaptiveConcurrency.for_run(provider.config.max_concurrency, load.room if load else None)
    workers_count = adaptive.upper if adaptive is not None else provider.config.concurrency
    sending = 0
    slot_freed = asyncio.Condition()

    def may_send() -> bool:
        return adaptive is None or sending < adaptive.limit or bool(stop)

    def observer(generation: int | None):
        """What a request's replies tell the controller: `generation`, the controller's when the request
        took its place (an overload of a request sent before the last back-off is not counted again)."""

        def observe(overloaded: bool) -> None:
            if adaptive is not None:
                adaptive.finished(time.monotonic(), overloaded, generation)

        return observe

    async def worker():
        nonlocal sending
        # A fatal reply stops new requests; those already on their way finish and are kept.
        while not stop and time.monotonic() < deadline:
            if adaptive is not None:
                async with slot_freed:
                    await slot_freed.wait_for(may_send)
            if stop or (row := next_row()) is None:
                return
            custom_id, body = row
            sending += 1
            generation = adaptive.generation if adaptive is not None else None
            try:
                reply = await _ask(
                    transports,
                    body.encode(),
                    deadline,
                    outcome,
                    stop,
                    lambda custom_id=custom_id: record_lost(custom_id),
                    observer(generation),
                )
            except FatalReply as exc:
                stop.append(exc)
                return
            finally:
                sending -= 1
                if adaptive is not None:
                    async with slot_freed:
                        slot_freed.notify_all()
            if reply is GAVE_UP:
                outcome.given_up += 1
            elif reply is not None:
                writer.add(custom_id, provider.realtime_result_line(custom_id, reply.status, reply.text))
                outcome.answered += 1

    async def record_lost(custom_id: str) -> None:
        # Committed (on the writer's thread, after the groups before it) before the request is sent again.
        await loop.run_in_executor(pool, writer.mark_lost, custom_id)

    async def read_engine_load() -> None:
        # The engine's gauges about once a second (on the default executor: the writer's thread is busy).
        while True:
            await asyncio.sleep(ENGINE_READ_SECONDS)
            load = await loop.run_in_executor(None, provider.engine_load)
            if load is not None and adaptive is not None:
                adaptive.engine_said(load.running, load.waiting)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm_realtime_writer") as pool:
        workers = asyncio.gather(*(worker() for _ in range(workers_count)))
        reader = asyncio.create_task(read_engine_load()) if adaptive and adaptive.engine_room else None
        try:
            while not workers.done():
                await asyncio.wait([workers], timeout=FLUSH_SECONDS)
                await loop.run_in_executor(pool, writer.write, writer.take())
                if progress is not None:
                    progress.update(outcome.answered + outcome.given_up)
            await workers  # re-raise a worker's error
            if adaptive is not None:
                # Named by model: two models sending at once (dbt threads) each settle on their own.
                log.info(
                    f"{writer.ledger.model}: {provider.name} llm_concurrency 'auto' settled at {describe(adaptive)}"
                )
        finally:
            if reader is not None:
                reader.cancel()
            await loop.run_in_executor(pool, writer.write, writer.take())
            for transport in transports:
                await transport.aclose()
    if stop:
        raise stop[0]


async def _ask(
    transports, body: bytes, deadline: float, outcome: RealtimeOutcome, stop: list, record_lost, observe=lambda _: None
):
    """Send one request, retrying 429/5xx/timeouts within the budget (after `retry-after`, never
    sooner than an exponential back-off, and on another replica when there is one); returns the final
    reply, or None when the budget ran out first. A reply that no retry can change (a rejected key, an
    unknown model or URL) raises FatalReply: the run stops instead of failing every row with it.
    A reply lost after sending is recorded (`await record_lost()`) and retried at most once; returns
    GAVE_UP when it is not answered after one (see the module's docstring). `observe(overloaded)` hears
    of each answer (False) and each sign of overload: 429/503/529, a timeout or a failed connection (True)."""
    delay = 0.5
    lost = 0
    while True:
        transport = pick(transports)
        server_wait = None
        try:
            reply = await transport.send(body, timeout=max(1.0, deadline - time.monotonic()) + REQUEST_GRACE_SECONDS)
            fatal = transport.fatal_problem(reply)
            if fatal:
                raise FatalReply(fatal)
            if reply.status not in RETRYABLE:
                transport.cooldown_until = 0.0
                observe(False)
                return reply
            if reply.status in OVERLOAD:
                observe(True)
            server_wait, outcome.last_transient = reply.retry_after, f"HTTP {reply.status} from {transport.name}"
        except LostReply as exc:
            observe(True)
            outcome.last_transient = f"reply lost: {exc} ({transport.name})"
            outcome.lost_replies += 1
            lost += 1
            await record_lost()
            if lost >= MAX_LOST_REPLIES:
                return GAVE_UP
        except TransientError as exc:
            observe(True)
            outcome.last_transient = f"{exc} ({transport.name})"
            if transport.never_connected and transport.failures >= UNREACHABLE_AFTER:
                transport.dead = True
                if all(t.dead for t in transports):
                    raise FatalReply(
                        f"cannot connect to {', '.join(t.name for t in transports)} ({exc}): is the "
                        f"engine running (scripts/engine.sh start), and is llm_base_url right?"
                    ) from None
        wait = max(server_wait or 0.0, delay * (1 + random.random() / 4))
        transport.cooldown_until = time.monotonic() + wait  # the next try goes to another replica if any
        if time.monotonic() + wait >= deadline or stop:
            return GAVE_UP if lost else None
        outcome.retries += 1
        await asyncio.sleep(wait)
        delay = min(delay * 2, MAX_RETRY_DELAY)


def pick(transports):
    """The replica to send to: one not cooling down after an error, with the fewest requests outstanding."""
    now = time.monotonic()
    live = [t for t in transports if not t.dead] or transports
    ready = [t for t in live if t.cooldown_until <= now]
    if ready:
        return min(ready, key=lambda t: t.outstanding)
    return min(live, key=lambda t: t.cooldown_until)


class ResultWriter:
    """Stores and settles groups of realtime replies, on a DuckDB connection of its own (a cursor of
    the run's), from one background thread: each group's lines are committed before they settle."""

    def __init__(self, ledger: Ledger, provider: Provider, job_id: str, price: dict | None, heartbeat=None):
        self.cursor = ledger.con.cursor()
        self.heartbeat = heartbeat
        self.ledger = Ledger(self.cursor, ledger.schema, ledger.model)
        self.provider, self.job_id, self.price = provider, job_id, price
        self.pending: list[tuple[str, str]] = []
        self.groups = 0

    def add(self, custom_id: str, line: str) -> None:
        self.pending.append((custom_id, line))

    def take(self) -> list[tuple[str, str]]:
        """The replies gathered since the last call (called on the event loop's thread)."""
        taken, self.pending = self.pending, []
        return taken

    def write(self, lines: list[tuple[str, str]]) -> None:
        if self.heartbeat:  # the run's connection is busy reading request bodies: use this one
            self.heartbeat(self.ledger)
        if not lines:
            return
        self.groups += 1
        source = f"realtime-{self.groups}"
        con = self.cursor
        table = arrow_tables.from_lists(
            con, {"custom_id": ("varchar", [c for c, _ in lines]), "raw": ("varchar", [raw for _, raw in lines])}
        )
        con.register(Scratch.realtime_lines, table)
        try:
            self.ledger.store_lines(self.job_id, source, Scratch.realtime_lines)
        finally:
            con.unregister(Scratch.realtime_lines)
        running = BatchState(status=JobStatus.REALTIME, ended=False)
        outcomes.settle(
            self.ledger, self.provider, self.provider.config, [(self.job_id, running)], self.price, source=source
        )
        crashpoints.reach("after_realtime_group")

    def mark_lost(self, custom_id: str) -> None:
        """One more send of this request whose reply was lost (possibly billed), committed now."""
        self.ledger.count_lost_reply(custom_id, self.job_id)

    def close(self) -> None:
        self.cursor.close()


def fail_possibly_billed(ledger: Ledger, job_id: str) -> None:
    """Store a failure line for each of the job's unanswered requests whose reply was lost after
    sending: it then fails when the job is settled (using up an attempt) instead of being voided and
    sent again for free, which could pay for it any number of times. The line is in both providers'
    error shapes at once (OpenAI reads body.error.message, Anthropic result.error.error.message)."""
    ledger.store_lost_reply_failures(
        job_id,
        """json_object('type', 'error', 'error', json_object(
               'type', 'lost_reply', 'message', 'the reply was lost after the request was sent, '
               || possibly_billed || ' time(s) (each may have been billed); counted as a failed '
               || 'attempt instead of being sent again'))""",
    )
