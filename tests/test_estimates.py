"""Honest estimates: once a model has answers, a request's output is estimated from them (the 95th
percentile of its recent answers' output tokens), not at llm_max_tokens; the run log and the dry run
show the expected figure and the ceiling; budgets gate on the ceiling unless llm_budget_basis =
'expected'. On the demo workload (integration_project's batch models against the sandbox), the estimate
after a first harvested run is within 2x of what the next run actually costs."""

from __future__ import annotations

import re
from decimal import Decimal

from conftest import failure_messages
from helpers import PROVIDER_MODELS, log_text

MODELS = ("ticket_triage", "review_summary")
# Same length as the demo's system prompts, different words: every row is asked again, with the same
# input size, so the first run's answers are this run's history.
REWORDED = {
    "ticket_triage": ("You triage customer support tickets.", "You triage customer service tickets."),
    "review_summary": ("Summarise the product review", "Summarize the product review"),
}


def use_provider(project, provider: str) -> None:
    path = project.root / "dbt_project.yml"
    text = path.read_text().replace("+llm_provider: openai", f"+llm_provider: {provider}")
    path.write_text(text.replace("+llm_model: gpt-4o-mini", f"+llm_model: {PROVIDER_MODELS[provider]}"))


def reword(project, extra: str = "") -> None:
    for model, (old, new) in REWORDED.items():
        assert len(old) == len(new)
        path = project.root / "models" / "batch" / f"{model}.sql"
        path.write_text(path.read_text().replace(old, new).replace("config(", f"config({extra}", 1))


def cost_since(project, model: str, before: list[str]) -> Decimal:
    """What the model's succeeded requests not among `before` (custom_ids) cost."""
    return project.query(
        "select sum(cost_usd) from main.llm_batch_requests where model = ? and status = 'succeeded' "
        "and not list_contains(?, custom_id)",
        [f"main.{model}", before],
    )[0][0]


def custom_ids(project, model: str) -> list[str]:
    return [
        r[0] for r in project.query("select custom_id from main.llm_batch_requests where model = ?", [f"main.{model}"])
    ]


def money(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def dry_run_figures(project, model: str) -> tuple[Decimal, Decimal, str]:
    """(estimated, ceiling, the whole line) of the model's last dry-run line."""
    line = [x for x in log_text(project).splitlines() if f"main.{model}: DRY RUN" in x][-1]
    estimated = money(re.search(r"estimated \$([\d.,]+) at batch prices", line)[1])
    ceiling = re.search(r"at most \$([\d.,]+) at (\d+) output tokens a request", line)
    return estimated, money(ceiling[1]) if ceiling else estimated, line


def test_estimate_after_a_first_run_is_within_2x_of_the_actual_cost(project, emulator, provider):
    use_provider(project, provider)
    project.dbt("seed")
    project.dbt("run", "-s", *MODELS)  # a first run has no history: every answer counted at llm_max_tokens
    emulator.complete_all()
    project.dbt("run", "-s", *MODELS)
    before = {m: custom_ids(project, m) for m in MODELS}

    reword(project)
    project.dbt("run", "-s", *MODELS, "--vars", "{llm_batch_dry_run: true}")
    estimates = {m: dry_run_figures(project, m) for m in MODELS}
    project.dbt("run", "-s", *MODELS)
    summary = {m: [x for x in log_text(project).splitlines() if f"main.{m}: submitted" in x][-1] for m in MODELS}
    emulator.complete_all()
    project.dbt("run", "-s", *MODELS)
    for model in MODELS:
        actual = cost_since(project, model, before[model])
        assert actual > 0
        estimated, ceiling, line = estimates[model]
        assert actual / 2 <= estimated <= actual * 2, (model, estimated, actual, line)
        assert estimated < ceiling and "expected output" in line and "from this model's last" in line, line
        # The run line shows both figures.
        assert re.search(r"\(estimated \$[\d.,]+, at most \$[\d.,]+\)", summary[model]), summary[model]


def test_budgets_gate_on_the_ceiling_unless_asked_for_the_expected_figure(project, emulator):
    project.dbt("seed")
    project.dbt("run", "-s", "review_summary")
    emulator.complete_all()
    project.dbt("run", "-s", "review_summary")
    reword(project)
    project.dbt("run", "-s", "review_summary", "--vars", "{llm_batch_dry_run: true}")
    expected, ceiling, _ = dry_run_figures(project, "review_summary")
    assert expected < ceiling
    limit = (expected + ceiling) / 2
    reword(project, extra=f"llm_max_cost_usd = {limit}, ")
    message = failure_messages(project.dbt("run", "-s", "review_summary", expect_ok=False))
    assert f"estimated ${ceiling:.6f} plus $0.000000 already in flight exceeds" in message
    assert "llm_budget_basis = 'expected' counts that instead" in message
    assert len(emulator.batches()) == 1
    path = project.root / "models" / "batch" / "review_summary.sql"
    path.write_text(path.read_text().replace("config(", "config(llm_budget_basis = 'expected', ", 1))
    project.dbt("run", "-s", "review_summary")
    assert len(emulator.batches()) == 2
    committed = project.query(
        "select sum(estimated_cost_usd) from main.llm_batch_requests where model = 'main.review_summary' "
        "and status = 'queued'"
    )[0][0]
    assert committed.quantize(Decimal("0.000001")) == expected, "what is committed in flight counts on the same basis"
