"""Project-wide claims under dbt's threads: models that run in parallel (the integration project's
profile runs 4 threads, as dbt does by default) share one project budget and one request per shared
prompt, exactly as they do when they run one after another.

The workload: rows `id, prompt` (helpers.write_rows), free-text models at the test prices, OpenAI's face
of the sandbox. What was sent and billed is read from the sandbox, not from the package's own ledger.

dbt starts the models together, but whether their steps overlap is up to the scheduler. The tests make
the worst order certain: a barrier after a step (the budget check, the plan) holds each model there
until every model has done it, so none records or sends anything before all have decided.
"""

from __future__ import annotations

import functools
import threading
from decimal import Decimal

import duckdb
import pytest
from conftest import failure_messages
from helpers import PRICE, PRICES, batch_counts, billed_cost, dup_model, log_text, prompt_of, write_rows

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.status import JobStatus
from dbt_llm_batch.ledger.store import SCHEMA_VERSION
from dbt_llm_batch.pipeline import budget, merge, plan, sharing

MODELS = ("spend_a", "spend_b", "spend_c")
# One model's plan: 5 requests of about 22 estimated input tokens (prompt and request overhead) and
# llm_max_tokens = 50 output tokens at $2 / $8 per million, half price in batch:
# 5 * (22 * 2 + 50 * 8) / 2 / 1e6 = $0.00111.
ESTIMATE = Decimal("0.00111")
# Room for one model's plan, not two.
LIMIT = "0.0016"


def all_wait_after(monkeypatch, module, name: str, parties: int) -> None:
    """Each call of module.name waits, once it returned or raised, until `parties` calls have."""
    barrier = threading.Barrier(parties)
    step = getattr(module, name)

    @functools.wraps(step)
    def together(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        finally:
            barrier.wait(timeout=120)  # a broken order fails the test, it never hangs it

    monkeypatch.setattr(module, name, together)


@pytest.fixture
def spend(project, emulator):
    project.write("seeds/llm_prices.csv", PRICES)
    for name in MODELS:
        project.write(f"models/{name}.sql", dup_model("openai"))
    write_rows(project, {i: i for i in range(5)})
    return project


def submitted_models(project) -> list[str]:
    return [r[0] for r in project.query("select distinct model from main.llm_batch_requests order by 1")]


def refusals(result) -> list[str]:
    return [line for line in failure_messages(result).splitlines() if "refusing to submit" in line]


def test_models_running_in_parallel_stay_within_the_project_budget(spend, emulator, monkeypatch):
    all_wait_after(monkeypatch, budget, "check_budget", parties=3)
    result = spend.dbt("run", "-s", *MODELS, "--vars", f"{{llm_batch_max_cost_usd: {LIMIT}}}", expect_ok=False)

    assert batch_counts(emulator) == [5], "one model's plan fits the budget, two do not"
    assert len(submitted_models(spend)) == 1
    assert len(refusals(result)) == 2
    committed = spend.query("select sum(estimated_cost_usd) from main.llm_batch_requests where status = 'queued'")
    assert committed == [(ESTIMATE,)]
    assert committed[0][0] <= Decimal(LIMIT)


def test_a_refusal_under_threads_leaves_the_tables_and_the_ledger_consistent(spend, emulator, monkeypatch):
    with monkeypatch.context() as patch:
        all_wait_after(patch, budget, "check_budget", parties=3)
        spend.dbt("run", "-s", *MODELS, "--vars", f"{{llm_batch_max_cost_usd: {LIMIT}}}", expect_ok=False)
    (sent,) = (m.removeprefix("main.") for m in submitted_models(spend))
    refused = [m for m in MODELS if m != sent]
    # Nothing of the refused models is in the ledger, and no reservation outlives the run.
    assert spend.query("select count(*) from main.llm_batch_row_answers where model not like ?", [f"%{sent}"]) == [(0,)]
    assert spend.query("select count(*) from main.llm_batch_reservations") == [(0,)]
    assert spend.query("select model, status, count(*) from main.llm_batch_requests group by all") == [
        (f"main.{sent}", "queued", 5)
    ]
    for name in MODELS:  # every table made, and no row final yet
        assert spend.query(f"select count(*) from main.{name}") == [(0,)], name

    # The budget raised: the refused models send their requests once, and every row lands at what was billed.
    emulator.complete_all()
    spend.dbt("run", "-s", *MODELS, "--vars", "{llm_batch_max_cost_usd: 1}")
    emulator.complete_all()
    spend.dbt("run", "-s", *MODELS)
    assert sorted(batch_counts(emulator)) == [5, 5, 5]
    total = Decimal(0)
    for name in (sent, *refused):
        rows = spend.query(f"select llm_status, llm_cost_usd from main.{name}")
        assert [r[0] for r in rows] == ["succeeded"] * 5, name
        total += sum(r[1] for r in rows)
    assert total == billed_cost(emulator, "openai")


def test_with_one_thread_the_second_and_third_models_are_refused(spend, emulator):
    result = spend.dbt(
        "run", "-s", *MODELS, "--threads", "1", "--vars", f"{{llm_batch_max_cost_usd: {LIMIT}}}", expect_ok=False
    )

    assert batch_counts(emulator) == [5]
    assert submitted_models(spend) == ["main.spend_a"]  # dbt's order with one thread
    assert len(refusals(result)) == 2
    assert "plus $0.001110 already in flight exceeds var llm_batch_max_cost_usd" in failure_messages(result)


def write_two_sharing_models(project) -> None:
    """dup and dup_twin ask the same 40 prompts over 100 rows each, sharing requests (llm_dedup = 'ledger')."""
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "dup_twin"):
        project.write(f"models/{name}.sql", dup_model("openai", extra="llm_dedup='ledger'"))
    write_rows(project, {i: i % 40 for i in range(100)})


def test_two_models_sharing_the_ledger_under_threads_send_each_request_once(project, emulator, monkeypatch):
    """Both models planned before either recorded anything, and the one that claimed second does not
    wait for the other to record them (the barrier holds that one until both planned, so waiting
    could only end at RECORD_WAIT_SECONDS): its rows are left for its next run."""
    write_two_sharing_models(project)

    with monkeypatch.context() as patch:
        patch.setattr(sharing, "RECORD_WAIT_SECONDS", 0)
        all_wait_after(patch, plan, "build_plan", parties=2)
        project.dbt("run", "-s", "dup", "dup_twin")
    assert sum(batch_counts(emulator)) == 40, "each shared request is sent once in the project run"
    assert project.query("select count(*) from main.llm_batch_request_claims") == [(0,)]
    assert "40 request(s) are being sent by another model running now" in log_text(project)
    emulator.complete_all()
    project.dbt("run", "-s", "dup", "dup_twin")  # the sender harvests; the other points its rows at its requests
    project.dbt("run", "-s", "dup", "dup_twin")  # (answered, if the sender had not harvested when it planned)

    assert sum(batch_counts(emulator)) == 40
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def test_a_model_planning_while_another_records_the_shared_requests_points_its_rows_at_them(
    project, emulator, monkeypatch
):
    """The other order: dup_twin planned before dup recorded its requests (so its plan still has them),
    and claims them after: its rows point at dup's requests in this same run, nothing is sent twice."""
    write_two_sharing_models(project)
    twin_planned, dup_recorded = threading.Event(), threading.Event()
    claim, record = Ledger.claim_requests, Ledger.write_intents

    def claim_in_order(ledger, *args, **kwargs):
        if ledger.model == "main.dup_twin":  # its plan is made; it claims once dup has recorded its own
            twin_planned.set()
            assert dup_recorded.wait(timeout=120)
        else:
            assert twin_planned.wait(timeout=120)
        return claim(ledger, *args, **kwargs)

    def record_and_say(ledger, *args, **kwargs):
        try:
            return record(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup":
                dup_recorded.set()

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "claim_requests", claim_in_order)
        patch.setattr(Ledger, "write_intents", record_and_say)
        project.dbt("run", "-s", "dup", "dup_twin")

    assert batch_counts(emulator) == [40]
    assert twin_rows_on_dups_requests(project) == [(100, 40)], (
        "every row of dup_twin points at dup's request for its prompt"
    )
    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "dup_twin")
    assert batch_counts(emulator) == [40]
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def dup_claims_before_the_twin():
    """(a stand-in for Ledger.claim_requests making dup_twin claim only after dup has claimed, the
    event set once dup_twin has claimed)."""
    dup_claimed, twin_claimed = threading.Event(), threading.Event()
    claim = Ledger.claim_requests

    def claim_in_order(ledger, *args, **kwargs):
        if ledger.model == "main.dup_twin":
            assert dup_claimed.wait(timeout=120)
            try:
                return claim(ledger, *args, **kwargs)
            finally:
                twin_claimed.set()
        try:
            return claim(ledger, *args, **kwargs)
        finally:
            dup_claimed.set()

    return claim_in_order, twin_claimed


def test_a_model_that_claims_after_another_waits_for_its_requests_and_its_rows_are_pending_at_once(
    project, emulator, monkeypatch
):
    """dup_twin claims the shared requests after dup claimed them and before dup recorded them: it asks
    again until dup has, then points its rows at dup's requests in this same run. So its rows are
    pending in its own model from this run on (they were left for its next run, "pending 0")."""
    write_two_sharing_models(project)
    claim_in_order, twin_claimed = dup_claims_before_the_twin()
    record = Ledger.write_intents

    def record_after_the_twin_claimed(ledger, *args, **kwargs):
        if ledger.model == "main.dup":  # the twin's first claim finds dup's claim, not its requests
            assert twin_claimed.wait(timeout=120)
        return record(ledger, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "claim_requests", claim_in_order)
        patch.setattr(Ledger, "write_intents", record_after_the_twin_claimed)
        project.dbt("run", "-s", "dup", "dup_twin")

    assert batch_counts(emulator) == [40]
    assert "being sent by another model running now" not in log_text(project)
    assert twin_rows_on_dups_requests(project) == [(100, 40)], (
        "every row of dup_twin points at dup's request for its prompt"
    )
    assert project.query("select model, rows_pending from main.llm_batch_progress order by model") == [
        ("main.dup", 100),
        ("main.dup_twin", 100),
    ]
    assert "main.dup_twin: submitted 0 request(s)" in log_text(project)
    assert "pending 0; 100 row(s) wait for requests of main.dup in flight" in log_text(project)
    emulator.complete_all()
    project.dbt("run", "-s", "dup_twin")  # harvests dup's batch for its own rows
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [40]
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def test_a_model_waiting_for_requests_another_claimed_sends_them_when_that_run_fails_before_recording(
    project, emulator, monkeypatch
):
    """dup claims the shared requests and its run fails before it records them, while dup_twin waits
    for them (sharing.RECORD_WAIT_SECONDS): dup's claim ends with its run, so dup_twin claims them and
    sends them itself, once; dup's next run answers its rows from dup_twin's requests."""
    write_two_sharing_models(project)
    claim_in_order, twin_claimed = dup_claims_before_the_twin()
    record = Ledger.write_intents

    def fail_after_the_twin_claimed(ledger, *args, **kwargs):
        if ledger.model == "main.dup":
            assert twin_claimed.wait(timeout=120)
            raise RuntimeError("dup's run dies before recording its requests")
        return record(ledger, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "claim_requests", claim_in_order)
        patch.setattr(Ledger, "write_intents", fail_after_the_twin_claimed)
        project.dbt("run", "-s", "dup", "dup_twin", expect_ok=False)

    assert batch_counts(emulator) == [40], "dup_twin sent the shared requests, once"
    assert "being sent by another model running now" not in log_text(project), "it waited, then sent them"
    assert project.query("select model, count(*) from main.llm_batch_requests group by model") == [
        ("main.dup_twin", 40)
    ], "dup recorded nothing"
    assert project.query("select rows_pending from main.llm_batch_progress where model = 'main.dup_twin'") == [(100,)]
    emulator.complete_all()
    project.dbt("run", "-s", "dup_twin")
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [40], "dup's rows are answered from dup_twin's requests"
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def test_urgent_rows_do_not_wait_for_a_batch_another_model_claimed(project, emulator, monkeypatch):
    """dup claims the 40 shared requests for its batch; dup_twin's rows of prompts 0-9 are urgent
    (llm_realtime_when). Another model's batch does not answer an urgent row, claimed or recorded, so
    dup_twin sends those 10 in realtime at once, without waiting for dup's claim to end, and points its
    other rows at dup's requests. dup's run holds, its requests recorded, until dup_twin has claimed:
    had dup_twin waited for dup's claim, it would have given up (the wait is cut to 2 s) and left its
    urgent rows for a later run."""
    project.write("seeds/llm_prices.csv", PRICES)
    project.write("models/dup.sql", dup_model("openai", extra="llm_dedup='ledger'"))
    project.write("models/dup_twin.sql", dup_model("openai", extra="llm_dedup='ledger', llm_realtime_when='id < 10'"))
    write_rows(project, {i: i % 40 for i in range(100)})
    claim_in_order, _ = dup_claims_before_the_twin()
    twin_shared = threading.Event()
    record, claim_shared = Ledger.write_intents, sharing.claim_shared

    def twin_claims_then_says(ledger, *args, **kwargs):
        try:
            return claim_shared(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup_twin":
                twin_shared.set()

    def record_then_hold(ledger, *args, **kwargs):
        try:
            return record(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup":  # its claim lasts until its run ends
                assert twin_shared.wait(timeout=120)

    with monkeypatch.context() as patch:
        patch.setattr(sharing, "RECORD_WAIT_SECONDS", 2)
        patch.setattr(Ledger, "claim_requests", claim_in_order)
        patch.setattr(Ledger, "write_intents", record_then_hold)
        patch.setattr(sharing, "claim_shared", twin_claims_then_says)
        project.dbt("run", "-s", "dup", "dup_twin")

    assert "being sent by another model running now" not in log_text(project)
    assert batch_counts(emulator) == [40], "dup's batch; dup_twin sent none"
    realtime = [b["prompt"] for b in emulator.billed() if b["via"] == "realtime"]
    assert sorted(realtime) == sorted(prompt_of(n) for n in range(10)), "each urgent prompt once, in realtime"
    urgent = project.query(
        "select count(*), count(*) filter (where llm_status = 'succeeded') from main.dup_twin where id % 40 < 10"
    )
    assert urgent == [(30, 30)], "dup_twin's rows of the urgent prompts are answered in this run"
    assert twin_rows_on_dups_requests(project) == [(70, 30)], "its other rows point at dup's requests"
    emulator.complete_all()
    project.dbt("run", "-s", "dup_twin")
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [40] and len(realtime) == 10
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def test_urgent_rows_of_two_models_sharing_a_realtime_request_are_asked_once_and_both_answered_in_the_run(
    project, emulator, monkeypatch
):
    """Both models' rows of prompts 0-9 are urgent. dup claims the 10 shared requests for realtime (and
    the other 30 for its batch) and records them; dup_twin claims them while dup's realtime requests are
    still unanswered: it sends none of them again (a shared request is one request everywhere, sent in
    realtime if one of its rows is urgent: docs/costs.md, Deduplication, "Retries, caps, realtime"), and
    its urgent rows are answered and merged in this same run like dup's ("sent in the same run ... and
    merged at the end of that run": docs/guides/realtime.md; docs/configuration.md, llm_realtime_when):
    dup_twin waits for dup's realtime answers before it merges, within its realtime budget
    (docs/costs.md, "Another model's request in flight"). dup's sending holds, its requests recorded,
    until dup_twin has merged (at most 5 s: a dup_twin that waits for dup's answers, as it must, lets
    dup go on then), so a dup_twin that merged without them is seen. Before the wait, dup_twin merged
    at once and its 30 urgent rows landed a run later."""
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "dup_twin"):
        project.write(
            f"models/{name}.sql", dup_model("openai", extra="llm_dedup='ledger', llm_realtime_when='id % 40 < 10'")
        )
    write_rows(project, {i: i % 40 for i in range(100)})
    claims_seen = run_while_dup_holds_its_realtime_sending(project, monkeypatch)

    assert claims_seen == [[("main.dup", "batch", 30), ("main.dup", "realtime", 10)]], (
        "dup_twin claimed while dup's claims stood, and took none: each names its route"
    )
    assert "being sent by another model running now" not in log_text(project)
    assert project.query("select model, route, count(*) from main.llm_batch_requests group by all order by all") == [
        ("main.dup", "batch", 30),
        ("main.dup", "realtime", 10),
    ], "dup_twin sent nothing of its own"
    assert batch_counts(emulator) == [30]
    realtime = [b["prompt"] for b in emulator.billed() if b["via"] == "realtime"]
    assert sorted(realtime) == sorted(prompt_of(n) for n in range(10)), "each urgent prompt once, in realtime"
    assert twin_rows_on_dups_requests(project) == [(100, 40)], "every row of dup_twin points at dup's request"
    for name in ("dup", "dup_twin"):
        urgent = project.query(
            f"""select count(*), count(*) filter (where llm_status = 'succeeded' and llm_route = 'realtime')
                from main.{name} where id % 40 < 10"""
        )
        assert urgent == [(30, 30)], f"{name}'s urgent rows are answered in this run"
    assert "main.dup_twin: waited" in log_text(project) and "still wait" not in log_text(project)
    emulator.complete_all()
    project.dbt("run", "-s", "dup_twin")
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [30] and len([b for b in emulator.billed() if b["via"] == "realtime"]) == 10
    assert_both_tables_answered_at_the_billed_cost(project, emulator)


def test_a_v31_ledger_with_a_batch_in_flight_migrates_and_its_claims_name_their_route(project, emulator):
    """The ledger schema version 31 left, with dup's batch in flight: migrations 32 to 34 only added
    llm_batch_request_claims.route, llm_batch_models.merged_into and llm_batch_jobs.provider_options,
    so dropping them (and the version rows) gives that ledger. Both
    models then run together: migrated, dup_twin's rows point at dup's requests in flight, nothing is
    sent twice, and the claims left behind name no route (the run's claims end with it)."""
    write_two_sharing_models(project)
    project.dbt("run", "-s", "dup")
    project.release_database()
    with duckdb.connect(str(project.db_path)) as con:
        con.execute("alter table main.llm_batch_request_claims drop column route")
        con.execute("alter table main.llm_batch_models drop column merged_into")  # migration 33's
        con.execute("alter table main.llm_batch_jobs drop column provider_options")  # migration 34's
        con.execute("delete from main.llm_batch_meta where schema_version >= 32")
        assert con.execute("select max(schema_version) from main.llm_batch_meta").fetchall() == [(31,)]
    project.dbt("run", "-s", "dup", "dup_twin")
    assert project.query("select max(schema_version) from main.llm_batch_meta") == [(SCHEMA_VERSION,)]
    assert project.query(
        "select count(*) from information_schema.columns where table_name = 'llm_batch_request_claims' and column_name = 'route'"
    ) == [(1,)]
    assert batch_counts(emulator) == [40]
    assert project.query("select rows_pending from main.llm_batch_progress order by model") == [(100,), (100,)]
    emulator.complete_all()
    project.dbt("run", "-s", "dup", "dup_twin")
    project.dbt("run", "-s", "dup", "dup_twin")
    assert batch_counts(emulator) == [40]
    assert_both_tables_answered_at_the_billed_cost(project, emulator)
    # Each model's merges since the migration recorded the table they wrote (merge.py trusts its marks for it).
    assert project.query("select model, merged_into from main.llm_batch_models order by model") == [
        ("main.dup", "main.dup"),
        ("main.dup_twin", "main.dup_twin"),
    ]


def twin_rows_on_dups_requests(project) -> list[tuple]:
    """[(dup_twin's row answers pointing at dup's requests, how many requests of dup they point at)]."""
    return project.query(
        """select count(*), count(distinct r.custom_id) from main.llm_batch_row_answers a
           join main.llm_batch_requests r using (custom_id) where a.model = 'main.dup_twin' and r.model = 'main.dup'"""
    )


def assert_both_tables_answered_at_the_billed_cost(project, emulator) -> None:
    """Every row of dup and dup_twin succeeded, and their tables' costs add up to what the sandbox billed
    (at the test prices: a batch line at half price, a realtime call at list price)."""
    total = Decimal(0)
    for name in ("dup", "dup_twin"):
        rows = project.query(f"select llm_status, llm_cost_usd from main.{name}")
        assert len(rows) == 100 and {r[0] for r in rows} == {"succeeded"}, name
        total += sum(r[1] for r in rows)
    price_in, price_out = PRICE["openai"]
    billed = sum(
        (b["usage"]["prompt_tokens"] * price_in + b["usage"]["completion_tokens"] * price_out)
        / Decimal(1_000_000)
        * (Decimal("0.5") if b["via"] == "batch" else 1)
        for b in emulator.billed()
    )
    assert total == billed


def test_urgent_rows_of_every_variant_sharing_another_model_s_realtime_request_are_answered_in_the_run(
    project, emulator, monkeypatch
):
    """The scenario of the test above, where dup_twin is an evaluation run: its variant 'twin' names
    its llm_max_tokens, the model's own value, so both its variants ask exactly dup's requests (a
    variant's requests are its config's: the variant's name is not part of the fingerprint, and
    identical variants share their requests, docs/guides/evaluate.md; with llm_dedup = 'ledger', also
    another model's, docs/costs.md, Deduplication). Every row of prompts 0-9 is urgent in both models.
    dup claims and records the 10 shared realtime requests first and holds its sending until dup_twin
    has merged (at most 5 s): dup_twin sends nothing, waits for dup's realtime answers before it
    merges, and the urgent rows of each of its variants are answered in this run, each urgent prompt
    billed once."""
    project.write("seeds/llm_prices.csv", PRICES)
    urgent = "llm_dedup='ledger', llm_realtime_when='id % 40 < 10'"
    project.write("models/dup.sql", dup_model("openai", extra=urgent))
    project.write(
        "models/dup_twin.sql", dup_model("openai", extra=f"{urgent}, llm_variants={{'twin': {{'llm_max_tokens': 50}}}}")
    )
    write_rows(project, {i: i % 40 for i in range(100)})
    claims_seen = run_while_dup_holds_its_realtime_sending(project, monkeypatch)

    assert claims_seen and all(c == [("main.dup", "batch", 30), ("main.dup", "realtime", 10)] for c in claims_seen), (
        f"dup_twin claimed while dup's claims stood, and took none: {claims_seen}"
    )
    assert "being sent by another model running now" not in log_text(project)
    assert project.query("select model, route, count(*) from main.llm_batch_requests group by all order by all") == [
        ("main.dup", "batch", 30),
        ("main.dup", "realtime", 10),
    ], "dup_twin sent nothing of its own, for either variant"
    assert batch_counts(emulator) == [30]
    realtime = [b["prompt"] for b in emulator.billed() if b["via"] == "realtime"]
    assert sorted(realtime) == sorted(prompt_of(n) for n in range(10)), "each urgent prompt once, in realtime"
    assert twin_rows_on_dups_requests(project) == [(200, 40)], "every row of each variant points at dup's request"
    answered_now = "count(*) filter (where llm_status = 'succeeded' and llm_route = 'realtime')"
    assert project.query(f"select count(*), {answered_now} from main.dup where id % 40 < 10") == [(30, 30)]
    assert project.query(
        f"select llm_variant, count(*), {answered_now} from main.dup_twin where id % 40 < 10 group by 1 order by 1"
    ) == [("default", 30, 30), ("twin", 30, 30)], "each variant's urgent rows are answered in this run"
    assert "main.dup_twin: waited" in log_text(project) and "still wait" not in log_text(project)

    emulator.complete_all()
    project.dbt("run", "-s", "dup_twin")
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [30] and len([b for b in emulator.billed() if b["via"] == "realtime"]) == 10
    assert project.query("select llm_status, count(*) from main.dup group by 1") == [("succeeded", 100)]
    assert project.query("select llm_variant, llm_status, count(*) from main.dup_twin group by all order by all") == [
        ("default", "succeeded", 100),
        ("twin", "succeeded", 100),
    ]
    # The tables' costs (a shared request's cost split among every row it answers, in both models and
    # both variants) add up to what the sandbox billed at the test prices, batch at half price.
    total = sum(project.query(f"select sum(llm_cost_usd) from main.{name}")[0][0] for name in ("dup", "dup_twin"))
    price_in, price_out = PRICE["openai"]
    billed = sum(
        (b["usage"]["prompt_tokens"] * price_in + b["usage"]["completion_tokens"] * price_out)
        / Decimal(1_000_000)
        * (Decimal("0.5") if b["via"] == "batch" else 1)
        for b in emulator.billed()
    )
    assert total == billed > 0


def run_while_dup_holds_its_realtime_sending(project, monkeypatch) -> list[list[tuple]]:
    """`dbt run -s dup dup_twin` with dup claiming first (dup_claims_before_the_twin) and, once it has
    recorded its realtime requests, holding their sending until dup_twin has merged (at most 5 s), so
    a dup_twin that merges without dup's realtime answers is seen. Returns the claims standing
    (model, route, count) when each of dup_twin's claims ended (one per variant)."""
    claim_in_order, _ = dup_claims_before_the_twin()
    twin_shared, twin_merged = threading.Event(), threading.Event()
    claims_seen: list[list[tuple]] = []
    record, claim_shared, merge_model = Ledger.write_intents, sharing.claim_shared, merge.merge

    def twin_claims_then_says(ledger, *args, **kwargs):
        try:
            return claim_shared(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup_twin":
                claims_seen.append(
                    ledger.con.execute(
                        "select model, route, count(*) from main.llm_batch_request_claims group by all order by all"
                    ).fetchall()
                )
                twin_shared.set()

    def record_then_hold(ledger, *args, **kwargs):
        try:
            return record(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup" and kwargs.get("status") == JobStatus.REALTIME:
                assert twin_shared.wait(timeout=120), "dup_twin claims while dup's realtime requests are unsent"
                twin_merged.wait(timeout=5)

    def merge_then_say(ledger, *args, **kwargs):
        try:
            return merge_model(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup_twin":
                twin_merged.set()

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "claim_requests", claim_in_order)
        patch.setattr(Ledger, "write_intents", record_then_hold)
        patch.setattr(sharing, "claim_shared", twin_claims_then_says)
        patch.setattr(merge, "merge", merge_then_say)
        project.dbt("run", "-s", "dup", "dup_twin")
    return claims_seen
