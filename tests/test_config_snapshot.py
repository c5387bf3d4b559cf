"""Every form of a model's output config reaches `dbt-llm-batch poll` and `dbt-llm-batch check` (#30
item 10): an `llm_output` dict of compact types, JSON Schema fragments, and `llm_output_from_columns`
(the model's YAML columns). The poller settles from the snapshot a run stores (config.settle_snapshot)
and `check` validates from the manifest: both must see the config the run saw."""

from __future__ import annotations

import json

import pytest
from helpers import TRIAGE_OUTPUT, assert_triage_rows_answered, batch_counts, triage_model

from dbt_llm_batch.ops.cli import main as cli
from dbt_llm_batch.ops.poller import EXIT_DONE

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]

# The triage model's output (helpers.TRIAGE_OUTPUT) as JSON Schema fragments.
FRAGMENTS = {
    "category": {"type": "string", "enum": TRIAGE_OUTPUT["category"]},
    "urgent": {"type": "boolean"},
    "summary": {"type": "string", "description": "one line"},
}
# The same output as the model's YAML columns (the unique_key's column is documentation, not an output).
COLUMNS_YML = """
version: 2
models:
  - name: triage
    columns:
      - name: ticket_id
        data_type: integer
      - name: category
        data_type: varchar
        description: the ticket's category
      - name: urgent
        data_type: boolean
      - name: summary
        data_type: text
"""


def write_model(project, form: str) -> None:
    text = triage_model()
    if form == "fragments":
        text = text.replace(json.dumps(TRIAGE_OUTPUT), json.dumps(FRAGMENTS))
    elif form == "yaml_columns":
        text = text.replace(f"llm_output = {json.dumps(TRIAGE_OUTPUT)},", "llm_output_from_columns = true,")
        project.write("models/triage.yml", COLUMNS_YML)
    project.write(MODEL, text)


@pytest.mark.parametrize("form", ["dict", "fragments", "yaml_columns"])
def test_check_accepts_and_poll_settles_every_output_form(project, emulator, capsys, form):
    write_model(project, form)
    project.dbt("parse")
    capsys.readouterr()
    assert cli(["check", "--project-dir", str(project.root)]) == 0, capsys.readouterr().err
    assert "llm_batch model(s) checked: no problems" in capsys.readouterr().out

    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]
    emulator.complete_all()
    capsys.readouterr()
    rc = cli(["poll", "--database", str(project.db_path)])
    out = capsys.readouterr().out
    assert rc == EXIT_DONE, out
    assert "main.triage: 1 batch(es) harvested: 6 succeeded, 0 failed; no batch open" in out

    calls = dict(emulator.stats()["calls"])
    project.dbt("run", *SELECT)
    assert dict(emulator.stats()["calls"]) == calls  # merged from what the poller stored
    if form == "dict":
        assert_triage_rows_answered(project)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded' and summary <> ''") == [(6,)]
