"""Operator controls, run from the `dbt-llm-batch` command line against the DuckDB file:

- `cancel`: cancel a model's in-flight batches at the provider. The cancel is recorded on the job
  (who, when, the provider's status); the next `dbt run` of the model harvests what the batches had
  finished, and holds the requests they left unanswered (`held`): they are not sent again until
  `release`, or until their prompt or answer-defining config changes (a new fingerprint).
- `release`: make held requests eligible again; also those of interrupted submissions that
  reconciliation holds, and in-flight requests whose job row is missing (with a warning: if their
  batch did run at the provider, they are paid twice).
- `requeue`: give a model's failed requests a fresh set of attempts without changing its config.
  The failures stay in the ledger (status `requeued`, error and answer kept); they stop counting.
- `unlock`: remove a dead run's lock (locks.py).

What a run does with these after a harvest (hold, report, delete files at the provider) is in
pipeline/reconcile.py.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys

import duckdb

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import LlmBatchError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import database_path, is_lock_conflict, lock_conflict_message, unlock
from dbt_llm_batch.ledger.status import PRE_SUBMISSION, JobStatus, RequestStatus, sql, sql_in
from dbt_llm_batch.pipeline import pool
from dbt_llm_batch.pipeline.submit import HELD_BY_RECONCILIATION
from dbt_llm_batch.providers import BatchProvider, get_provider
from dbt_llm_batch.providers.calls import describe

# Job statuses of a submission whose batch id is not known (submit.py).
INTERRUPTED = PRE_SUBMISSION


class OperatorError(LlmBatchError):
    """A command cannot do what was asked; the message says why and what to do."""


def open_database(path: str, command: str = "this command"):
    if not os.path.exists(path):
        raise OperatorError(f"no DuckDB file at {path}: pass the file your dbt profile writes (its `path`)")
    try:
        return duckdb.connect(path)
    except duckdb.IOException as exc:
        if is_lock_conflict(exc):
            raise OperatorError(lock_conflict_message(path, str(exc), f"{command} cannot run")) from None
        raise


def resolve_model(con, schema: str, model: str) -> Ledger:
    """The ledger of `model` ('schema.name' as the ledger records it, or just the model's name)."""
    exists = con.execute(
        "select count(*) from information_schema.tables where table_schema = ? and table_name = 'llm_batch_requests'",
        [schema],
    ).fetchall()[0][0]
    if not exists:
        raise OperatorError(
            f"no dbt-llm-batch ledger in schema {schema}: pass --schema (the model's schema, or its llm_ledger_schema)"
        )
    ledger = Ledger(con, schema, model)
    names = [
        r[0]
        for r in con.execute(
            f"""select distinct model from {ledger.table("llm_batch_requests")} where model = ? or model like ?
            union select distinct model from {ledger.table("llm_batch_jobs")} where model = ? or model like ?""",
            [model, "%." + model, model, "%." + model],
        ).fetchall()
    ]
    exact = [n for n in names if n == model]
    if exact or len(names) == 1:
        ledger.model = (exact or names)[0]
        ledger.migrate()  # a ledger written by an older version gains the operator columns
        return ledger
    if not names:
        raise OperatorError(f"model {model} has no requests in the ledger in schema {schema}")
    raise OperatorError(f"model {model} is ambiguous in schema {schema}: use one of {sorted(names)}")


def operator_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def cancel_model(con, schema: str, model: str) -> list[str]:
    """Cancel every submitted, unharvested batch of the model; returns one report line per batch."""
    ledger = resolve_model(con, schema, model)
    ledger.forget_settled()  # rows become due again: the next run must not skip (pipeline/settled.py)
    who = operator_name()
    jobs = con.execute(
        f"""select job_id, batch_id, provider, llm_model, provider_options from {ledger.table("llm_batch_jobs")}
            where model = ? and harvested_at is null and status <> {sql(JobStatus.VOIDED)} order by created_at""",
        [ledger.model],
    ).fetchall()
    if not jobs:
        return [f"{ledger.model}: no batch in flight; nothing to cancel"]
    lines: list[str] = []
    providers: dict[tuple[str, str, str | None], BatchProvider] = {}
    for job_id, batch_id, provider_name, llm_model, options in jobs:
        if not batch_id:
            lines.append(
                f"{job_id}: its submission was interrupted and is not matched to a provider batch yet; "
                f"run the model once (it reconciles) and cancel again"
            )
            continue
        key = (provider_name, llm_model, options)
        if key not in providers:
            job = {"provider": provider_name, "llm_model": llm_model, "provider_options": options}
            config = pool.sent_with(parse_config(_cancel_config(con, ledger, provider_name, llm_model)), job)
            client = get_provider(provider_name)(config)
            if not isinstance(client, BatchProvider):  # never the case: only a batch API gives batch ids
                lines.append(f"{batch_id}: {provider_name} has no batch API; nothing to cancel")
                continue
            providers[key] = client
            providers[key].check_credentials()
        try:
            new_status = providers[key].cancel(batch_id)
        except Exception as exc:  # e.g. it ended meanwhile: the provider refuses to cancel it
            lines.append(f"{batch_id}: not cancelled ({describe(exc)}); the next run harvests it")
            continue
        ledger.record_provider_status(job_id, new_status, cancel_requested_at=_now(con), cancelled_by=who)
        lines.append(f"{batch_id}: cancel requested by {who} (provider status: {new_status})")
    lines.append(
        f"{ledger.model}: the next `dbt run` of this model harvests what these batches finished; the "
        f"requests they left unanswered are held (not resent) until `dbt-llm-batch release "
        f"--database {database_path(con)} --schema {schema} --model {ledger.model}`, or until their prompt "
        f"or config changes"
    )
    return lines


def _cancel_config(con, ledger: Ledger, provider_name: str, llm_model: str) -> dict:
    """The raw config to reach the provider of a batch: the model's settle snapshot (its provider keys,
    e.g. a Ray cluster's address and storage) when a run stored one and it parses, else the provider
    and model alone."""
    raw = {"unique_key": "key", "llm_provider": provider_name, "llm_model": llm_model}
    try:
        rows = con.execute(
            f"select config_snapshot from {ledger.table('llm_batch_models')} where model = ? and config_snapshot is not null",
            [ledger.model],
        ).fetchall()
    except duckdb.Error:  # a ledger from before the snapshot column
        return raw
    if not rows:
        return raw
    snapshot = {k: v for k, v in json.loads(rows[0][0])["config"].items() if k != "llm_variants"}
    candidate = {**snapshot, **raw, "unique_key": snapshot.get("unique_key", "key")}
    try:
        parse_config(candidate)
    except LlmBatchError:
        return raw
    return candidate


def release_model(con, schema: str, model: str) -> tuple[int, int, int, int]:
    """Make the model's requests that no run will send eligible again, as 'released' (like 'voided':
    planned again without using up an attempt; a status of its own, so reconcile.hold_cancelled does not hold
    them again): the held ones (after a cancel), those of interrupted submissions reconciliation holds
    (no batch id: the provider may or may not have their batch), and in-flight ones whose job row is
    missing. Returns (held, interrupted requests, interrupted submissions, job missing)."""
    ledger = resolve_model(con, schema, model)
    ledger.forget_settled()  # rows become due again: the next run must not skip (pipeline/settled.py)
    jobs = ledger.table("llm_batch_jobs")
    who = operator_name()
    held = ledger.release_held(who)
    # Only submissions a run looked up and could not decide: one nobody has reconciled yet (or an
    # OpenAI one, which its metadata token settles) may well be a live batch.
    interrupted = [
        r[0]
        for r in con.execute(
            f"""select job_id from {jobs} where model = ? and batch_id is null and harvested_at is null
              and status in {sql_in(INTERRUPTED)} and error = ?""",
            [ledger.model, HELD_BY_RECONCILIATION],
        ).fetchall()
    ]
    freed = 0
    for job_id in interrupted:
        freed += ledger.release_interrupted(job_id, who)
        ledger.mark_job_voided(job_id, error=f"released by {who}")
    orphans = ledger.release_orphans(who)
    return held, freed, len(interrupted), orphans


def requeue_model(con, schema: str, model: str) -> tuple[int, int]:
    """Failed requests that were sent stop counting as attempts (status 'requeued'); returns (requeued,
    failed before sending). Rows that failed before sending (empty, too long, not UTF-8) need their
    input fixed instead: they stay failed."""
    ledger = resolve_model(con, schema, model)
    ledger.forget_settled()  # rows become due again: the next run must not skip (pipeline/settled.py)
    requests = ledger.table("llm_batch_requests")
    n = ledger.requeue_failed()
    unsent = con.execute(
        f"select count(*) from {requests} where model = ? and status = {sql(RequestStatus.FAILED)} and job_id is null",
        [ledger.model],
    ).fetchall()[0][0]
    return n, unsent


def _now(con):
    return con.execute("select now()").fetchall()[0][0]


def command(args) -> int:
    """`dbt-llm-batch cancel|release|requeue|unlock`: run one operator action and print what it did."""
    try:
        con = open_database(args.database, f"`dbt-llm-batch {args.command}`")
        try:
            if args.command == "cancel":
                print("\n".join(cancel_model(con, args.schema, args.model)))
            elif args.command == "release":
                held, freed, submissions, orphans = release_model(con, args.schema, args.model)
                if held or not (submissions or orphans):
                    print(f"released {held} held request(s) of {args.model}: the next run sends them")
                if submissions:
                    print(
                        f"released {freed} request(s) of {submissions} interrupted submission(s) that no "
                        f"provider batch was matched to: the next run sends them. WARNING: if a submission did "
                        f"reach the provider, its batch still runs and those requests are paid twice"
                    )
                if orphans:
                    print(
                        f"released {orphans} request(s) whose job is missing from llm_batch_jobs: the next run "
                        f"sends them. WARNING: if their batch ran at the provider, they are paid twice"
                    )
            elif args.command == "requeue":
                n, unsent = requeue_model(con, args.schema, args.model)
                print(
                    f"requeued {n} failed request(s) of {args.model}: the next run sends them again, with "
                    f"a fresh set of llm_max_attempts"
                    + (
                        f"; {unsent} row(s) failed before sending (empty, "
                        f"too long or not UTF-8) and need their input fixed"
                        if unsent
                        else ""
                    )
                )
            elif args.command == "unlock":
                rows = unlock(con, args.schema, resolve_model(con, args.schema, args.model).model)
                print(
                    f"removed the lock of {rows[0][0]} (held since {rows[0][1]}, last heartbeat {rows[0][2]})"
                    if rows
                    else f"{args.model} was not locked"
                )
        finally:
            con.close()
    except LlmBatchError as exc:
        print(f"dbt-llm-batch {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0
