"""A dbt-duckdb plugin that turns "another process holds the DuckDB file" into a clear message.

dbt-duckdb opens the database before any model (and so before any code of ours) runs, and a
DuckDB lock conflict there surfaces as an uncaught `duckdb.IOException` with a Python stack trace.
dbt-duckdb's only hook before that `connect` is a plugin's `update_connection_config`: this plugin
opens the file there itself, and on a lock conflict raises a RuntimeError, which dbt-duckdb reports
as a one-line "Database Error" instead of a trace. Enable it in profiles.yml (README, "Runs that
collide"):

    plugins:
      - module: dbt_llm_batch.duckdb_plugin   # the stable name; that module re-exports this Plugin

The probe connection stays open until `configure_connection`, so dbt-duckdb's own `connect` reuses
the same in-process database instance instead of opening the file a second time.
"""

from __future__ import annotations

import duckdb
from dbt.adapters.duckdb.plugins import BasePlugin

from dbt_llm_batch.ledger.locks import is_lock_conflict, lock_conflict_message


class Plugin(BasePlugin):
    def initialize(self, plugin_config):
        self._probe = None

    def update_connection_config(self, creds, config):
        path = creds.path
        if not path or path == ":memory:" or path.startswith("md:") or "://" in path:
            return  # only a local file can be held by another process
        try:
            self._probe = duckdb.connect(path, read_only=False, config=dict(config))
        except duckdb.IOException as exc:
            if is_lock_conflict(exc):
                raise RuntimeError(lock_conflict_message(path, str(exc))) from None
            raise

    def configure_connection(self, conn):
        if self._probe is not None:  # dbt-duckdb's connection shares its database instance now
            self._probe.close()
            self._probe = None
