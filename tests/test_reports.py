"""Reports that read right: the status command's cost rows name their route; `dbt run-operation
dbt_llm_batch.status` has a cost section with dollar amounts, never `0E-9`; the run line says what the
harvested batches cost and what the realtime rows cost, apart; a dry run's result says DRY RUN; the
lock message of a CLI command speaks of that command; a schema change names only the difference."""

from __future__ import annotations

import re

from conftest import failure_messages
from helpers import command, file_held_by_another_process, log_text, triage_model

URGENT = "llm_realtime_when = \"priority = 'urgent'\","


def summary_lines(project) -> list[str]:
    return [line for line in log_text(project).splitlines() if "main.triage: submitted" in line]


def test_costs_name_their_route_and_the_run_line_keeps_them_apart(project, emulator, capsys):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(extra_config=URGENT))
    project.dbt("run", "-s", "triage")  # the urgent rows are answered now, the rest go in a batch
    first = summary_lines(project)[-1]
    assert "harvested 0 batch(es) (cost $0.000000, saved $0.000000 vs realtime)" in first
    realtime_cost = project.query("select sum(cost_usd) from main.llm_batch_requests where route = 'realtime'")[0][0]
    assert realtime_cost > 0
    assert re.search(rf"; realtime 2 request\(s\) in [\d.]+ s \(cost \${realtime_cost:.6f}\): 2 succeeded", first), (
        first
    )
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    second = summary_lines(project)[-1]
    batch_cost = project.query("select sum(cost_usd) from main.llm_batch_requests where route = 'batch'")[0][0]
    assert f"harvested 1 batch(es) (cost ${batch_cost:.6f}, saved $" in second and "realtime " not in second

    rc, out, _ = command(project, capsys, "status")
    assert rc == 0
    costs = out.split("Cost per model, day and route")[1]
    header = next(line for line in costs.splitlines() if "model" in line and "route" in line)
    assert header.split("│").index(next(c for c in header.split("│") if c.strip() == "route")) > 0
    assert "│ batch " in costs and "│ realtime " in costs

    project.release_database()
    project.dbt("run-operation", "dbt_llm_batch.status")
    log = log_text(project).split("Cost per model, day and route")[-1]
    assert "route=batch" in log and "route=realtime" in log
    assert f"cost_usd=${batch_cost:.6f}" in log and "committed_not_billed_usd=$0.000000" in log
    assert "0E-9" not in log_text(project)


def test_a_dry_run_says_dry_run_not_ok(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    result = project.dbt("run", "-s", "triage", "--vars", "{llm_batch_dry_run: true}")
    assert [r.message for r in result.result.results] == ["DRY RUN"]
    assert re.search(
        r"OK created sql llm_batch model main\.triage \.+ \[(\x1b\[\d+m)?DRY RUN(\x1b\[0m)? in ", log_text(project)
    )
    assert emulator.stats()["calls"] == {}
    result = project.dbt("run", "-s", "triage")
    assert [r.message for r in result.result.results] == ["OK"]


def test_the_lock_message_of_a_cli_command_speaks_of_that_command(project, tmp_path, capsys):
    path = tmp_path / "held.duckdb"
    from dbt_llm_batch.ops.cli import main as cli

    with file_held_by_another_process(path):
        capsys.readouterr()
        unlock_rc = cli(["unlock", "--database", str(path), "--model", "triage"])
        unlock_err = capsys.readouterr().err
        status_rc = cli(["status", "--database", str(path)])
        status_err = capsys.readouterr().err
    assert (unlock_rc, status_rc) == (2, 2)
    assert "so `dbt-llm-batch unlock` cannot run; nothing was changed" in unlock_err
    assert "so `dbt-llm-batch status` cannot read it; nothing was changed" in status_err
    assert "this dbt run" not in unlock_err + status_err


def test_a_schema_change_names_only_the_difference(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    changed = triage_model(extra_config="on_schema_change = 'fail',").replace(
        "select ticket_id, subject, priority,",
        "select ticket_id, length(subject) as subject, length(body) as body_len,",
    )
    project.write("models/triage.sql", changed)
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "  added: body_len BIGINT\n" in message
    assert "  removed: priority VARCHAR\n" in message
    assert "  changed: subject VARCHAR -> BIGINT\n" in message
    for unchanged in ("ticket_id", "llm_status", "category", "prompt"):
        assert unchanged not in message.split("changed):")[1].split("on_schema_change='fail'")[0], unchanged
