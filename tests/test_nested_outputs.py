"""Structured extraction into nested, typed columns: integration_project's resume example (an object,
a list of objects, a list of strings, an optional field, a date) through both batch providers and a
self-hosted engine (the sandbox's chat completions endpoint), on real dbt and DuckDB.

The sandbox answers nested schemas deterministically (expected_answer over the schema as sent), so
every row's typed values are checked against it; an off-schema answer fails its row with the
validator's message; a schema a provider cannot take is refused before anything is sent."""

from __future__ import annotations

import datetime
import json
import re

import pytest
from conftest import failure_messages
from helpers import PROVIDER_MODELS, batch_input_lines

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sandbox import expected_answer

MODEL = "models/extraction/resume_extraction.sql"
SYSTEM = "Extract the candidate, their jobs, their skills and the date they can start from the resume."
ROUTES = ("anthropic", "openai", "openai_compatible")  # both batch providers and the self-hosted path

TYPES = {
    "candidate": 'STRUCT(email VARCHAR, "name" VARCHAR)',
    "jobs": 'STRUCT(company VARCHAR, title VARCHAR, "years" BIGINT)[]',
    "skills": "VARCHAR[]",
    "available_from": "DATE",
}


@pytest.fixture(params=ROUTES)
def route(request) -> str:
    return request.param


def route_config(route: str, emulator) -> str:
    """The config keys that send the example model through `route`."""
    if route == "openai_compatible":
        return f"llm_provider = 'openai_compatible', llm_model = 'engine-model', llm_base_url = {emulator.openai_base_url!r}, llm_api_key_env = 'OPENAI_API_KEY',"
    return f"llm_provider = '{route}', llm_model = '{PROVIDER_MODELS[route]}',"


def write_model(project, route: str, emulator, extra: str = "", output: str | None = None) -> None:
    text = (project.root / MODEL).read_text()
    text = text.replace(
        "materialized = 'llm_batch',", f"materialized = 'llm_batch', {route_config(route, emulator)} {extra}"
    )
    if output is not None:
        text = re.sub(r"llm_output = \{.*?\n    \},\n", f"llm_output = {output},\n", text, flags=re.S)
    project.write(MODEL, text)


def sent_schema(project, route: str) -> dict:
    """The output schema as the provider module sends it (what the sandbox answers after)."""
    manifest = json.loads((project.root / "target" / "manifest.json").read_text())
    node = manifest["nodes"]["model.integration_project.resume_extraction"]
    raw = {k: v for k, v in node["config"].items() if k.startswith("llm_")} | {"unique_key": "resume_id"}
    provider = get_provider(route)(parse_config(raw))
    if route == "anthropic":
        return provider.params()["tools"][0]["input_schema"]
    return provider.request_body()["response_format"]["json_schema"]["schema"]


def settle(project, emulator, runs: int = 2) -> None:
    """Run the model, letting the sandbox finish every batch between runs (a self-hosted engine
    answers within the run: the later runs find nothing to send)."""
    for _ in range(runs):
        project.dbt("run", "-s", "resume_extraction")
        emulator.complete_all()


def expected_row(answer: dict) -> tuple:
    """The sandbox's JSON answer as DuckDB gives the typed columns back to Python."""
    return (
        {"email": answer["candidate"].get("email"), "name": answer["candidate"]["name"]},
        [{"company": j["company"], "title": j["title"], "years": j["years"]} for j in answer["jobs"]],
        answer["skills"],
        datetime.date.fromisoformat(answer["available_from"]),
    )


def test_nested_columns_are_typed_hold_the_answers_and_unnest_downstream(project, emulator, route):
    project.dbt("seed", "-s", "resumes")
    write_model(project, route, emulator)
    settle(project, emulator)

    described = {name: typ for name, typ, *_ in project.query("describe main.resume_extraction")}
    assert {name: described[name] for name in TYPES} == TYPES

    schema = sent_schema(project, route)
    rows = project.query(
        "select r.resume, e.candidate, e.jobs, e.skills, e.available_from, e.llm_status "
        "from main.resume_extraction e join main.resumes r using (resume_id) order by resume_id"
    )
    assert len(rows) == 5 and all(row[-1] == "succeeded" for row in rows)
    answers = {}
    for resume, *values, _ in rows:
        answers[resume] = json.loads(expected_answer(SYSTEM, resume, schema))
        assert tuple(values) == expected_row(answers[resume]), resume
    # The answers exercise what the types are for: lists of more than one item, and an optional
    # field that is NULL in some rows and set in others.
    assert all(len(a["jobs"]) > 1 and len(a["skills"]) > 1 for a in answers.values())
    emails = [values[0]["email"] for _, *values, _ in rows]
    assert None in emails and any(emails)

    # A downstream model unnests the list with plain SQL, and its dbt tests pass.
    result = project.dbt("build", "-s", "resume_jobs")
    tests = [r for r in result.result.results if r.node.resource_type == "test"]
    assert len(tests) == 4 and all(r.status == "pass" for r in tests)
    jobs = project.query("select resume_id, candidate, title, company, years from main.resume_jobs order by all")
    resume_ids = dict(project.query("select resume, resume_id from main.resumes"))
    assert jobs == sorted(
        (resume_ids[r], a["candidate"]["name"], j["title"], j["company"], j["years"])
        for r, a in answers.items()
        for j in a["jobs"]
    )


def test_off_schema_answers_fail_their_rows_with_the_validators_message(project, emulator, route):
    project.dbt("seed", "-s", "resumes")
    write_model(project, route, emulator, extra="llm_max_attempts = 1,")
    emulator.add_fault(kind="off_schema", code="missing_required", prompt_contains="Grace Brewster", times=None)
    emulator.add_fault(kind="off_schema", code="wrong_item_type", prompt_contains="Linus Park", times=None)
    settle(project, emulator)

    rows = project.query(
        "select r.resume, e.llm_status, e.llm_error from main.resume_extraction e join main.resumes r using (resume_id)"
    )
    failed = {resume.split(",")[0].split(".")[0]: error for resume, status, error in rows if status == "failed"}
    assert set(failed) == {"Grace Brewster", "Linus Park"}
    assert re.fullmatch(
        r"answer does not match llm_output at \$\.\w+: '\w+' is a required property \(rule 'required'\)",
        failed["Grace Brewster"],
    ), failed
    assert failed["Linus Park"] == (
        "answer does not match llm_output at $.jobs[0]: 12345 is not of type 'object' (rule 'type')"
    )
    # The rest merged.
    assert sum(1 for _, status, _ in rows if status == "succeeded") == 3


def test_an_off_schema_answer_is_a_failed_attempt_that_is_retried(project, emulator, route):
    project.dbt("seed", "-s", "resumes")
    write_model(project, route, emulator, extra="llm_max_attempts = 2,")
    emulator.add_fault(kind="off_schema", code="missing_required", prompt_contains="Grace Brewster", times=1)
    settle(project, emulator, runs=3)

    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.resume_extraction") == [
        (5,)
    ]
    attempts = project.query(
        "select status, error from main.llm_batch_requests where row_json like '%Grace Brewster%' order by seq"
    )
    assert [s for s, _ in attempts] == ["failed", "succeeded"]
    assert "is a required property (rule 'required')" in attempts[0][1]


@pytest.mark.parametrize("openai_route", ["openai", "openai_compatible"])
def test_a_schema_openai_strict_mode_cannot_take_is_refused_before_anything_is_sent(project, emulator, openai_route):
    project.dbt("seed", "-s", "resumes")
    output = "{'links': {'type': 'array', 'items': {'type': 'string', 'format': 'uri'}}}"
    write_model(project, openai_route, emulator, output=output)
    result = project.dbt("run", "-s", "resume_extraction", expect_ok=False)
    message = failure_messages(result)
    assert "llm_output['links'].items: OpenAI strict structured outputs do not support format 'uri'" in message
    assert sum(emulator.counters.calls.values()) == 0, "nothing reached the provider"
    assert project.query(
        "select count(*) from information_schema.tables where table_name in ('resume_extraction', 'llm_batch_requests')"
    ) == [(0,)]


def test_anthropic_takes_that_schema_as_its_tools_input_schema(project, emulator):
    project.dbt("seed", "-s", "resumes")
    output = "{'links': {'type': 'array', 'items': {'type': 'string', 'format': 'uri'}}}"
    write_model(project, "anthropic", emulator, output=output)
    settle(project, emulator)
    schema = sent_schema(project, "anthropic")
    assert schema["properties"]["links"] == {"type": "array", "items": {"type": "string", "format": "uri"}}
    rows = project.query("select r.resume, e.links from main.resume_extraction e join main.resumes r using (resume_id)")
    # The answers are the sandbox's for exactly that schema: it is what the provider received.
    assert len(rows) == 5
    assert all(links == json.loads(expected_answer(SYSTEM, resume, schema))["links"] for resume, links in rows)


def test_a_schema_no_column_type_fits_is_refused_for_every_provider(project, emulator, route):
    project.dbt("seed", "-s", "resumes")
    write_model(project, route, emulator, output="{'x': {'type': 'string', 'oneOf': [{'const': 'a'}]}}")
    result = project.dbt("run", "-s", "resume_extraction", expect_ok=False)
    assert "llm_output['x']: keyword 'oneOf' is not supported in llm_output" in failure_messages(result)
    assert sum(emulator.counters.calls.values()) == 0


def test_output_columns_from_the_models_yaml(project, emulator):
    """llm_output_from_columns: the YAML columns (name, data_type, description) are the outputs; the
    descriptions reach the provider with the schema."""
    project.dbt("seed", "-s", "resumes")
    text = (project.root / MODEL).read_text()
    text = re.sub(r"llm_output = \{.*?\n    \},\n", "llm_output_from_columns = true,\n", text, flags=re.S)
    project.write(MODEL, text)
    schema_yml = (project.root / "models/extraction/schema.yml").read_text()
    project.write(
        "models/extraction/schema.yml",
        schema_yml.replace(
            "      - name: llm_status\n",
            """      - name: candidate
        data_type: STRUCT(name VARCHAR, email VARCHAR)
        description: who the resume is about
      - name: skills
        data_type: VARCHAR[]
        description: tools and skills named
      - name: available_from
        data_type: date
      - name: llm_status
""",
            1,
        ),
    )
    settle(project, emulator)
    described = {name: typ for name, typ, *_ in project.query("describe main.resume_extraction")}
    assert {n: described.get(n) for n in ("candidate", "skills", "available_from", "jobs")} == {
        "candidate": 'STRUCT(email VARCHAR, "name" VARCHAR)',
        "skills": "VARCHAR[]",
        "available_from": "DATE",
        "jobs": None,
    }
    assert project.query(
        "select count(*) from main.resume_extraction where llm_status = 'succeeded' and len(skills) > 1"
    ) == [(5,)]
    (batch,) = emulator.batches()
    sent = batch_input_lines(emulator, batch)[0]["body"]["response_format"]["json_schema"]["schema"]["properties"]
    assert sent["candidate"]["description"] == "who the resume is about"
    assert sent["skills"]["description"] == "tools and skills named"
    assert "llm_status" not in sent and "resume_id" not in sent


def test_the_whole_answer_as_one_json_column(project, emulator):
    project.dbt("seed", "-s", "resumes")
    write_model(project, "openai", emulator, extra="llm_output_format = 'json',")
    settle(project, emulator)
    described = {name: typ for name, typ, *_ in project.query("describe main.resume_extraction")}
    assert described["llm_output"] == "JSON" and "jobs" not in described
    schema = sent_schema(project, "openai")
    for resume, answer in project.query(
        "select r.resume, e.llm_output from main.resume_extraction e join main.resumes r using (resume_id)"
    ):
        assert json.loads(answer) == json.loads(expected_answer(SYSTEM, resume, schema))
