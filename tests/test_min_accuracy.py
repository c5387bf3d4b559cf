"""The min_accuracy test on a real llm_batch model answered by the sandbox, through `dbt build`: it never
passes on nothing measured, warns while the rows are still at the provider, fails a measured figure
under the minimum, and measures only the answers to what each row asks now (not an earlier prompt's)."""

from __future__ import annotations

import json

import pytest
from helpers import log_text

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.sandbox import expected_answer

CATEGORIES = ["billing", "bug", "how_to", "other"]
OUTPUT = {"category": CATEGORIES}
SCHEMA = parse_config({"unique_key": "id", "llm_model": "m", "llm_output": OUTPUT}).output_json_schema()
SYSTEM_A = "You sort support tickets into a category."
SYSTEM_B = "Category of the ticket, nothing else."
N = 20


def prompt_of(i: int) -> str:
    return f"Ticket {i}: the export of report {i % 7} fails with error {i * 13 % 97}."


def answer(system: str, i: int) -> str:
    return json.loads(expected_answer(system, prompt_of(i), SCHEMA))["category"]


def accuracy(system: str) -> float:
    """The accuracy of `system`'s answers against the labels, which are SYSTEM_A's answers."""
    return sum(answer(system, i) == answer(SYSTEM_A, i) for i in range(N)) / N


def write_project(project, system: str, variants: dict | None, gates: list[dict], rows: str = "") -> None:
    """The labelled tickets, the model `evals` (`system`, `variants`) and its min_accuracy tests."""
    labels = "".join(f'{i},"{prompt_of(i)}",{answer(SYSTEM_A, i)}\n' for i in range(N))
    project.write("seeds/eval_tickets.csv", "id,prompt,expected_category\n" + labels)
    extra = f", llm_variants = {json.dumps(variants)}" if variants else ""
    project.write(
        "models/evals.sql",
        f"""
{{{{ config(materialized = 'llm_batch', unique_key = 'id', llm_provider = 'openai', llm_model = 'gpt-4o-mini',
            llm_system = {json.dumps(system)}, llm_output = {json.dumps(OUTPUT)}, llm_max_tokens = 100{extra}) }}}}
select id, prompt, expected_category from {{{{ ref('eval_tickets') }}}} {rows}
""",
    )
    tests = "".join(
        f"          - dbt_llm_batch.min_accuracy:\n              arguments: {json.dumps(gate)}\n" for gate in gates
    )
    project.write(
        "models/evals.yml",
        f"version: 2\nmodels:\n  - name: evals\n    columns:\n      - name: category\n        data_tests:\n{tests}",
    )


def build(project) -> tuple[bool, dict[str | None, str]]:
    """`dbt build` of the seed and the model: (success, {the test's variant argument: its status})."""
    result = project.dbt("build", "-s", "eval_tickets", "evals", expect_ok=False)
    statuses = {
        r.node.test_metadata.kwargs.get("variant"): str(r.status)
        for r in result.result.results
        if r.node.resource_type == "test"
    }
    return result.success, statuses


@pytest.fixture
def sandbox(emulator):
    emulator.auto_advance_seconds = None  # batches end when the test says so
    return emulator


def test_a_first_build_with_every_row_pending_warns_and_measures_once_answered(project, sandbox):
    terse = accuracy(SYSTEM_B)
    assert 0.2 < terse < 0.9  # the variant's answers differ from the labels on some tickets
    gates = [{"reference": "expected_category", "minimum": 0.9}]  # every variant
    gates.append({"reference": "expected_category", "minimum": round(terse - 0.05, 4), "variant": "terse"})
    write_project(project, SYSTEM_A, {"terse": {"llm_system": SYSTEM_B}}, gates)

    # Every row is at the provider: nothing is measured, and nothing fails because of it.
    ok, statuses = build(project)
    assert statuses == {None: "warn", "terse": "warn"} and ok
    log = log_text(project)
    assert "variant 'terse': accuracy n/a over 0 row(s) with a reference, nothing measured yet, 20 row(s) wait" in log
    assert "variant 'default': accuracy n/a over 0 row(s) with a reference, nothing measured yet" in log

    # Answered: the default variant meets 0.9, the terse one does not (the unnamed gate fails), and
    # meets its own, lower, minimum.
    sandbox.complete_all()
    ok, statuses = build(project)
    assert statuses == {None: "fail", "terse": "pass"} and not ok
    assert f"variant 'terse': accuracy {terse:.4f} over 20 row(s) with a reference, below the minimum 0.9" in (
        log_text(project)
    )


def test_after_a_prompt_edit_only_the_new_prompt_s_answers_are_measured(project, sandbox):
    worse = accuracy(SYSTEM_B)
    assert worse < 0.9
    write_project(project, SYSTEM_A, None, [{"reference": "expected_category", "minimum": 0.9}])
    build(project)
    sandbox.complete_all()
    assert build(project) == (True, {None: "pass"})  # SYSTEM_A's answers are the labels

    # The prompt changes; its answers are at the provider. The table still shows SYSTEM_A's, which
    # vouch for nothing now: a warning, not a pass on the old prompt's figure.
    write_project(project, SYSTEM_B, None, [{"reference": "expected_category", "minimum": 0.9}])
    assert build(project) == (True, {None: "warn"})
    assert project.query("select count(*) from main.evals where llm_status = 'succeeded'") == [(N,)]
    assert "variant 'default': accuracy n/a over 0 row(s) with a reference, nothing measured yet, 20 row(s)" in (
        log_text(project)
    )

    # The new answers land: measured, and below the minimum.
    sandbox.complete_all()
    assert build(project) == (False, {None: "fail"})
    assert f"variant 'default': accuracy {worse:.4f} over 20 row(s) with a reference, below the minimum 0.9" in (
        log_text(project)
    )


def test_nothing_to_measure_and_nothing_pending_fails(project, sandbox):
    write_project(project, SYSTEM_A, None, [{"reference": "expected_category", "minimum": 0.9}], rows="where false")
    assert build(project) == (False, {None: "fail"})
    assert "min_accuracy: evals.category variant 'default': accuracy n/a over 0 row(s) with a reference" not in (
        log_text(project)
    )
    assert "min_accuracy: evals.category: no row to measure, none pending" in log_text(project)
