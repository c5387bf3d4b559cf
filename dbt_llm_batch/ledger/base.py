"""What every part of the ledger shares: transactions, conflict retries, and the tables of a schema."""

from __future__ import annotations

import time
from contextlib import contextmanager

import duckdb

from dbt_llm_batch.sql import ident


@contextmanager
def transaction(con):
    """One DuckDB transaction: committed if the block succeeds, rolled back (if still open) if not."""
    con.execute("begin transaction")
    try:
        yield
        con.execute("commit")
    except BaseException:
        try:
            con.execute("rollback")
        except duckdb.TransactionException:
            pass  # a failed COMMIT has already ended the transaction; keep the original error
        raise


def retry_on_conflict(fn, attempts: int = 20):
    """Run fn(), retrying DuckDB transaction conflicts between concurrent model threads."""
    for i in range(attempts):
        try:
            return fn()
        except duckdb.TransactionException as exc:
            if "conflict" not in str(exc).lower() or i == attempts - 1:
                raise
            time.sleep(0.05 * (i + 1))


class LedgerBase:
    """The state tables of one schema, seen from one dbt model."""

    def __init__(self, con, schema: str, model: str):
        self.con = con
        self.schema = schema
        self.model = model
        # The evaluation variant whose pass is running ('' the default): the row answers, requests and
        # jobs this object writes carry it, and its deferred requests are its own (pipeline/variants.py).
        self.variant = ""
        # The run that holds the model's lock (locks.ModelLock.acquire; None before, and in a dry run):
        # the project-wide claims this object makes are its (claims.py), and end with it.
        self.owner: str | None = None
        self.claimed = False  # whether it made one: only then has the run's end anything to release

    def table(self, name: str) -> str:
        return f"{ident(self.schema)}.{name}"

    def execute(self, sql: str, params=None):
        """Execute one statement (autocommit), retrying write conflicts with other model threads."""
        return retry_on_conflict(lambda: self.con.execute(sql, params or []))

    def count(self, sql: str, params=None) -> int:
        """Execute one write and return how many rows it changed."""
        return self.execute(sql, params).fetchall()[0][0]
