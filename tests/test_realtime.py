"""The realtime path: urgent rows (llm_realtime_when), exhausted batch attempts (llm_fallback) and a
self-hosted OpenAI-compatible engine (llm_provider='openai_compatible'), on real dbt and DuckDB,
against the emulator's realtime endpoints through the official SDKs."""

from __future__ import annotations

import itertools
import re
import threading
from decimal import Decimal

import pytest
from helpers import (
    TRIAGE_SYSTEM,
    batch_counts,
    batch_input_lines,
    dbt_subprocess,
    expected_triage,
    log_text,
    sorted_batches,
    triage_model,
)

from dbt_llm_batch.sandbox.server import Reply

URGENT = "llm_realtime_when = \"priority = 'urgent'\","


def prompts(project, where: str = "true") -> dict[int, str]:
    return dict(
        project.query(
            f"select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body "
            f"from main.support_tickets where {where}"
        )
    )


def table(project) -> dict[int, tuple]:
    rows = project.query("""select ticket_id, category, urgent, summary, llm_status, llm_route, llm_batch_id,
                                   llm_cost_usd, llm_realtime_cost_usd from main.triage""")
    return {r[0]: r[1:] for r in rows}


def run_and_expect_every_row_answered_once(project, engine) -> None:
    """Seed, run the triage model, and check that each of its 6 rows holds the sandbox's answer to its own
    prompt, from one request each."""
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    texts = prompts(project)
    rows = table(project)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for ticket_id, (category, urgent, summary, status, *_) in rows.items():
        assert status == "succeeded" and (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, texts[ticket_id])
    assert engine.stats()["realtime_requests"]["openai"] == 6


def test_urgent_rows_go_realtime_in_the_same_run_and_never_into_a_batch(project, emulator, provider):
    project.write("models/triage.sql", triage_model(provider=provider, extra_config=URGENT))
    project.dbt("seed")
    urgent, normal = prompts(project, "priority = 'urgent'"), prompts(project, "priority <> 'urgent'")
    assert sorted(urgent) == [1, 6]

    project.dbt("run", "-s", "triage")
    # The urgent rows are answered in this run, once each, by the realtime endpoint ...
    asked = {prompt: n for (face, prompt), n in emulator.counters.realtime_prompts.items() if face == provider}
    assert asked == {p: 1 for p in urgent.values()}
    rows = table(project)
    assert sorted(rows) == [1, 6]
    for ticket_id in (1, 6):
        category, is_urgent, summary, status, route, batch_id, cost, realtime_cost = rows[ticket_id]
        assert (status, route, batch_id) == ("succeeded", "realtime", None)
        assert (category, is_urgent, summary) == expected_triage(TRIAGE_SYSTEM, urgent[ticket_id])
        assert cost == realtime_cost and cost > 0  # priced at realtime rates: no batch discount
    # ... and the rest wait in one batch that holds none of them.
    assert batch_counts(emulator) == [4]
    if provider == "openai":
        sent = [
            line["body"]["messages"][-1]["content"] for line in batch_input_lines(emulator, sorted_batches(emulator)[0])
        ]
        assert sorted(sent) == sorted(normal.values())
    line = summary_line(project)
    assert "submitted 4 request(s) in 1 batch(es)" in line and "realtime 2 request(s) in " in line
    assert "2 succeeded, 0 failed" in line

    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    rows = table(project)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert {rows[t][4] for t in normal} == {"batch"}
    for t in normal:  # batch rows cost half their realtime price
        assert rows[t][6] == rows[t][7] / 2
    costs = dict(project.query("select route, sum(cost_usd) from main.llm_batch_costs group by route"))
    assert set(costs) == {"batch", "realtime"}

    before = (emulator.stats()["realtime_requests"], len(emulator.batches()))
    project.dbt("run", "-s", "triage")  # nothing new: no realtime call, no batch
    assert (emulator.stats()["realtime_requests"], len(emulator.batches())) == before


def summary_line(project) -> str:
    """The last per-model summary line the run wrote to the dbt log."""
    lines = [
        line for line in (project.root / "logs" / "dbt.log").read_text().splitlines() if "triage: submitted" in line
    ]
    return lines[-1]


def test_a_bad_realtime_expression_fails_before_anything_is_sent(project, emulator):
    project.write("models/triage.sql", triage_model(extra_config='llm_realtime_when = "no_such_column > 1",'))
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert (
        "llm_realtime_when = 'no_such_column > 1' is not a boolean SQL expression over the model's columns" in message
    )
    assert "nothing was sent" in message
    assert emulator.stats()["calls"] == {}


def test_exhausted_batch_attempts_fall_back_to_realtime(project, emulator):
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 1, llm_fallback = 'realtime',"))
    project.dbt("seed")
    # Ticket 3's request fails in the batch (once: the fault is used up by then) with a server error,
    # which a retry can fix (a 400 would be final at once, with no fallback: the same request again).
    emulator.add_fault(
        kind="http_error",
        prompt_contains="export all my projects",
        status_code=500,
        message="Upstream failure: sandbox says no.",
        times=1,
    )
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # harvests the failure, sends it again in realtime, merges
    rows = table(project)
    assert len(rows) == 6
    assert rows[3][3:5] == ("succeeded", "realtime")
    assert rows[3][:3] == expected_triage(TRIAGE_SYSTEM, prompts(project)[3])
    assert {rows[t][4] for t in (1, 2, 4, 5, 6)} == {"batch"}
    assert sum(emulator.counters.realtime_prompts.values()) == 1
    history = project.query("""select route, status, error from main.llm_batch_requests
                               where key = '["3"]' order by queued_at""")
    assert history == [("batch", "failed", "Upstream failure: sandbox says no."), ("realtime", "succeeded", None)]
    # The fallback is one more try: a realtime failure is final, and nothing is asked again after it.
    project.dbt("run", "-s", "triage")
    assert sum(emulator.counters.realtime_prompts.values()) == 1


@pytest.fixture
def replicas(api_key):
    """Two engines behind no balancer, each an emulator answering /v1/chat/completions."""
    from dbt_llm_batch.sandbox import Emulator

    engines = [Emulator(api_key=api_key).start() for _ in range(2)]
    for engine in engines:
        engine.realtime_latency = 0.05
    yield engines
    for engine in engines:
        engine.stop()
    for engine in engines:
        engine.raise_internal_errors()


def self_hosted_model(urls, extra: str = "") -> str:
    return triage_model(
        extra_config=f"llm_base_url = {urls!r}, llm_api_key_env = 'ENGINE_KEY', llm_concurrency = 4, {extra}"
    ).replace("llm_provider = 'openai'", "llm_provider = 'openai_compatible'")


def test_a_self_hosted_engine_answers_every_row_in_the_run_spread_over_replicas(
    project, replicas, monkeypatch, api_key
):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    urls = [engine.openai_base_url for engine in replicas]
    project.write("models/triage.sql", self_hosted_model(urls))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    rows = table(project)
    texts = prompts(project)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for ticket_id, (category, urgent, summary, status, route, batch_id, cost, realtime_cost) in rows.items():
        assert (status, route, batch_id) == ("succeeded", "realtime", None)
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, texts[ticket_id])
        assert cost == Decimal(0) and realtime_cost is None  # free unless priced; no realtime counterfactual
    per_replica = [engine.stats()["realtime_requests"]["openai"] for engine in replicas]
    assert sum(per_replica) == 6 and min(per_replica) >= 1, per_replica
    assert [engine.stats()["batches_created"] for engine in replicas] == [0, 0]

    project.dbt("run", "-s", "triage")  # nothing new: nothing sent
    assert sum(engine.stats()["realtime_requests"]["openai"] for engine in replicas) == 6


def test_a_missing_engine_key_fails_naming_the_variable(project, replicas, monkeypatch):
    monkeypatch.delenv("ENGINE_KEY", raising=False)
    project.write("models/triage.sql", self_hosted_model([replicas[0].openai_base_url]))
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert "ENGINE_KEY is not set (named by llm_api_key_env)" in message
    assert replicas[0].stats()["calls"] == {}


def test_overload_is_retried_and_what_the_budget_does_not_reach_waits(project, replicas, monkeypatch, api_key):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    # Every request is refused with 429 and retry-after 2 s, more times than a 1 s budget allows.
    engine.add_fault(endpoint="POST /v1/chat/completions", status_code=429, retry_after=2, times=None)
    project.write("models/triage.sql", self_hosted_model([engine.openai_base_url], "llm_realtime_budget_seconds = 1,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage") == [(0,)]
    voided = project.query("select distinct status, error from main.llm_batch_requests")
    assert voided == [
        (
            "voided",
            f"no answer within the realtime time budget (llm_realtime_budget_seconds=1; last "
            f"error: HTTP 429 from {engine.openai_base_url}); sent again by the next run",
        )
    ]
    engine.clear_faults()
    engine.add_fault(endpoint="POST /v1/chat/completions", status_code=503, retry_after=0.1, times=2)
    # The default budget (600 s) now: six answers and two retries need not fit in 1 s on a busy machine.
    project.write("models/triage.sql", self_hosted_model([engine.openai_base_url]))
    project.dbt("run", "-s", "triage")  # the overload passed: two 503s are retried, every row answered
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [
        (6, 6)
    ]
    assert engine.stats()["realtime_requests"]["openai"] == 6
    attempts = project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'")
    assert attempts == [(6,)]


def test_a_run_killed_mid_way_asks_only_the_unfinished_rows_again(project, replicas, monkeypatch, api_key, tmp_path):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    # One request at a time; the engine answers the first and holds the rest until the killed run is
    # gone, so the first group the run commits (and dies after) holds exactly one answer, however
    # slow the machine. A held request is then dropped unanswered (never billed).
    project.write(
        "models/triage.sql",
        self_hosted_model([engine.openai_base_url]).replace("llm_concurrency = 4", "llm_concurrency = 1"),
    )
    answered, released, answer = itertools.count(), threading.Event(), engine.handle

    def first_then_hold(method, path, headers, body):
        if path.startswith("/v1/chat/completions") and next(answered) >= 1:
            released.wait(timeout=300)  # bounded: a stuck test fails instead of hanging
            return Reply(0, b"", cut="disconnect")
        return answer(method, path, headers, body)

    engine.handle = first_then_hold
    project.dbt("seed")
    project.release_database()
    marker = tmp_path / "marker"
    try:
        killed = dbt_subprocess(
            project, {"DBT_LLM_BATCH_CRASH_AT": "after_realtime_group", "DBT_LLM_BATCH_CRASH_MARKER": str(marker)}
        )
    finally:
        released.set()
        engine.handle = answer
    assert killed.returncode == -9 and marker.read_text() == "after_realtime_group", killed.stdout[-2000:]
    texts = prompts(project)
    stored = {
        row[0]
        for row in project.query(
            """select cast(json_extract_string(key, '$[0]') as integer) from main.llm_batch_requests r
           where exists (select 1 from main.llm_batch_results l where l.custom_id = r.custom_id)"""
        )
    }
    assert len(stored) == 1
    asked_before = dict(engine.counters.realtime_prompts)

    project.dbt("run", "-s", "triage")
    asked_after = {p: n - asked_before.get((f, p), 0) for (f, p), n in engine.counters.realtime_prompts.items()}
    asked_again = {t for t, p in texts.items() if asked_after.get(p, 0) > 0}
    assert asked_again == set(texts) - stored  # only the rows without a stored answer
    assert all(asked_after.get(texts[t], 0) == 1 for t in asked_again)
    rows = table(project)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6] and {r[3] for r in rows.values()} == {"succeeded"}


def test_a_budget_that_ends_before_every_row_started_leaves_the_rest_for_the_next_run(
    project, replicas, monkeypatch, api_key
):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    # One at a time: the first row is answered at once, the second only after 3 s, when the 2 s budget
    # (which began before the first request) has surely passed, however slow the machine: no third
    # request starts. (Held, not refused: a request started in time may finish late.)
    answered, answer = itertools.count(), engine.handle

    def second_is_slow(method, path, headers, body):
        if path.startswith("/v1/chat/completions") and next(answered) == 1:
            threading.Event().wait(3)
        return answer(method, path, headers, body)

    engine.handle = second_is_slow
    project.write(
        "models/triage.sql",
        self_hosted_model([engine.openai_base_url], "llm_realtime_budget_seconds = 2,").replace(
            "llm_concurrency = 4", "llm_concurrency = 1"
        ),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    engine.handle = answer
    done = project.query("select count(*) from main.triage where llm_status = 'succeeded'")[0][0]
    assert done == 2
    waiting = project.query("select count(*), min(error) from main.llm_batch_requests where status = 'voided'")
    assert waiting == [
        (
            6 - done,
            "no answer within the realtime time budget (llm_realtime_budget_seconds=2); sent again by the next run",
        )
    ]
    line = summary_line(project)
    assert f"{6 - done} left for the next run (llm_realtime_budget_seconds)" in line
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert engine.stats()["realtime_requests"]["openai"] == 6  # each row answered once


def test_a_rejected_key_stops_the_run_without_failing_any_row(project, replicas, monkeypatch):
    monkeypatch.setenv("ENGINE_KEY", "sk-wrong-key-0000")
    project.write("models/triage.sql", self_hosted_model([replicas[0].openai_base_url]))
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert (
        f"{replicas[0].openai_base_url} answered HTTP 401: the API key was rejected "
        f"(check ENGINE_KEY, named by llm_api_key_env)"
    ) in message
    assert "sk-wrong-key" not in message and "0000" not in message
    assert project.query("select distinct status from main.llm_batch_requests") == [("voided",)]
    monkeypatch.setenv("ENGINE_KEY", replicas[0]._api_key)
    project.dbt("run", "-s", "triage")  # with the key fixed, every row is answered: none was failed
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]


def test_an_engine_that_is_not_running_fails_fast_with_what_to_do(project, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    project.write("models/triage.sql", self_hosted_model([url]).replace("llm_api_key_env = 'ENGINE_KEY', ", ""))
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert f"cannot connect to {url}" in message
    assert "is the engine running (scripts/engine.sh start), and is llm_base_url right?" in message


def test_a_dead_replica_is_avoided_and_the_live_one_answers_everything(project, replicas, monkeypatch, api_key):
    import socket

    monkeypatch.setenv("ENGINE_KEY", api_key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    project.write("models/triage.sql", self_hosted_model([dead, replicas[0].openai_base_url]))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert replicas[0].stats()["realtime_requests"]["openai"] == 6


def test_a_comment_in_the_realtime_expression_is_harmless(project, emulator):
    project.write(
        "models/triage.sql",
        triage_model(extra_config="llm_realtime_when = \"priority = 'urgent' -- the ones that cannot wait\","),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["realtime_requests"]["openai"] == 2 and batch_counts(emulator) == [4]


def test_retry_after_zero_still_backs_off(project, replicas, monkeypatch, api_key):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    engine.add_fault(endpoint="POST /v1/chat/completions", status_code=503, retry_after=0, times=None)
    project.write(
        "models/triage.sql",
        self_hosted_model([engine.openai_base_url], "llm_realtime_budget_seconds = 2,").replace(
            "llm_concurrency = 4", "llm_concurrency = 1"
        ),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    calls = engine.stats()["calls"]["POST /v1/chat/completions"]
    assert 2 <= calls <= 10, calls  # exponential back-off from 0.5 s, not a tight loop (it was 443 calls)
    assert project.query("select distinct status from main.llm_batch_requests") == [("voided",)]


REALTIME_ENDPOINT = {"openai": "POST /v1/chat/completions", "anthropic": "POST /v1/messages"}
TICKET_1 = "llm_realtime_when = 'ticket_id = 1',"  # one realtime row: which send a fault hits is certain


def billed(emulator, provider, prompt: str) -> int:
    """How many times the sandbox answered (and so billed) this prompt on its realtime endpoint."""
    return emulator.counters.realtime_prompts[(provider, prompt)]


def test_a_reply_lost_after_the_provider_answered_is_sent_once_more_and_counted(project, emulator, provider):
    # The provider answers (and bills) ticket 1, then the connection drops half-way through the reply.
    emulator.add_fault(endpoint=REALTIME_ENDPOINT[provider], kind="truncate", times=1)
    project.write(
        "models/triage.sql", triage_model(provider=provider, extra_config=TICKET_1, where="where ticket_id = 1")
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    prompt = prompts(project, "ticket_id = 1")[1]
    # Sent once more (the answer is wanted now), so billed exactly twice: the lost reply and the answer.
    assert billed(emulator, provider, prompt) == 2
    assert table(project)[1][3:5] == ("succeeded", "realtime")
    # The ledger says one send may have been paid for without an answer, and the views count it.
    assert project.query("select status, possibly_billed from main.llm_batch_requests") == [("succeeded", 1)]
    assert project.query("select sum(possibly_billed) from main.llm_batch_costs where route = 'realtime'") == [(1,)]
    assert project.query("select possibly_billed from main.llm_batch_progress") == [(1,)]
    assert summary_line(project).endswith(
        "1 succeeded, 0 failed, 1 retried, 1 reply(ies) lost after sending (possibly billed)"
    )

    project.dbt("run", "-s", "triage")  # answered: never asked again
    assert billed(emulator, provider, prompt) == 2


def test_a_reply_lost_twice_fails_the_row_and_is_never_sent_a_third_time(project, emulator, provider):
    # Every reply is lost after the provider answered it.
    emulator.add_fault(endpoint=REALTIME_ENDPOINT[provider], kind="truncate", times=None)
    project.write(
        "models/triage.sql",
        triage_model(provider=provider, extra_config=TICKET_1 + " llm_max_attempts = 1,", where="where ticket_id = 1"),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    prompt = prompts(project, "ticket_id = 1")[1]
    assert billed(emulator, provider, prompt) == 2
    status, error = table(project)[1][3], project.query("select llm_error from main.triage")[0][0]
    assert status == "failed"
    assert error == (
        "the reply was lost after the request was sent, 2 time(s) (each may have been billed); "
        "counted as a failed attempt instead of being sent again"
    )
    assert project.query("select status, is_final, possibly_billed from main.llm_batch_requests") == [
        ("failed", True, 2)
    ]
    assert project.query("select sum(rows_failed), sum(possibly_billed) from main.llm_batch_costs") == [(1, 2)]

    project.dbt("run", "-s", "triage")  # the attempt is used up: not sent again, however often dbt runs
    assert billed(emulator, provider, prompt) == 2


def test_only_failures_after_the_request_went_out_count_as_possibly_billed():
    """How an SDK failure is read: the SDKs wrap the HTTP library's error (httpx2) as the cause of
    APIConnectionError / APITimeoutError. Not connected or not written: nothing can have been billed."""
    import httpx2 as httpx
    import openai

    from dbt_llm_batch.providers.realtime_transport import reached_the_provider

    request = httpx.Request("POST", "https://api.example/v1/chat/completions")

    def sdk_error(cause, timeout=False):
        try:
            try:
                raise cause
            except Exception as exc:
                raise (
                    openai.APITimeoutError(request=request) if timeout else openai.APIConnectionError(request=request)
                ) from exc
        except openai.APIConnectionError as exc:
            return exc

    for cause, timeout in (
        (httpx.ConnectError("refused"), False),
        (httpx.ConnectTimeout("slow"), True),
        (httpx.PoolTimeout("busy"), True),
        (httpx.WriteError("reset"), False),
    ):
        assert not reached_the_provider(sdk_error(cause, timeout)), cause
    for cause, timeout in (
        (httpx.ReadTimeout("no answer"), True),
        (httpx.ReadError("reset"), False),
        (httpx.RemoteProtocolError("peer closed connection"), False),
    ):
        assert reached_the_provider(sdk_error(cause, timeout)), cause


def test_auto_concurrency_answers_every_row_and_backs_off_on_429(project, replicas, monkeypatch, api_key):
    """llm_concurrency = 'auto' end to end: the controller (pipeline/concurrency.py, tested against a
    simulated engine in tests/unit) finds its number under the bound and halves it on overload."""
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    engine.add_fault(endpoint="POST /v1/chat/completions", status_code=429, retry_after=0.05, times=2)
    model = self_hosted_model([engine.openai_base_url]).replace(
        "llm_concurrency = 4", "llm_concurrency = 'auto', llm_max_concurrency = 3"
    )
    project.write("models/triage.sql", model)
    run_and_expect_every_row_answered_once(project, engine)
    log = log_text(project)
    settled = re.search(
        r"llm_concurrency 'auto' settled at (\d+) request\(s\) in flight \(started at 3, bound 3; "
        r"the engine said nothing of its load; (\d+) back-off",
        log,
    )
    assert settled, log[-3000:]
    assert 1 <= int(settled.group(1)) <= 3 and int(settled.group(2)) >= 1


def test_auto_starts_where_the_engine_has_room_and_comes_down_to_its_batch(project, replicas, monkeypatch, api_key):
    """llm_concurrency = 'auto' (the default) against an engine that serves vLLM's /metrics: the run starts
    with as many requests in flight as the engine's KV cache holds (8, so all 6 rows at once), reads
    its gauges while sending (every 50 ms here, 1 s by default), and comes down to the engine's batch
    (2) plus half of it (min 2) once requests wait there for a place."""
    from dbt_llm_batch.pipeline import realtime

    monkeypatch.setenv("ENGINE_KEY", api_key)
    monkeypatch.setattr(realtime, "ENGINE_READ_SECONDS", 0.05)
    engine = replicas[0]
    batch = engine.emulate_engine(batch=2, kv_room=8.6)
    engine.realtime_latency = 0.3
    project.write("models/triage.sql", self_hosted_model([engine.openai_base_url]).replace("llm_concurrency = 4, ", ""))
    run_and_expect_every_row_answered_once(project, engine)
    assert batch.peak_in_engine == 6  # all 6 sent at once: the engine said it has room for 8
    assert batch.metrics_reads >= 2  # once before sending, then while sending
    log = log_text(project)
    assert (
        "llm_concurrency 'auto' settled at 4 request(s) in flight (started at 8, bound 64; the engine's "
        "/metrics: KV room for 8, a full batch of 2 with requests waiting; 0 back-off(s) on overload)" in log
    ), log[-3000:]


def test_the_load_of_replicas_is_summed_and_one_silent_replica_silences_it(replicas, api_key):
    from dbt_llm_batch.providers.engine_load import EngineLoad, read_engine_load

    urls = tuple(engine.openai_base_url for engine in replicas)
    replicas[0].emulate_engine(batch=64, kv_room=142.3)
    assert read_engine_load(urls[:1], api_key) == EngineLoad(running=0, waiting=0, room=142)
    assert read_engine_load(urls, api_key) is None  # the second says nothing: its room is unknown
    replicas[1].emulate_engine(batch=32, kv_room=40.0)
    assert read_engine_load(urls, None) == EngineLoad(running=0, waiting=0, room=182)
    assert read_engine_load(("http://127.0.0.1:9/v1",), None) is None  # nothing listening


def test_a_bad_concurrency_is_refused_before_anything_is_sent(project, replicas, monkeypatch, api_key):
    monkeypatch.setenv("ENGINE_KEY", api_key)
    engine = replicas[0]
    project.write(
        "models/triage.sql",
        self_hosted_model([engine.openai_base_url]).replace("llm_concurrency = 4", "llm_concurrency = 'fast'"),
    )
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    assert "llm_concurrency must be an integer, got 'fast'" in str(result.result.results[0].message)
    assert engine.stats()["realtime_requests"]["openai"] == 0
