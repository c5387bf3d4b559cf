"""No run leaves a scratch table on the connection dbt gave it: not after a run that fails midway
(a refused upload, a budget refusal), not after a successful one. Real dbt, in-process: the
materialization's call into the runner is wrapped to look at that very connection when the run
returns or raises (dbt keeps using it for the next models of the invocation)."""

from __future__ import annotations

import pytest
from conftest import failure_messages
from helpers import triage_model

from dbt_llm_batch.pipeline import runner
from dbt_llm_batch.pipeline.scratch import Scratch

PRICES = """provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,per_hour,batch_discount,as_of,source
openai,gpt-4o-mini,token,2.00,8.00,0,1.00,,0.5,2026-11-29,test prices
"""
URGENT = "llm_realtime_when = \"priority = 'urgent'\","


def scratch_on(con) -> set[str]:
    tables = con.execute(
        r"select table_name from duckdb_tables() where temporary and table_name like '\_\_llm\_%' escape '\'"
    )
    names = {r[0] for r in tables.fetchall()}
    views = con.execute(
        r"select view_name from duckdb_views() where temporary and view_name like '\_\_llm\_%' escape '\'"
    )
    return names | {r[0] for r in views.fetchall()}


@pytest.fixture
def runs(monkeypatch):
    """One entry per model run: (scratch present when the run began its cleanup, scratch left after it)."""
    seen: list[dict] = []
    run_model, drop_all = runner.run_model, Scratch.drop_all

    def recording_drop_all(self):
        seen.append({"before_cleanup": scratch_on(self.con)})
        drop_all(self)

    def recording_run_model(con, **payload):
        try:
            return run_model(con, **payload)
        finally:
            seen[-1]["left"] = scratch_on(con)

    monkeypatch.setattr(Scratch, "drop_all", recording_drop_all)
    monkeypatch.setattr(runner, "run_model", recording_run_model)
    return seen


def test_a_run_failing_at_upload_leaves_no_scratch_table(project, emulator, runs):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    emulator.add_fault(endpoint="POST /v1/files", kind="http_error", status_code=400, times=1)
    assert not project.dbt("run", "-s", "triage", expect_ok=False).success  # the upload is refused: it raises

    assert len(runs) == 1
    # The run had its plan and request file rows when it failed; all of them are gone.
    assert {Scratch.input, Scratch.desired, Scratch.run_plan, Scratch.sent, Scratch.prices} <= runs[0]["before_cleanup"]
    assert runs[0]["left"] == set()


def test_a_budget_refusal_leaves_no_scratch_table(project, emulator, runs):
    project.write("seeds/llm_prices.csv", PRICES)
    project.dbt("seed")
    project.write(
        "models/triage.sql", triage_model(extra_config="llm_price_table='main.llm_prices', llm_max_cost_usd=0.000001,")
    )
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    assert "nothing was sent" in failure_messages(result)
    assert emulator.stats()["calls"] == {}

    assert len(runs) == 1
    assert {Scratch.input, Scratch.run_plan, Scratch.sent, Scratch.realtime_plan} <= runs[0]["before_cleanup"]
    assert runs[0]["left"] == set()


def test_successful_runs_leave_no_scratch_table(project, emulator, runs):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(extra_config=URGENT))
    project.dbt("run", "-s", "triage")  # batch for most rows, realtime for the urgent ones
    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # harvest and merge

    assert len(runs) == 2
    assert {Scratch.run_plan, Scratch.realtime_plan, Scratch.sent} <= runs[0]["before_cleanup"]
    assert all(run["left"] == set() for run in runs), runs
    succeeded = project.query("select count(*) from main.triage where llm_status = 'succeeded'")[0][0]
    assert succeeded == project.query("select count(*) from main.support_tickets")[0][0]
