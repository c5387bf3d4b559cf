"""The main job on a real model: `dbt build` of integration_project's local models against a real
vLLM engine (CPU build) serving Gemma 3 270M, started by scripts/engine.sh. Not an emulator: the
answers are the model's, constrained by structured output to the enum."""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from conftest import REPO

ENGINE_URL = os.environ.get("DBT_LLM_BATCH_ENGINE_URL", "http://127.0.0.1:8791/v1")
# The Ray job's test needs the session's Ray cluster, which one worker holds.
pytestmark = pytest.mark.xdist_group("ray")
CATEGORIES = {"billing", "bug", "how_to", "feature_request", "other"}


class CountingProxy:
    """A loopback proxy in front of the engine that counts the chat requests that pass through it.

    A test points its model at the proxy and counts its own requests: the engine's /metrics count every
    client's, and on a busy machine another client (a benchmark, a second checkout's tests) may share the
    engine."""

    def __init__(self, engine_url: str):
        self.engine = engine_url.rsplit("/v1", 1)[0]
        self.lock = threading.Lock()
        self.answered: list[str] = []  # the sha256 of each request body the engine answered with 200
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the engine's own server

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, reply = proxy.forward(self.path, body, self.headers.get("Content-Type", "application/json"))
                if status == 200 and self.path.endswith("/chat/completions"):
                    with proxy.lock:
                        proxy.answered.append(hashlib.sha256(body).hexdigest())
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self):
                status, reply = proxy.forward(self.path, None, None)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, path: str, body: bytes | None, content_type: str | None) -> tuple[int, bytes]:
        headers = {"Content-Type": content_type} if content_type else {}
        request = urllib.request.Request(self.engine + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def count(self) -> int:
        with self.lock:
            return len(self.answered)

    def repeated(self) -> list[str]:
        """Request bodies answered more than once."""
        with self.lock:
            return sorted({h for h in self.answered if self.answered.count(h) > 1})


@pytest.fixture
def engine_proxy(local_engine):
    proxy = CountingProxy(local_engine)
    yield proxy
    proxy.server.shutdown()
    proxy.server.server_close()


@pytest.fixture(scope="module")
def local_engine():
    """The engine, started (and set up if needed) by scripts/engine.sh, which waits until it answers.
    A failure to start is an error of this test, never a skip: CI must run it."""
    started = subprocess.run([str(REPO / "scripts" / "engine.sh"), "start"], capture_output=True, text=True)
    assert started.returncode == 0, f"scripts/engine.sh start failed:\n{started.stdout}\n{started.stderr}"
    yield ENGINE_URL


def test_dbt_build_on_the_real_engine_gives_valid_enum_values_and_a_second_run_sends_nothing(
    project, local_engine, engine_proxy, monkeypatch
):
    monkeypatch.setenv("DBT_LLM_BATCH_ENGINE_URL", engine_proxy.url)  # the local models' llm_base_url
    project.dbt("seed")
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
    assert engine_proxy.count() == 6 and engine_proxy.repeated() == []  # one request per row, each once

    project.dbt("build", "--select", "+tag:local")  # nothing new: nothing is sent
    assert engine_proxy.count() == 6
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


def test_a_ray_job_on_the_real_engine_answers_every_row_once(project, engine_proxy, ray_cluster, tmp_path):
    import time

    project.write(
        "models/ray_triage.sql",
        RAY_TRIAGE.format(address=ray_cluster.address, storage=tmp_path / "storage", engine=engine_proxy.url),
    )
    project.dbt("seed", "-s", "support_tickets")
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
    # One request per row, each answered once (a retried Ray task would send its rows again).
    assert (engine_proxy.count(), engine_proxy.repeated()) == (6, []), client.get_job_logs(batch_id)[-3000:]
