"""A dbt-duckdb plugin that turns "another process holds the DuckDB file" into a clear message.

dbt-duckdb opens the database before any model (and so before any code of ours) runs, and a
DuckDB lock conflict there surfaces as an uncaught `duckdb.IOException` with a Python stack trace.
dbt-duckdb's only hook before that `connect` is a plugin's `update_connection_config`: this plugin
opens the file there itself, and on a lock conflict raises a RuntimeError, which dbt-duckdb reports
as a one-line "Database Error" instead of a trace. Enable it in profiles.yml (docs/operations.md, "Runs that
collide"):

    plugins:
      - module: dbt_llm_batch.duckdb_plugin   # the stable name; that module re-exports this Plugin

The probe connection stays open until `configure_connection`, so dbt-duckdb's own `connect` reuses
the same in-process database instance instead of opening the file a second time.

Before giving that message it waits a little (WAIT_SECONDS, or the plugin's `wait_seconds` config),
retrying with back-off: `dbt-llm-batch poll` holds the file for seconds at a time only, so a run
started meanwhile goes ahead as soon as the poller lets go, instead of failing.
"""

from __future__ import annotations

import os
import time

import duckdb
from dbt.adapters.duckdb.plugins import BasePlugin
from dbt.adapters.events.logging import AdapterLogger

from dbt_llm_batch.ledger.locks import is_lock_conflict, lock_conflict_message

# Longest wait for a file another process holds: the poller's writes take seconds; a dbt run's whole run.
WAIT_SECONDS = 15.0


class Plugin(BasePlugin):
    def initialize(self, plugin_config):
        self._probe = None
        self._wait_seconds = float((plugin_config or {}).get("wait_seconds", WAIT_SECONDS))

    def update_connection_config(self, creds, config):
        path = creds.path
        if not path or path == ":memory:" or path.startswith("md:") or "://" in path:
            return  # only a local file can be held by another process
        until, delay, said = time.monotonic() + self._wait_seconds, 0.2, False
        while True:
            try:
                self._probe = duckdb.connect(path, read_only=False, config=dict(config))
                return
            except duckdb.IOException as exc:
                if not is_lock_conflict(exc):
                    raise
                left = until - time.monotonic()
                if left <= 0:
                    raise RuntimeError(lock_conflict_message(path, str(exc))) from None
                if not said:
                    AdapterLogger("llm_batch").info(
                        f"{os.path.abspath(path)} is in use by another process; waiting up to {int(left)} s for it"
                    )
                    said = True
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)

    def configure_connection(self, conn):
        if self._probe is not None:  # dbt-duckdb's connection shares its database instance now
            self._probe.close()
            self._probe = None
