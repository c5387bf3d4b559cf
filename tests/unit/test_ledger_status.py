"""The ledger owns its state machine (ledger/status.py): no status word is spelled out in SQL outside
the ledger package, every status the code writes is in the transition table, every change the ledger
makes to a row is an allowed transition, and a ledger an older release left (with the legacy
'submitted' status) is upgraded and still harvested. Fast: in-memory DuckDB, no dbt, no provider."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import duckdb
import pytest

import dbt_llm_batch
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger import IN_FLIGHT, Ledger
from dbt_llm_batch.ledger import status as st
from dbt_llm_batch.ledger.status import JobStatus, RequestStatus
from dbt_llm_batch.ledger.store import MIGRATIONS
from dbt_llm_batch.pipeline import outcomes
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.providers.base import BatchState

PACKAGE = Path(dbt_llm_batch.__file__).parent
EVERY_STATUS = st.REQUEST_STATUSES | st.JOB_STATUSES | set(st.LEGACY_REQUEST_STATUSES)
# 'realtime' is also a request's route ('batch' or 'realtime', `llm_batch_requests.route`): as a job
# status it is flagged where SQL compares a status with it; every other status word, anywhere quoted.
ALSO_ROUTES = {"realtime"}
QUOTED_STATUS = re.compile(
    r"'(" + "|".join(sorted(EVERY_STATUS - ALSO_ROUTES)) + r")'"
    r"|status\s*(?:=|<>|!=|in\s*\([^)]*)\s*'(" + "|".join(sorted(ALSO_ROUTES)) + r")'"
)
# Exempt from the literal scan:
# - ledger/: it owns the words (status.py), and its migrations keep the SQL of the versions they created;
# - sandbox/: the provider's side (an emulator of OpenAI and Anthropic), whose words are the providers';
# - providers/: they parse the provider's own result and batch words (e.g. Anthropic's result type
#   'succeeded' / 'errored'), which are the provider's vocabulary, not the ledger's; the import
#   contracts also forbid them to import the ledger.
EXEMPT = ("ledger", "sandbox", "providers")


def _string_constants(path: Path):
    """(line, text) of every string constant in the module, docstrings left out (they describe, they
    are not SQL). An f-string's literal parts are constants too."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def _sources(include_exempt: bool = False):
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0]
        if include_exempt or part not in EXEMPT:
            yield path


def test_no_status_literal_in_sql_outside_the_ledger():
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)}"
        for path in _sources()
        for line, text in _string_constants(path)
        for m in QUOTED_STATUS.finditer(text)
    ]
    assert not hits, (
        "status words spelled out in SQL outside dbt_llm_batch/ledger (use ledger/status.py):\n" + "\n".join(hits)
    )


def test_the_scan_finds_a_status_literal(tmp_path):
    """The scan above would see one (it is not vacuous): a module with status words in SQL, as the
    pipeline used to write them, is caught; its docstring is not."""
    module = tmp_path / "pipeline_like.py"
    module.write_text(
        '''"""Docstrings may say 'queued'."""\n'''
        "def settle(con, requests):\n"
        "    con.execute(f\"update {requests} set status = 'voided' where status in ('queued', 'submitted')\")\n"
    )
    hits = [m.group(1) or m.group(2) for _, text in _string_constants(module) for m in QUOTED_STATUS.finditer(text)]
    assert sorted(hits) == ["queued", "submitted", "voided"]


# A write whose target is a ledger table: `insert into {ledger.table(...)}`, `update {requests} ...`.
_WRITE = re.compile(r"(insert\s+into|update|delete\s+from)\s*$", re.IGNORECASE)
_LEDGER_TABLE = re.compile(r"\btable\(|\b(requests|jobs|results|models|locks)\b|llm_batch_")


def test_no_ledger_table_is_written_outside_the_ledger():
    """Every INSERT/UPDATE/DELETE on llm_batch_* is a Ledger method: the pipeline asks, the ledger
    writes. (Writes to the model's own table and to the run's temp tables stay where they are.)"""
    hits = []
    for path in _sources(include_exempt=True):
        if path.relative_to(PACKAGE).parts[0] in ("ledger", "sandbox"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.JoinedStr):
                continue
            text = ""
            for part in node.values:
                if isinstance(part, ast.Constant):
                    text += str(part.value)
                    continue
                target = ast.unparse(part.value)
                if _WRITE.search(text.split(";")[-1]) and _LEDGER_TABLE.search(target):
                    hits.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: ...{text[-30:]}{{{target}}}")
                text += "{}"
    assert not hits, "ledger tables written outside dbt_llm_batch/ledger:\n" + "\n".join(hits)


# Where the ledger's SQL names a status: `status = 'x'`, `status <> 'x'`, `status in ('x', ...)`,
# `then 'x'` / `else 'x'` of a status CASE.
_STATUS_USE = re.compile(r"status\s*(?:=|<>)\s*'(\w+)'|status\s+in\s*\(([^)]*)\)|(?:then|else)\s+'(\w+)'")


def test_every_status_the_ledger_names_is_in_the_transition_table():
    listed = set(st.REQUEST_TRANSITIONS) | set(st.JOB_TRANSITIONS) | st.REQUEST_STATUSES | st.JOB_STATUSES
    named = set()
    for path in (PACKAGE / "ledger").glob("*.py"):
        for _, text in _string_constants(path):
            for m in _STATUS_USE.finditer(text):
                words = [m.group(1), m.group(3)] + re.findall(r"'(\w+)'", m.group(2) or "")
                named.update(w for w in words if w)
    # What CASE branches name besides statuses in the ledger's SQL (emitted, failure kinds, outcomes).
    not_statuses = {"merged", "superseded", "deterministic", "gave_up", "batch_failed", "batch"}
    named -= not_statuses
    # The ledger's SQL spells (almost) no status out any more: it uses the constants, checked below.
    assert named - listed <= set(st.LEGACY_REQUEST_STATUSES), named - listed
    # Every RequestStatus.X / JobStatus.X the package uses exists and is in the transition table.
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in ("RequestStatus", "JobStatus"):
                    used.add((node.value.id, node.attr))
    assert len(used) > 10, "the scan found too few status constants in use: it is broken"
    for owner, attr in used:
        value = getattr(RequestStatus if owner == "RequestStatus" else JobStatus, attr, None)
        assert value is not None, f"{owner}.{attr} is used but not defined"
        assert value in listed, f"{owner}.{attr} = {value!r} is used but not in the transition table"
    # Every constant is in the table, and every table entry is a known status.
    constants = {v for k, v in vars(RequestStatus).items() if k.isupper()}
    assert constants == st.REQUEST_STATUSES
    assert set(st.REQUEST_TRANSITIONS) - {st.NEW} == st.REQUEST_STATUSES
    for targets in st.REQUEST_TRANSITIONS.values():
        assert targets <= st.REQUEST_STATUSES | {st.DELETED}
    job_constants = {v for k, v in vars(JobStatus).items() if k.isupper()}
    assert job_constants == st.LEDGER_JOB_STATUSES
    for source, targets in st.JOB_TRANSITIONS.items():
        assert source in st.LEDGER_JOB_STATUSES | {st.NEW, st.PROVIDER}
        assert targets <= st.LEDGER_JOB_STATUSES | {st.PROVIDER, st.DELETED}
    assert IN_FLIGHT == (RequestStatus.QUEUED,)


# --- the state machine at work on an in-memory ledger -------------------------------------------


class Recorder:
    """Snapshots every request's and job's status; `check()` asserts that every change since the last
    snapshot is one the transition table allows, and that every status present is listed."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.seen: set[tuple[str, str, str]] = set()
        self.requests, self.jobs = self._snapshot()

    def _snapshot(self):
        requests = dict(
            self.ledger.con.execute(
                f"select custom_id, status from {self.ledger.table('llm_batch_requests')}"
            ).fetchall()
        )
        jobs = dict(
            self.ledger.con.execute(f"select job_id, status from {self.ledger.table('llm_batch_jobs')}").fetchall()
        )
        return requests, jobs

    def check(self) -> None:
        requests, jobs = self._snapshot()
        assert set(requests.values()) <= st.REQUEST_STATUSES, requests
        assert set(jobs.values()) <= st.JOB_STATUSES, jobs
        for before, after, allowed, kind in (
            (self.requests, requests, st.request_transition_allowed, "request"),
            (self.jobs, jobs, st.job_transition_allowed, "job"),
        ):
            for key in before.keys() | after.keys():
                old, new = before.get(key, st.NEW), after.get(key, st.DELETED)
                if old != new:
                    assert allowed(old, new), f"{kind} {key}: {old} -> {new} is not in the transition table"
                    self.seen.add((kind, old, new))
        self.requests, self.jobs = requests, jobs


@pytest.fixture
def ledger():
    con = duckdb.connect()
    ledger = Ledger(con, "main", "m")
    ledger.migrate()
    yield ledger
    con.close()


def plan(ledger: Ledger, n: int, chunks: int = 1, start: int = 0) -> str:
    """A plan_rows temp table of n requests spread over `chunks` chunks."""
    ledger.con.execute(
        f"""create or replace temp table plan_rows as
            select 'c' || (i + {start}) as custom_id, 'k' || (i + {start}) as key, 'f' as fingerprint, 0 as seq,
                   '{{"p": "x"}}' as row_json, 0.01::decimal(18, 9) as estimated_cost_usd, 10 as estimated_input_tokens,
                   'batch' as route, i % {chunks} as chunk, i // {chunks} + 1 as line, null::ubigint as prompt_hash
            from range({n}) t(i)"""
    )
    return "plan_rows"


def statuses(ledger: Ledger) -> dict[str, str]:
    return dict(
        ledger.con.execute(f"select custom_id, status from {ledger.table('llm_batch_requests')} order by 1").fetchall()
    )


def job_status(ledger: Ledger, job_id: str) -> str | None:
    rows = ledger.con.execute(
        f"select status from {ledger.table('llm_batch_jobs')} where job_id = ?", [job_id]
    ).fetchall()
    return rows[0][0] if rows else None


def openai():
    return get_provider("openai")(
        parse_config({"unique_key": "id", "llm_provider": "openai", "llm_model": "gpt-4o-mini"})
    )


def answer_line(custom_id: str, content: str | None = "ok", status: int = 200) -> str:
    body = json.dumps(
        {
            "choices": [{"finish_reason": "stop", "message": {"content": content}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
        if content is not None
        else {"error": {"message": "bad request", "code": "invalid_request_error"}}
    )
    return openai().realtime_result_line(custom_id, status, body)


def store(ledger: Ledger, job_id: str, lines: list[tuple[str, str]]) -> None:
    import pyarrow as pa

    ledger.con.register("lines", pa.table({"custom_id": [c for c, _ in lines], "raw": [raw for _, raw in lines]}))
    ledger.store_lines(job_id, "output", "lines")
    ledger.con.unregister("lines")


def test_a_batch_from_intent_to_harvest(ledger):
    rec = Recorder(ledger)
    ledger.defer(plan(ledger, 4, chunks=2))
    rec.check()
    assert set(statuses(ledger).values()) == {RequestStatus.DEFERRED}
    jobs = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 4, chunks=2), [0, 1])
    rec.check()
    assert set(statuses(ledger).values()) == {RequestStatus.QUEUED}
    first, second = jobs[0], jobs[1]
    assert job_status(ledger, first) == JobStatus.INTENT
    ledger.mark_uploading(first)
    rec.check()
    ledger.mark_submitting(first, "file-1")
    rec.check()
    ledger.record_submission(first, "batch_1", "file-1", "validating")
    rec.check()
    ledger.record_provider_status(first, "in_progress")
    rec.check()
    assert job_status(ledger, first) == "in_progress"
    ledger.return_to_deferred([second])  # its upload was never attempted
    rec.check()
    assert job_status(ledger, second) is None
    assert statuses(ledger) == {"c0": "queued", "c1": "deferred", "c2": "queued", "c3": "deferred"}
    # The batch ends: c0 answered, c2 rejected by the API; settled through the harvest code (outcomes.settle).
    store(ledger, first, [("c0", answer_line("c0")), ("c2", answer_line("c2", None, 400))])
    outcomes.settle(ledger, openai(), openai().config, [(first, BatchState(status="completed", ended=True))], None)
    rec.check()
    assert statuses(ledger) == {"c0": "succeeded", "c1": "deferred", "c2": "failed", "c3": "deferred"}
    assert job_status(ledger, first) == "completed"
    assert ledger.requeue_failed() == 1
    rec.check()
    assert statuses(ledger)["c2"] == RequestStatus.REQUEUED
    assert ("request", "queued", "succeeded") in rec.seen and ("job", "submitting", "validating") in rec.seen


def test_cancel_hold_release(ledger):
    rec = Recorder(ledger)
    job = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 3), [0])[0]
    rec.check()
    ledger.mark_uploading(job)
    rec.check()
    ledger.mark_submitting(job, "file-1")
    rec.check()
    ledger.record_submission(job, "batch_1", "file-1", "in_progress")
    rec.check()
    now = ledger.con.execute("select now()").fetchall()[0][0]
    ledger.record_provider_status(job, "cancelling", cancel_requested_at=now, cancelled_by="op@host")
    rec.check()
    store(ledger, job, [("c0", answer_line("c0"))])  # answered before the cancel took effect
    outcomes.settle(ledger, openai(), openai().config, [(job, BatchState(status="cancelled", ended=True))], None)
    rec.check()
    assert statuses(ledger) == {"c0": "succeeded", "c1": "voided", "c2": "voided"}
    assert ledger.hold_cancelled() == 2
    rec.check()
    assert ledger.release_held("op@host") == 2
    rec.check()
    assert statuses(ledger) == {"c0": "succeeded", "c1": "released", "c2": "released"}
    assert ("request", "voided", "held") in rec.seen and ("request", "held", "released") in rec.seen


def test_refused_and_interrupted_submissions(ledger):
    rec = Recorder(ledger)
    jobs = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 4, chunks=2), [0, 1])
    rec.check()
    ledger.mark_uploading(jobs[0])
    rec.check()
    ledger.mark_submitting(jobs[0], "file-1")
    rec.check()
    ledger.void_job(jobs[0], "refused")
    rec.check()
    ledger.mark_job_voided(jobs[0], error="HTTP 400")
    rec.check()
    assert job_status(ledger, jobs[0]) == JobStatus.VOIDED
    # An interrupted submission an operator releases.
    ledger.mark_uploading(jobs[1])
    rec.check()
    ledger.mark_submitting(jobs[1], None)
    rec.check()
    assert ledger.release_interrupted(jobs[1], "op@host") == 2
    ledger.mark_job_voided(jobs[1], error="released by op@host")
    rec.check()
    assert set(statuses(ledger).values()) == {RequestStatus.VOIDED, RequestStatus.RELEASED}
    assert ("job", "submitting", "voided") in rec.seen and ("request", "queued", "released") in rec.seen


def test_a_realtime_job(ledger):
    rec = Recorder(ledger)
    job = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 2), [0], status=JobStatus.REALTIME)[0]
    rec.check()
    store(ledger, job, [("c0", answer_line("c0"))])
    outcomes.settle(
        ledger, openai(), openai().config, [(job, BatchState(status=JobStatus.COMPLETED, ended=True))], None
    )
    rec.check()
    assert job_status(ledger, job) == JobStatus.COMPLETED
    assert statuses(ledger) == {"c0": "succeeded", "c1": "voided"}
    assert ("job", "realtime", "completed") in rec.seen


def test_transitions_outside_the_table_change_nothing(ledger):
    job = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 1), [0])[0]
    ledger.mark_submitting(job, "file-1")  # intent -> submitting skips uploading
    ledger.record_submission(job, "batch_1", "file-1", "validating")  # not submitting
    assert job_status(ledger, job) == JobStatus.INTENT
    ledger.mark_uploading(job)
    ledger.mark_uploading(job)  # again: not an intent any more
    assert job_status(ledger, job) == JobStatus.UPLOADING
    assert ledger.release_held("op") == 0 and ledger.requeue_failed() == 0 and ledger.hold_cancelled() == 0
    assert statuses(ledger) == {"c0": "queued"}
    with pytest.raises(ValueError, match="transition methods"):
        ledger.update_job(job, status="voided")
    with pytest.raises(ValueError, match="starts as"):
        ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 1, start=5), [0], status="validating")
    assert not st.request_transition_allowed("succeeded", "queued")
    assert not st.job_transition_allowed("voided", "in_progress")
    assert st.job_transition_allowed("in_progress", "ended") and st.job_transition_allowed("realtime", "completed")


# --- upgrade: the legacy 'submitted' status ------------------------------------------------------


def test_a_submitted_request_of_an_older_ledger_is_rewritten_and_still_harvested():
    con = duckdb.connect()
    old = Ledger(con, "main", "m")
    assert 13 in dict(MIGRATIONS)  # the migration this test is about (later ones may follow)
    old.migrate(up_to=12)  # the ledger as the release before this one left it
    con.execute(
        """insert into main.llm_batch_jobs (job_id, model, provider, llm_model, batch_id, status, request_count,
             created_at, submitted_at, updated_at)
           values ('job_old', 'm', 'openai', 'gpt-4o-mini', 'batch_old', 'in_progress', 2, now(), now(), now())"""
    )
    con.execute(
        """insert into main.llm_batch_requests (custom_id, model, key, fingerprint, seq, job_id, status, row_json,
             queued_at, estimated_cost_usd, estimated_input_tokens)
           values ('c0', 'm', 'k0', 'f', 0, 'job_old', 'submitted', '{}', now(), 0.5, 7),
                  ('c1', 'm', 'k1', 'f', 0, 'job_old', 'submitted', '{}', now(), 0.25, 3)"""
    )
    ledger = Ledger(con, "main", "m")
    ledger.migrate()
    assert con.execute("select max(schema_version) from main.llm_batch_meta").fetchall()[0][0] == MIGRATIONS[-1][0]
    assert statuses(ledger) == {"c0": "queued", "c1": "queued"}
    # In flight: counted by the ledger's reads and its views, and the planner would not resend it.
    assert ledger.in_flight() == (1, 2, 10) and ledger.pending_count() == 2
    assert float(ledger.committed_usd()) == 0.75
    assert con.execute("select requests_pending from main.llm_batch_progress").fetchall() == [(2,)]
    assert con.execute("select rows_pending from main.llm_batch_costs").fetchall() == [(2,)]
    # And harvested: its batch ends with one answer; the other is voided (planned again, no attempt used).
    store(ledger, "job_old", [("c0", answer_line("c0"))])
    outcomes.settle(ledger, openai(), openai().config, [("job_old", BatchState(status="completed", ended=True))], None)
    assert statuses(ledger) == {"c0": "succeeded", "c1": "voided"}
    assert ledger.pending_count() == 0
    con.close()


def test_a_combined_answer_of_a_v26_ledger_names_its_base_in_the_list_of_parts():
    # v27: a row answer names the earlier requests it is combined with in a list (added_fields.py);
    # v26 named one (base_custom_id), which becomes the list's only element.
    con = duckdb.connect()
    Ledger(con, "main", "m").migrate(up_to=26)
    con.execute(
        """insert into main.llm_batch_row_answers (model, key, variant, fingerprint, custom_id, reused, created_at,
             base_custom_id)
           values ('m', 'k0', '', 'f1', 'delta', false, now(), 'base'), ('m', 'k1', '', 'f0', 'plain', false, now(), null)"""
    )
    Ledger(con, "main", "m").migrate()
    rows = con.execute("select key, base_custom_ids from main.llm_batch_row_answers order by key").fetchall()
    assert rows == [("k0", ["base"]), ("k1", None)]
    columns = {
        c
        for (c,) in con.execute(
            "select column_name from information_schema.columns where table_name = 'llm_batch_row_answers'"
        ).fetchall()
    }
    assert "base_custom_id" not in columns
    con.close()


def test_a_v28_ledger_gets_the_views_that_count_each_row_once():
    # v29 changed the views only: a row (model, variant, key) is counted once, by its current answer,
    # never once per request that answered it (a prompt's answer superseded by a later one; an
    # earlier part of a combined answer, store._CURRENT_ANSWERS). A ledger of v28 gets them.
    con = duckdb.connect()
    Ledger(con, "main", "m").migrate(up_to=28)
    # What v28's views counted: every row answer of a succeeded request (costs), every row answer (progress).
    con.execute("""create or replace view main.llm_batch_costs as
                   select count(*) as rows_succeeded from main.llm_batch_row_answers""")
    con.execute("""create or replace view main.llm_batch_progress as
                   select count(*) as keys_succeeded, count(*) as rows_mapped from main.llm_batch_row_answers""")
    con.execute(
        """insert into main.llm_batch_requests (custom_id, model, key, fingerprint, seq, status, is_final,
             queued_at, completed_at, cost_usd)
           values ('old', 'm', 'k0', 'f0', 0, 'succeeded', true, now(), now(), 0.5),
                  ('new', 'm', 'k0', 'f1', 0, 'succeeded', true, now(), now(), 0.5),
                  ('base', 'm', 'k1', 'f0', 0, 'succeeded', true, now(), now(), 0.5),
                  ('delta', 'm', 'k1', 'd1', 0, 'succeeded', true, now(), now(), 0.25),
                  ('fail', 'm', 'k2', 'f1', 0, 'failed', true, now(), now(), 0.5)"""
    )
    con.execute(
        """insert into main.llm_batch_row_answers (model, key, variant, fingerprint, custom_id, reused, created_at,
             emitted, base_custom_ids)
           values ('m', 'k0', '', 'f0', 'old', false, now() - interval 1 hour, 'superseded', null),
                  ('m', 'k0', '', 'f1', 'new', false, now(), 'merged', null),
                  ('m', 'k1', '', 'f0', 'base', false, now() - interval 1 hour, 'superseded', null),
                  ('m', 'k1', '', 'f1', 'delta', false, now(), 'merged', ['base']),
                  ('m', 'k2', '', 'f0', 'old', false, now() - interval 1 hour, 'superseded', null),
                  ('m', 'k2', '', 'f1', 'fail', false, now(), 'merged', null)"""
    )
    assert con.execute("select rows_succeeded from main.llm_batch_costs").fetchall() == [(6,)]
    Ledger(con, "main", "m").migrate()
    assert con.execute("select max(schema_version) from main.llm_batch_meta").fetchall()[0][0] == MIGRATIONS[-1][0]
    assert con.execute("select sum(rows_succeeded) from main.llm_batch_costs").fetchall() == [(2,)], "recreated"
    costs = "select sum(rows_succeeded), sum(rows_failed), sum(rows_answered), sum(requests_succeeded) from main.llm_batch_costs"
    assert con.execute(costs).fetchall() == [(2, 1, 2, 4)]
    progress = "select keys_succeeded, keys_failed, rows_mapped, rows_reused from main.llm_batch_progress"
    assert con.execute(progress).fetchall() == [(2, 1, 3, 0)]
    con.close()


def test_migrations_are_numbered_in_the_order_they_run():
    # _migrate_once runs them in list order and records each version: a version listed after a
    # higher one would be skipped on every ledger that already has the higher one.
    versions = [version for version, _ in MIGRATIONS]
    assert versions == sorted(set(versions)), versions


def test_one_job_holds_several_variants_requests_each_with_its_own_variant(ledger):
    """Evaluation variants on the same provider and model share a batch: each request, row answer and
    member row keeps its own variant; the job lists its variants."""
    plan(ledger, 4)
    ledger.con.execute(
        "create or replace temp table rows_v as select *, case when key in ('k0', 'k1') then '' else 'terse' end as variant from plan_rows"
    )
    ledger.con.execute(
        """create or replace temp table members_v as
           select 'k9' as key, 'f' as fingerprint, 'c3' as custom_id, false as reused, true as duplicate,
                  null::ubigint as prompt_hash, 'claude' as variant, '{"p": "y"}' as row_json"""
    )
    job = ledger.write_intents("openai", "gpt-4o-mini", "rows_v", [0], members="members_v", per_row_variant=True)[0]
    requests = ledger.con.execute(
        f"select custom_id, variant from {ledger.table('llm_batch_requests')} order by 1"
    ).fetchall()
    assert requests == [("c0", ""), ("c1", ""), ("c2", "terse"), ("c3", "terse")]
    answers = ledger.con.execute(
        f"select key, variant, custom_id from {ledger.table('llm_batch_row_answers')} order by 1"
    ).fetchall()
    assert answers == [("k0", "", "c0"), ("k1", "", "c1"), ("k2", "terse", "c2"), ("k3", "terse", "c3"),
                       ("k9", "claude", "c3")]  # fmt: skip
    jobs = ledger.con.execute(f"select job_id, variant, request_count from {ledger.table('llm_batch_jobs')}").fetchall()
    assert jobs == [(job, ",terse", 4)]


def test_the_ledger_refuses_a_second_live_request_for_one_custom_id(ledger):
    """A request is deferred or in a job, never both, and never in two jobs: a write that would make a
    second live request of one custom_id is refused whole (#30 item 1's double billing)."""
    from dbt_llm_batch.errors import LedgerInvariantError

    job = ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 2), [0])[0]
    before = statuses(ledger)
    with pytest.raises(LedgerInvariantError, match="second live request for c0, c1"):
        ledger.defer(plan(ledger, 2))  # the same requests, also waiting: sent twice
    with pytest.raises(LedgerInvariantError, match="second live request for c0"):
        ledger.write_intents("openai", "gpt-4o-mini", plan(ledger, 1), [0])  # in a second job
    assert statuses(ledger) == before  # nothing written
    # Once the job is voided (never reached the provider), the same requests may wait or be sent again.
    ledger.void_job(job, "never sent")
    ledger.defer(plan(ledger, 2))
    rows = ledger.con.execute(f"select custom_id, status from {ledger.table('llm_batch_requests')} order by all")
    assert rows.fetchall() == [("c0", "deferred"), ("c0", "voided"), ("c1", "deferred"), ("c1", "voided")]
