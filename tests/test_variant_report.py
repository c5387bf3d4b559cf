"""Comparing answers with expected values in SQL: the variant_report macro and the min_accuracy test,
on a real llm_batch table answered by the sandbox and on a hand-made table with several variants.
Every expected figure is computed here, in Python, from the rows themselves."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest
from conftest import failure_messages
from helpers import TRIAGE_OUTPUT, TRIAGE_SYSTEM, expected_triage, log_text

# -- A hand-made table with three variants ---------------------------------------------------------

VARIANTS = ("concise", "default", "verbose")


def eval_rows() -> list[dict]:
    """40 keys x 3 variants, with answers that agree and disagree in known ways."""
    rows = []
    for i in range(40):
        expected = {
            "category": ["billing", "bug", "other"][i % 3],
            "summary": f"Ticket {i} about a refund",
            "score": round(i / 7, 3),
            "urgent": i % 2 == 0,
        }
        for v, variant in enumerate(VARIANTS):
            wrong = (i + v) % (v + 3) == 0  # each variant wrong on its own share of keys
            rows.append(
                {
                    "id": i,
                    "llm_variant": variant,
                    "category": "bug" if wrong and expected["category"] != "bug" else expected["category"],
                    # Normalisation: case, surrounding spaces, inner runs of spaces and a final "." are
                    # not differences; a changed word is.
                    "summary": (f"  ticket {i}  about a REFUND. " if v == 1 else expected["summary"])
                    if not wrong
                    else f"Ticket {i} about a return",
                    "score": expected["score"] + (0.5 if wrong else 1e-9),
                    "urgent": expected["urgent"] != (wrong and v == 2),
                    # Some keys have no reference at all, for some columns: left out, not counted wrong.
                    "expected_category": None if i % 10 == 9 else expected["category"],
                    "expected_summary": expected["summary"],
                    "expected_score": expected["score"],
                    "expected_urgent": expected["urgent"],
                    "llm_status": "failed" if (i == 5 and variant == "verbose") else "succeeded",
                    "llm_cost_usd": Decimal("0.000100") * (v + 1),
                    "llm_realtime_cost_usd": Decimal("0.000200") * (v + 1),
                    "llm_input_tokens": 100 + v,
                    "llm_output_tokens": 10 * (v + 1),
                }
            )
    for row in rows:  # a failed row has no answer
        if row["llm_status"] == "failed":
            row.update(category=None, summary=None, score=None, urgent=None)
    return rows


def sql_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(value)


def eval_table_sql(rows: list[dict]) -> str:
    columns = list(rows[0])
    types = {
        "id": "integer",
        "score": "double",
        "expected_score": "double",
        "urgent": "boolean",
        "expected_urgent": "boolean",
        "llm_cost_usd": "decimal(18,9)",
        "llm_realtime_cost_usd": "decimal(18,9)",
        "llm_input_tokens": "bigint",
        "llm_output_tokens": "bigint",
    }
    values = ",\n".join("(" + ", ".join(sql_value(r[c]) for c in columns) + ")" for r in rows)
    casts = ", ".join(f"cast({c} as {types.get(c, 'varchar')}) as {c}" for c in columns)
    return f"{{{{ config(materialized='table') }}}}\nselect {casts} from (values {values}) t({', '.join(columns)})"


def normalise(text: str) -> str:
    return re.sub(r"[.!?]+$", "", re.sub(r"\s+", " ", text.strip())).lower()


def matches(column: str, actual, expected) -> bool:
    if actual is None:
        return False
    if column == "score":
        return abs(actual - expected) <= 1e-6
    if column == "summary":
        return normalise(actual) == normalise(expected)
    return actual == expected


def accuracy(rows: list[dict], column: str) -> float | None:
    judged = [r for r in rows if r[f"expected_{column}"] is not None]
    if not judged:
        return None
    return sum(matches(column, r[column], r[f"expected_{column}"]) for r in judged) / len(judged)


def agreement(rows: list[dict], column: str, a: str, b: str) -> float:
    by_key = {(r["id"], r["llm_variant"]): r for r in rows}
    both = [
        (by_key[(i, a)], by_key[(i, b)])
        for i in sorted({r["id"] for r in rows})
        if by_key[(i, a)]["llm_status"] == by_key[(i, b)]["llm_status"] == "succeeded"
    ]
    return sum(matches(column, x[column], y[column]) for x, y in both) / len(both)


REFERENCE = {c: f"expected_{c}" for c in ("category", "summary", "score", "urgent")}


def test_variant_report_per_variant_figures_and_pairwise_agreement(project):
    rows = eval_rows()
    project.write("models/evals.sql", eval_table_sql(rows))
    project.write(
        "models/eval_report.sql",
        f"{{{{ config(materialized='table') }}}}\n"
        f"{{{{ dbt_llm_batch.variant_report(ref('evals'), reference={json.dumps(REFERENCE)}, unique_key='id') }}}}",
    )
    project.dbt("run", "-s", "evals", "eval_report")

    report = project.query("select * from main.eval_report order by variant")
    names = [r[0] for r in project.query("select column_name from (describe main.eval_report)")]
    got = {row[0]: dict(zip(names, row, strict=True)) for row in report}
    assert sorted(got) == list(VARIANTS)
    for variant in VARIANTS:
        mine = [r for r in rows if r["llm_variant"] == variant]
        g = got[variant]
        assert g["rows"] == 40
        assert g["succeeded"] == sum(r["llm_status"] == "succeeded" for r in mine)
        assert g["failed"] == sum(r["llm_status"] == "failed" for r in mine)
        assert g["cost_usd"] == sum(r["llm_cost_usd"] for r in mine)
        assert g["realtime_cost_usd"] == sum(r["llm_realtime_cost_usd"] for r in mine)
        assert g["input_tokens"] == sum(r["llm_input_tokens"] for r in mine)
        assert g["output_tokens"] == sum(r["llm_output_tokens"] for r in mine)
        for column in REFERENCE:
            assert float(g[f"{column}_accuracy"]) == pytest.approx(accuracy(mine, column)), (variant, column)
        assert g["category_judged"] == 36  # 4 keys have no expected category
        for column in REFERENCE:
            others = {o: float(x) for o, x in g[f"{column}_agreement"].items()}
            assert others == pytest.approx({o: agreement(rows, column, variant, o) for o in VARIANTS if o != variant})
    # The data really does exercise each rule: normalised text matches, and not every variant is perfect.
    assert got["default"]["summary_accuracy"] > 0 and any(g["score_accuracy"] < 1 for g in got.values())


def test_min_accuracy_gates_each_variant_with_the_figure_in_the_log(project):
    rows = eval_rows()
    project.write("models/evals.sql", eval_table_sql(rows))
    measured = {v: accuracy([r for r in rows if r["llm_variant"] == v], "category") for v in VARIANTS}
    worst, best = min(measured.values()), max(measured.values())
    assert worst < best

    def gate(minimum: float, variant: str | None) -> None:
        args = {"reference": "expected_category", "minimum": minimum}
        if variant:
            args["variant"] = variant
        project.write(
            "models/schema_evals.yml",
            "version: 2\nmodels:\n  - name: evals\n    columns:\n      - name: category\n        data_tests:\n"
            f"          - dbt_llm_batch.min_accuracy:\n              arguments: {json.dumps(args)}\n",
        )

    gate(round(worst - 0.01, 4), None)
    project.dbt("build", "-s", "evals")

    gate(round(best + 0.01, 4), None)
    result = project.dbt("build", "-s", "evals", expect_ok=False)
    assert not result.success and "Got 3 results" in failure_messages(result)
    log = log_text(project)
    for variant, figure in measured.items():
        assert f"variant '{variant}': accuracy {figure:.4f} over 36 row(s) with a reference, below the minimum" in log

    best_variant = max(measured, key=measured.get)
    gate(round(best - 0.001, 4), best_variant)
    project.dbt("build", "-s", "evals")
    gate(round(best - 0.001, 4), "no_such_variant")  # a variant with nothing to measure fails
    assert not project.dbt("build", "-s", "evals", expect_ok=False).success


# -- A real llm_batch table answered by the sandbox ------------------------------------------------


def labelled_triage_model() -> str:
    """The triage model, selecting an expected category next to each ticket: right for some tickets
    (the sandbox's own answer), wrong for others, differently cased for some (an enum is compared
    exactly: 'Billing' is not 'billing'), missing for some (left out)."""
    return f"""
{{{{ config(
    materialized = 'llm_batch', llm_provider = 'openai', llm_model = 'gpt-4o-mini',
    unique_key = 'ticket_id', llm_system = {json.dumps(TRIAGE_SYSTEM)},
    llm_output = {json.dumps(TRIAGE_OUTPUT)}, llm_max_tokens = 200, llm_wait_seconds = 60
) }}}}
select t.ticket_id, t.prompt, l.expected_category
from (select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body as prompt
      from {{{{ ref('support_tickets') }}}}) t
left join {{{{ ref('triage_labels') }}}} l using (ticket_id)
"""


def test_variant_report_and_min_accuracy_on_an_llm_batch_table(project, emulator):
    emulator.auto_advance_seconds = 0.2
    project.dbt("seed", "-s", "support_tickets")
    tickets = project.query(
        "select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body from main.support_tickets order by 1"
    )
    answers = {tid: expected_triage(TRIAGE_SYSTEM, prompt)[0] for tid, prompt in tickets}
    labels = {}
    for n, (tid, answer) in enumerate(sorted(answers.items())):
        labels[tid] = [answer, answer.capitalize(), "other" if answer != "other" else "bug", None, answer][n % 5]
    project.write(
        "models/triage_labels.sql",
        "select * from (values "
        + ", ".join(f"({tid}, {sql_value(label)})" for tid, label in labels.items())
        + ") t(ticket_id, expected_category)",
    )
    project.write("models/triage.sql", labelled_triage_model())
    project.write(
        "models/triage_report.sql",
        "{{ dbt_llm_batch.variant_report(ref('triage'), reference={'category': 'expected_category'}) }}",
    )
    project.dbt("run", "-s", "triage_labels", "triage", "triage_report")

    judged = [tid for tid, label in labels.items() if label is not None]
    right = [tid for tid in judged if labels[tid] == answers[tid]]
    expected = len(right) / len(judged)
    assert 0 < expected < 1
    (variant, rows, succeeded, accuracy_, judged_n) = project.query(
        "select variant, rows, succeeded, category_accuracy, category_judged from main.triage_report"
    )[0]
    # No llm_variant column: the whole table is the variant 'default'.
    assert (variant, rows, succeeded, judged_n) == ("default", len(tickets), len(tickets), len(judged))
    assert float(accuracy_) == pytest.approx(expected)
