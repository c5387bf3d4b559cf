"""Evaluation runs (llm_variants): one model asks the same rows of several configs in one run, each
variant through its own provider, and its table holds one row per (key, variant).

The workload: 60 labelled tickets (`id, prompt, expected_category`) and three variants: the model's
own (OpenAI, system prompt A: the variant 'default'), 'terse' (OpenAI, system prompt B) and 'claude'
(Anthropic). Every answer is checked against the sandbox's answer function for its variant's request
(system prompt, prompt, output schema), and every accuracy is computed here from the rows.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import re
from decimal import Decimal

import pytest
from conftest import failure_messages
from helpers import (
    TRIAGE_SYSTEM,
    batch_input_lines,
    billed_per_key,
    expected_triage,
    is_anthropic,
    kill_then_run_on,
    log_text,
    sorted_batches,
    succeeded_custom_ids,
    triage_model,
)

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.sandbox import expected_answer

CATEGORIES = ["billing", "bug", "how_to", "other"]
OUTPUT = {"category": CATEGORIES}
SCHEMA = parse_config({"unique_key": "id", "llm_model": "m", "llm_output": OUTPUT}).output_json_schema()
SYSTEM_A = "You sort support tickets into a category."
SYSTEM_B = "Category of the ticket, nothing else."
SYSTEM_B2 = "Name the single best category for this support ticket."
N = 60


def prompt_of(i: int) -> str:
    return f"Ticket {i}: the export of report {i % 7} fails with error {i * 13 % 97}."


def labels() -> dict[int, str | None]:
    """The expected category per ticket: the default variant's answer for most, another for some
    (so each variant has its own accuracy), none for a few (left out of accuracy, not counted wrong)."""
    out: dict[int, str | None] = {}
    for i in range(N):
        right = json.loads(expected_answer(SYSTEM_A, prompt_of(i), SCHEMA))["category"]
        if i % 10 == 9:
            out[i] = None
        elif i % 4 == 0:
            out[i] = CATEGORIES[(CATEGORIES.index(right) + 1) % len(CATEGORIES)]
        else:
            out[i] = right
    return out


def write_seed(project) -> None:
    rows = "".join(f'{i},"{prompt_of(i)}",{label or ""}\n' for i, label in labels().items())
    project.write("seeds/eval_tickets.csv", "id,prompt,expected_category\n" + rows)
    project.dbt("seed", "-s", "eval_tickets")


def variants_config(terse_system: str = SYSTEM_B, sample: dict | None = None, variants: dict | None = None) -> str:
    if variants is None:
        variants = {
            "terse": {"llm_system": terse_system},
            "claude": {"llm_provider": "anthropic", "llm_model": "claude-sonnet-4-5"},
        }
    extra = f", llm_variant_sample = {json.dumps(sample)}" if sample else ""
    return f"llm_variants = {json.dumps(variants)}{extra}"


def eval_model(config: str = "", system: str = SYSTEM_A, unique_key: str = "id") -> str:
    return f"""
{{{{ config(materialized = 'llm_batch', unique_key = {unique_key!r}, llm_provider = 'openai', llm_model = 'gpt-4o-mini',
            llm_system = {json.dumps(system)}, llm_output = {json.dumps(OUTPUT)}, llm_max_tokens = 100
            {", " + config if config else ""}) }}}}
select id, id + 1000 as ticket_no, prompt, expected_category from {{{{ ref('eval_tickets') }}}}
"""


SYSTEMS = {"default": SYSTEM_A, "terse": SYSTEM_B, "claude": SYSTEM_A}


def answer(system: str, i: int) -> str:
    return json.loads(expected_answer(system, prompt_of(i), SCHEMA))["category"]


def table(project) -> dict[tuple[int, str], tuple]:
    rows = project.query(
        "select id, llm_variant, category, llm_status, llm_model, llm_fingerprint, llm_batch_id from main.evals"
    )
    return {(r[0], r[1]): r[2:] for r in rows}


def assert_each_row_answered(rows: dict, system: dict[str, str], model: dict[str, str], default_model: str) -> None:
    """Every row of `rows` (table()) succeeded with the sandbox's answer to its variant's system prompt
    (`system`, by variant; SYSTEM_A otherwise), from its variant's model (`model`, else `default_model`)."""
    for (i, variant), (category, status, llm_model, *_rest) in rows.items():
        assert status == "succeeded", (i, variant)
        assert category == answer(system.get(variant, SYSTEM_A), i), (i, variant)
        assert llm_model == model.get(variant, default_model), (i, variant)


def batches_by_face(emulator) -> list[tuple[str, int, set[str]]]:
    """Each batch the sandbox received, in order: (face, requests, the system prompts of its OpenAI lines)."""
    out = []
    for b in sorted_batches(emulator):
        if is_anthropic(b):
            out.append(("anthropic", sum(b["request_counts"].values()), set()))
        else:
            lines = batch_input_lines(emulator, b)
            systems = {m["content"] for line in lines for m in line["body"]["messages"] if m["role"] == "system"}
            out.append(("openai", len(lines), systems))
    return out


def accuracy(rows: dict, variant: str) -> float:
    judged = [(i, cat) for (i, v), (cat, *_rest) in rows.items() if v == variant and labels()[i] is not None]
    return sum(cat == labels()[i] for i, cat in judged) / len(judged)


def in_sample(i: int, fraction: float) -> bool:
    """The documented rule, computed apart: the first 32 bits of md5 of the ledger key (["<id>"])."""
    key = json.dumps([str(i)])
    return int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


@pytest.fixture
def evals(project, emulator):
    write_seed(project)
    project.write("models/evals.sql", eval_model(variants_config()))
    return project


def test_three_variants_two_providers_one_run_180_rows_report_and_gate(evals, emulator):
    evals.dbt("run", "-s", "evals")
    # One batch per provider in the same run: the two OpenAI variants' 120 requests (each line with
    # its own variant's system prompt) in one batch, the Anthropic variant's 60 in another.
    sent = batches_by_face(emulator)
    assert sorted((face, n) for face, n, _ in sent) == [("anthropic", N), ("openai", 2 * N)]
    assert [systems for face, _, systems in sent if face == "openai"] == [{SYSTEM_A, SYSTEM_B}]
    assert evals.query("select count(*) from main.evals") == [(0,)]  # nothing final yet
    # A batch holding several variants' requests lists them, named as the table names them.
    in_flight = evals.query("select variant, provider, request_count from main.llm_batch_in_flight order by 1")
    assert in_flight == [("claude", "anthropic", N), ("default,terse", "openai", 2 * N)]
    assert "submitted 120 request(s) in 1 batch(es) to openai (gpt-4o-mini): variant default 60, variant terse 60" in (
        log_text(evals)
    )

    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    rows = table(evals)
    assert len(rows) == 3 * N
    assert {v for _, v in rows} == {"default", "terse", "claude"}
    assert_each_row_answered(rows, SYSTEMS, {"claude": "claude-sonnet-4-5"}, "gpt-4o-mini")
    # The labels follow the default variant's answers for most keys, so terse (another system prompt)
    # scores lower. The sandbox answers from (system, prompt, schema), whatever the model: claude, with
    # the default's system prompt, gives the default's answers, through the other provider.
    measured = {v: accuracy(rows, v) for v in ("default", "terse", "claude")}
    assert measured["default"] > measured["terse"] and measured["claude"] == measured["default"]
    assert len(emulator.billed()) == 3 * N  # nothing asked twice
    # Each variant's requests and cost, apart, though two variants shared a batch.
    per_variant = evals.query(
        "select variant, sum(rows_succeeded), sum(cost_usd) > 0 from main.llm_batch_costs group by 1 order by 1"
    )
    assert per_variant == [("claude", N, True), ("default", N, True), ("terse", N, True)]
    table_costs = dict(evals.query("select llm_variant, sum(llm_cost_usd) from main.evals group by 1"))
    ledger_costs = dict(evals.query("select variant, sum(cost_usd) from main.llm_batch_requests group by 1"))
    assert table_costs == {
        "default": ledger_costs[""],
        "terse": ledger_costs["terse"],
        "claude": ledger_costs["claude"],
    }

    # variant_report returns the accuracy computed here from the rows.
    evals.write(
        "models/evals_report.sql",
        "{{ dbt_llm_batch.variant_report(ref('evals'), reference={'category': 'expected_category'}) }}",
    )
    evals.dbt("run", "-s", "evals_report")
    report = evals.query("select variant, rows, succeeded, category_accuracy, category_judged from main.evals_report")
    judged = sum(label is not None for label in labels().values())
    assert {r[0]: (r[1], r[2], r[4]) for r in report} == {v: (N, N, judged) for v in measured}
    for variant, _, _, figure, _ in report:
        assert float(figure) == pytest.approx(measured[variant]), variant

    # min_accuracy: passes under the measured figure, fails above it with the figure in the log.
    def gate(minimum: float) -> None:
        args = {"reference": "expected_category", "minimum": minimum, "variant": "terse"}
        evals.write(
            "models/evals.yml",
            "version: 2\nmodels:\n  - name: evals\n    columns:\n      - name: category\n        data_tests:\n"
            f"          - dbt_llm_batch.min_accuracy:\n              arguments: {json.dumps(args)}\n",
        )

    gate(round(measured["terse"] - 0.01, 4))
    evals.dbt("test", "-s", "evals")
    gate(round(measured["terse"] + 0.01, 4))
    result = evals.dbt("test", "-s", "evals", expect_ok=False)
    assert not result.success and "Got 1 result" in failure_messages(result)
    assert f"variant 'terse': accuracy {measured['terse']:.4f} over {judged} row(s) with a reference" in log_text(evals)


def test_editing_one_variant_s_prompt_re_asks_only_that_variant(evals, emulator):
    evals.dbt("run", "-s", "evals")
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    before = table(evals)
    assert len(before) == 3 * N

    evals.write("models/evals.sql", eval_model(variants_config(terse_system=SYSTEM_B2)))
    evals.dbt("run", "-s", "evals")
    sent = batches_by_face(emulator)
    assert len(sent) == 3 and sent[2] == ("openai", N, {SYSTEM_B2}), "one new batch: the terse variant's 60 rows"
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    after = table(evals)
    assert len(after) == 3 * N
    for (i, variant), row in after.items():
        if variant == "terse":
            assert row[0] == answer(SYSTEM_B2, i) and row[3] != before[(i, variant)][3]  # a new fingerprint
        else:
            assert row == before[(i, variant)], (i, variant)  # the other variants' rows stay as they were
    assert len(emulator.billed()) == 4 * N

    # Changing it back shows the stored answers again, with no request.
    evals.write("models/evals.sql", eval_model(variants_config()))
    evals.dbt("run", "-s", "evals")
    assert len(batches_by_face(emulator)) == 3
    assert table(evals) == before


def test_a_sampled_challenger_answers_the_same_keys_on_every_run(evals, emulator):
    fraction = 0.3
    sampled = {i for i in range(N) if in_sample(i, fraction)}
    assert 0 < len(sampled) < N
    evals.write("models/evals.sql", eval_model(variants_config(sample={"terse": fraction})))
    evals.dbt("run", "-s", "evals")
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    rows = table(evals)
    assert {i for i, v in rows if v == "terse"} == sampled  # the challenger: its sample only
    assert {i for i, v in rows if v == "default"} == set(range(N))  # the champion: every row
    assert {i for i, v in rows if v == "claude"} == set(range(N))  # not sampled: every row

    # A new prompt for the challenger: asked again for the same keys, and a fresh ledger agrees.
    evals.write("models/evals.sql", eval_model(variants_config(terse_system=SYSTEM_B2, sample={"terse": fraction})))
    evals.dbt("run", "-s", "evals")
    last = batches_by_face(emulator)[-1]
    assert last == ("openai", len(sampled), {SYSTEM_B2})
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    assert {i for i, v in table(evals) if v == "terse"} == sampled
    # The champion selected downstream as a view.
    evals.write(
        "models/evals_champion.sql",
        "{{ config(materialized='view') }} select * from {{ ref('evals') }} where llm_variant = 'default'",
    )
    evals.dbt("run", "-s", "evals_champion")
    assert evals.query("select count(*), count(distinct id) from main.evals_champion") == [(N, N)]


def test_adding_and_removing_variants_keeps_every_answer_paid_for(project, emulator):
    write_seed(project)
    project.write("models/evals.sql", eval_model())  # no variants yet: today's table
    project.dbt("run", "-s", "evals")
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    columns = [
        r[0] for r in project.query("select column_name from information_schema.columns where table_name = 'evals'")
    ]
    assert "llm_variant" not in columns
    old = {r[0]: r[1:] for r in project.query("select id, category, llm_fingerprint from main.evals")}
    assert len(old) == N

    # Adding variants: llm_variant is appended, the old rows are the default variant's, nothing re-asked.
    project.write("models/evals.sql", eval_model(variants_config()))
    project.dbt("run", "-s", "evals")
    sent = batches_by_face(emulator)
    assert sorted((face, n) for face, n, _ in sent[1:]) == [("anthropic", N), ("openai", N)]
    assert [systems for face, _, systems in sent[1:] if face == "openai"] == [{SYSTEM_B}]  # terse, not the default
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert len(rows) == 3 * N
    assert {i: (r[0], r[3]) for (i, v), r in rows.items() if v == "default"} == old

    # Removing a variant: its rows leave the table; the ledger keeps its answers (paid for once).
    project.write("models/evals.sql", eval_model(variants_config(variants={"terse": {"llm_system": SYSTEM_B}})))
    project.dbt("run", "-s", "evals")
    assert {v for _, v in table(project)} == {"default", "terse"} and len(table(project)) == 2 * N
    kept = project.query("select count(*) from main.llm_batch_row_answers where variant = 'claude'")
    assert kept == [(N,)]
    # Adding it back shows its stored answers again, without a request.
    project.write("models/evals.sql", eval_model(variants_config()))
    project.dbt("run", "-s", "evals")
    assert len(batches_by_face(emulator)) == 3 and len(emulator.billed()) == 3 * N
    assert table(project) == rows


def test_a_bad_variant_fails_before_anything_is_recorded(project, emulator):
    write_seed(project)
    project.write("models/evals.sql", eval_model("llm_variants = {'wide': {'llm_output': {'category': 'text'}}}"))
    result = project.dbt("run", "-s", "evals", expect_ok=False)
    assert "llm_variants['wide']: 'llm_output' cannot differ per variant" in failure_messages(result)
    assert emulator.batches() == []
    tables = project.query("select table_name from information_schema.tables where table_name like 'llm_batch%'")
    assert tables == []


def test_the_dry_run_reports_each_variant(evals, emulator):
    evals.dbt("run", "-s", "evals", "--vars", "{llm_batch_dry_run: true}")
    log = log_text(evals)
    for variant in ("default", "terse", "claude"):
        assert f"main.evals (variant {variant}): DRY RUN: would submit {N} request(s) in 1 batch(es)" in log, variant
    # The batches a real run would make: one per provider, the two OpenAI variants together.
    assert (
        f"main.evals: DRY RUN: openai (gpt-4o-mini) would get {2 * N} request(s) in 1 batch(es): "
        f"variant default {N}, variant terse {N}"
    ) in log
    assert f"main.evals: DRY RUN: anthropic (claude-sonnet-4-5) would get {N} request(s) in 1 batch(es)" in log
    assert emulator.batches() == []


# -- The integration project's evaluation run and judge ----------------------------------------------

EVAL_SYSTEMS = {
    "baseline": "You triage customer support tickets. Answer with the category and a one-line summary.",
    "concise": "Classify the support ticket. Keep the summary under ten words.",
}
EVAL_SYSTEMS["claude"] = EVAL_SYSTEMS["baseline"]
JUDGE_SYSTEM = (
    "You grade the one-line summary of a support ticket: is it faithful to the ticket and useful to an agent? "
    "Give a score from 1 (useless) to 5 (excellent) and a verdict."
)


def test_the_integration_project_evaluation_run_and_its_judge(project, emulator):
    eval_schema = parse_config(
        {
            "unique_key": "id",
            "llm_model": "m",
            "llm_output": {"category": ["billing", "bug", "how_to", "feature_request", "other"], "summary": "text"},
        }
    ).output_json_schema()
    judge_schema = parse_config(
        {"unique_key": "id", "llm_model": "m", "llm_output": {"score": "integer", "verdict": ["good", "poor"]}}
    ).output_json_schema()
    project.dbt("seed", "-s", "support_tickets", "ticket_labels")
    select = ("-s", "+tag:evaluation")
    project.dbt("run", *select)  # the variants are asked; the judge has nothing final to grade yet
    assert sorted(face for face, _, _ in batches_by_face(emulator)) == ["anthropic", "openai"]  # one per provider
    emulator.complete_all()
    project.dbt("run", *select)  # the variants' answers are merged, then the judge asks about them
    emulator.complete_all()
    project.dbt("build", *select)  # the grades are merged, the report built, the tests pass

    tickets = dict(
        project.query(
            "select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body from main.support_tickets"
        )
    )
    label = dict(project.query("select ticket_id, expected_category from main.ticket_labels"))
    rows = project.query("select ticket_id, llm_variant, category, summary, llm_status from main.ticket_triage_eval")
    assert len(rows) == 3 * len(tickets)
    answers = {}
    for tid, variant, category, summary, status in rows:
        assert status == "succeeded"
        expected = json.loads(expected_answer(EVAL_SYSTEMS[variant], tickets[tid], eval_schema))
        assert (category, summary) == (expected["category"], expected["summary"]), (tid, variant)
        answers[(tid, variant)] = (category, summary)

    grades = project.query("select ticket_id, judged_variant, score, verdict, llm_status from main.ticket_triage_judge")
    assert len(grades) == len(rows)
    for tid, variant, score, verdict, status in grades:
        assert status == "succeeded"
        prompt = f"{tickets[tid]}\n\nSummary to grade: {answers[(tid, variant)][1]}"
        expected = json.loads(expected_answer(JUDGE_SYSTEM, prompt, judge_schema))
        assert (score, verdict) == (expected["score"], expected["verdict"]), (tid, variant)

    report = {
        r[0]: r[1:]
        for r in project.query(
            "select variant, rows, category_accuracy, judge_score from main.ticket_triage_eval_report"
        )
    }
    assert set(report) == set(EVAL_SYSTEMS)
    for variant in EVAL_SYSTEMS:
        right = sum(answers[(tid, variant)][0] == label[tid] for tid in tickets)
        scores = [g[2] for g in grades if g[1] == variant]
        n, accuracy_, judge_score = report[variant]
        assert n == len(tickets)
        assert float(accuracy_) == pytest.approx(right / len(tickets)), variant
        assert float(judge_score) == pytest.approx(sum(scores) / len(scores)), variant


# -- A crash with two providers' batches in flight -------------------------------------------------

CLAUDE = "llm_variants = {'claude': {'llm_provider': 'anthropic', 'llm_model': 'claude-sonnet-4-5'}}"


@pytest.mark.parametrize(
    "point,occurrence,in_harvest",
    [
        ("after_create", 1, False),  # the OpenAI batch made, its id not recorded; Anthropic not yet sent
        ("after_create", 2, False),  # OpenAI recorded; the Anthropic batch made, its id not recorded
        ("after_store", 1, True),  # both ended: killed after the first batch's lines were stored
        ("before_merge", 1, True),  # both harvested, nothing merged
    ],
)
def test_a_killed_run_with_two_providers_in_flight_is_finished_by_later_runs(
    project, emulator, point, occurrence, in_harvest, tmp_path
):
    project.write("models/triage.sql", triage_model(extra_config=CLAUDE))
    project.dbt("seed", "-s", "support_tickets")
    if in_harvest:  # die in the run that harvests both, not the one that submits
        project.dbt("run", "-s", "triage")
        assert sorted(is_anthropic(b) for b in sorted_batches(emulator)) == [False, True]
        emulator.complete_all()
    kill_then_run_on(
        project, emulator, tmp_path / "crash-marker", point, {"DBT_LLM_BATCH_CRASH_OCCURRENCE": str(occurrence)}
    )

    rows = project.query("""select t.ticket_id, t.llm_variant, s.subject, s.body, t.category, t.urgent, t.summary,
                                   t.llm_status, t.llm_model
                            from main.triage t join main.support_tickets s using (ticket_id)""")
    assert sorted((r[0], r[1]) for r in rows) == sorted((i, v) for i in range(1, 7) for v in ("claude", "default"))
    for _, variant, subject, body, category, urgent, summary, status, llm_model in rows:
        assert status == "succeeded"
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}\n\n{body}")
        assert llm_model == ("claude-sonnet-4-5" if variant == "claude" else "gpt-4o-mini")
    # Nothing lost: every result either provider returned is stored in the ledger.
    stored = {r[0] for r in project.query("select custom_id from main.llm_batch_results")}
    assert set(succeeded_custom_ids(emulator)) <= stored
    # Nothing billed twice: each key billed once by each provider (twice in all), counting every batch.
    key_of_prompt = {f"Subject: {r[2]}\n\n{r[3]}": r[0] for r in rows}
    billed = billed_per_key(emulator, key_of_prompt)
    assert sorted(billed.values()) == [2] * 6, billed
    faces = {face: sum(1 for b in emulator.billed() if b["face"] == face) for face in ("openai", "anthropic")}
    assert faces == {"openai": 6, "anthropic": 6}


def test_identical_variants_share_their_requests(project, emulator):
    write_seed(project)
    # 'twin' sets a key to the model's own value: its requests are the default's, sent once for both.
    project.write("models/evals.sql", eval_model("llm_variants = {'twin': {'llm_max_tokens': 100}}"))
    project.dbt("run", "-s", "evals")
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", N)]
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert len(rows) == 2 * N and len(emulator.billed()) == N
    for i in range(N):
        assert (
            rows[(i, "twin")][:4]
            == rows[(i, "default")][:4]
            == (answer(SYSTEM_A, i), "succeeded", "gpt-4o-mini", rows[(i, "default")][3])
        )
    # One request answers both rows: its cost is split between them, and adds up to what was billed once.
    costs = dict(project.query("select llm_variant, sum(llm_cost_usd) from main.evals group by 1"))
    request_cost = project.query("select sum(cost_usd) from main.llm_batch_requests where model = 'main.evals'")[0][0]
    assert costs["twin"] + costs["default"] == request_cost > 0
    assert abs(costs["twin"] - costs["default"]) <= N * Decimal("0.000000001")


def test_realtime_rows_go_through_each_variant_s_provider_and_the_budget_names_the_variant(project, emulator):
    write_seed(project)
    claude = "llm_variants = {'claude': {'llm_provider': 'anthropic', 'llm_model': 'claude-sonnet-4-5'}}"
    project.write("models/evals.sql", eval_model(f"llm_realtime_when = 'id < 3', {claude}"))
    project.dbt("run", "-s", "evals")
    realtime = sorted((b["face"], b["prompt"]) for b in emulator.billed() if b["via"] == "realtime")
    assert realtime == sorted((face, prompt_of(i)) for face in ("openai", "anthropic") for i in range(3))
    assert sorted((face, n) for face, n, _ in batches_by_face(emulator)) == [("anthropic", N - 3), ("openai", N - 3)]
    rows = table(project)  # the urgent rows are answered within the run, for both variants
    assert sorted(rows) == sorted((i, v) for i in range(3) for v in ("default", "claude"))
    assert all(r[0] == answer(SYSTEM_A, i) and r[1] == "succeeded" for (i, _), r in rows.items())

    # A budget: checked once for the whole run (both variants' batch and realtime requests) against
    # everything the model has in flight; the refusal names the variants, and nothing more is sent.
    emulator.complete_all()
    billed = len(emulator.billed())
    project.write("models/evals.sql", eval_model(f"llm_max_cost_usd = 0.000001, {claude}", system=SYSTEM_B))
    result = project.dbt("run", "-s", "evals", expect_ok=False)
    message = failure_messages(result)
    assert f"main.evals (variants default, claude): refusing to submit {2 * N} request(s)" in message
    assert "exceeds llm_max_cost_usd (this model)" in message
    assert len(batches_by_face(emulator)) == 2 and len(emulator.billed()) == billed
    assert len(table(project)) == 2 * N  # what was final is merged first


# -- One batch per sender, the budget and the caps across variants ----------------------------------


def billed_once(emulator) -> bool:
    """Nothing paid twice: every request the sandbox billed has its own custom_id (variants that
    share a request share its id)."""
    counts = collections.Counter(b["custom_id"] for b in emulator.billed())
    return all(n == 1 for n in counts.values())


def test_two_openai_variants_on_two_models_go_in_two_batches(project, emulator):
    """An OpenAI batch input file holds requests to one model only (OpenAI Batch API docs): variants on
    two OpenAI models are two batches, each of one model; variants on the same model share one."""
    write_seed(project)
    variants = {"big": {"llm_model": "gpt-4o"}, "terse": {"llm_system": SYSTEM_B}}
    project.write("models/evals.sql", eval_model(variants_config(variants=variants)))
    project.dbt("run", "-s", "evals")
    batches = sorted_batches(emulator)
    assert not any(is_anthropic(b) for b in batches)
    shape = sorted(
        (
            sorted({line["body"]["model"] for line in batch_input_lines(emulator, b)}),
            len(batch_input_lines(emulator, b)),
        )
        for b in batches
    )
    assert shape == [(["gpt-4o"], N), (["gpt-4o-mini"], 2 * N)]
    in_flight = project.query("select llm_model, variant, request_count from main.llm_batch_in_flight order by 1")
    # The views name the default variant as the table does ('default', llm_default_variant unset).
    assert in_flight == [("gpt-4o", "big", N), ("gpt-4o-mini", "default,terse", 2 * N)]

    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert len(rows) == 3 * N
    assert_each_row_answered(rows, {"terse": SYSTEM_B}, {"big": "gpt-4o"}, "gpt-4o-mini")
    assert len(emulator.billed()) == 3 * N and billed_once(emulator)
    # Each batch priced by its own model: big and default asked the same, at gpt-4o's and gpt-4o-mini's prices.
    costs = dict(project.query("select llm_variant, sum(llm_cost_usd) from main.evals group by 1"))
    assert float(costs["big"] / costs["default"]) == pytest.approx(2.50 / 0.15, rel=1e-3)


def test_the_budget_is_checked_for_the_whole_run_before_anything_is_sent(project, emulator):
    """A budget the default variant's plan fits under but not both variants' together: nothing is sent
    (checked variant by variant, the first variant's batch went before the second was refused)."""
    write_seed(project)
    project.write("models/evals.sql", eval_model(CLAUDE))
    project.dbt("run", "-s", "evals", "--vars", "{llm_batch_dry_run: true}")
    ceilings = {
        variant: Decimal(figure.replace(",", ""))
        for variant, figure in re.findall(
            r"main\.evals \(variant (\w+)\): DRY RUN: .*? at most \$([\d.,]+) at 100 output tokens", log_text(project)
        )
    }
    assert set(ceilings) == {"default", "claude"} and all(ceilings.values())
    limit = ceilings["default"] + ceilings["claude"] / 2
    project.write("models/evals.sql", eval_model(f"llm_max_cost_usd = {limit}, {CLAUDE}"))
    result = project.dbt("run", "-s", "evals", expect_ok=False)
    message = failure_messages(result)
    assert f"main.evals (variants default, claude): refusing to submit {2 * N} request(s)" in message
    assert emulator.batches() == [] and emulator.billed() == []
    assert project.query("select count(*) from main.llm_batch_jobs") == [(0,)]

    # Raised over both: one run sends both, one batch per provider.
    project.write("models/evals.sql", eval_model(f"llm_max_cost_usd = {2 * limit}, {CLAUDE}"))
    project.dbt("run", "-s", "evals")
    assert sorted((face, n) for face, n, _ in batches_by_face(emulator)) == [("anthropic", N), ("openai", N)]


def test_the_in_flight_caps_are_the_model_s_total_across_variants(evals, emulator):
    """llm_max_batches_in_flight (like every in-flight cap) counts the model's batches, all variants
    together; what does not fit waits in the ledger as its own variant's, and the run log shows each
    variant's share of it."""
    evals.write("models/evals.sql", eval_model(variants_config() + ", llm_max_batches_in_flight = 1"))
    evals.dbt("run", "-s", "evals")
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", 2 * N)]
    assert evals.query("select count(*) from main.llm_batch_in_flight") == [(1,)]
    assert f"{N} request(s) wait in the ledger for a later run" in log_text(evals)
    assert f"(variant claude {N})" in log_text(evals)
    waiting = evals.query("select variant, requests_waiting from main.llm_batch_progress order by 1")
    assert waiting == [("claude", N), ("default", 0), ("terse", 0)]

    evals.dbt("run", "-s", "evals")  # the one batch allowed is still in flight: nothing more is sent
    assert len(batches_by_face(emulator)) == 1
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")  # harvested: the waiting variant's batch goes now
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", 2 * N), ("anthropic", N)]
    assert evals.query("select count(*) from main.llm_batch_in_flight") == [(1,)]
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    rows = table(evals)
    assert len(rows) == 3 * N and all(r[1] == "succeeded" for r in rows.values())
    assert len(emulator.billed()) == 3 * N and billed_once(emulator)


# -- Variants under change -------------------------------------------------------------------------


def completed(project, emulator) -> dict:
    project.dbt("run", "-s", "evals")
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert len(rows) == 3 * N and all(r[1] == "succeeded" for r in rows.values())
    return rows


def test_changing_the_unique_key_of_a_model_with_variants_asks_nothing_again(evals, emulator):
    before = completed(evals, emulator)
    evals.write("models/evals.sql", eval_model(variants_config(), unique_key="ticket_no"))
    evals.dbt("run", "-s", "evals")
    assert len(batches_by_face(emulator)) == 2 and len(emulator.billed()) == 3 * N  # nothing asked again
    assert table(evals) == before  # every variant's rows, as they were
    assert evals.query("select count(*), count(distinct (ticket_no, llm_variant)) from main.evals") == [(3 * N, 3 * N)]


@pytest.mark.parametrize("in_flight", [True, False], ids=["in_flight", "answered"])
def test_a_unique_key_renamed_to_a_column_the_stored_rows_lack_re_keys_every_variant_s_requests(
    evals, emulator, in_flight
):
    """The stored rows lack the new key's column (`id` selected as `tid`): each stored request finds
    its new key by its fingerprint, every variant's (each asks its own prompt and settings), not only
    the default's; none is set aside and asked again, and the table has one row per (key, variant)."""
    if in_flight:
        evals.dbt("run", "-s", "evals")  # every variant's requests in flight
    else:
        completed(evals, emulator)
    evals.write(
        "models/evals.sql", eval_model(variants_config(), unique_key="tid").replace("select id,", "select id as tid,")
    )
    evals.dbt("run", "-s", "evals")
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    assert len(emulator.billed()) == 3 * N  # nothing asked again
    rows = evals.query("select tid, llm_variant, category, llm_status from main.evals")
    assert len(rows) == len({(tid, variant) for tid, variant, *_ in rows}) == 3 * N
    for tid, variant, category, status in rows:
        assert (status, category) == ("succeeded", answer(SYSTEMS[variant], tid)), (tid, variant)
    assert "kept aside" not in log_text(evals)
    assert evals.query("select count(*) from main.llm_batch_requests where model <> 'main.evals'") == [(0,)]


# The new key's columns (computed, so the stored rows lack them), and their values for a ticket_id:
# one integer, or a composite of a DATE and a text (the ledger's key holds each part as text).
NEW_KEYS = {
    "one column": ("'tno'", "ticket_id * 7 + 100 as tno", lambda t: (t * 7 + 100,)),
    "composite": (
        "['tday', 'tgrp']",
        "date '2026-01-01' + ticket_id as tday, 'g' || (ticket_id % 2) as tgrp",
        lambda t: (datetime.date(2026, 1, 1) + datetime.timedelta(days=t), f"g{t % 2}"),
    ),
}


@pytest.mark.parametrize("new_key", NEW_KEYS)
def test_a_unique_key_changed_to_a_new_column_with_a_sampled_variant_in_flight(project, emulator, new_key):
    """The key changes to columns the stored rows lack (computed) while a sampled variant's batch is
    in flight: its requests are re-keyed by fingerprint, and one whose new key left the sample is
    merged from its stored row with its key columns from the ledger's key (the stored row has none
    of them), each cast back to its type: a row per (key, variant), each request billed once, the
    sample's keys answered."""
    unique_key, columns, key_of = NEW_KEYS[new_key]
    names = [c.split(" as ")[-1] for c in columns.split(", ")]
    terse = "Be terse."
    config = f"llm_variants = {json.dumps({'terse': {'llm_system': terse}})}, llm_variant_sample = {{'terse': 0.5}},"
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(extra_config=config))
    project.dbt("run", "-s", "triage")  # both variants' requests in flight
    rekeyed = (
        triage_model(extra_config=config)
        .replace("unique_key = 'ticket_id'", f"unique_key = {unique_key}")
        .replace("select ticket_id, subject,", f"select {columns}, ticket_id, subject,")
    )
    project.write("models/triage.sql", rekeyed)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")

    bodies = collections.Counter(json.dumps(b["request"], sort_keys=True) for b in emulator.billed())
    assert max(bodies.values()) == 1, "a request billed twice"
    found = project.query(f"""select {", ".join("t." + n for n in names)}, t.ticket_id, t.llm_variant, t.llm_status,
                                     t.category, t.urgent, t.summary, s.subject, s.body
                              from main.triage t join main.support_tickets s using (ticket_id)""")
    rows = [(tuple(row[: len(names)]), *row[len(names) :]) for row in found]
    assert len(rows) == len({(key, variant) for key, _, variant, *_ in rows})
    by_variant = collections.defaultdict(set)
    for key, ticket_id, variant, status, category, urgent, summary, subject, body in rows:
        assert (status, key) == ("succeeded", key_of(ticket_id)), (ticket_id, variant)
        system = terse if variant == "terse" else TRIAGE_SYSTEM
        assert (category, urgent, summary) == expected_triage(system, f"Subject: {subject}\n\n{body}")
        by_variant[variant].add(key)
    expected = {key_of(t) for t in range(1, 7)}
    assert by_variant["default"] == expected

    def sampled(key: tuple) -> bool:  # the documented rule over the ledger's key, each part as text
        text = json.dumps([str(part) for part in key])
        return int(hashlib.md5(text.encode()).hexdigest()[:8], 16) / 2**32 < 0.5

    assert {k for k in expected if sampled(k)} <= by_variant["terse"]


def test_two_identical_sampling_variants_each_get_their_own_answers(project, emulator):
    """At llm_temperature > 0 dedup is off by default (each row is its own sample): two variants that
    ask the same thing are two samples, each row with its own request and answer."""
    write_seed(project)
    project.write(
        "models/evals.sql", eval_model("llm_temperature = 0.7, llm_variants = {'twin': {'llm_max_tokens': 100}}")
    )
    project.dbt("run", "-s", "evals")
    sent = sorted_batches(emulator)
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", 2 * N)]
    assert len({line["custom_id"] for line in batch_input_lines(emulator, sent[0])}) == 2 * N
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert sorted(rows) == sorted((i, v) for i in range(N) for v in ("default", "twin"))
    for (i, variant), (category, status, *_rest) in rows.items():
        assert (category, status) == (answer(SYSTEM_A, i), "succeeded"), (i, variant)
    assert len(emulator.billed()) == 2 * N and billed_once(emulator)
    assert collections.Counter(b["prompt"] for b in emulator.billed()) == {prompt_of(i): 2 for i in range(N)}
    ids = project.query("select llm_variant, count(distinct llm_batch_id), count(*) from main.evals group by 1")
    assert sorted(ids) == [("default", 1, N), ("twin", 1, N)]
    project.dbt("run", "-s", "evals")  # nothing new
    assert len(sorted_batches(emulator)) == 1 and len(emulator.billed()) == 2 * N


def test_renaming_the_default_variant_relabels_its_rows_and_asks_nothing(evals, emulator):
    before = completed(evals, emulator)
    evals.write("models/evals.sql", eval_model(variants_config() + ", llm_default_variant = 'champion'"))
    evals.dbt("run", "-s", "evals")
    after = table(evals)
    assert after == {(i, "champion" if v == "default" else v): row for (i, v), row in before.items()}
    assert len(batches_by_face(emulator)) == 2 and len(emulator.billed()) == 3 * N


def test_switching_a_variant_s_provider_while_its_batch_is_in_flight(project, emulator):
    """The in-flight batch is still polled and harvested through the provider it went to (and paid
    for once); the variant's rows are asked of the new provider; nothing is lost."""
    write_seed(project)
    project.write("models/evals.sql", eval_model(variants_config(variants={"alt": {"llm_system": SYSTEM_B}})))
    project.dbt("run", "-s", "evals")
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", 2 * N)]
    moved = {"alt": {"llm_system": SYSTEM_B, "llm_provider": "anthropic", "llm_model": "claude-sonnet-4-5"}}
    project.write("models/evals.sql", eval_model(variants_config(variants=moved)))
    project.dbt("run", "-s", "evals")  # the OpenAI batch is in flight; alt is asked of Anthropic
    assert [(face, n) for face, n, _ in batches_by_face(emulator)] == [("openai", 2 * N), ("anthropic", N)]
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert len(rows) == 2 * N
    assert_each_row_answered(rows, {"alt": SYSTEM_B}, {"alt": "claude-sonnet-4-5"}, "gpt-4o-mini")
    # Nothing lost: every answer either provider gave is stored, the in-flight one's too, and costed.
    stored = {r[0] for r in project.query("select custom_id from main.llm_batch_results")}
    assert set(succeeded_custom_ids(emulator)) <= stored
    assert project.query(
        "select count(*) from main.llm_batch_requests where variant = 'alt' and status = 'succeeded' and cost_usd > 0"
    ) == [(2 * N,)]
    assert project.query("select count(*) from main.llm_batch_in_flight") == [(0,)]
    assert len(emulator.billed()) == 3 * N and billed_once(emulator)


def test_a_renamed_model_with_variants_keeps_its_batches_in_flight_with_llm_ledger_identity(evals, emulator):
    """As for a model without variants (test_under_change): renamed with llm_ledger_identity set to its
    old schema.name, it takes over the ledger and the batches in flight, paying for nothing again."""
    evals.dbt("run", "-s", "evals")
    assert len(batches_by_face(emulator)) == 2
    (evals.root / "models" / "evals.sql").unlink()
    evals.write("models/evals_v2.sql", eval_model(variants_config() + ", llm_ledger_identity = 'main.evals'"))
    evals.dbt("run", "-s", "evals_v2")  # both batches are in flight: nothing is sent
    assert len(batches_by_face(emulator)) == 2
    assert "first run of this model" not in log_text(evals)
    emulator.complete_all()
    evals.dbt("run", "-s", "evals_v2")
    rows = evals.query("select id, llm_variant, category, llm_status from main.evals_v2")
    assert len(rows) == 3 * N
    for i, variant, category, status in rows:
        assert (category, status) == (answer(SYSTEM_B if variant == "terse" else SYSTEM_A, i), "succeeded")
    assert len(emulator.billed()) == 3 * N and billed_once(emulator)


@pytest.mark.parametrize("temperature", ["0", "0.7"], ids=["shared", "sampled"])
def test_a_row_that_cannot_be_sent_fails_alone_in_each_identical_variant(project, emulator, temperature):
    """Two variants asking the same thing (one request shared at temperature 0, one sample each above
    it): a row with an empty prompt fails in both variants' rows, each with its own never-sent
    failure, and later runs record nothing again."""
    write_seed(project)
    model = eval_model(f"llm_temperature = {temperature}, llm_variants = {{'twin': {{'llm_max_tokens': 100}}}}")
    project.write("models/evals.sql", model.replace(" prompt,", " case when id = 3 then '' else prompt end as prompt,"))
    project.dbt("run", "-s", "evals")
    emulator.complete_all()
    project.dbt("run", "-s", "evals")
    rows = table(project)
    assert sorted(rows) == sorted((i, v) for i in range(N) for v in ("default", "twin"))
    assert rows[(3, "default")][:2] == rows[(3, "twin")][:2] == (None, "failed")
    errors = project.query("select llm_variant, llm_error from main.evals where id = 3 order by 1")
    assert errors == [(v, "prompt is NULL or empty: nothing was sent") for v in ("default", "twin")]
    assert all(status == "succeeded" for (i, _v), (_c, status, *_r) in rows.items() if i != 3)
    never_sent = "select variant, count(*) from main.llm_batch_requests where starts_with(custom_id, 'x_') group by 1"
    assert sorted(project.query(never_sent)) == [("", 1), ("twin", 1)]
    project.dbt("run", "-s", "evals")  # nothing new: nothing recorded again, nothing sent
    assert sorted(project.query(never_sent)) == [("", 1), ("twin", 1)]
    assert table(project) == rows and len(sorted_batches(emulator)) == 1


def test_a_column_changed_while_the_champion_is_re_asked_refreshes_every_variants_rows(evals, emulator):
    """The merge skips refreshing the rows it did not write when it wrote every selected key's row,
    but not with variants: a sampled challenger's rows of keys that left its sample are kept
    (llm_on_unselected 'keep') and only another pass's refresh brings them the column's new value."""
    sample = lambda fraction: variants_config(variants={"terse": {"llm_system": SYSTEM_B}}, sample={"terse": fraction})  # noqa: E731
    left = {i for i in range(N) if in_sample(i, 0.5) and not in_sample(i, 0.3)}
    assert left, "some keys leave the challenger's sample"
    evals.write("models/evals.sql", eval_model(sample(0.5)))
    evals.dbt("run", "-s", "evals")
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")
    evals.write("models/evals.sql", eval_model(sample(0.3)))
    evals.dbt("run", "-s", "evals")  # the challenger's rows of the keys that left stay
    evals.write("models/evals.sql", eval_model(sample(0.3), system=SYSTEM_B2))
    evals.dbt("run", "-s", "evals")  # the champion asks every key again
    evals.write("models/evals.sql", eval_model(sample(0.3), system=SYSTEM_B2).replace("id + 1000", "id + 2000"))
    emulator.complete_all()
    evals.dbt("run", "-s", "evals")  # the champion writes every key; the challenger has nothing new
    rows = evals.query("select id, llm_variant, ticket_no from main.evals")
    assert {i for i, v, _ in rows if v == "terse"} >= left
    assert [(i, v, t) for i, v, t in rows if t != i + 2000] == []


def run_until_answered(project, emulator, name: str, model: str) -> None:
    """`model` written, run, its batches ended, and run again to merge them."""
    project.write(f"models/{name}.sql", model)
    project.dbt("run", "-s", name)
    emulator.complete_all()
    project.dbt("run", "-s", name)


@pytest.mark.parametrize("when", ["in_flight", "answered"])
def test_requests_kept_aside_by_a_key_change_answer_their_rows_when_they_are_selected_again(project, emulator, when):
    """unique_key changes to a computed column while the selection is narrowed: the requests of the
    rows left out match no selected row (their stored rows lack the new key) and are kept aside. When
    the rows are selected again, those requests answer them (taken back under their new key): nothing
    is asked, or paid, twice; every (key, variant) row lands with its variant's answer."""
    terse = "Be terse."
    config = f"llm_variants = {json.dumps({'terse': {'llm_system': terse}})},"
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(extra_config=config))
    project.dbt("run", "-s", "triage")  # 12 requests in flight
    if when == "answered":
        emulator.complete_all()
        project.dbt("run", "-s", "triage")
    rekeyed = (
        triage_model(extra_config=config)
        .replace("unique_key = 'ticket_id'", "unique_key = 'tno'")
        .replace("select ticket_id, subject,", "select ticket_id * 7 + 100 as tno, ticket_id, subject,")
    )
    project.write("models/triage.sql", rekeyed + "where ticket_id <= 3\n")
    project.dbt("run", "-s", "triage")  # tickets 4-6's requests kept aside
    aside = "select count(*) from main.llm_batch_requests where model like 'main.triage (unique_key %'"
    assert project.query(aside) == [(6,)]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    run_until_answered(project, emulator, "triage", rekeyed)  # every ticket selected again

    assert project.query(aside) == [(0,)]
    bodies = collections.Counter(json.dumps(b["request"], sort_keys=True) for b in emulator.billed())
    assert len(bodies) == 12 and max(bodies.values()) == 1, "a request billed twice"
    rows = project.query("""select t.tno, t.ticket_id, t.llm_variant, t.llm_status, t.category, t.urgent, t.summary,
                                   s.subject, s.body
                            from main.triage t join main.support_tickets s using (ticket_id)""")
    assert sorted((tno, v) for tno, _, v, *_ in rows) == sorted(
        (t * 7 + 100, v) for t in range(1, 7) for v in ("default", "terse")
    )
    for tno, ticket_id, variant, status, category, urgent, summary, subject, body in rows:
        assert (status, tno) == ("succeeded", ticket_id * 7 + 100), (ticket_id, variant)
        system = terse if variant == "terse" else TRIAGE_SYSTEM
        assert (category, urgent, summary) == expected_triage(system, f"Subject: {subject}\n\n{body}")


@pytest.mark.parametrize("narrowed", [True, False], ids=["narrowed", "all_selected"])
@pytest.mark.parametrize("when", ["in_flight", "answered"])
def test_a_key_change_keeps_one_row_per_key_when_rows_share_requests(project, emulator, when, narrowed):
    """unique_key changes to a computed column while rows share requests (llm_dedup, on by default:
    rows asking the same prompt), with every row selected or (`narrowed`) one row per prompt, then all
    again: each key has one row, with its prompt's answer; each prompt is billed once; the rows' costs
    add up to what was billed. (The rows answered by another row's request, whose stored row lacks the
    new key, took that row's key by their shared fingerprint: three rows of one key in the table.)"""
    from helpers import PRICES, billed_cost, dup_model, prompt_of, write_rows

    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {i: i % 4 for i in range(12)})  # 4 prompts, 3 rows each
    model = dup_model("openai")
    project.write("models/dup.sql", model)
    project.dbt("run", "-s", "dup")  # 4 requests in flight, answering 12 rows
    if when == "answered":
        emulator.complete_all()
        project.dbt("run", "-s", "dup")
    rekeyed = model.replace("unique_key='id'", "unique_key='tno'").replace("select *", "select id + 2000 as tno, *")
    if narrowed:
        run_until_answered(project, emulator, "dup", rekeyed + "where id < 4\n")  # one row per prompt
    run_until_answered(project, emulator, "dup", rekeyed)  # every row selected again

    billed = collections.Counter(json.dumps(b["request"], sort_keys=True) for b in emulator.billed())
    assert len(billed) == 4 and max(billed.values()) == 1, "a prompt billed twice"
    rows = project.query("select tno, id, prompt, llm_status, llm_output, llm_cost_usd from main.dup order by tno")
    assert [(t, i) for t, i, *_ in rows] == [(i + 2000, i) for i in range(12)]
    for _, i, prompt, status, output, _ in rows:
        asked = prompt_of(i % 4)
        assert (prompt, status, output) == (asked, "succeeded", expected_answer(None, asked, None)), i
    assert sum(cost for *_, cost in rows) == billed_cost(emulator, "openai")
