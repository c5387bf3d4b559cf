"""Runs that collide: another process holding the DuckDB file, and two runs of one model at once."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from helpers import batch_counts, file_held_by_another_process, triage_model

from dbt_llm_batch.ledger import Ledger, locks
from dbt_llm_batch.ledger.locks import LockHeldError, ModelLock
from dbt_llm_batch.ops.cli import main as cli

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]


def test_a_second_process_gets_a_clear_message_naming_the_holder(project, emulator):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.release_database()
    holder = duckdb.connect(str(project.db_path))  # like a notebook, or a dbt run still going
    try:
        dbt = Path(sys.executable).parent / "dbt"
        done = subprocess.run(
            [str(dbt), "run", *SELECT, "--project-dir", str(project.root), "--profiles-dir", str(project.root)],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.close()
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output
    pid = os.getpid()
    expected = (
        re.escape(f"The DuckDB file {project.db_path} is in use by ")
        + r"\S+"
        + re.escape(
            f" (PID {pid}). DuckDB lets only one process open a database file for writing, so this dbt run cannot "
            f"start; nothing was changed. Wait for that process (another dbt run, a notebook or a DuckDB shell) to "
            f"finish or close the file, then run again. If that process is stuck or forgotten, stop it (for example "
            f'`kill {pid}`). (DuckDB said: IO Error: Could not set lock on file "{project.db_path}": Conflicting '
            f"lock is held in "
        )
        + r"\S+"
        + re.escape(f" (PID {pid}).")
    )
    assert re.search(expected, output), output[-2000:]
    # Nothing was sent and nothing written; once the file is free the same run works.
    assert emulator.batches() == []
    assert project.query("select count(*) from information_schema.tables where table_name = 'llm_batch_requests'") == [
        (0,)
    ]
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]


def test_the_cli_says_the_same_when_the_file_is_held(project, tmp_path, capsys):
    path = tmp_path / "held.duckdb"
    with file_held_by_another_process(path) as holder:
        rc = cli(["cancel", "--database", str(path), "--model", "triage"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"dbt-llm-batch cancel: The DuckDB file {path} is in use by ")
    assert f"(PID {holder.pid}). DuckDB lets only one process open a database file for writing" in err


@pytest.fixture
def ledger(tmp_path):
    con = duckdb.connect(str(tmp_path / "locks.duckdb"))
    ledger = Ledger(con, "main", "main.triage")
    ledger.migrate()
    yield ledger
    con.close()


def test_a_second_owner_is_refused_with_who_holds_the_lock_and_how_to_clear_it(ledger, tmp_path):
    first, second = ModelLock(ledger, owner="host-a:101:aaaa"), ModelLock(ledger, owner="host-b:202:bbbb")
    first.acquire()
    with pytest.raises(LockHeldError) as refused:
        second.acquire()
    since = ledger.con.execute("select strftime(acquired_at, '%Y-%m-%d %H:%M:%S') from main.llm_batch_locks")
    message = str(refused.value)
    assert re.fullmatch(
        re.escape(f"main.triage is being run by host-a:101:aaaa (host:pid:run) since {since.fetchall()[0][0]} ")
        + r"\S+"
        + re.escape(
            ", last heartbeat 0 s ago. Two runs of one model must not submit at once, so this run "
            "stopped before harvesting, planning or sending anything. Wait for that run to finish. "
            "If that process is dead, its lock is taken over automatically (at once if it ran on "
            "this host, else once its heartbeat is 10 minutes old), or clear it now with: "
            "dbt-llm-batch unlock --database "
            f"{tmp_path / 'locks.duckdb'} --schema main --model main.triage"
        ),
        message,
    ), message
    first.heartbeat()  # still the owner
    first.release()
    second.acquire()
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("host-b:202:bbbb",)]
    second.acquire()  # re-entrant for its owner
    second.release()
    assert ledger.con.execute("select count(*) from main.llm_batch_locks").fetchall() == [(0,)]


def test_a_stale_lock_is_taken_over_with_a_warning(ledger, caplog):
    dead, alive = ModelLock(ledger, owner="host-a:101:dead"), ModelLock(ledger, owner="host-b:202:next")
    dead.acquire()
    ledger.con.execute("update main.llm_batch_locks set heartbeat_at = now() - interval 11 minutes")
    with caplog.at_level(logging.WARNING, logger="dbt_llm_batch"):
        alive.acquire()
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("host-b:202:next",)]
    assert re.fullmatch(
        r"main\.triage: took over the lock of host-a:101:dead \(held since .+; no heartbeat for "
        r"66\d s, more than 600 s\): that run is presumed dead",
        caplog.messages[-1],
    )
    with pytest.raises(LockHeldError, match="this run's lock was taken over by another run"):
        dead.heartbeat()  # the presumed-dead run, if it was only slow, stops before submitting more
    dead.release()  # and cannot release the new owner's lock
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("host-b:202:next",)]


def test_dbt_run_refuses_while_another_run_holds_the_model_then_unlock(project, emulator, capsys):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)  # creates the ledger; the lock is released at the end
    assert project.query("select count(*) from main.llm_batch_locks") == [(0,)]
    emulator.complete_all()
    project.query("insert into main.llm_batch_locks values ('main.triage', 'other-host:4242:cafe', now(), now())")
    result = project.dbt("run", *SELECT, expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert "main.triage is being run by other-host:4242:cafe (host:pid:run) since " in message
    assert f"dbt-llm-batch unlock --database {project.db_path} --schema main --model main.triage" in message
    assert project.query("select count(*) from main.triage") == [(0,)]  # nothing harvested or merged
    assert project.query("select owner from main.llm_batch_locks") == [("other-host:4242:cafe",)]

    capsys.readouterr()
    assert cli(["unlock", "--database", str(project.db_path), "--model", "triage"]) == 0
    assert capsys.readouterr().out.startswith("removed the lock of other-host:4242:cafe (held since ")
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage") == [(6,)]
    assert project.query("select count(*) from main.llm_batch_locks") == [(0,)]


def test_the_lock_is_released_when_the_run_fails(project, emulator, monkeypatch):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    monkeypatch.delenv("OPENAI_API_KEY")
    result = project.dbt("run", *SELECT, expect_ok=False)
    assert "OPENAI_API_KEY is not set" in "\n".join(str(r.message) for r in result.result.results)
    assert project.query("select count(*) from main.llm_batch_locks") == [(0,)]


def test_a_lock_whose_process_died_on_this_host_is_taken_over_at_once(ledger, caplog):
    """A killed run (SIGKILL, OOM) leaves its lock; its PID no longer exists, so the next run need not
    wait for the heartbeat timeout."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = f"{socket.gethostname()}:{gone.stdout.strip()}:dead"
    ModelLock(ledger, owner=owner).acquire()
    with caplog.at_level(logging.WARNING, logger="dbt_llm_batch"):
        ModelLock(ledger, owner="next-run").acquire()
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("next-run",)]
    assert re.fullmatch(
        re.escape(f"main.triage: took over the lock of {owner} (held since ")
        + r".+"
        + re.escape("; its process is no longer running on this host): that run is presumed dead"),
        caplog.messages[-1],
    )
    # A live process on this host (this one, under another run id) is respected.
    ledger.con.execute("delete from main.llm_batch_locks")
    ModelLock(ledger, owner=f"{socket.gethostname()}:{os.getppid()}:live").acquire()
    with pytest.raises(LockHeldError):
        ModelLock(ledger, owner="next-run").acquire()


def test_a_run_waits_for_another_model_s_brief_harvest_holding_its_lock(ledger, monkeypatch):
    """Another model's run harvesting this model's shared batches (pipeline/shared.py) holds its lock for a
    moment: a run of this model starting then (another dbt thread) waits for it instead of failing; two
    brief holders never wait for each other (the second skips), and a run's own lock is never waited for."""
    harvest = ModelLock(ledger, owner=locks.brief_owner())
    harvest.acquire()
    with pytest.raises(LockHeldError):  # another harvest: refused at once (it leaves the batch alone)
        ModelLock(ledger, owner=locks.brief_owner()).acquire()
    waits = []
    monkeypatch.setattr(locks.time, "sleep", lambda seconds: (waits.append(seconds), harvest.release()))
    run = ModelLock(ledger, owner="this-host:1:run")
    run.acquire()  # waits once, the harvest ends, the run has the lock
    assert len(waits) == 1
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("this-host:1:run",)]
    with pytest.raises(LockHeldError):  # a run's lock: another run is refused at once, as before
        ModelLock(ledger, owner="this-host:2:run").acquire()
    assert len(waits) == 1


def test_two_takers_of_a_free_lock_at_once_one_is_refused_without_a_traceback(ledger):
    """dbt's threads: a model's run and another model's harvest of its shared requests (shared.py)
    take the same model's lock at once. The second reads the lock free, the first commits its row,
    the second's insert then meets that row: it looks again and is refused as by a live holder (the
    model-based test, seed 130 step 10, ended a run with DuckDB's "Duplicate key" traceback)."""
    first = ModelLock(Ledger(ledger.con.cursor(), "main", ledger.model), owner="host-a:101:aaaa")
    second_ledger = Ledger(ledger.con.cursor(), "main", ledger.model)
    second = ModelLock(second_ledger, owner="host-b:202:bbbb")

    class FirstTakesItMeanwhile:  # the second's connection, with the first's commit before its insert
        def __init__(self, con):
            self.con, self.done = con, False

        def execute(self, sql, params=None):
            if sql.startswith("insert into") and "llm_batch_locks" in sql and not self.done:
                self.done = True
                first.acquire()
            return self.con.execute(sql, params or [])

        def __getattr__(self, name):
            return getattr(self.con, name)

    second_ledger.con = FirstTakesItMeanwhile(second_ledger.con)
    with pytest.raises(LockHeldError, match="is being run by host-a:101:aaaa"):
        second.acquire()
    assert ledger.con.execute("select owner from main.llm_batch_locks").fetchall() == [("host-a:101:aaaa",)]
