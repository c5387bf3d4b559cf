"""The main job on a real model: `dbt build` of integration_project's local models against a real
vLLM engine (CPU build) serving Gemma 3 270M, started by scripts/engine.sh. Not an emulator: the
answers are the model's, constrained by structured output to the enum."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request

import pytest
from conftest import REPO

ENGINE_URL = os.environ.get("DBT_LLM_BATCH_ENGINE_URL", "http://127.0.0.1:8791/v1")
CATEGORIES = {"billing", "bug", "how_to", "feature_request", "other"}


def engine_requests_served() -> int:
    """Requests the engine finished, from its Prometheus metrics: the engine's own count."""
    with urllib.request.urlopen(ENGINE_URL.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


@pytest.fixture(scope="module")
def local_engine():
    """The engine, started (and set up if needed) by scripts/engine.sh, which waits until it answers.
    A failure to start is an error of this test, never a skip: CI must run it."""
    started = subprocess.run([str(REPO / "scripts" / "engine.sh"), "start"], capture_output=True, text=True)
    assert started.returncode == 0, f"scripts/engine.sh start failed:\n{started.stdout}\n{started.stderr}"
    yield ENGINE_URL


def test_dbt_build_on_the_real_engine_gives_valid_enum_values_and_a_second_run_sends_nothing(project, local_engine):
    project.dbt("seed")
    before = engine_requests_served()
    result = project.dbt("build", "--select", "+tag:local")
    tests = [r for r in result.result.results if r.node.resource_type == "test"]
    assert len(tests) == 5 and all(r.status == "pass" for r in tests)
    rows = project.query("""select ticket_id, category, urgent, llm_status, llm_route, llm_model, llm_output_tokens
                            from main.ticket_triage_local order by ticket_id""")
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
    for ticket_id, category, urgent, status, route, model, output_tokens in rows:
        assert status == "succeeded" and route == "realtime" and model == "gemma-3-270m", ticket_id
        assert category in CATEGORIES and isinstance(urgent, bool), (ticket_id, category, urgent)
        assert output_tokens > 0
    assert engine_requests_served() - before == 6  # the engine's own count: one request per row

    project.dbt("build", "--select", "+tag:local")  # nothing new: nothing is sent
    assert engine_requests_served() - before == 6
    assert project.query("select count(*) from main.llm_batch_requests") == [(6,)]
