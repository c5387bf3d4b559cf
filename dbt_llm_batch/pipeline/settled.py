"""A run with nothing new, decided without reading the prompts (llm_updated_at; docs/large-models.md).

A run with nothing new otherwise loads every selected row (model_input.load_input: the key, prompt
hash and length of each) and looks each up among the ledger's row answers: at ten million rows that
is seconds, and it grows with the prompts' size. With `llm_updated_at` set, the model promises that
the named column changes whenever anything its prompt reads changes (the promise dbt snapshots'
`timestamp` strategy rests on). A run that leaves the model complete records the selection's
signature (ledger/settled.py); the next run computes the same signature with one aggregate over only
the key columns and that column of the model's SQL (DuckDB projects the prompt away) and, when
nothing differs, skips: the table stays as it is and nothing is loaded, planned or sent.

A signature is
- the hash of everything else that decides the table: the model's config as dbt gave it (every
  variant's, the output schema's), its compiled SQL (a prompt edited in SQL, `is_incremental()`),
  its selected columns and their types, its contract, and the plugin's version and ledger version;
- the selection's row count and the sum of hash(key columns, updated_at) over its rows: equal for the
  same rows in any order, different when a row is added, removed, re-keyed or has a new updated_at.

It is recorded only by a run that leaves every selected row of every pass with a final answer for its
current fingerprint and nothing of the model in flight, deferred, backing off, held or waiting for
another model's request; every other run deletes it before it changes anything (runner._run).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.config_values import canonical
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.settled import Signature
from dbt_llm_batch.ledger.store import SCHEMA_VERSION
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import merge, shared
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import ident

KEY = "llm_updated_at"


def config_signature(
    con, config: ModelConfig, sql: str | None, raw_config: dict, target: str, contract: dict | None
) -> str | None:
    """The hash of what decides the table besides the selected rows; None without llm_updated_at, or
    when the SQL does not bind (the normal path then says why). A Python model cannot set the key."""
    import duckdb

    if config.updated_at is None:
        return None
    if sql is None:
        raise python_model_error()
    try:
        columns = con.execute(f"describe (\n{sql}\n)").fetchall()
    except duckdb.Error:
        return None
    decided_by = {
        "config": canonical(raw_config),
        "sql": sql,
        "columns": [(str(name), str(typ)) for name, typ, *_ in columns],
        "target": target,
        "contract": canonical(contract or {}),
        "plugin": importlib.metadata.version("dbt-llm-batch"),  # the package's own __init__ imports ops
        "ledger": SCHEMA_VERSION,
    }
    text = json.dumps(decided_by, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def rows_sql(relation: str, config: ModelConfig) -> str:
    """One aggregate over the key columns and updated_at of `relation` (a table, or the model's SQL in
    parentheses): its row count and an order-independent hash of the rows (a HUGEINT sum of UBIGINTs)."""
    assert config.updated_at is not None
    columns = ", ".join(ident(c) for c in (*config.unique_key, config.updated_at))
    return f"select count(*), coalesce(sum(hash({columns})), 0)::hugeint from {relation} s"


def check_column(config: ModelConfig, input_columns) -> None:
    """llm_updated_at names a selected column (checked with the others, before anything is sent)."""
    if config.updated_at is None:
        return
    if config.updated_at.lower() not in {name.lower() for name, _ in input_columns}:
        raise ConfigError(
            f"{KEY} = {config.updated_at!r} is not a column the model selects "
            f"({', '.join(name for name, _ in input_columns)}): select it, or unset {KEY}; nothing was sent"
        )


def python_model_error() -> ConfigError:
    """A Python model's rows come as a DataFrame, with no query to aggregate without running it."""
    return ConfigError(
        f"{KEY} is for SQL models only: a Python model's rows are computed by running it, so a run "
        f"cannot tell that nothing changed without reading them. Unset {KEY} on this model; nothing was sent"
    )


def nothing_new(
    con,
    config: ModelConfig,
    schema: str,
    identifier: str,
    model: str,
    sql: str | None,
    full_refresh: bool,
    project: dict,
) -> bool:
    """Whether this run ends before loading the rows: llm_updated_at is set, it is no full refresh or
    dry run, and the model's settled selection is the current one (unchanged)."""
    signature = project.get("settled_config")
    if signature is None or sql is None or full_refresh or config.dry_run or project.get("dry_run"):
        return False
    ledger = Ledger(con, config.ledger_schema or schema, model)
    ledger.migrate()
    return unchanged(con, ledger, config, sql, signature, merge.relation_exists(con, schema, identifier))


def unchanged(con, ledger: Ledger, config: ModelConfig, sql: str, signature: str | None, table_exists: bool) -> bool:
    """Whether this run has nothing to do: the model's settled selection is the current one, its
    table exists and nothing of it is open. Logs the line that says so. Reads the ledger's small
    tables and one aggregate over (key columns, updated_at) of the model's SQL: no prompt."""
    settled = ledger.settled()
    if settled is None or signature is None or settled.signature.config != signature or not table_exists:
        return False
    # Only runs and operator commands make requests due, and each deletes the signature; a batch open
    # now would still be harvested by a run. The jobs table is small: no scan of the requests' millions.
    if ledger.open_jobs():
        return False
    count, rows_hash = con.execute(rows_sql(f"(\n{sql}\n)", config)).fetchall()[0]
    if (count, int(rows_hash)) != (settled.signature.rows, settled.signature.rows_hash):
        return False
    log.info(
        f"{ledger.model}: nothing new: {count} row(s) unchanged since {settled.recorded_at:%Y-%m-%d %H:%M:%S %Z} "
        f"(by {KEY} = {settled.updated_at_column}); nothing was loaded or sent, the table is as it was"
    )
    return True


def record_if_complete(run, signature: str | None) -> bool:
    """After the merge, under the model's lock: record the selection's signature if the run left the
    model complete (see the module's docstring); returns whether it did. `run`: the ModelRun."""
    config: ModelConfig = run.config
    ledger: Ledger = run.ledger
    if (
        signature is None
        or config.updated_at is None
        or run.dry_run
        or run.unavailable_error
        or run.summary.interrupted
    ):
        return False
    if ledger.open_jobs() or ledger.pending_count() or ledger.deferred_count() or any(ledger.waiting_counts()):
        return False
    if config.dedup == "ledger" and shared.waiting_elsewhere(ledger):
        return False
    # Each pass's selected rows (its sample) and fingerprints are in Scratch.desired once entered; every
    # pass is entered (each_pass ends back at the first), whatever the first one says.
    if any([_unanswered(ledger) for _ in run.each_pass()]):
        return False
    count, rows_hash = ledger.con.execute(rows_sql(Scratch.input, config)).fetchall()[0]
    ledger.record_settled(Signature(signature, count, int(rows_hash)), config.updated_at)
    return True


def _unanswered(ledger: Ledger) -> bool:
    """Whether a row of the entered pass has no final answer (succeeded, or failed for good) for its
    current fingerprint: asked and not answered yet, due for a retry, or never asked."""
    return ledger.con.execute(
        f"""select exists (
                select 1 from {Scratch.desired} d
                anti join (select a.key, a.fingerprint
                           from {ledger.table("llm_batch_row_answers")} a
                                join {ledger.table("llm_batch_requests")} r using (custom_id)
                           where a.model = $model and a.variant = $variant and r.is_final) a
                on a.key = d.key and a.fingerprint = d.fingerprint)""",
        {"model": ledger.model, "variant": ledger.variant},
    ).fetchall()[0][0]
