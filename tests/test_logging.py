"""One logger: the warnings the package emits during a run reach dbt's own log (logs/dbt.log) and the
console, each once."""

from __future__ import annotations

import re

from helpers import dbt_subprocess, triage_model

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]


def test_lock_takeover_and_failed_delete_warnings_reach_dbt_log_once(project, emulator):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)  # submits; creates the ledger and its lock table
    emulator.complete_all()
    # A run that died 11 minutes ago (past the 10-minute heartbeat timeout) left its lock behind ...
    project.query(
        "insert into main.llm_batch_locks values "
        "('main.triage', 'gone-host:4242:dead', now() - interval 11 minutes, now() - interval 11 minutes)"
    )
    # ... and the provider refuses to delete the harvested batch's files.
    emulator.add_fault(endpoint="DELETE /v1/files/{id}", status_code=400, times=None, message="deletion refused")

    project.release_database()
    done = dbt_subprocess(project, {})  # as a user runs it: the console is what it printed
    assert done.returncode == 0, done.stdout + done.stderr
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]

    takeover = re.compile(
        r"main\.triage: took over the lock of gone-host:4242:dead \(held since [^;]+; no heartbeat for \d+ s, "
        r"more than 600 s\): that run is presumed dead"
    )
    refused = re.compile(
        r"main\.triage: could not delete the files of batch batch_\w+ at openai \(BadRequestError: [^\n]*"
        r"deletion refused[^\n]*\); the results are stored, the next run tries again"
    )
    log = (project.root / "logs" / "dbt.log").read_text()
    console = done.stdout + done.stderr
    for warning in (takeover, refused):
        assert len(warning.findall(log)) == 1, (warning.pattern, log[-3000:])
        assert len(warning.findall(console)) == 1, (warning.pattern, console)  # shown once, not twice
