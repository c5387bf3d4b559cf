"""One writer per model: a lock row in the ledger, with an owner and a heartbeat.

DuckDB itself allows one writing process per file, but a warehouse that allows several writers (or
two runs sharing one process, as dbt threads or a notebook do) could otherwise have two runs plan
and submit the same model's rows at once and pay twice. A run takes the model's row in
`llm_batch_locks` before it harvests, plans or submits, refreshes `heartbeat_at` while it waits, and
deletes the row at the end, also when it fails. A row whose heartbeat is older than
STALE_AFTER_SECONDS, or whose owner ran on this host under a PID that no longer exists, was left by a
process that died: the next run takes it over, with a warning.
"""

from __future__ import annotations

import os
import re
import time

import duckdb

from dbt_llm_batch.errors import LlmBatchError
from dbt_llm_batch.ledger import Ledger, transaction
from dbt_llm_batch.ledger.owners import STALE_AFTER_SECONDS, new_owner, process_is_gone
from dbt_llm_batch.log import log

# Another process holds the DuckDB file itself (DuckDB allows one writing process per file).
HOLDER = re.compile(r"Conflicting lock is held in (?P<program>.+?) \(PID (?P<pid>\d+)\)")


def lock_conflict_message(path: str, error: str, blocked: str = "this dbt run cannot start") -> str:
    """The user-facing message for a DuckDB file another process holds (DuckDB names the holder).
    `blocked` says what cannot happen, in the caller's words (a dbt run, a CLI command). The file is
    named by its absolute path: a profile's relative path is relative to where dbt was started."""
    m = HOLDER.search(error)
    holder = f"{m['program']} (PID {m['pid']})" if m else "another process"
    stop = f" If that process is stuck or forgotten, stop it (for example `kill {m['pid']}`)." if m else ""
    return (
        f"The DuckDB file {os.path.abspath(path)} is in use by {holder}. DuckDB lets only one process open a database "
        f"file for writing, so {blocked}; nothing was changed. Wait for that process "
        f"(another dbt run, a notebook or a DuckDB shell) to finish or close the file, then run again."
        f"{stop} (DuckDB said: {error})"
    )


def is_lock_conflict(exc: Exception) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


class LockHeldError(LlmBatchError):
    """Another live run owns the model's lock (`owner`)."""

    def __init__(self, message: str, owner: str = ""):
        super().__init__(message)
        self.owner = owner


# A lock held for a moment by another model's run, to harvest this model's batches that its rows share
# (llm_dedup = 'ledger', pipeline/shared.py): a run of this model finding it waits for it (at most
# BRIEF_WAIT_SECONDS) instead of failing, as it would for a run of its own.
BRIEF = ":brief"
BRIEF_WAIT_SECONDS = 120.0


def brief_owner() -> str:
    """An owner that holds a model's lock only for a harvest (see BRIEF)."""
    return new_owner() + BRIEF


def database_path(con) -> str:
    row = con.execute("select path from duckdb_databases() where database_name = current_database()").fetchall()
    return (row[0][0] if row and row[0][0] else None) or "<your DuckDB file>"


class ModelLock:
    def __init__(self, ledger: Ledger, owner: str | None = None, stale_after: float = STALE_AFTER_SECONDS):
        self.ledger, self.owner, self.stale_after = ledger, owner or new_owner(), stale_after
        self.table = ledger.table("llm_batch_locks")

    def acquire(self) -> None:
        """Take the model's lock, or take over a stale one; raise LockHeldError if a live run holds it
        (after waiting for a brief holder: see BRIEF)."""
        waited_since = time.monotonic()
        while True:
            try:
                previous = self._acquire_once()
                break
            except LockHeldError as held:
                brief = held.owner.endswith(BRIEF) and not self.owner.endswith(BRIEF)
                if not brief or time.monotonic() - waited_since > BRIEF_WAIT_SECONDS:
                    raise
                time.sleep(0.1)
        self.ledger.owner = self.owner  # the run's project-wide claims are this owner's (claims.py)
        if previous:
            owner, acquired_at, age = previous
            why = (
                "its process is no longer running on this host"
                if age < self.stale_after
                else f"no heartbeat for {int(age)} s, more than {int(self.stale_after)} s"
            )
            log.warning(
                f"{self.ledger.model}: took over the lock of {owner} (held since {acquired_at}; {why}): "
                f"that run is presumed dead"
            )

    def _acquire_once(self):
        for attempt in range(20):
            try:
                return self._try_acquire()
            # A concurrent taker committed first: look again. Its row is a write conflict while it is
            # open, and a duplicate key once committed after this transaction read the lock free.
            except (duckdb.TransactionException, duckdb.ConstraintException):
                if attempt == 19:
                    raise
                time.sleep(0.05 * (attempt + 1))
        return None

    def _try_acquire(self):
        con, model = self.ledger.con, self.ledger.model
        with transaction(con):
            rows = con.execute(
                f"""select owner, acquired_at, heartbeat_at, epoch(now() - heartbeat_at)
                                   from {self.table} where model = ?""",
                [model],
            ).fetchall()
            if not rows:
                con.execute(f"insert into {self.table} values (?, ?, now(), now())", [model, self.owner])
                return None
            owner, acquired_at, heartbeat_at, age = rows[0]
            if owner != self.owner and age < self.stale_after and not process_is_gone(owner):
                raise LockHeldError(self.held_message(owner, acquired_at, age), owner)
            con.execute(
                f"""update {self.table} set owner = ?, acquired_at = now(), heartbeat_at = now()
                            where model = ?""",
                [self.owner, model],
            )
            return None if owner == self.owner else (owner, acquired_at, age)

    def held_message(self, owner: str, acquired_at, age: float) -> str:
        ledger = self.ledger
        return (
            f"{ledger.model} is being run by {owner} (host:pid:run) since {acquired_at:%Y-%m-%d %H:%M:%S %Z}, "
            f"last heartbeat {int(age)} s ago. Two runs of one model must not submit at once, so this run "
            f"stopped before harvesting, planning or sending anything. Wait for that run to finish. If that "
            f"process is dead, its lock is taken over automatically (at once if it ran on this host, else once its "
            f"heartbeat is {int(self.stale_after // 60)} minutes old), or clear it now with: dbt-llm-batch unlock "
            f"--database {database_path(ledger.con)} --schema {ledger.schema} --model {ledger.model}"
        )

    def heartbeat(self) -> None:
        """Refresh the heartbeat; raise if another run took the lock over (this run was presumed dead)."""
        n = self.ledger.execute(
            f"update {self.table} set heartbeat_at = now() where model = ? and owner = ?",
            [self.ledger.model, self.owner],
        ).fetchall()[0][0]
        if not n:
            raise LockHeldError(
                f"{self.ledger.model}: this run's lock was taken over by another run (no heartbeat "
                f"for {int(self.stale_after)} s); stopping before it submits anything more"
            )

    def release(self) -> None:
        """The run ends: its lock, and the project-wide claims it made (claims.py), go."""
        self.ledger.execute(f"delete from {self.table} where model = ? and owner = ?", [self.ledger.model, self.owner])
        if self.ledger.owner == self.owner:
            self.ledger.release_claims()


def unlock(con, schema: str, model: str) -> list[tuple]:
    """Remove a model's lock row whatever its owner (the operator says that owner is dead); returns
    the removed rows (owner, acquired_at, heartbeat_at)."""
    table = Ledger(con, schema, model).table("llm_batch_locks")
    rows = con.execute(f"select owner, acquired_at, heartbeat_at from {table} where model = ?", [model]).fetchall()
    con.execute(f"delete from {table} where model = ?", [model])
    return rows
