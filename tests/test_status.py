"""What is pending and what it cost, from the run log, `dbt run-operation` and the CLI."""

from __future__ import annotations

from helpers import triage_model

from dbt_llm_batch.ops import cli


def test_status_operation_and_cli_show_in_flight_batches_and_progress(project, emulator, capsys):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    batch_id = emulator.batches()[0]["id"]

    project.dbt("run-operation", "dbt_llm_batch.status")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "In-flight batches (1)" in log
    assert f"model=main.triage, provider=openai, batch_id={batch_id}, status=validating, request_count=6" in log
    assert "model=main.triage, keys_succeeded=0, keys_failed=0, requests_pending=6" in log

    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    capsys.readouterr()
    assert cli.main(["status", "--database", str(project.db_path)]) == 0
    out = capsys.readouterr().out
    assert "In-flight batches:" in out and batch_id not in out  # harvested: no longer in flight
    progress = project.query(
        "select keys_succeeded, requests_pending, committed_not_billed_usd from main.llm_batch_progress"
    )
    assert progress == [(6, 0, 0)]
    progress_section = out.split("Progress per model:")[1]
    assert "main.triage" in progress_section and "keys_succeeded" in progress_section


def test_run_log_has_one_summary_line_per_model(project, emulator):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    log = (project.root / "logs" / "dbt.log").read_text()
    # gpt-4o-mini at the shipped price: the estimate is printed, nothing harvested yet.
    assert "main.triage: submitted 6 request(s) in 1 batch(es) (estimated $" in log
    assert (
        "harvested 0 batch(es) (cost $0.000000, saved $0.000000 vs realtime); merged 0 row(s) (0 failed); pending 6"
        in log
    )
