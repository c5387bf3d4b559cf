"""What a tester found trying, as a dbt user would, the config table (config_keys.py) and `poll`
(ops/poller.py) together: each test failed on the code before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import failure_messages
from helpers import batch_counts, sorted_batches, triage_model

from dbt_llm_batch.ops.cli import main as cli

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]
CLI = [sys.executable, "-m", "dbt_llm_batch.ops.cli"]


def test_a_typo_in_a_variant_is_an_unknown_key_with_a_did_you_mean(project, emulator, capsys):
    """A misspelt key in a variant was reported as a key that 'cannot differ per variant', listing
    the keys a variant may set, with no did-you-mean: the user looks for a rule, not a typo."""
    variants = "llm_variants = {'big': {'llm_modle': 'gpt-4o', 'llm_max_tokns': 50}},"
    project.write(MODEL, triage_model(extra_config=variants))
    result = project.dbt("run", *SELECT, expect_ok=False)
    message = failure_messages(result)
    assert "llm_variants['big']: unknown config key 'llm_modle' (did you mean 'llm_model'?)" in message
    assert "llm_variants['big']: unknown config key 'llm_max_tokns' (did you mean 'llm_max_tokens'?)" in message
    assert "cannot differ per variant" not in message
    assert emulator.batches() == []
    # `check` says the same from the manifest, before any run.
    project.dbt("parse")
    capsys.readouterr()
    assert cli(["check", "--project-dir", str(project.root)]) == 1
    assert "unknown config key 'llm_modle' (did you mean 'llm_model'?)" in capsys.readouterr().err
    # A key the model may set but a variant may not still says so.
    project.write(MODEL, triage_model(extra_config="llm_variants = {'big': {'llm_max_attempts': 2}},"))
    result = project.dbt("run", *SELECT, expect_ok=False)
    assert "llm_variants['big']: 'llm_max_attempts' cannot differ per variant" in failure_messages(result)


def test_a_then_command_the_poller_did_not_see_finish_is_run_again(project, emulator, tmp_path):
    """A poll stopped while its --then runs (cron's timeout, a reboot: here the command kills its poller)
    had stored the results, and recorded nothing: the next poll with --then said "no batch open" and
    never rebuilt the models. Owed from the moment their results are stored, it is run again."""
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]
    emulator.complete_all()
    project.release_database()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    poll = [*CLI, "poll", "--database", str(project.db_path), "--then"]
    killed = subprocess.run(
        [*poll, "kill -9 $PPID; echo {models}"], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert project.query("select count(*) from main.llm_batch_results") == [(6,)]  # stored before the kill

    record = tmp_path / "then.txt"
    rebuild = f"echo {{models}}+ >> {record}"
    again = subprocess.run([*poll, rebuild], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "--then owed for results stored earlier" in again.stdout
    assert record.read_text() == "triage+\n"
    # Done: owed no more, and a successful command leaves no row behind.
    assert project.query("select count(*) from main.llm_batch_then_commands") == [(0,)]
    again = subprocess.run([*poll, rebuild], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and record.read_text() == "triage+\n", again.stdout + again.stderr


def test_results_a_waiting_poll_stored_before_it_was_stopped_get_their_then_command(project, emulator, tmp_path):
    """`poll --wait --then` stores one model's results in its first round and waits for another's batch;
    stopped while it waits (cron's timeout), it had recorded nothing: the next poll named only the
    model it harvested itself, and `dbt build -s {models}+` never rebuilt the first."""
    project.write(MODEL, triage_model())
    project.write("models/triage_two.sql", triage_model(system="Triage, in two words."))
    project.dbt("seed")
    project.dbt("run", "-s", "triage", "triage_two")
    assert batch_counts(emulator) == [6, 6]
    emulator.complete(sorted_batches(emulator)[0]["id"])  # one model's batch ends, the other's does not
    project.release_database()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "DBT_LLM_BATCH_POLL_FIRST_DELAY": "300",  # it waits after its first round, until it is stopped
    }
    record = tmp_path / "then.txt"
    poll = [*CLI, "poll", "--database", str(project.db_path), "--then", f"echo {{models}}+ >> {record}"]
    waiting = subprocess.Popen([*poll, "--wait", "600"], env=env, stderr=subprocess.PIPE, text=True)
    assert waiting.stderr is not None
    for line in waiting.stderr:
        if "polling again" in line:  # its first round stored one model's results
            break
    waiting.kill()
    waiting.communicate(timeout=60)
    assert not record.exists()
    assert project.query("select count(*) from main.llm_batch_results") == [(6,)]

    emulator.complete_all()
    again = subprocess.run(poll, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert record.read_text() == "triage+ triage_two+\n"
