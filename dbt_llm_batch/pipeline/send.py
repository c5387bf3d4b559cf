"""What a run sends, for every pass at once (ARCHITECTURE.md, "The run", steps 6 to 9).

The one path of every model: a model without variants is a run with one pass (pipeline/passes.py).
Every pass is planned first (its plan kept in the run's tables, variants.stash_pass), then the
added-fields passes its planning left (rows asked only the output fields added since their answer,
added_fields.py); then the passes' batch requests are written into one set of request files per
*sender* (provider and model; an added-fields pass's schema too), each line rendered with its own
pass's config; before anything is sent, every sending pass's provider
key and then the budget (once, for the whole run) are checked; then each sender's files are
submitted; what did not fit waits as deferred, each pass's own; then each pass's realtime rows.
Which requests a job holds is submit.Submitted's answer alone, so a request is never both deferred
and in a job (the ledger refuses it too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from decimal import Decimal
from typing import Any

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.errors import BudgetError
from dbt_llm_batch.ledger import Ledger, locks
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import (
    added_fields,
    budget,
    costs,
    plan,
    realtime,
    reconcile,
    report,
    request_files,
    submit,
    tempdirs,
    validate,
    variants,
    wider_answers,
)
from dbt_llm_batch.pipeline.passes import Pass, added_passes, enter
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.pipeline.report import RunSummary
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers import BatchProvider, get_provider
from dbt_llm_batch.sql import literal

# (provider, model, and an added-fields pass's schema): one OpenAI batch file holds one model's
# requests, and a job records the one schema its answers are checked against (added_fields.py).
Sender = tuple[str, str, str | None]


@dataclasses.dataclass
class Planned:
    """One pass's plan: requests planned, its realtime part (count, estimate), output estimate,
    rows a dry run would reject, and (rows sharing a request planned now, rows reusing a stored one)."""

    requests: int
    realtime: tuple[int, Decimal | None]
    output: costs.OutputEstimate | None
    unsendable: int
    dedup: tuple[int, int]


@dataclasses.dataclass
class RunState:
    """What every step of one run shares: the connection, ledger, pool, the model's own config, its
    selected columns, the run's summary and the limits that hold for the whole run."""

    con: Any
    ledger: Ledger
    pool: Pool
    default: ModelConfig
    input_columns: list
    precomputed: bool
    summary: RunSummary
    project_max_cost: object
    realtime_deadline: float
    lock: locks.ModelLock | None = None
    said_dedup_off: bool = False

    @property
    def model(self) -> str:
        return self.ledger.model


def send(state: RunState, passes: tuple[Pass, ...], dry: bool = False) -> None:
    """Plan every pass, then write, check, submit and defer as one run; then the realtime rows.
    `dry`: plan and report only (no provider call, no ledger row)."""
    held, until = state.ledger.backed_off()
    if held and not dry:  # the model's, all passes together: said once
        report.backed_off(state.model, held, until)
    added_fields.start(state.con)
    planned = [plan_pass(state, p, dry) for p in passes]
    # Rows holding some of the output fields asked now are asked the others by passes of their own.
    added = added_passes(state.con, passes)
    planned += [plan_pass(state, p, dry) for p in added]
    passes += added
    if len(passes) > 1:  # the model's own selected rows again, for the steps after (merge, wait)
        enter(state.con, state.ledger, passes[0], state.input_columns, state.precomputed)
    senders: dict[Sender, list[int]] = {}  # in the order the passes first name them
    for p, pl in zip(passes, planned, strict=True):
        if pl.requests > pl.realtime[0] and issubclass(get_provider(p.config.provider), BatchProvider):
            schema = None if p.delta is None else output_schema.recorded(p.config.output_json_schema())
            senders.setdefault((p.config.provider, p.config.model, schema), []).append(p.index)
    variants.start_sent(state.con)
    with contextlib.ExitStack() as stack:
        directory = None if dry else stack.enter_context(tempdirs.private_dir())
        files = write_sender_files(state, passes, senders, directory)
        written = in_files(state, passes, files)
        estimates = [_estimate(p, written, pl) for p, pl in zip(passes, planned, strict=True)]
        if dry:
            report_dry(state, passes, planned, estimates, written, senders, files)
            return
        # Before anything is sent: every sending pass's provider key, then the budget for them all.
        state.pool.check([p.config for p, pl in zip(passes, planned, strict=True) if pl.requests])
        check_budget(state, passes, planned, estimates, written)
        for sender, indexes in enumerate(senders.values()):
            if files[sender]:
                files[sender] = submit_sender(state, sender, [passes[i] for i in indexes], files[sender])
    defer_unsent(state, passes, planned, in_files(state, passes, files))
    for p, pl in zip(passes, planned, strict=True):
        if pl.realtime[0]:
            state.ledger.variant = p.variant
            state.con.execute(
                f"create or replace temp table {Scratch.realtime_plan} as "
                f"select * exclude (pass_index) from {Scratch.run_realtime} where pass_index = {p.index}"
            )
            send_realtime(state, p)
    if added:  # the answers to the fields just asked (in flight, or in realtime answered) join their rows'
        for p in passes[: len(passes) - len(added)]:
            enter(state.con, state.ledger, p, state.input_columns, state.precomputed)
            added_fields.prepare(state.ledger, p.config, again=True)
        if len(passes) > 1:
            enter(state.con, state.ledger, passes[0], state.input_columns, state.precomputed)
    state.ledger.variant = passes[0].variant


def plan_pass(state: RunState, p: Pass, dry: bool) -> Planned:
    """`p`'s plan, kept in the run's tables (variants.stash_pass); rows that cannot be sent fail alone."""
    con, ledger = state.con, state.ledger
    if p.index:
        enter(con, ledger, p, state.input_columns, state.precomputed)
    unsendable = 0
    if dry:  # rows a real run would fail before sending are kept out of the plan, not recorded
        unsendable = validate.reject_unsendable(ledger, p.config, state.input_columns, record=False)
        wider_answers.adopt(ledger, p.config, dry=True)  # rows a real run answers from a wider llm_output
        if p.delta is None:  # rows holding some of the fields asked now are asked only the others
            added_fields.prepare(ledger, p.config, dry=True)
    else:
        state.summary.rejected_prompts += plan.reject_empty_prompts(ledger, Scratch.input, state.input_columns)
        state.summary.rejected_prompts += validate.reject_unsendable(ledger, p.config, state.input_columns)
        state.summary.rejected_prompts += validate.reject_deferred_without_prompt(ledger, p.config)
        if p.delta is None:  # rows holding some of the fields asked now are asked only the others
            added_fields.prepare(ledger, p.config)
            if p.config.dedup is not None:  # rows that stopped asking a request in flight stop sharing its cost
                ledger.unmap_superseded(added_fields.not_held(p.variant))
    output = costs.output_estimate(ledger, p.config)  # what build_plan's estimate counts
    if p.config.dedup_defaulted_off and not state.said_dedup_off:
        state.said_dedup_off = True
        log.info(
            f"{state.model}: llm_temperature is above 0, so identical requests are sent once per row "
            "(llm_dedup is off by default for sampling); set llm_dedup = true to send each distinct request once"
        )
    n = plan.build_plan(ledger, p.config, Scratch.input, state.input_columns, p.price, p.index)
    if n and p.index and p.config.dedup is not None:  # asked by an earlier pass already
        n -= variants.share_planned(con)
    dedup = plan.dedup_counts(con)
    if not dry:
        map_answered(state, dedup)
    _route_under_minimum(state, p)
    realtime_part = _split_realtime(con)
    variants.stash_pass(con, p.index, p.variant)
    return Planned(n, realtime_part, output, unsendable, dedup)


def map_answered(state: RunState, dedup: tuple[int, int]) -> None:
    """Rows whose request is answered or in flight already (plan.build_plan) point at it now: the
    answered ones are merged this run, with no provider call. `dedup`: plan.dedup_counts."""
    shared, reused = dedup
    if reused:
        state.ledger.map_rows(plan.member_rows(state.input_columns, "not m.duplicate"))
    state.summary.reused += reused
    state.summary.shared += shared


def _route_under_minimum(state: RunState, p: Pass) -> None:
    """A plan with fewer batch requests than the provider's minimum per batch (Bedrock: 100) goes
    realtime now when the provider's config says so (BatchProvider.under_minimum); otherwise its file
    is not submitted and its requests wait (write_sender_files)."""
    provider_cls = get_provider(p.config.provider)
    if not issubclass(provider_cls, BatchProvider) or provider_cls.min_requests_per_batch <= 1:
        return
    n = state.con.execute(f"select count(*) from {Scratch.plan} where route <> 'realtime'").fetchall()[0][0]
    if 0 < n < provider_cls.min_requests_per_batch and provider_cls(p.config).under_minimum() == "realtime":
        sets = "route = 'realtime'"
        if p.price is not None:  # estimated again at list price, for the budget gate
            output = costs.output_estimate(state.ledger, p.config).basis
            estimate = costs.estimated_cost_sql(
                p.config, p.price, route_sql="'realtime'", chars_sql="prompt_chars", output_tokens=output
            )
            sets += f", estimated_cost_usd = {estimate}"
        state.con.execute(f"update {Scratch.plan} set {sets} where route <> 'realtime'")
        log.info(
            f"{p.label(state.model)}: {n} request(s), fewer than the {provider_cls.min_requests_per_batch} a "
            f"{p.config.provider} batch needs: sent realtime, at list price"
        )


def _split_realtime(con) -> tuple[int, Decimal | None]:
    """Move the plan's realtime rows (llm_realtime_when, llm_fallback, a self-hosted engine) into their
    own table; returns (count, estimated cost or None)."""
    con.execute(
        f"create or replace temp table {Scratch.realtime_plan} as select * from {Scratch.plan} where route = 'realtime'"
    )
    con.execute(f"delete from {Scratch.plan} where route = 'realtime'")
    return con.execute(f"select count(*), sum(estimated_cost_usd) from {Scratch.realtime_plan}").fetchall()[0]


def _estimate(p: Pass, written, planned: Planned) -> Decimal | None:
    """The pass's estimated cost: its requests in request files and its realtime ones (None: unpriced)."""
    batch_cost = written[p.index][1] if p.index in written else Decimal(0)
    if p.price is None or batch_cost is None:
        return None
    return batch_cost + (planned.realtime[1] or 0)


def in_files(
    state: RunState, passes: tuple[Pass, ...], files: list[list[request_files.RequestFile]]
) -> dict[int, tuple[int, Decimal | None, int]]:
    """Per pass: (requests in `files`, their estimated cost or None, files they are in). One pass
    (a model without variants) has every file to itself: its figures are the files' own, with no
    query over the plan."""
    if len(passes) > 1:
        return variants.written(state.con)
    every = [f for sender in files for f in sender if f.requests]
    if not every:
        return {}
    priced = [f.cost for f in every if f.cost is not None]
    cost = sum(priced, Decimal(0)) if len(priced) == len(every) else None
    return {passes[0].index: (sum(f.requests for f in every), cost, len(every))}


def write_sender_files(
    state: RunState, passes: tuple[Pass, ...], senders: dict[Sender, list[int]], directory: str | None
) -> list[list[request_files.RequestFile]]:
    """Each sender's request files, of every pass sending through it (one rendered line per request,
    with its own pass's config), as many as the in-flight caps leave: the model's caps hold for all
    its passes together, so each sender's files take what the earlier ones left."""
    out: list[list[request_files.RequestFile]] = []
    taken = (0, 0, 0)  # batches, requests, estimated input tokens written for earlier senders
    for sender, ((provider_name, _, _), indexes) in enumerate(senders.items()):
        provider_cls = get_provider(provider_name)
        assert issubclass(provider_cls, BatchProvider)  # senders are batch providers only
        path = None
        if directory is not None:
            path = os.path.join(directory, f"sender-{sender}")
            os.mkdir(path, 0o700)
        packs = packed(provider_cls, [passes[i] for i in indexes])
        files = request_files.write_request_files(
            state.con,
            "line_text",
            sender_rows(state, [passes[i] for i in indexes], lines=True),
            path,
            *provider_cls.batch_limits(passes[indexes[0]].config),
            room(state, provider_name, taken),
            (provider_cls.max_inputs_per_line, provider_cls.max_tokens_per_line) if packs else None,
        )
        variants.record_sent(state.con, sender)
        files = _without_undersized(state, sender, provider_cls, files)
        taken = (
            taken[0] + len(files),
            taken[1] + sum(f.requests for f in files),
            taken[2] + sum(f.tokens for f in files),
        )
        out.append(files)
    return out


def _without_undersized(state: RunState, sender: int, provider_cls, files: list) -> list:
    """The files up to the first one under the provider's minimum per batch: a create of it would
    fail, so it is never made; its requests, and those of the files after it, wait as deferred."""
    minimum = provider_cls.min_requests_per_batch
    small = next((i for i, f in enumerate(files) if f.requests < minimum), None)
    if small is None:
        return files
    variants.keep_submitted(state.con, sender, files[small].chunk)
    waiting = sum(f.requests for f in files[small:])
    state.summary.under_minimum += waiting
    hint = f"; {provider_cls.under_minimum_hint}" if provider_cls.under_minimum_hint else ""
    log.info(
        f"{state.model}: {waiting} request(s) wait for more rows: a {provider_cls.name} batch needs at least "
        f"{minimum} requests{hint}"
    )
    return files[:small]


def sender_rows(state: RunState, passes: list[Pass], lines: bool = False, written_by: int | None = None) -> str:
    """The run's plan rows of `passes` (variants.pass_rows); with `lines`, each with its request line
    (`line_text`), rendered by its own pass's provider config; `written_by`: only those in that
    sender's files, with their `chunk` and `line`."""
    parts = []
    for p in passes:
        rows = variants.pass_rows(p.config, state.input_columns, p.index, sender=written_by)
        if lines and packed(get_provider(p.config.provider), [p]):
            # Packed lines are rendered per line from these parts (packing.py), the prompt as an input.
            pieces = get_provider(p.config.provider)(p.config).request_line_parts()  # type: ignore[attr-defined]
            head, middle, tail = (literal(piece) for piece in pieces)
            rows = f"""(select *, {int(p.index)} as pack_group, to_json(prompt) as input_json, {head} as line_head,
                               {middle} as line_middle, {tail} as line_tail from {rows})"""
        elif lines:
            line = get_provider(p.config.provider)(p.config).request_line_sql()  # type: ignore[attr-defined]
            rows = f"(select *, {line} as line_text from {rows})"
        parts.append(f"select * from {rows}")
    return "(" + " union all ".join(parts) + ")"


def packed(provider_cls, passes) -> bool:
    """Whether a sender's requests are packed several to a line: embeddings, through a provider whose
    request lines take an array of inputs (packing.py). A sender's passes share provider and task."""
    return provider_cls.max_inputs_per_line > 1 and all(p.config.embeds for p in passes)


def room(state: RunState, provider: str, taken: tuple[int, int, int] = (0, 0, 0)) -> request_files.Room:
    """What the in-flight caps leave: llm_max_batches_in_flight, the token cap (the model's
    llm_max_tokens_in_flight, else the provider's default) and the provider's request cap. The caps
    are the model's, all passes together: `taken` is what this run's earlier senders' files took."""
    tokens_cap, requests_cap = tokens_cap_of(state.default, provider), get_provider(provider).max_requests_in_flight
    batches, requests, tokens = (a + b for a, b in zip(state.ledger.in_flight(), taken, strict=True))
    return request_files.Room(
        batches=max(0, state.default.max_batches_in_flight - batches),
        requests=None if requests_cap is None else max(0, requests_cap - requests),
        tokens=None if tokens_cap is None else max(0, tokens_cap - tokens),
        nothing_in_flight=batches == 0,
    )


def tokens_cap_of(config: ModelConfig, provider: str) -> int | None:
    """Most estimated input tokens in flight: the model's setting, else the provider's default."""
    return config.max_tokens_in_flight or get_provider(provider).default_max_tokens_in_flight


def check_budget(state: RunState, passes: tuple[Pass, ...], planned: list[Planned], estimates, written) -> None:
    """The budget gate, once for the whole run (every pass's batch and realtime requests), before
    anything is sent; a model with variants is named with the variants that would have sent."""
    counts = [written.get(p.index, (0, None, 0))[0] + planned[p.index].realtime[0] for p in passes]
    sending = [p for p in passes if counts[p.index]]
    if not sending:
        return
    label = state.model
    if state.default.variant_name is not None:
        names = ", ".join(str(p.config.variant_name) for p in sending)
        label += f" (variant {names})" if len(sending) == 1 else f" (variants {names})"
    unpriced = [p for p in sending if estimates[p.index] is None]
    first = unpriced[0] if unpriced else sending[0]
    total = None if unpriced else sum((estimates[p.index] for p in sending), Decimal(0))
    state.ledger.variant = first.variant
    try:
        budget.check_budget(
            state.ledger, first.config, state.project_max_cost, sum(counts), total, planned[first.index].output
        )
    except BudgetError as exc:
        raise BudgetError(str(exc).replace(f"{state.model}:", f"{label}:", 1)) from None
    finally:
        state.ledger.variant = passes[0].variant


def submit_sender(state: RunState, sender: int, passes: list[Pass], files) -> list[request_files.RequestFile]:
    """Submit one sender's request files (several passes' requests in each batch), through the first
    of its passes' clients (a client depends only on the provider and model); returns the files a job
    holds (sent, or left to reconciliation)."""
    first = passes[0]
    client = first.client
    for p in passes:
        report.prefix_too_short(p.label(state.model), p.config, get_provider(p.config.provider)(p.config))
    submitted = submit.submit_chunks(
        state.ledger,
        client,
        files,
        sender_rows(state, passes, written_by=sender),
        answer_rows=variants.written_plan([p.index for p in passes], sender),
        members=variants.member_rows(state.input_columns),
        per_row_variant=True,
    )
    # A file uploaded for a create that was refused is not left at the provider.
    reconcile.delete_provider_files(state.ledger, state.pool.client_for_job, state.default.delete_provider_files)
    # A failed create or upload stops this sender: its file stays in its job (reconciliation
    # decides), the files after it wait as deferred.
    variants.keep_submitted(state.con, sender, submitted.first_unsent)
    sent = sum(f.requests for f in files[: len(submitted.batch_ids)])
    state.summary.submitted += sent
    state.summary.batches += len(submitted.batch_ids)
    state.summary.interrupted |= submitted.interrupted
    if submitted.batch_ids and state.default.variant_name is not None:  # each batch's share of the variants
        log.info(
            f"{state.model}: submitted {sent} request(s) in {len(submitted.batch_ids)} batch(es) to "
            f"{first.config.provider} ({first.config.model}): "
            f"{variants.labels(state.default, variants.shares(state.con, sender))}"
        )
    return files[: submitted.first_unsent]


def defer_unsent(
    state: RunState,
    passes: tuple[Pass, ...],
    planned: list[Planned],
    submitted: dict[int, tuple[int, Decimal | None, int]],
) -> None:
    """Each pass's planned requests not in a job wait as deferred (replacing what waited before); the
    estimates of what a job holds go into the run's summary. `submitted`: what a job holds, per pass
    (in_files of the files submitted)."""
    summary = state.summary
    for p, pl in zip(passes, planned, strict=True):
        state.ledger.variant = p.variant
        n_sent, sent_cost, _ = submitted.get(p.index, (0, None, 0))
        if pl.requests or state.ledger.has_deferred():
            # The pass's batch requests (its plan less its realtime part) that no job holds.
            n_unsent = pl.requests - pl.realtime[0] - n_sent
            unsent = variants.unsent_rows(variants.pass_rows(p.config, state.input_columns, p.index))
            state.ledger.defer(unsent if n_unsent else None)
        if n_sent and sent_cost is not None and p.price is not None and pl.output is not None:
            summary.estimated_usd = (summary.estimated_usd or 0) + sent_cost
            expected, ceiling = costs.estimate_range(p.price, pl.output, sent_cost, n_sent)
            summary.expected_usd = (summary.expected_usd or 0) + expected
            summary.ceiling_usd = (summary.ceiling_usd or 0) + ceiling
    state.ledger.variant = passes[0].variant
    waiting = summary.deferred = state.ledger.deferred_count()
    # Those under the provider's minimum per batch were said to wait for more rows (_without_undersized),
    # and after Ctrl-C submit said why they wait: neither is the caps.
    capped = waiting - min(summary.under_minimum, waiting)
    if capped and not summary.interrupted:
        shares = ""
        if state.default.variant_name is not None and capped == waiting:
            shares = variants.labels(state.default, state.ledger.deferred_by_variant())
        report.deferred(
            state.model, capped, state.default, tokens_cap_of(state.default, state.default.provider), shares=shares
        )


def send_realtime(state: RunState, p: Pass) -> None:
    """`p`'s realtime rows (Scratch.realtime_plan), through its provider, within the run's realtime budget."""
    rows = plan.plan_rows(p.config, state.input_columns, plan=Scratch.realtime_plan)
    lock = state.lock
    heartbeat = (lambda ledger: locks.ModelLock(ledger, owner=lock.owner).heartbeat()) if lock else None
    outcome = realtime.run_realtime(
        state.ledger,
        p.client,
        rows,
        p.price,
        state.realtime_deadline,
        heartbeat,
        members=variants.member_rows(state.input_columns),
        per_row_variant=True,
    )
    lost = outcome.lost_replies  # this round's
    previous = state.summary.realtime
    if previous:  # a second pass or round (llm_wait_seconds): add up
        for name in ("requests", "answered", "succeeded", "failed", "retries", "lost_replies", "given_up"):
            setattr(outcome, name, getattr(outcome, name) + getattr(previous, name))
        outcome.seconds += previous.seconds
    state.summary.realtime = outcome
    report.realtime_round(state.model, outcome, lost, p.config)


def report_dry(state: RunState, passes, planned: list[Planned], estimates, written, senders, files) -> None:
    """The dry run: each pass's line (its requests, what they would cost, what would wait); with
    variants, each sender's batches with every variant's share of them."""
    committed = budget.committed(state.ledger)
    total: Decimal | None = Decimal(0)
    for p, pl in zip(passes, planned, strict=True):
        n, n_realtime = pl.requests, pl.realtime[0]
        batch, _, n_files = written.get(p.index, (0, None, 0))
        estimate = estimates[p.index]
        this = estimate if n else 0
        total = None if total is None or this is None else total + this
        figures = None
        if estimate is not None and p.price is not None and pl.output is not None and n:
            figures = (*costs.estimate_range(p.price, pl.output, estimate, batch, n_realtime), pl.output)
        report.dry_run(
            p.label(state.model), n, batch, n_files, n_realtime, pl.unsendable, estimate, committed, figures, *pl.dedup
        )
    state.summary.estimated_usd = total
    if state.default.variant_name is None:
        return
    for sender, (provider_name, llm_model, _) in enumerate(senders):
        if files[sender]:
            log.info(
                f"{state.model}: DRY RUN: {provider_name} ({llm_model}) would get "
                f"{sum(f.requests for f in files[sender])} request(s) in {len(files[sender])} batch(es): "
                f"{variants.labels(state.default, variants.shares(state.con, sender))}"
            )
