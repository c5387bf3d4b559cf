"""What a run's log line says: "merged N row(s)" counts the rows whose request newly became final,
never the rows a rebuild or a reverted prompt writes again from answers merged before."""

from __future__ import annotations

from helpers import log_text, triage_model


def run_lines(project) -> list[str]:
    return [line for line in log_text(project).splitlines() if "main.triage: submitted" in line]


def test_merged_counts_only_rows_that_newly_became_final(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert "merged 6 row(s) (0 failed); pending 0" in run_lines(project)[-1]
    project.dbt("run", "-s", "triage", "--full-refresh")  # nothing new became final: all six written again
    assert "merged 0 row(s) (0 failed), 6 rewritten from the ledger; pending 0" in run_lines(project)[-1]
    project.query("drop table main.triage")
    project.dbt("run", "-s", "triage")
    assert "merged 0 row(s) (0 failed), 6 rewritten from the ledger" in run_lines(project)[-1]
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
