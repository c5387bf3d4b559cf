"""Progress while long work runs (pipeline/progress.py): rows done of total, rate and time left.
On a terminal `dbt-llm-batch poll --wait` draws a rich progress bar (checked on a pseudo-terminal);
anywhere else, and inside dbt (whose console and logs/dbt.log are line-based, shared by its threads),
the same figures come as plain log lines."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from helpers import log_text, triage_model

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def read_all(fd: int, proc: subprocess.Popen, timeout: float = 180) -> str:
    """Everything the process writes to its terminal until it exits (bounded, not timed)."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    return b"".join(chunks).decode(errors="replace")


def test_poll_wait_draws_a_bar_on_a_pseudo_terminal(project, emulator):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    project.release_database()
    emulator.auto_advance_seconds = 0.3
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color", "COLUMNS": "120"}
    env.update({"DBT_LLM_BATCH_POLL_FIRST_DELAY": "0.2", "DBT_LLM_BATCH_PROGRESS_SECONDS": "0"})
    command = [sys.executable, "-m", "dbt_llm_batch.ops.cli", "poll", "--database", str(project.db_path)]
    main, terminal = pty.openpty()
    proc = subprocess.Popen([*command, "--wait", "120"], stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    try:
        shown = read_all(main, proc)
    finally:
        os.close(main)
    assert proc.returncode == 0, shown
    assert "\x1b[" in shown, "a terminal gets a live display (cursor control)"
    text = ANSI.sub("", shown)
    assert "poll: waiting for batches" in text and "6/6" in text and "━" in text, text  # rich's bar, done/total
    assert "Traceback" not in text
    # Not a terminal, the same figures are plain lines: test_poller's test_poll_wait_returns_done_and_then_runs_once.


def test_a_realtime_send_logs_rows_done_rate_and_time_left_in_dbts_log(project, emulator, monkeypatch):
    monkeypatch.setenv("DBT_LLM_BATCH_PROGRESS_SECONDS", "0")  # every update a line: deterministic
    emulator.realtime_latency = 0.3  # one answer per flush or so: the count moves while it runs
    project.write("models/triage.sql", triage_model(extra_config="llm_realtime_when = 'true', llm_concurrency = 1,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    lines = [line for line in log_text(project).splitlines() if "main.triage: realtime: " in line]
    assert any(
        re.search(r"realtime: [1-5]/6 answered \(\d+%\), [\d.]+/s, (about .+ left|time left unknown)", x) for x in lines
    ), lines
    assert re.search(r"realtime: 6/6 answered \(100%\), [\d.]+/s, done in \d+ s", lines[-1]), lines
    assert "\x1b[" not in "".join(lines).replace("\x1b[0m", "")  # dbt's own colour reset aside: plain lines
