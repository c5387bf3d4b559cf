"""Feeling native to dbt: errors read like dbt's own (one message, no Python traceback unless
--debug), enforced contracts, `dbt-llm-batch check` before a run, and docs and lineage."""

from __future__ import annotations

import json

from conftest import failure_messages
from helpers import TRIAGE_OUTPUT, triage_model

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]


def console_of(capfd, result) -> str:
    """What dbt printed (in-process runs print to this process's stdout/stderr) and the failures' text."""
    out, err = capfd.readouterr()
    return out + err + "\n" + failure_messages(result)


def test_a_config_typo_is_one_message_without_traceback(project, emulator, capfd):
    project.write(MODEL, triage_model(extra_config="llm_temprature = 0.2,"))
    project.dbt("seed")
    capfd.readouterr()
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert not result.success
    assert "unknown config key 'llm_temprature' (did you mean 'llm_temperature'?)" in output
    assert "Traceback" not in output and "Python model failed" not in output
    assert "Compilation Error in model triage" in output, output[-3000:]
    assert emulator.batches() == []


def test_a_missing_key_is_one_message_without_traceback(project, emulator, capfd, monkeypatch):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    monkeypatch.delenv("OPENAI_API_KEY")
    capfd.readouterr()
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert not result.success
    assert "OPENAI_API_KEY is not set" in output
    assert "Traceback" not in output and "Python model failed" not in output
    assert output.count("OPENAI_API_KEY is not set") == failure_messages(result).count("OPENAI_API_KEY is not set") + 1
    assert emulator.batches() == []


def test_a_schema_change_is_one_message_without_traceback_and_debug_shows_it(project, emulator, capfd):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    changed = triage_model(extra_config="on_schema_change = 'fail',")
    project.write(MODEL, changed.replace("select ticket_id,", "select ticket_id, 1 as extra,"))
    capfd.readouterr()
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert "the columns of" in output and "added: extra INTEGER" in output
    assert "dbt run --full-refresh -s triage" in output and "<model>" not in output
    assert "Traceback" not in output and "Python model failed" not in output
    # With --debug the traceback is there for a bug report, in dbt's debug log lines.
    result = project.dbt("--debug", "run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert "Traceback" in output and "schema_change.py" in output
    assert "Traceback" not in failure_messages(result)


CONTRACT_YML = """
version: 2
models:
  - name: triage
    config:
      contract: {{enforced: true}}
    columns:
      - {{name: ticket_id, data_type: integer}}
      - {{name: subject, data_type: varchar}}
      - {{name: priority, data_type: {priority}}}
      - {{name: prompt, data_type: text}}
      - {{name: category, data_type: varchar}}
      - {{name: summary, data_type: varchar}}
      - {{name: urgent, data_type: boolean}}
      - {{name: llm_status, data_type: varchar}}
      - {{name: llm_cost_usd, data_type: "decimal(18,9)"}}
"""


def test_an_enforced_contract_that_disagrees_fails_before_any_call(project, emulator, capfd):
    project.write(MODEL, triage_model())
    project.write("models/triage.yml", CONTRACT_YML.format(priority="integer"))  # priority is text
    project.dbt("seed")
    capfd.readouterr()
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert not result.success
    assert "This model has an enforced contract that failed." in output  # dbt's own ContractError
    mismatch = [line for line in output.splitlines() if "| data type mismatch" in line]
    assert len(mismatch) == 2 and all("priority" in line and "INTEGER" in line for line in mismatch), output
    assert "Traceback" not in output
    assert emulator.stats()["calls"] == {}  # no provider call at all

    # An undeclared output column is named as missing in the contract.
    project.write("models/triage.yml", CONTRACT_YML.format(priority="varchar").replace("- {name: urgent", "# "))
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert any("urgent" in line and "missing in contract" in line for line in output.splitlines()), output
    assert emulator.stats()["calls"] == {}


def test_an_enforced_contract_that_agrees_runs(project, emulator):
    project.write(MODEL, triage_model())
    project.write("models/triage.yml", CONTRACT_YML.format(priority="varchar"))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]


def test_check_catches_a_misspelled_key_that_dbt_parse_accepts(project, capsys):
    from dbt_llm_batch.ops.cli import main as cli

    project.write(MODEL, triage_model())
    project.dbt("parse")
    capsys.readouterr()
    assert cli(["check", "--project-dir", str(project.root)]) == 0
    assert "llm_batch model(s) checked: no problems" in capsys.readouterr().out

    project.write(MODEL, triage_model(extra_config="llm_temprature = 0.2,"))
    project.write(
        "models/batch/review_typo.sql",
        "{{ config(materialized='llm_batch', unique_key='id', llm_max_tokens='lots') }}\nselect 1 as id, 'x' as prompt",
    )
    assert project.dbt("parse").success  # dbt itself accepts both
    capsys.readouterr()
    assert cli(["check", "--project-dir", str(project.root)]) == 1
    err = capsys.readouterr().err
    assert "triage (models/triage.sql): invalid llm_batch config:" in err
    assert "unknown config key 'llm_temprature' (did you mean 'llm_temperature'?)" in err
    assert "review_typo (models/batch/review_typo.sql): invalid llm_batch config:" in err
    assert "llm_max_tokens must be an integer, got 'lots'" in err
    assert not project.db_path.exists()  # no warehouse was opened, let alone written

    manifest = project.root / "target" / "manifest.json"
    assert cli(["check", "--manifest", str(manifest)]) == 1
    assert cli(["check", "--project-dir", str(project.root / "nowhere")]) == 2
    assert "run `dbt parse`" in capsys.readouterr().err


def test_docs_show_the_llm_column_descriptions_and_the_ledger_sources(project, emulator):
    from dbt_llm_batch.pipeline.docs import COLUMN_DESCRIPTIONS, output_description

    project.write(MODEL, triage_model())
    project.write(
        "models/ledger_costs.sql",
        "select model, sum(cost_usd) as cost from {{ source('llm_batch_ledger', 'llm_batch_costs') }} group by 1",
    )
    project.dbt("seed")
    project.dbt("run", *SELECT)
    emulator.complete_all()
    project.dbt("run", "-s", "triage", "ledger_costs")  # a downstream model can select from the ledger
    assert project.query("select count(*) from main.ledger_costs") == [(1,)]
    project.dbt("docs", "generate")

    catalog = json.loads((project.root / "target" / "catalog.json").read_text())
    manifest = json.loads((project.root / "target" / "manifest.json").read_text())
    columns = catalog["nodes"]["model.integration_project.triage"]["columns"]
    for name in ("llm_status", "llm_error", "llm_finish_reason", "llm_cost_usd", "llm_route"):
        assert columns[name]["comment"] == COLUMN_DESCRIPTIONS[name]
    assert columns["category"]["comment"] == output_description(
        "category", {"type": "string", "enum": TRIAGE_OUTPUT["category"]}
    )
    assert columns["category"]["comment"] == (
        "The answer's 'category' field (llm_output): one of ['billing', 'bug', 'how_to', 'feature_request', "
        "'other']. NULL when llm_status is 'failed'."
    )
    assert columns["subject"]["comment"] is None  # the user's own columns are theirs to describe

    for name in (
        "llm_batch_requests",
        "llm_batch_jobs",
        "llm_batch_results",
        "llm_batch_in_flight",
        "llm_batch_costs",
        "llm_batch_progress",
        "llm_batch_failures",
        "llm_batch_focus",
    ):
        unique_id = f"source.dbt_llm_batch.llm_batch_ledger.{name}"
        assert manifest["sources"][unique_id]["schema"] == "main"
        assert manifest["sources"][unique_id]["description"]
        assert unique_id in catalog["sources"], name  # found in the warehouse
    # Lineage: the downstream model depends on the ledger's view.
    assert manifest["nodes"]["model.integration_project.ledger_costs"]["depends_on"]["nodes"] == [
        "source.dbt_llm_batch.llm_batch_ledger.llm_batch_costs"
    ]


def test_a_warning_test_flags_a_model_whose_rows_are_still_pending(project, emulator):
    project.write(MODEL, triage_model())
    project.write(
        "models/triage.yml",
        "version: 2\nmodels:\n  - name: triage\n    data_tests:\n      - dbt_llm_batch.no_pending_requests\n",
    )
    project.dbt("seed")
    project.dbt("run", *SELECT)  # submitted: 6 requests pending at the provider
    result = project.dbt("test", *SELECT)  # a warning, not a failure
    [test] = result.result.results
    assert (str(test.status), test.failures) == ("warn", 1)

    emulator.complete_all()
    project.dbt("run", *SELECT)
    [test] = project.dbt("test", *SELECT).result.results
    assert (str(test.status), test.failures) == ("pass", 0)


def test_an_error_in_the_model_sql_is_dbt_s_database_error(project, emulator, capfd):
    project.write(MODEL, triage_model().replace("select ticket_id,", "select ticket_id, no_such_column,"))
    project.dbt("seed")
    capfd.readouterr()
    result = project.dbt("run", *SELECT, expect_ok=False)
    output = console_of(capfd, result)
    assert "Database Error in model triage" in output
    assert "the model's SQL failed, nothing was sent: Binder Error" in output and "no_such_column" in output
    assert "Traceback" not in output
    assert emulator.stats()["calls"] == {}
