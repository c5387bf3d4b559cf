"""Pay once for each distinct request (llm_dedup): rows whose rendered request is identical share one
request; a row whose request was answered already is answered from the ledger, with no provider call.

The workload: rows `id, prompt` whose prompts take fewer distinct values than there are rows
(`question <n>`), a free-text model at test prices. Money is compared, in exact decimals, with what the
sandbox reports it billed (its usage totals, succeeded requests only) at the same prices.
"""

from __future__ import annotations

import collections
from decimal import Decimal

import pytest
from helpers import PRICES, batch_counts, billed_cost, dbt_subprocess, dup_model, prompt_of, write_rows

from dbt_llm_batch.sandbox import expected_answer


def requests_sent(emulator) -> int:
    return sum(batch_counts(emulator))


def table(project, name: str = "dup") -> dict[int, tuple]:
    rows = project.query(
        f"select id, prompt, llm_output, llm_status, llm_error, llm_cost_usd, llm_route from main.{name}"
    )
    return {r[0]: r[1:] for r in rows}


def assert_answers(rows: dict[int, tuple]) -> None:
    """Every row has the sandbox's answer to its own prompt (its answer function, row by row)."""
    for key, (prompt, answer, status, *_rest) in rows.items():
        assert status == "succeeded", (key, status)
        assert answer == expected_answer(None, prompt, None), key


@pytest.fixture
def dup(project, emulator, provider):
    project.write("seeds/llm_prices.csv", PRICES)
    project.write("models/dup.sql", dup_model(provider))
    return project


def run_to_end(project, emulator, model: str = "dup") -> None:
    project.dbt("run", "-s", model)
    emulator.complete_all()
    project.dbt("run", "-s", model)


def test_100_rows_with_40_distinct_prompts_send_40_requests_and_cost_what_was_billed(dup, emulator, provider, capsys):
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)

    assert requests_sent(emulator) == 40
    assert len(emulator.billed()) == 40
    assert collections.Counter(b["prompt"] for b in emulator.billed()) == {prompt_of(n): 1 for n in range(40)}
    rows = table(dup)
    assert len(rows) == 100
    assert_answers(rows)
    # Money: the rows' costs add up to exactly what the 40 requests were billed.
    total = sum(r[4] for r in rows.values())
    assert total == billed_cost(emulator, provider) > 0
    assert {r[5] for r in rows.values()} == {"batch"}  # shared before harvest: not reused
    # A shared request's cost is split equally (to the billionth of a dollar) among its rows.
    shares = collections.defaultdict(set)
    for prompt, _, _, _, cost, _ in rows.values():
        shares[prompt].add(cost)
    assert all(max(c) - min(c) <= Decimal("0.000000001") for c in shares.values())
    # The views count requests and rows apart, and what sharing saved.
    view = dup.query("""select sum(requests_succeeded), sum(rows_answered), sum(rows_reused), sum(cost_usd), sum(dedup_saved_usd),
                               sum(rows_succeeded)
                        from main.llm_batch_costs where model = 'main.dup'""")[0]
    assert view[:4] == (40, 100, 0, total) and view[4] > 0
    assert view[5] == 100, "rows_succeeded counts rows, requests_succeeded the requests that answered them"
    progress = dup.query("select requests_sent, rows_mapped, rows_reused, dedup_saved_usd from main.llm_batch_progress")
    assert progress == [(40, 100, 0, view[4])]
    # `dbt-llm-batch status` shows rows apart from requests, and the money sharing saved.
    from dbt_llm_batch.ops import cli

    dup.release_database()
    capsys.readouterr()
    assert cli.main(["status", "--database", str(dup.db_path), "--wide"]) == 0
    shown = capsys.readouterr().out
    assert "rows_answered" in shown and "rows_reused" in shown and "dedup_saved_usd" in shown and "rows_mapped" in shown


def test_a_second_run_asks_only_new_requests_and_answers_the_rest_from_the_ledger(dup, emulator, provider):
    first = {i: i % 40 for i in range(100)}
    write_rows(dup, first)
    run_to_end(dup, emulator)
    billed_before = billed_cost(emulator, provider)
    # 20 new rows: 10 ask prompts already answered, 10 ask new ones (5 distinct, each twice).
    added = {100 + i: i for i in range(10)} | {110 + i: 40 + i % 5 for i in range(10)}
    write_rows(dup, first | added)
    dup.dbt("run", "-s", "dup")

    assert batch_counts(emulator) == [40, 5], "only the new distinct requests are sent"
    rows = table(dup)
    reused = {k: rows[k] for k in range(100, 110)}
    assert_answers(reused)  # merged in the same run, with no provider call
    assert {(r[4], r[5]) for r in reused.values()} == {(Decimal(0), "reused")}
    assert all(k not in rows for k in range(110, 120))  # still in flight
    assert dup.query("select sum(rows_reused) from main.llm_batch_costs where model = 'main.dup'") == [(10,)]

    emulator.complete_all()
    dup.dbt("run", "-s", "dup")
    rows = table(dup)
    assert len(rows) == 120
    assert_answers(rows)
    assert len(emulator.billed()) == 45
    total = sum(r[4] for r in rows.values())
    assert total == billed_cost(emulator, provider) > billed_before
    assert sum(r[4] for k, r in rows.items() if k < 100) == billed_before  # the first rows' costs are unchanged


def test_a_failing_shared_request_is_retried_once_for_all_its_rows(dup, emulator, provider):
    dup.write("models/dup.sql", dup_model(provider, extra="llm_max_attempts=2"))
    write_rows(dup, {i: i % 40 for i in range(100)})
    # Every attempt of prompt 7 (rows 7, 47 and 87) fails at the provider.
    emulator.add_fault(prompt_contains=prompt_of(7), status_code=500, message="Upstream failure.", times=None)
    for _ in range(3):
        run_to_end(dup, emulator)

    assert batch_counts(emulator) == [40, 1], "retried once, as one request for its three rows"
    rows = table(dup)
    failed = {k: (r[2], r[3]) for k, r in rows.items() if r[2] != "succeeded"}
    assert sorted(failed) == [7, 47, 87]
    assert len(set(failed.values())) == 1 and next(iter(failed.values()))[0] == "failed"
    assert "Upstream failure." in next(iter(failed.values()))[1]
    assert_answers({k: r for k, r in rows.items() if k not in failed})
    # Two attempts in all, each answering the three rows.
    assert dup.query(
        """select count(distinct custom_id), count(*) from main.llm_batch_row_answers
           where fingerprint = (select llm_fingerprint from main.dup where id = 7)"""
    ) == [(2, 6)]


def test_a_run_killed_after_create_with_shared_requests_pays_nothing_twice(dup, emulator, provider, tmp_path):
    dup.write("models/triage.sql", dup_model(provider))  # dbt_subprocess runs `-s triage`
    write_rows(dup, {i: i % 40 for i in range(100)})
    marker = tmp_path / "crash-marker"
    dup.release_database()
    killed = dbt_subprocess(dup, {"DBT_LLM_BATCH_CRASH_AT": "after_create", "DBT_LLM_BATCH_CRASH_MARKER": str(marker)})
    assert killed.returncode == -9, killed.stdout[-2000:]
    assert marker.read_text() == "after_create"

    for _ in range(3):
        dup.dbt("run", "-s", "triage")
        emulator.complete_all()
    dup.dbt("run", "-s", "triage")

    rows = table(dup, "triage")
    assert len(rows) == 100
    assert_answers(rows)
    emulator.complete_all()
    assert collections.Counter(b["prompt"] for b in emulator.billed()) == {prompt_of(n): 1 for n in range(40)}
    assert sum(r[4] for r in rows.values()) == billed_cost(emulator, provider)


def test_dedup_off_sends_one_request_per_row(dup, emulator, provider):
    dup.write("models/dup.sql", dup_model(provider, extra="llm_dedup=false"))
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    assert requests_sent(emulator) == 100
    rows = table(dup)
    assert_answers(rows)
    assert sum(r[4] for r in rows.values()) == billed_cost(emulator, provider)


def test_two_models_sharing_the_ledger_pay_once(dup, emulator, provider):
    for name in ("dup", "dup_twin"):
        dup.write(f"models/{name}.sql", dup_model(provider, extra="llm_dedup='ledger'"))
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    dup.dbt("run", "-s", "dup_twin")  # the same requests: answered from the ledger in this run

    assert requests_sent(emulator) == 40
    twin = table(dup, "dup_twin")
    assert len(twin) == 100
    assert_answers(twin)
    assert {(r[4], r[5]) for r in twin.values()} == {(Decimal(0), "reused")}
    total = sum(r[4] for r in table(dup).values()) + sum(r[4] for r in twin.values())
    assert total == billed_cost(emulator, provider)


def test_temperature_above_zero_turns_dedup_off_by_default_and_says_so(dup, emulator, provider):
    dup.write("models/dup.sql", dup_model(provider, extra="llm_temperature=0.7"))
    write_rows(dup, {i: i % 4 for i in range(10)})
    dup.dbt("run", "-s", "dup")
    assert requests_sent(emulator) == 10
    log = (dup.root / "logs" / "dbt.log").read_text()
    assert log.count("llm_temperature is above 0, so identical requests are sent once per row") == 1


def test_dry_run_counts_distinct_requests_and_duplicates(dup, emulator, provider):
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    write_rows(dup, {i: i % 40 for i in range(100)} | {100 + i: i for i in range(10)} | {110: 50, 111: 50})
    dup.dbt("run", "-s", "dup", "--vars", "{llm_batch_dry_run: true}")
    log = (dup.root / "logs" / "dbt.log").read_text()
    assert "DRY RUN: would submit 1 request(s) in 1 batch(es)" in log
    assert "1 row(s) duplicate another row's request and 10 a stored answer" in log
    assert requests_sent(emulator) == 40


def test_a_ledger_of_the_previous_version_merges_the_same_rows_and_asks_nothing(dup, emulator, provider):
    # A ledger as the previous version left it: one request per row (llm_dedup=false is exactly that),
    # at schema version 13 (no row answers).
    dup.write("models/dup.sql", dup_model(provider, extra="llm_dedup=false"))
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    before = sorted(dup.query("select * from main.dup"))
    dup.query("drop view main.llm_batch_progress")
    dup.query("drop view main.llm_batch_costs")
    dup.query("drop table main.llm_batch_row_answers")
    dup.query("alter table main.llm_batch_models drop column config_snapshot")  # migration 15 (the poller)
    dup.query("alter table main.llm_batch_jobs drop column output_schema")  # migration 18
    dup.query("delete from main.llm_batch_meta where schema_version > 13")
    dup.query("update main.llm_batch_requests set emitted = 'merged' where is_final")  # as 0.2.0's merge left them
    calls = emulator.stats()["calls"]

    dup.write("models/dup.sql", dup_model(provider))  # upgraded, with the default llm_dedup
    dup.dbt("run", "-s", "dup")
    assert sorted(dup.query("select * from main.dup")) == before
    dup.dbt("run", "-s", "dup", "--full-refresh")
    assert sorted(dup.query("select * from main.dup")) == before
    assert emulator.stats()["calls"] == calls, "no provider call"


def test_edits_between_runs_re_ask_each_distinct_request_once(dup, emulator, provider):
    """Under change: a new system prompt re-asks the 40 distinct requests (not the 100 rows), and
    changing the system back shows the stored answers again with no call."""
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    assert requests_sent(emulator) == 40

    dup.write("models/dup.sql", dup_model(provider, extra="llm_system='Answer in one word.'"))
    run_to_end(dup, emulator)
    assert requests_sent(emulator) == 80  # 40 more: one per distinct request under the new system
    rows = table(dup)
    assert len(rows) == 100
    for key, (prompt, answer, status, *_rest) in rows.items():
        assert status == "succeeded" and answer == expected_answer("Answer in one word.", prompt, None), key

    dup.write("models/dup.sql", dup_model(provider))  # back: the stored answers, nothing sent
    dup.dbt("run", "-s", "dup")
    assert requests_sent(emulator) == 80
    assert_answers(table(dup))


def test_a_key_change_with_shared_requests_asks_nothing_again(dup, emulator, provider):
    """Under change: the unique_key becomes another column of the same rows; shared answers follow."""
    write_rows(dup, {i: i % 40 for i in range(100)})
    run_to_end(dup, emulator)
    dup.write(
        "models/dup.sql",
        dup_model(provider)
        .replace("unique_key='id'", "unique_key='ref'")
        .replace("select * from", "select 'T-' || id as ref, prompt from"),
    )
    dup.dbt("run", "-s", "dup", "--full-refresh")
    assert requests_sent(emulator) == 40
    rows = dup.query("select ref, prompt, llm_output, llm_status from main.dup")
    # Each ref once, with its own row's prompt (rows sharing a request once took its row's key: 100
    # rows, of 40 refs).
    assert sorted(r for r, *_ in rows) == sorted(f"T-{i}" for i in range(100))
    assert all(p == prompt_of(int(r.removeprefix("T-")) % 40) for r, p, *_ in rows), rows
    assert all(s == "succeeded" and o == expected_answer(None, p, None) for _, p, o, s in rows)
