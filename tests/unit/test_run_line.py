"""The run line's counts keep their units apart (issue #36's note): `pending` is the model's own
requests in flight; rows whose request is another model's are a clause of their own, in rows."""

from __future__ import annotations

from dbt_llm_batch.pipeline.report import RunSummary


def test_pending_requests_and_rows_waiting_on_another_model_are_counted_apart():
    # 5 requests of its own in flight; 40 rows wait on main.other's requests (which may be fewer).
    summary = RunSummary("main.triage", pending=5, pending_elsewhere={"main.other": 40})
    line = summary.line()
    assert "; pending 5; 40 row(s) wait for requests of main.other in flight" in line, line
    assert "pending 45" not in line


def test_nothing_waiting_elsewhere_adds_no_clause():
    line = RunSummary("main.triage", pending=3).line()
    assert line.endswith("; pending 3"), line
