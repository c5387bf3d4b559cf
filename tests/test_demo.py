"""The demo (scripts/demo.sh): one setting, DBT_LLM_BATCH_ENGINE_PORT, moves the local engine and the
model that reads it together; a taken port is one clear message before anything starts; the printed
tables show the answer columns (scripts/demo_tables.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_engine_port_moves_the_local_model_and_the_demo_shows_answers(project, emulator, monkeypatch):
    monkeypatch.delenv("DBT_LLM_BATCH_ENGINE_URL", raising=False)
    monkeypatch.setenv("DBT_LLM_BATCH_ENGINE_PORT", "8899")
    project.dbt("parse")
    manifest = json.loads((project.root / "target" / "manifest.json").read_text())
    node = manifest["nodes"]["model.integration_project.ticket_triage_local"]
    assert node["config"]["llm_base_url"] == "http://127.0.0.1:8899/v1"

    project.dbt("seed")
    project.dbt("run", "-s", "ticket_triage", "review_summary")
    emulator.complete_all()
    project.dbt("run", "-s", "ticket_triage", "review_summary")
    project.release_database()
    shown = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "demo_tables.py"),
            str(project.db_path),
            "ticket_triage",
            "review_summary",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for column in ("ticket_id", "category", "urgent", "summary", "llm_status", "review_no", "llm_output"):
        assert f"│ {column}" in shown or f"│{column}" in shown.replace(" ", ""), (column, shown)
    assert "…" not in shown, shown  # no column hidden behind an ellipsis
    assert "succeeded" in shown


def test_a_taken_engine_port_is_one_clear_message(tmp_path):
    with socket.socket() as listener:  # another process's server on the port
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        env = {**os.environ, "DBT_LLM_BATCH_ENGINE_PORT": str(port), "DBT_LLM_BATCH_ENGINE_CACHE": str(tmp_path)}
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "engine.sh"), "start"], capture_output=True, text=True, env=env, timeout=60
        )
    assert done.returncode != 0
    assert f"port {port} is taken by another process" in done.stderr
    assert "DBT_LLM_BATCH_ENGINE_PORT" in done.stderr and "the demo's model reads the same variable" in done.stderr
