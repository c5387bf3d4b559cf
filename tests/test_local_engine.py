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
# Each test counts the requests the one engine served (engine_requests_served): they run one after
# another, on the worker that holds the session's Ray cluster (the Ray job's test needs it).
pytestmark = pytest.mark.xdist_group("ray")
CATEGORIES = {"billing", "bug", "how_to", "feature_request", "other"}


def _engine_metrics() -> str:
    with urllib.request.urlopen(ENGINE_URL.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as response:
        return response.read().decode()


def engine_requests_served() -> int:
    """Requests the engine answered, from its Prometheus metrics: the engine's own count.

    It waits until the engine is idle first: a request an earlier run gave up on (a timeout on a loaded
    machine) may still be generating, and would be counted in the next test's window. Aborted requests are
    not answers: vLLM counts them under request_success too, with finished_reason="abort"."""
    import time

    began = time.monotonic()
    while True:
        text = _engine_metrics()
        busy = sum(
            float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        )
        if busy == 0 or time.monotonic() - began > 300:
            break
        time.sleep(0.5)
    assert busy == 0, f"the engine still had {busy:.0f} request(s) running or waiting after 300 s"
    answered = re.findall(r"^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M)
    return int(sum(float(v) for labels, v in answered if 'finished_reason="abort"' not in labels))


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


# Structured extraction into nested columns on the real model: vLLM's guided decoding gets the
# schema in OpenAI's strict form. `pattern` and `maxItems` bound strings and lists, so a small model
# cannot run an answer past llm_max_tokens.
NESTED_EXTRACTION = """
{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_provider = 'openai_compatible',
    llm_model = 'gemma-3-270m',
    llm_base_url = env_var('DBT_LLM_BATCH_ENGINE_URL', 'http://127.0.0.1:8791/v1'),
    llm_concurrency = 32,
    llm_max_tokens = 200,
    llm_temperature = 0,
    llm_system = 'Extract from the support ticket: its category, the product it is about, up to three keywords, and up to two next steps.',
    llm_output = {
        'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'],
        'product': {
            'type': 'object',
            'properties': {
                'name': {'type': 'string', 'pattern': '^[A-Za-z0-9 ]{1,24}$', 'description': 'the product named'},
                'platform': ['web', 'ios', 'android', 'unknown'],
            },
            'required': ['name', 'platform'],
        },
        'keywords': {'type': 'array', 'items': {'type': 'string', 'pattern': '^[a-z]{1,16}$'}, 'minItems': 1, 'maxItems': 3},
        'steps': {
            'type': 'array',
            'maxItems': 2,
            'items': {
                'type': 'object',
                'properties': {'action': {'type': 'string', 'pattern': '^[A-Za-z ]{1,40}$'}, 'urgent': 'boolean'},
                'required': ['action', 'urgent'],
            },
        },
    },
) }}
select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body as prompt
from {{ ref('support_tickets') }}
"""


def test_nested_extraction_on_the_real_engine_every_answer_validates(project, local_engine):
    import json

    import jsonschema

    from dbt_llm_batch import output_schema
    from dbt_llm_batch.config import parse_config

    project.dbt("seed", "-s", "support_tickets")
    project.write("models/local/ticket_extraction_local.sql", NESTED_EXTRACTION)
    project.dbt("run", "-s", "ticket_extraction_local")

    described = {name: typ for name, typ, *_ in project.query("describe main.ticket_extraction_local")}
    assert described["product"] == 'STRUCT("name" VARCHAR, platform VARCHAR)'
    assert described["keywords"] == "VARCHAR[]"
    assert described["steps"] == 'STRUCT("action" VARCHAR, urgent BOOLEAN)[]'  # DuckDB quotes a keyword
    rows = project.query("select ticket_id, llm_status, llm_error, product, keywords from main.ticket_extraction_local")
    assert len(rows) == 6 and all(status == "succeeded" for _, status, *_ in rows), rows
    assert all(
        product["platform"] in ("web", "ios", "android", "unknown") and keywords for *_, product, keywords in rows
    )

    # Every answer the engine gave validates against the schema (checked here again, from the ledger).
    manifest = json.loads((project.root / "target" / "manifest.json").read_text())
    node = manifest["nodes"]["model.integration_project.ticket_extraction_local"]
    config = parse_config(
        {k: v for k, v in node["config"].items() if k.startswith("llm_")} | {"unique_key": "ticket_id"}
    )
    validator = jsonschema.Draft202012Validator(output_schema.validation_schema(config.output_json_schema()))
    raws = [json.loads(raw) for (raw,) in project.query("select raw from main.llm_batch_results")]
    answers = [json.loads(r["response"]["body"]["choices"][0]["message"]["content"]) for r in raws]
    assert len(answers) == 6
    for answer in answers:
        validator.validate(answer)


RAY_TRIAGE = """
{{{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_provider = 'ray',
    llm_model = 'gemma-3-270m',
    llm_ray_address = '{address}',
    llm_ray_storage = '{storage}',
    llm_base_url = '{engine}',
    llm_concurrency = 32,
    llm_system = 'You triage customer support tickets. Answer with the category and whether it is urgent.',
    llm_output = {{'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'], 'urgent': 'boolean'}},
    llm_max_tokens = 40,
    llm_temperature = 0,
) }}}}
select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body as prompt from {{{{ ref('support_tickets') }}}}
"""


def test_a_ray_job_on_the_real_engine_answers_every_row_once(project, local_engine, ray_cluster, tmp_path):
    import time

    project.write(
        "models/ray_triage.sql",
        RAY_TRIAGE.format(address=ray_cluster.address, storage=tmp_path / "storage", engine=local_engine),
    )
    project.dbt("seed", "-s", "support_tickets")
    before = engine_requests_served()
    project.dbt("run", "-s", "ray_triage")  # submits the Ray job and returns
    [(batch_id,)] = project.query("select batch_id from main.llm_batch_jobs")
    client, began = ray_cluster.client(), time.monotonic()
    while not client.get_job_status(batch_id).is_terminal():
        assert time.monotonic() - began < 600, "the Ray job did not end within 10 minutes"
        time.sleep(1)
    assert str(client.get_job_status(batch_id).value) == "SUCCEEDED", client.get_job_logs(batch_id)[-3000:]
    project.dbt("run", "-s", "ray_triage")
    rows = project.query("select category, urgent, llm_status, llm_model, llm_batch_id from main.ray_triage")
    assert len(rows) == 6
    for category, urgent, status, model, batch in rows:
        assert (status, model, batch) == ("succeeded", "gemma-3-270m", batch_id)
        assert category in CATEGORIES and isinstance(urgent, bool)
    served = engine_requests_served() - before
    # The engine's own count: one request per row. If not, say where the extra ones came from.
    assert served == 6, (served, _engine_metrics()[-3000:], client.get_job_logs(batch_id)[-3000:])
