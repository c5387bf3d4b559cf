"""One run path (#30): a model with variants and one without go through the same steps, so a failed
create or upload, a removed or renamed variant and a missing key behave the same on both. Real dbt
against the sandbox."""

from __future__ import annotations

import collections

import pytest
from conftest import failure_messages
from helpers import log_text, triage_model

CLAUDE = "llm_variants = {'claude': {'llm_provider': 'anthropic', 'llm_model': 'claude-sonnet-4-5'}}"


def billed_twice(emulator) -> dict[str, int]:
    """custom_ids the sandbox billed more than once (every open batch finished first)."""
    emulator.complete_all()
    counts = collections.Counter(b["custom_id"] for b in emulator.billed())
    return {c: n for c, n in counts.items() if n > 1}


def rows_per_key_and_variant(project) -> dict[tuple, int]:
    counts = project.query("select ticket_id, llm_variant, count(*) from main.triage group by 1, 2")
    return {(k, v): n for k, v, n in counts}


def live_requests_per_custom_id(project) -> list:
    return project.query(
        """select custom_id, count(*) from main.llm_batch_requests
           where status in ('deferred', 'queued', 'submitted', 'in_progress', 'held')
           group by 1 having count(*) > 1"""
    )


@pytest.mark.parametrize(
    "fault",
    [
        # The batch is created at the provider; the client sees a 500 (create is never retried).
        dict(endpoint="POST /v1/batches", status_code=500, when="after", times=1),
        # The upload keeps failing until the run's retry budget (1 s) is spent: no batch.
        dict(endpoint="POST /v1/files", status_code=503, times=None),
    ],
    ids=["create-500-after", "upload-503"],
)
def test_a_failed_create_or_upload_with_variants_pays_nothing_twice(project, emulator, fault):
    """#30 item 1: the failed submission's requests stay in its job only (never also deferred), and
    the next runs with a changed selection adopt or void it and send the rest: nothing billed twice,
    one row per (key, variant)."""
    config = CLAUDE + ", llm_retry_budget_seconds = 1,"
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model(extra_config=config))
    emulator.add_fault(kind="http_error", **fault)
    project.dbt("run", "-s", "triage")
    assert live_requests_per_custom_id(project) == []
    assert "in-flight caps are reached" not in log_text(project)
    emulator.clear_faults()
    # A changed selection: the next runs plan again, adopt (or void) the failed submission, send the rest.
    project.write("models/triage.sql", triage_model(extra_config=config, where="where ticket_id > 0"))
    for _ in range(3):
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    assert billed_twice(emulator) == {}
    per_row = rows_per_key_and_variant(project)
    assert sorted(per_row) == sorted((k, v) for k in range(1, 7) for v in ("default", "claude"))
    assert set(per_row.values()) == {1}
    assert project.query("select distinct llm_status from main.triage") == [("succeeded",)]


STRICT = ("--warn-error-options", '{"error": ["JinjaLogWarning"]}')


def test_a_missing_key_with_a_batch_in_flight_is_a_dbt_warning_never_a_traceback(project, emulator, monkeypatch):
    """#30 item 9 (the run): the key unset while a batch is in flight. With no new rows the run merges
    what is final and ends with a dbt warning (--warn-error fails it); with new rows it fails with the
    package's message naming the variable, never the SDK's traceback; nothing is sent either way."""
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 3"))
    project.dbt("run", "-s", "triage")
    key = emulator_key = __import__("os").environ["OPENAI_API_KEY"]
    monkeypatch.delenv("OPENAI_API_KEY")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    warning = next(line for line in log_text(project).splitlines() if "OPENAI_API_KEY is not set" in line)
    assert "[warn ]" in warning or "WARNING" in warning.upper()
    strict = project.dbt("run", "-s", "triage", *STRICT, expect_ok=False)
    assert "OPENAI_API_KEY is not set" in failure_messages(strict)

    project.write("models/triage.sql", triage_model())  # three new rows
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(result)
    assert "OPENAI_API_KEY is not set: export it" in message
    assert "Traceback" not in message and "Missing credentials" not in message
    assert emulator.stats()["request_lines"] == 3

    monkeypatch.setenv("OPENAI_API_KEY", key or emulator_key)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert billed_twice(emulator) == {}


def test_every_variant_s_key_is_checked_before_anything_is_sent(project, emulator, monkeypatch):
    """#30 item 8: a variant's provider key missing fails the run before any variant's batch is sent."""
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model(extra_config=CLAUDE + ","))
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "ANTHROPIC_API_KEY is not set: export it" in message
    assert emulator.stats()["batches_created"] == 0 and emulator.stats()["request_lines"] == 0
    assert project.query("select count(*) from main.llm_batch_requests") == [(0,)]


def test_a_removed_variant_s_deferred_requests_are_voided_and_reported_once(project, emulator):
    """#30 item 7: requests of a variant that waited for the in-flight caps, the variant then removed:
    they are dropped (never sent, nothing paid), said once, and nothing waits for them."""
    terse = "'terse': {'llm_system': 'Category only.'}"
    claude = "'claude': {'llm_provider': 'anthropic', 'llm_model': 'claude-sonnet-4-5'}"
    project.dbt("seed", "-s", "support_tickets")
    capped = "llm_max_batches_in_flight = 1,"
    project.write("models/triage.sql", triage_model(extra_config=f"llm_variants = {{{terse}, {claude}}}, {capped}"))
    project.dbt("run", "-s", "triage")  # one batch (default and terse); claude's 6 wait for the cap
    assert project.query(
        "select variant, count(*) from main.llm_batch_requests where status = 'deferred' group by 1"
    ) == [("claude", 6)]
    emulator.complete_all()
    project.write("models/triage.sql", triage_model(extra_config=f"llm_variants = {{{terse}}}, {capped}"))
    project.dbt("run", "-s", "triage")
    project.dbt("run", "-s", "triage")
    said = [line for line in log_text(project).splitlines() if "of removed variant" in line]
    assert len(said) == 1 and "6 request(s) of removed variant(s) claude" in said[0], said
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(0,)]
    assert "request(s) wait in the ledger" not in log_text(project).split("of removed variant")[-1]
    assert not any(b["face"] == "anthropic" for b in emulator.billed())
    per_row = rows_per_key_and_variant(project)
    assert sorted(per_row) == sorted((k, v) for k in range(1, 7) for v in ("default", "terse"))


def test_a_variant_renamed_in_flight_carries_the_whole_cost_of_its_requests(project, emulator):
    """#30 item 13: 'terse' renamed 'short' while its batch is in flight: the renamed rows point at the
    requests in flight (nothing asked again), and each carries its request's whole cost: the table's
    costs add up to what was billed."""
    project.dbt("seed", "-s", "support_tickets")
    variant = "{'llm_system': 'Category only.'}"
    project.write("models/triage.sql", triage_model(extra_config=f"llm_variants = {{'terse': {variant}}},"))
    project.dbt("run", "-s", "triage")
    project.write("models/triage.sql", triage_model(extra_config=f"llm_variants = {{'short': {variant}}},"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert billed_twice(emulator) == {} and len(emulator.billed()) == 12
    per_row = rows_per_key_and_variant(project)
    assert sorted(per_row) == sorted((k, v) for k in range(1, 7) for v in ("default", "short"))
    costs = dict(project.query("select llm_variant, sum(llm_cost_usd) from main.triage group by 1"))
    asked = dict(project.query("select variant, sum(cost_usd) from main.llm_batch_requests group by 1"))
    assert costs == {"default": asked[""], "short": asked["terse"]} and asked["terse"] > 0
    billed = project.query("select sum(cost_usd) from main.llm_batch_requests where status = 'succeeded'")[0][0]
    assert project.query("select sum(llm_cost_usd) from main.triage")[0][0] == billed


def test_a_run_without_variants_takes_its_figures_from_the_files_as_the_plan_counts_them(
    project, emulator, monkeypatch
):
    """A model without variants takes its figures (requests, estimated cost, files) from its request
    files (send.in_files, no query); they are what variants.written counts over the plan, after the
    files are written and after the in-flight cap left some of them unsent."""
    from dbt_llm_batch.pipeline import send, variants
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    monkeypatch.setattr(OpenAIBatchProvider, "batch_limits", classmethod(lambda cls, config: (2, 200_000_000)))
    seen = []
    from_files = send.in_files

    def both(state, passes, files):
        seen.append((from_files(state, passes, files), variants.written(state.con)))
        return seen[-1][0]

    monkeypatch.setattr(send, "in_files", both)
    project.write("models/triage.sql", triage_model(extra_config="llm_max_batches_in_flight = 2,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert len(seen) == 2, "written, then submitted"
    for fast, planned in seen:
        assert fast == planned
    (requests, cost, files) = seen[0][0][0]
    assert (requests, files) == (4, 2) and cost > 0  # two files of two; the third waits for the cap
