"""The fault table: every provider endpoint the plugin calls, each failing in each way a provider or
the network fails (429 with retry-after, 503/529 overloaded, a dropped connection), switched on through
the emulator's per-endpoint fault API.

Transient cases fail twice then recover: the runs succeed and finish the work. Persistent cases
fail until the per-run retry budget (llm_retry_budget_seconds=1) is spent: the run still succeeds,
leaves the work pending and loses nothing; once the provider recovers, later runs finish it.
For every case: every source row ends succeeded (or failed with a reason), no key was answered
successfully twice by the emulator's own count, and every result the emulator returned is stored in
the ledger. `pytest --collect-only -q tests/test_fault_table.py` lists the cases.
"""

from __future__ import annotations

import pytest
from helpers import (
    billed_per_key,
    run,
    setup,
    succeeded_custom_ids,
)

ENDPOINTS = {
    "openai": [
        "POST /v1/files",
        "POST /v1/batches",
        "GET /v1/batches/{id}",
        "GET /v1/batches",
        "GET /v1/files/{id}/content",
        "DELETE /v1/files/{id}",
    ],
    "anthropic": [
        "POST /v1/messages/batches",
        "GET /v1/messages/batches/{id}",
        "GET /v1/messages/batches",
        "GET /v1/messages/batches/{id}/results",
        "DELETE /v1/messages/batches/{id}",
    ],
}
CREATE = ("POST /v1/batches", "POST /v1/messages/batches")
DELETE = ("DELETE /v1/files/{id}", "DELETE /v1/messages/batches/{id}")  # after harvest; never fails a run
LIST = ("GET /v1/batches", "GET /v1/messages/batches")
# One of each way a call fails: throttled (with retry-after), a server error, no answer at all. Other 5xx
# (500, 502, 504) take the same path as the overloaded 503/529 and are left out to keep the table quick.
FAULTS = {  # name -> emulator fault arguments
    "429": {"status_code": 429, "retry_after": 1},
    "overloaded": {"status_code": 503},  # Anthropic words it 529 (see below)
    "disconnect": {"kind": "disconnect"},
}
ROWS = 6


def fault_args(provider: str, name: str) -> dict:
    base, _, when = name.partition(" ")
    args = dict(FAULTS[base], **({"when": when} if when else {}))
    if provider == "anthropic" and base == "overloaded":
        args["status_code"] = 529
    return args


def cases(faults, skip=()) -> list:
    return [
        pytest.param(p, e, f, id=f"{p} {e} {f}")
        for p in ENDPOINTS
        for e in ENDPOINTS[p]
        if e not in skip
        for f in faults
    ]


# A create the provider carried out before failing (a 5xx or a reset after the batch exists): the run
# must find that batch (reconciliation), never create and bill a second one.
CREATED_THEN_FAILED = [
    pytest.param(p, e, f, id=f"{p} {e} {f}")
    for p in ENDPOINTS
    for e in ENDPOINTS[p]
    if e in CREATE
    for f in ("overloaded after",)  # "disconnect after": every batch provider's, in tests/conformance
]
TRANSIENT = cases(FAULTS) + CREATED_THEN_FAILED
PERSISTENT = cases(
    ["overloaded"], skip=CREATE + DELETE
)  # create is never retried: its failures are all transient cases


def pass_a_day(project) -> None:
    """Nightly runs are a day apart: an interrupted submission's intent is then a day old, and
    reconciliation looks at every batch the provider created since."""
    project.release_database()
    project.query(
        "update main.llm_batch_jobs set created_at = created_at - interval 26 hour "
        "where status = 'submitting' and batch_id is null"
    )


def finished(project) -> bool:
    done = project.query("select count(*) from main.m where llm_status in ('succeeded', 'failed')")[0][0]
    pending = project.query(
        "select count(*) from main.llm_batch_requests where status in ('queued', 'submitted') or status = 'deferred'"
    )[0][0]
    return done == ROWS and pending == 0


def nightly_runs(project, emulator, runs: int) -> None:
    for _ in range(runs):
        run(project)  # never fails: a provider fault is survived, not raised
        if finished(project):
            return
        emulator.complete_all()
        pass_a_day(project)


def start(project, emulator, provider, endpoint, args, times, budget) -> None:
    setup(project, provider, f"llm_retry_budget_seconds={budget},", rows=ROWS)
    if endpoint in LIST:  # the list call is made by reconciliation: lose a create's answer first
        emulator.add_fault(
            kind="truncate",
            endpoint="POST /v1/batches" if provider == "openai" else "POST /v1/messages/batches",
            times=1,
        )
    elif endpoint not in CREATE and endpoint not in ("POST /v1/files",):
        run(project)  # submit cleanly; the fault hits the later poll / download
        emulator.complete_all()
    emulator.add_fault(endpoint=endpoint, times=times, **args)


def assert_invariants(project, emulator) -> None:
    rows = project.query("select llm_status, llm_error from main.m")
    assert len(rows) == ROWS
    assert all(s == "succeeded" or (s == "failed" and e) for s, e in rows), rows
    returned = succeeded_custom_ids(emulator)
    stored = {r[0] for r in project.query("select custom_id from main.llm_batch_results")}
    assert set(returned) <= stored, "a result the provider returned is missing from the ledger"
    key_of_prompt = {prompt: a for a, prompt in project.query("select a, prompt from main.things")}
    per_key = billed_per_key(emulator, key_of_prompt)  # finishes every open batch first
    assert sorted(per_key.values()) == [1] * ROWS, f"billed more than once (or never): {per_key}"


@pytest.mark.parametrize("provider_name,endpoint,fault", TRANSIENT)
def test_transient_fault(project, emulator, provider_name, endpoint, fault):
    # A delete is made once per run (a failure waits for the next run), so it fails once here; so does a
    # create that succeeded at the provider (the rows are then in a batch: there is no second create).
    times = 1 if endpoint in DELETE or fault.endswith(" after") else 2
    start(project, emulator, provider_name, endpoint, fault_args(provider_name, fault), times=times, budget=300)
    nightly_runs(project, emulator, runs=4)
    assert [f for f in emulator.faults() if f["endpoint"] == endpoint] == [], "the fault never fired"
    nightly_runs(project, emulator, runs=4)
    assert finished(project)
    assert_invariants(project, emulator)
    if endpoint in DELETE:  # the next run deleted what the failed call left
        run(project)
        assert project.query(
            "select count(*) from main.llm_batch_jobs where batch_id is not null and files_deleted_at is null"
        ) == [(0,)]


@pytest.mark.parametrize("provider_name,endpoint,fault", PERSISTENT)
def test_persistent_fault_past_the_budget(project, emulator, provider_name, endpoint, fault):
    start(project, emulator, provider_name, endpoint, fault_args(provider_name, fault), times=None, budget=1)
    for _ in range(2):  # the provider stays down: each run succeeds and keeps the work pending
        run(project)
        emulator.complete_all()
    assert "the provider kept failing for llm_retry_budget_seconds=1" in (project.root / "logs" / "dbt.log").read_text()
    assert project.query("select count(*) from main.m") == [(0,)]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(0,)]
    emulator.clear_faults()
    nightly_runs(project, emulator, runs=6)
    assert finished(project)
    assert_invariants(project, emulator)
