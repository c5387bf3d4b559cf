"""The `project` fixture's own promise (tests/conftest.py): a test's first dbt command takes the
session's saved manifest and parses only the files the test wrote. If a change to the profile or
the copy broke it, every test would parse the whole project again, silently, about 2 s each."""

from __future__ import annotations

from helpers import triage_model


def test_a_test_s_first_dbt_command_parses_only_the_files_it_wrote(project, emulator):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed", "-s", "support_tickets")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "Unable to do partial parsing" not in log and "Starting full parse" not in log, log
    assert "Partial parsing: added file: integration_project://models/triage.sql" in log, log
    project.dbt("parse", "--no-partial-parse")  # a test asking for a parse from scratch gets one
    assert "Partial parsing not enabled" in (project.root / "logs" / "dbt.log").read_text()
