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


def test_deferred_requests_are_said_to_wait_for_what_holds_them():
    """Under the provider's minimum per batch they wait for more rows, over the caps for the caps; a
    run with both says how many of each."""
    assert "; deferred 5 (in-flight cap)" in RunSummary("m", deferred=5).line()
    fewer = RunSummary("m", deferred=40, under_minimum=40).line()
    assert "; deferred 40 (too few for a batch: waiting for more rows)" in fewer
    both = RunSummary("m", deferred=40, under_minimum=30).line()
    assert "; deferred 40 (30 too few for a batch: waiting for more rows, 10 in-flight cap)" in both
    interrupted = RunSummary("m", deferred=40, under_minimum=30, interrupted=True).line()
    assert "; deferred 40 (the run was interrupted: they wait for the next run)" in interrupted
