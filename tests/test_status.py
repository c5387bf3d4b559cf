"""What is pending and what it cost, from the run log, `dbt run-operation` and the CLI."""

from __future__ import annotations

import json

from helpers import triage_model

from dbt_llm_batch.ops import cli


def test_status_operation_and_cli_show_in_flight_batches_and_progress(project, emulator, capsys):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    batch_id = emulator.batches()[0]["id"]

    project.dbt("run-operation", "dbt_llm_batch.status")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "In-flight batches (1)" in log
    assert f"model=main.triage, provider=openai, batch_id={batch_id}, status=validating, request_count=6" in log
    assert "model=main.triage, keys_succeeded=0, keys_failed=0, requests_pending=6" in log

    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    capsys.readouterr()
    assert cli.main(["status", "--database", str(project.db_path)]) == 0
    out = capsys.readouterr().out
    assert "In-flight batches:" in out and batch_id not in out  # harvested: no longer in flight
    progress = project.query(
        "select keys_succeeded, requests_pending, committed_not_billed_usd from main.llm_batch_progress"
    )
    assert progress == [(6, 0, 0)]
    progress_section = out.split("Progress per model")[1]
    assert "main.triage" in progress_section and "rows_ok" in progress_section


def test_run_log_has_one_summary_line_per_model(project, emulator):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    log = (project.root / "logs" / "dbt.log").read_text()
    # gpt-4o-mini at the shipped price: the estimate is printed, nothing harvested yet.
    assert "main.triage: submitted 6 request(s) in 1 batch(es) (estimated $" in log
    assert (
        "harvested 0 batch(es) (cost $0.000000, saved $0.000000 vs realtime); merged 0 row(s) (0 failed); pending 6"
        in log
    )


def test_status_reads_the_dbt_profile_fits_100_columns_and_names_variants(project, emulator, capsys):
    """Without --database the file is the profile's; the default fits 100 columns, --wide and --json
    show every column; the default variant is named as the table names it, by the CLI and by the
    run-operation; rows and requests are counted apart."""
    variants = "llm_variants = {'terse': {'llm_system': 'Be terse.'}},"
    project.write("models/triage.sql", triage_model(extra_config=variants))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    project.dbt("run-operation", "dbt_llm_batch.status")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "model=main.triage, variant=default,terse, provider=openai" in log  # one batch, both variants
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    project.dbt("run-operation", "dbt_llm_batch.status")
    log = (project.root / "logs" / "dbt.log").read_text()
    for variant in ("default", "terse"):
        assert "model=main.triage, keys_succeeded=6" in log and f"variant={variant}, rows_pending=0" in log
        assert f"model=main.triage, variant={variant}, provider=openai" in log
    project.release_database()

    where = ["--project-dir", str(project.root), "--profiles-dir", str(project.root)]
    capsys.readouterr()
    assert cli.main(["status", *where]) == 0  # no --database: the profile's file and schema
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert "…" not in out, "no column hidden behind an ellipsis"
    progress = out.split("Progress per model")[1].split("Cost per model")[0]
    assert "rows_ok" in progress and "req_pending" in progress and "default" in progress and "terse" in progress
    assert "''" not in out

    assert cli.main(["status", *where, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "committed_not_billed_usd" in wide and "dedup_saved_usd" in wide

    assert cli.main(["status", *where, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["database"] == str(project.db_path) and shown["schema"] == "main"
    costs = {row["variant"]: (row["rows_succeeded"], row["requests_succeeded"]) for row in shown["costs"]}
    assert costs == {"default": (6, 6), "terse": (6, 6)}
    assert {row["variant"] for row in shown["progress"]} == {"default", "terse"}

    assert cli.main(["status", *where, "--target", "prod"]) == 2
    assert "has no target 'prod'" in capsys.readouterr().err


def test_status_names_each_models_provider_and_model_and_the_money_in_flight(project, emulator, capsys, monkeypatch):
    """Two requests sent and four waiting for the in-flight cap: the default view names the model's
    provider and llm_model and what its requests in flight are estimated to cost; the requests not sent
    yet have no job, and still name the configured provider (never `None`)."""
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    monkeypatch.setattr(OpenAIBatchProvider, "batch_limits", classmethod(lambda cls, config: (2, 200_000_000)))
    project.write("models/triage.sql", triage_model(extra_config="llm_max_batches_in_flight = 1,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1 order by 1") == [
        ("deferred", 4),
        ("queued", 2),
    ]
    assert project.query("select provider, llm_model from main.llm_batch_progress") == [("openai", "gpt-4o-mini")]
    assert project.query("select distinct provider, llm_model from main.llm_batch_costs") == [("openai", "gpt-4o-mini")]
    project.dbt("run-operation", "dbt_llm_batch.status")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "provider=None" not in log and "model=main.triage, provider=openai, day=" in log
    assert "provider=openai, llm_model=gpt-4o-mini" in log  # the progress line
    project.release_database()

    capsys.readouterr()
    assert cli.main(["status", "--database", str(project.db_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100 and "…" not in out, out
    models = out.split("Provider, model and money in flight per model")[1].split("Progress per model")[0]
    (in_flight,) = project.query("select committed_not_billed_usd from main.llm_batch_progress")[0]
    assert in_flight > 0
    assert "in_flight_usd" in models and "req_in_flight" in models
    (line,) = [row for row in models.splitlines() if "main.triage" in row]
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    assert cells[:4] == ["main.triage", "openai", "gpt-4o-mini", "2"] and cells[4] == str(in_flight), cells


def test_rows_answered_counts_rows_whose_current_answer_succeeded(project, emulator):
    """llm_batch_costs.rows_answered: not the rows of requests in flight, nor rows whose answer a later
    one (a changed prompt) superseded."""
    answered = "select sum(rows_answered) from main.llm_batch_costs"
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert project.query(answered) == [(0,)]  # six in flight, none answered
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query(answered) == [(6,)]
    project.write("models/triage.sql", triage_model(system="Triage the ticket, tersely."))
    project.dbt("run", "-s", "triage")  # every row asked again: their old answers stay until the new ones
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(12,)]
    assert project.query(answered) == [(6,)]  # the six rows, each once: their first answers are superseded


def test_a_row_whose_prompt_changed_is_counted_once_in_both_views(project, emulator):
    """A row (model, variant, key) is counted once, by its current answer: after a prompt edit its first
    answer is superseded, not another row. llm_batch_costs.rows_succeeded (summed) is the rows the model
    has, as llm_batch_progress.keys_succeeded says, and progress maps each row once (rows_mapped)."""
    costs = (
        "select sum(rows_succeeded), sum(rows_answered), sum(rows_failed), sum(rows_reused) from main.llm_batch_costs"
    )
    progress = "select keys_succeeded, keys_failed, rows_mapped, rows_reused from main.llm_batch_progress"
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query(costs) == [(6, 6, 0, 0)]
    assert project.query(progress) == [(6, 0, 6, 0)]
    project.write("models/triage.sql", triage_model(system="Triage the ticket, tersely."))
    project.dbt("run", "-s", "triage")  # every row asked again: the table shows the first answers meanwhile
    assert project.query(progress) == [(6, 0, 6, 0)], "six rows: answered, and mapped once though asked again"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(12,)]
    assert project.query(costs) == [(6, 6, 0, 0)], "six rows, not one per request that ever answered them"
    assert project.query(progress) == [(6, 0, 6, 0)], "the superseded answers are no rows of the model"
    assert project.query("select count(*) from main.triage") == [(6,)]
