"""The poller: `dbt-llm-batch poll` harvests ended batches between runs, and the next `dbt run` merges
them without a provider call; sharing the DuckDB file with a dbt run; a killed poller; progress lines.

Every poller story runs once per batch provider (the `provider` fixture)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from helpers import (
    PRICES,
    assert_triage_rows_answered,
    batch_counts,
    billed_per_key,
    dup_model,
    log_text,
    triage_model,
    write_rows,
)

from dbt_llm_batch.errors import PollError
from dbt_llm_batch.ops.cli import main as cli
from dbt_llm_batch.ops.poller import EXIT_CANNOT_POLL, EXIT_DONE, EXIT_PENDING, EXIT_THEN_FAILED
from dbt_llm_batch.ops.then_command import expand

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]
CLI = [sys.executable, "-m", "dbt_llm_batch.ops.cli"]


def poll(project, capsys, *args: str) -> tuple[int, str, str]:
    """`dbt-llm-batch poll --database <the project's file> <args>`, in-process: (exit code, out, err)."""
    capsys.readouterr()
    rc = cli(["poll", "--database", str(project.db_path), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def shared_models(project, rows: dict[int, int]) -> None:
    """`dup` and `dup_twin`: the same rows, sharing the ledger's requests (llm_dedup = 'ledger'), through OpenAI."""
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "dup_twin"):
        project.write(f"models/{name}.sql", dup_model("openai", extra="llm_dedup='ledger'"))
    write_rows(project, rows)


def submitted(project, emulator, provider: str) -> None:
    """Run 1 of the triage model: one batch of its six rows, the table still empty."""
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]


def assert_billed_and_stored_once(project, emulator) -> None:
    rows = project.query("select ticket_id, subject, body from main.support_tickets")
    billed = billed_per_key(emulator, {f"Subject: {s}\n\n{b}": k for k, s, b in rows})
    assert sorted(billed.values()) == [1] * 6, billed
    # No batch harvested twice: each result line stored once.
    assert project.query("select count(*), count(distinct custom_id) from main.llm_batch_results") == [(6, 6)]


def test_poll_stores_results_and_the_next_run_merges_them_without_a_provider_call(project, emulator, provider, capsys):
    submitted(project, emulator, provider)

    # Not ended yet: pending, exit code 3, nothing stored.
    rc, out, _ = poll(project, capsys)
    assert rc == EXIT_PENDING
    assert "main.triage: 6 request(s) pending in 1 open batch(es)" in out
    assert project.query("select count(*) from main.llm_batch_results") == [(0,)]

    emulator.complete_all()
    rc, out, _ = poll(project, capsys, "--schema", "main", "--model", "triage")
    assert rc == EXIT_DONE, out
    assert "main.triage: 1 batch(es) harvested: 6 succeeded, 0 failed; no batch open" in out
    assert "new results for: triage" in out
    # Stored and settled in the ledger; the poller does not touch the model table.
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("succeeded", 6)]
    assert project.query("select count(*) from main.triage") == [(0,)]
    assert project.query("select count(*) from main.llm_batch_jobs where files_deleted_at is null") == [(0,)]

    calls = dict(emulator.stats()["calls"])
    project.dbt("run", *SELECT)
    assert_triage_rows_answered(project)
    assert dict(emulator.stats()["calls"]) == calls  # merged from the ledger: not a single provider call
    assert_billed_and_stored_once(project, emulator)

    # Nothing open: a poll makes no provider call and says it is done.
    rc, out, _ = poll(project, capsys)
    assert rc == EXIT_DONE and "no batch open" in out
    assert dict(emulator.stats()["calls"]) == calls


def test_poll_wait_returns_done_and_then_runs_once_with_the_selector(
    project, emulator, provider, capsys, tmp_path, monkeypatch
):
    submitted(project, emulator, provider)
    emulator.auto_advance_seconds = 0.5  # each stage of a batch lasts half a second
    monkeypatch.setenv("DBT_LLM_BATCH_POLL_FIRST_DELAY", "0.2")
    monkeypatch.setenv("DBT_LLM_BATCH_PROGRESS_SECONDS", "0")
    record = tmp_path / "then.txt"
    then = (
        f"{sys.executable} -c 'import sys; open(sys.argv[1], \"a\").write(sys.argv[2] + chr(10))' {record} {{models}}+"
    )
    rc, out, err = poll(project, capsys, "--wait", "120", "--then", then)
    assert rc == EXIT_DONE, out + err
    assert record.read_text() == "triage+\n"  # exactly once, with the model's dbt name
    assert "new results for: triage; --then ran: " in out and "the next `dbt run`" not in out  # true after --then
    assert "poll: waiting for batches: " in err  # progress while it waits

    calls = dict(emulator.stats()["calls"])
    project.dbt("run", *SELECT)
    assert_triage_rows_answered(project)
    assert dict(emulator.stats()["calls"]) == calls


def test_a_model_last_run_by_an_older_version_is_skipped_with_advice(project, emulator, provider, capsys):
    submitted(project, emulator, provider)
    emulator.complete_all()
    project.query("update main.llm_batch_models set config_snapshot = null")  # as an earlier version left it
    calls = dict(emulator.stats()["calls"])
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_CANNOT_POLL  # not "still open": nothing ends until it is run once with dbt
    assert "run it once with dbt first" in out and "run it once with dbt first" in err
    assert dict(emulator.stats()["calls"]) == calls
    project.dbt("run", *SELECT)  # the run harvests it as always
    assert_triage_rows_answered(project)


def test_a_poller_killed_between_download_and_store_loses_nothing(project, emulator, provider, tmp_path):
    submitted(project, emulator, provider)
    emulator.complete_all()
    project.release_database()
    for point in ("after_download", "after_store"):
        marker = tmp_path / f"crashed-{point}"
        env = {
            **os.environ,
            "DBT_LLM_BATCH_CRASH_AT": point,
            "DBT_LLM_BATCH_CRASH_MARKER": str(marker),
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        }
        killed = subprocess.run(
            [*CLI, "poll", "--database", str(project.db_path)], env=env, capture_output=True, text=True, timeout=300
        )
        assert killed.returncode == -9, killed.stdout + killed.stderr
        assert marker.read_text() == point
        if point == "after_download":
            assert project.query("select count(*) from main.llm_batch_results") == [(0,)]
        else:  # stored, not settled
            assert project.query("select count(*) from main.llm_batch_results") == [(6,)]
            assert project.query("select distinct status from main.llm_batch_requests") == [("queued",)]

    project.dbt("run", *SELECT)  # or a poll: the same harvest
    assert_triage_rows_answered(project)
    assert_billed_and_stored_once(project, emulator)


def test_a_poller_waits_for_a_file_another_process_holds(project, emulator, provider, capsys):
    submitted(project, emulator, provider)
    emulator.complete_all()
    project.release_database()
    with hold_file(project.db_path, seconds=3):
        rc, out, err = poll(project, capsys)
    assert rc == EXIT_DONE, out + err
    assert re.search(rf"poll: {re.escape(str(project.db_path))} is in use by .* \(PID \d+\); waiting for it", err)
    assert "6 succeeded" in out


def test_a_dbt_run_waits_briefly_for_a_file_another_process_holds(project, emulator, provider):
    """What a dbt run does when it starts while the poller writes: it waits (the plugin, up to 15 s)."""
    submitted(project, emulator, provider)
    emulator.complete_all()
    project.release_database()
    holder = hold_file(project.db_path, seconds=None)
    with holder:
        run = dbt_run_process(project)
        assert run.stdout is not None
        output = ""
        for line in run.stdout:  # the file is let go once the run says it waits for it
            output += line
            if "in use by another process; waiting" in line:
                break
        holder.release()
        output += run.communicate(timeout=300)[0]
    assert "in use by another process; waiting up to" in output, output[-2000:]
    assert run.returncode == 0 and "Completed successfully" in output, output[-2000:]
    assert_triage_rows_answered(project)


def test_a_poller_and_a_dbt_run_started_together_both_finish(project, emulator, provider):
    submitted(project, emulator, provider)
    emulator.complete_all()
    project.release_database()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    poller = subprocess.Popen(
        [*CLI, "poll", "--database", str(project.db_path), "--wait", "120"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = dbt_run_process(project)
    poll_out = poller.communicate(timeout=300)[0]
    run_out = run.communicate(timeout=300)[0]
    assert poller.returncode == EXIT_DONE, poll_out
    assert run.returncode == 0, run_out[-3000:]
    # Whichever harvested the batch, it was harvested once; a final run merges what the poller stored.
    project.dbt("run", *SELECT)
    assert_triage_rows_answered(project)
    assert_billed_and_stored_once(project, emulator)
    assert project.query("select count(*) from main.llm_batch_jobs where harvested_at is not null") == [(1,)]


def test_a_long_realtime_run_logs_its_progress(project, emulator, monkeypatch):
    rows = 24
    project.write("models/things.sql", f"select range as a, 'row ' || range as prompt from range({rows})")
    project.write(
        "models/m.sql",
        """{{ config(materialized='llm_batch', unique_key='a', llm_provider='openai', llm_model='gpt-4o-mini',
                     llm_realtime_when='true', llm_concurrency=2, llm_max_tokens=50) }}
select * from {{ ref('things') }}""",
    )
    emulator.realtime_latency = 0.25  # 24 rows, 2 at a time: at least 3 s
    monkeypatch.setenv("DBT_LLM_BATCH_PROGRESS_SECONDS", "0.5")
    project.dbt("run", "-s", "things", "m")
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(rows,)]
    lines = re.findall(
        rf"main\.m: realtime: (\d+)/{rows} answered \(\d+%\), [\d.]+/s, about .+ left", log_text(project)
    )
    assert len(lines) >= 2, lines
    assert [int(n) for n in lines] == sorted(int(n) for n in lines)  # done only grows


# --- helpers -------------------------------------------------------------------------------------


class hold_file:
    """Another process holds the DuckDB file (like a dbt run) for `seconds`, or until release()."""

    def __init__(self, path: Path, seconds: float | None):
        self.path, self.seconds = path, seconds

    def __enter__(self):
        code = (
            "import duckdb, sys, time; con = duckdb.connect(sys.argv[1]); print('held', flush=True); "
            "time.sleep(float(sys.argv[2])) if sys.argv[2] != 'None' else sys.stdin.readline(); con.close()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(self.path), str(self.seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "held"
        return self

    def release(self) -> None:
        assert self.process.stdin is not None
        if not self.process.stdin.closed:
            self.process.stdin.write("go\n")
            self.process.stdin.close()

    def __exit__(self, *exc):
        if self.seconds is None:
            self.release()
        self.process.wait(timeout=60)


def dbt_run_process(project) -> subprocess.Popen:
    dbt = Path(sys.executable).parent / "dbt"
    return subprocess.Popen(
        [str(dbt), "run", *SELECT, "--project-dir", str(project.root), "--profiles-dir", str(project.root)],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_poll_function_reports_for_a_sensor(project, emulator, provider):
    import dbt_llm_batch

    submitted(project, emulator, provider)
    result = dbt_llm_batch.poll(str(project.db_path))
    assert not result.done and result.pending == {"main.triage": 6} and result.open_batches == 1
    assert result.oldest_pending_age is not None and result.models_with_new_results == []
    emulator.complete_all()
    result = dbt_llm_batch.poll(str(project.db_path))
    assert result.done and result.models_with_new_results == ["triage"] and result.exit_code == EXIT_DONE
    assert json.loads(project.query("select config_snapshot from main.llm_batch_models")[0][0])["dbt_name"] == "triage"


# --- exit codes: each condition a cron job must tell apart (docs/operations.md, "Polling between runs") --------

KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


def assert_one_line_without_traceback(err: str, *expected: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dbt-llm-batch poll:")]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], err


def test_a_missing_key_with_a_batch_in_flight_cannot_poll(project, emulator, provider, capsys, monkeypatch, api_key):
    submitted(project, emulator, provider)
    emulator.complete_all()
    monkeypatch.delenv(KEY_ENV[provider])
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_CANNOT_POLL, out + err  # not 3: nothing ends until someone sets the key
    assert_one_line_without_traceback(err, "main.triage", f"{KEY_ENV[provider]} is not set", "export it")
    assert project.query("select count(*) from main.llm_batch_results") == [(0,)]

    monkeypatch.setenv(KEY_ENV[provider], api_key)
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_DONE and "6 succeeded" in out, out + err


def test_an_unknown_model_an_unreadable_config_or_database_cannot_poll(project, emulator, provider, capsys, tmp_path):
    submitted(project, emulator, provider)
    rc, _, err = poll(project, capsys, "--model", "no_such_model")
    assert rc == EXIT_CANNOT_POLL
    assert_one_line_without_traceback(err, "no model no_such_model", "triage", "--model")
    assert poll(project, capsys, "--model", "triage")[0] == EXIT_PENDING  # known by its dbt name

    snapshot = json.loads(project.query("select config_snapshot from main.llm_batch_models")[0][0])
    snapshot["config"]["llm_max_attempts"] = "several"
    project.query("update main.llm_batch_models set config_snapshot = ?", [json.dumps(snapshot)])
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_CANNOT_POLL, out + err
    assert_one_line_without_traceback(err, "main.triage", "stored config does not parse", "run it once with dbt")

    for database, expected in (
        (tmp_path / "missing.duckdb", "no DuckDB file at"),
        (tmp_path / "notes.txt", "cannot open the DuckDB file"),
        (tmp_path / "empty.duckdb", "no dbt-llm-batch ledger in"),
    ):
        if database.name == "notes.txt":
            database.write_text("not a database\n")
        if database.name == "empty.duckdb":
            duckdb.connect(str(database)).close()
        capsys.readouterr()
        rc = cli(["poll", "--database", str(database)])
        err = capsys.readouterr().err
        assert rc == EXIT_CANNOT_POLL, (database, err)
        assert_one_line_without_traceback(err, expected, "pass the")


def test_a_submission_not_yet_reconciled_is_not_done(project, emulator, provider, capsys):
    """A create that failed with a 5xx leaves an intent without a batch id (it may have reached the
    provider): the poll must not say "nothing open" while the model's next run has it to reconcile."""
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    emulator.add_fault(endpoint=CREATE_ENDPOINT[provider], status_code=500, times=1)
    project.dbt("run", *SELECT)
    assert project.query("select status, batch_id from main.llm_batch_jobs") == [("submitting", None)]
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_PENDING, out + err
    assert "main.triage: no batch open; 1 interrupted submission(s) not reconciled yet" in out
    assert "the model's next dbt run matches them" in out

    project.dbt("run", *SELECT)  # reconciles it, then sends the rows again
    emulator.complete_all()
    assert poll(project, capsys)[0] == EXIT_DONE


CREATE_ENDPOINT = {"openai": "POST /v1/batches", "anthropic": "POST /v1/messages/batches"}


# --- --then: shell semantics, a failed command run again, every model a harvest completes -------------


def test_then_runs_through_the_shell_as_cron_would(project, emulator, provider, capsys, tmp_path, monkeypatch):
    submitted(project, emulator, provider)
    emulator.complete_all()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out_file = tmp_path / "then.txt"
    then = (
        f"cd {tmp_path} && printf '%s\\n' {{models}}+ > then.txt && echo \"$HOME\" >> then.txt; echo last >> then.txt"
    )
    rc, out, err = poll(project, capsys, "--then", then)
    assert rc == EXIT_DONE, out + err
    assert out_file.read_text() == f"triage+\n{tmp_path / 'home'}\nlast\n"


def test_then_substitutes_shell_quoted_words_and_refuses_a_placeholder_it_cannot(project, capsys):
    assert expand("dbt build -s {models}+ && notify", ["a", "b"]) == "dbt build -s a+ b+ && notify"
    assert expand("dbt run -s +{models} 2+{models}+1 @{models} > log", ["x", "y"]) == (
        "dbt run -s +x +y 2+x+1 2+y+1 @x @y > log"
    )
    assert expand("echo '{x}' {models}", ["it's"]) == "echo '{x}' 'it'\"'\"'s'"  # a name is never shell syntax
    for template in ("dbt build --select={models}", 'echo "{models}"', "echo '{models}'", "echo {models}{models}"):
        with pytest.raises(PollError, match="models"):
            expand(template, ["a"])
    # Refused before anything is polled, with exit code 2.
    rc = cli(["poll", "--database", str(project.db_path), "--then", "dbt build -s '{models}'"])
    assert rc == EXIT_CANNOT_POLL
    assert_one_line_without_traceback(capsys.readouterr().err, "inside '...' quotes")


def test_a_failed_then_command_is_recorded_and_run_again_until_it_succeeds(
    project, emulator, provider, capsys, tmp_path
):
    submitted(project, emulator, provider)
    emulator.complete_all()
    calls, ok, script = tmp_path / "calls.txt", tmp_path / "ok", tmp_path / "rebuild.sh"
    script.write_text(f'echo "$@" >> {calls}\ntest -f {ok}\n')  # records its arguments; fails until `ok` exists
    then = f"sh {script} {{models}}+"

    rc, out, first_err = poll(project, capsys, "--then", then)
    assert rc == EXIT_THEN_FAILED, out + first_err
    assert calls.read_text() == "triage+\n"

    # Nothing new to harvest: the poll runs it again, as the ledger says it is owed.
    rc, out, err = poll(project, capsys, "--then", then)
    assert calls.read_text() == "triage+\n" * 2
    assert rc == EXIT_THEN_FAILED, out + err
    assert "--then exited with status 1" in first_err and "runs it again for triage" in first_err
    owed = (
        "select model, dbt_name, command, exit_code, attempts, succeeded_at is null from main.llm_batch_then_commands"
    )
    command = f"sh {script} triage+"
    assert project.query(owed) == [("main.triage", "triage", command, 1, 2, True)]

    # A poll without --then runs nothing, and says what is owed.
    rc, out, err = poll(project, capsys)
    assert rc == EXIT_DONE and calls.read_text() == "triage+\n" * 2
    assert "an earlier --then failed for triage" in err

    ok.touch()
    rc, out, err = poll(project, capsys, "--then", then)
    assert rc == EXIT_DONE, out + err
    assert calls.read_text() == "triage+\n" * 3
    assert project.query(owed) == [("main.triage", "triage", command, 1, 2, False)]

    rc, out, err = poll(project, capsys, "--then", then)  # settled: not run again
    assert rc == EXIT_DONE and calls.read_text() == "triage+\n" * 3


def test_then_names_every_model_whose_rows_a_harvest_completes(project, emulator, capsys, tmp_path):
    """`dup_twin`'s rows point at `dup`'s requests in flight (llm_dedup = 'ledger'): harvesting `dup`'s
    batch completes both models' rows, so both are named (and both rebuilt by `dbt build -s {models}+`);
    and polling `dup_twin` alone polls the batch its rows wait for, though `dup` sent it."""
    shared_models(project, {i: i % 4 for i in range(8)})
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "dup_twin")
    assert batch_counts(emulator) == [4]
    out_file, script = tmp_path / "then.txt", tmp_path / "rebuild.sh"
    script.write_text(f'echo "$@" > {out_file}\n')
    then = ["--then", f"sh {script} {{models}}+"]

    rc, out, err = poll(project, capsys, *then)
    assert rc == EXIT_PENDING and not out_file.exists(), out + err
    emulator.complete_all()
    rc, out, err = poll(project, capsys, *then)
    assert rc == EXIT_DONE, out + err
    assert out_file.read_text() == "dup+ dup_twin+\n"
    assert "new results for: dup dup_twin" in out
    assert "main.dup_twin: 8 row(s) answered by shared requests of other models" in out
    project.dbt("run", "-s", "dup_twin")
    assert project.query("select count(*) from main.dup_twin where llm_status = 'succeeded'") == [(8,)]

    # Another round: `dup_twin` asked alone waits for, and harvests, `dup`'s batch.
    write_rows(project, {i: 10 + i % 4 for i in range(8)})
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "dup_twin")
    rc, out, err = poll(project, capsys, "--model", "dup_twin")
    assert rc == EXIT_PENDING, out + err
    assert "main.dup: 4 request(s) pending in 1 open batch(es)" in out
    emulator.complete_all()
    rc, out, err = poll(project, capsys, "--model", "dup_twin", *then)
    assert rc == EXIT_DONE, out + err
    assert out_file.read_text() == "dup+ dup_twin+\n"
