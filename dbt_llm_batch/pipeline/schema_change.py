"""on_schema_change: an incremental run of a model whose columns no longer match its table's.

The table is a pure function of the ledger and the selection (merge.py), so a changed SELECT or
`llm_output` never needs a manual full refresh to be right; the policy (dbt's own key and values) says
what happens to the table's columns, before anything is sent:

- `append_new_columns` (the default; dbt's default `'ignore'` is read as it, since dbt sets it on every
  model): the columns the model gained are added, NULL until the merge writes them. An output field is
  in the request's fingerprint, so the same run asks for it. Columns the model lost stay in the table
  with the values they had (NULL in rows written later). A removed output field asks nothing: the
  answers held were asked with every field still asked (wider_answers.py). A column whose type changed fails the run, as
  dbt's own `append_new_columns` leaves types alone.
- `sync_all_columns`: the new columns are added, the lost ones dropped, a changed type is cast (a value
  that does not cast is NULL until the merge rewrites its row).
- `fail`: the run stops, naming the model and the columns, and sends nothing.

A key column the table lacks (`unique_key` changed) cannot be added in place (old rows would have a NULL
key), nor can `llm_variant` be kept once a model drops its variants (rows per key and variant): the
table is rebuilt from the ledger in this run, as a full refresh does, which sends nothing for it.
Status columns a newer dbt-llm-batch adds, and `llm_variant` when a model gains evaluation variants
(its rows are the default variant's), are appended under every policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dbt_llm_batch.config import STATUS_COLUMNS, ModelConfig
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline.merge import VARIANT_COLUMN, relation_exists, table_columns
from dbt_llm_batch.pipeline.plan import describe
from dbt_llm_batch.sql import ident, literal


@dataclass(frozen=True)
class Changes:
    """How the model's columns differ from its table's, by lower-cased name (DuckDB's rule)."""

    added: list[tuple[str, str]]  # (name, type) the model has and the table lacks
    removed: list[tuple[str, str]]  # (name, type) the table has and the model lacks
    retyped: list[tuple[str, str, str]]  # (name, table's type, model's type)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.retyped)

    def lines(self) -> str:
        parts = [
            ("added", [f"{n} {t}" for n, t in self.added]),
            ("removed", [f"{n} {t}" for n, t in self.removed]),
            ("changed", [f"{n} {old} -> {new}" for n, old, new in self.retyped]),
        ]
        return "".join(f"  {what}: {', '.join(cols)}\n" for what, cols in parts if cols)


def changes(actual, expected) -> Changes:
    """The difference only, by name, in name order: a wide table's full column lists would hide it.
    Columns are compared as a set: the table's own order wins (rows are inserted by name)."""
    table, model = {n.lower(): (n, t) for n, t in actual}, {n.lower(): (n, t) for n, t in expected}
    return Changes(
        added=[model[k] for k in sorted(model) if k not in table],
        removed=[table[k] for k in sorted(table) if k not in model],
        retyped=[
            (model[k][0], table[k][1], model[k][1]) for k in sorted(model) if k in table and table[k][1] != model[k][1]
        ],
    )


def prepare_table(
    con,
    schema: str,
    identifier: str,
    target: str,
    input_columns,
    config: ModelConfig,
    full_refresh: bool,
    model: str,
    dry_run: bool,
) -> tuple[bool, bool]:
    """The run's table step, before anything is sent: (whether the model's table exists, whether this
    run rebuilds it from the ledger). A table kept follows the model's columns (`apply`)."""
    exists = relation_exists(con, schema, identifier)
    if full_refresh or not exists:
        return exists, True
    return True, apply(con, target, table_columns(input_columns, config), config, model, dry_run=dry_run)


def _null_key(con, target: str, columns: list[str]) -> bool:
    """Whether a row of `target` holds NULL in one of its key `columns` (row groups with no NULL are
    skipped by their statistics)."""
    if not columns:
        return False
    nulls = " or ".join(f"{ident(c)} is null" for c in columns)
    return con.execute(f"select exists (select 1 from {target} where {nulls})").fetchall()[0][0]


def apply(con, target: str, expected, config: ModelConfig, model: str, dry_run: bool = False) -> bool:
    """Bring the existing table `target` to the model's columns `expected` under config.on_schema_change.

    `model` is the model's dbt name (what `-s` selects). Returns True when the table must be rebuilt
    from the ledger in this run (a key column is new). Raises ConfigError, before anything is sent,
    under `fail` or for a type change `append_new_columns` does not make. A dry run changes nothing:
    it says what the real run will do, and fails where the real run would.
    """
    default_variant = config.variant_name
    internal = [*STATUS_COLUMNS, *([VARIANT_COLUMN] if default_variant is not None else [])]
    actual = describe(con, target)
    found = changes(actual, expected)
    # Columns the package itself adds come whatever the policy: they change no user column.
    own = [c for c in found.added if c in internal]
    found = Changes([c for c in found.added if c not in internal], found.removed, found.retyped)
    policy = config.on_schema_change
    rebuild_hint = f"`dbt run --full-refresh -s {model}` rebuilds it from the ledger and sends nothing"
    if found and policy == "fail":
        raise ConfigError(
            f"{model}: the columns of {target} changed (the model's SELECT, unique_key or llm_output changed):\n"
            f"{found.lines()}"
            f"on_schema_change='fail' stops here: {rebuild_hint}, or set on_schema_change to "
            f"'append_new_columns' or 'sync_all_columns' to let the run change the table."
        )
    if found.retyped and policy == "append_new_columns":
        raise ConfigError(
            f"{model}: columns of {target} changed type:\n{Changes([], [], found.retyped).lines()}"
            f"on_schema_change='append_new_columns' only adds columns: set on_schema_change='sync_all_columns' "
            f"to cast them, or {rebuild_hint}."
        )
    keys = {k.lower() for k in config.unique_key}
    # A new key column (old rows would have a NULL key), or llm_variant gone (the model dropped its
    # evaluation variants: its table's rows per key and variant become one per key): rebuilt. So is a
    # key column the table kept from an earlier unique_key (on_schema_change kept it when the key
    # moved on, NULL in the rows written since): the run never writes a NULL key (merge.py refuses),
    # so a NULL there is such a column's, and the rows holding it have no key to be merged by.
    kept_keys = [n for n, _ in actual if n.lower() in keys]
    if any(n.lower() in keys for n, _ in found.added):
        why = "unique_key changed to a column the table lacks"
    elif VARIANT_COLUMN in found.removed:
        why = "the evaluation variants were removed"
    elif _null_key(con, target, kept_keys):
        why = f"key column(s) {', '.join(kept_keys)} hold NULL in rows written under another unique_key"
    else:
        why = ""
    rebuild = bool(why)
    if dry_run:
        if found:
            how = "rebuild it from the ledger" if rebuild else f"change it ({policy})"
            log.info(f"{model}: the columns of {target} changed; the real run will {how}:\n{found.lines().rstrip()}")
        elif rebuild:
            log.info(f"{model}: {why}: the real run will rebuild {target} from the ledger")
        return rebuild
    if rebuild:
        log.info(f"{model}: {why}: the table is rebuilt from the ledger in this run (nothing is sent for it)")
        return True
    for name, typ in own:
        default = (
            f" default {literal(default_variant)}"
            if default_variant is not None and (name, typ) == VARIANT_COLUMN
            else ""
        )
        con.execute(f"alter table {target} add column {ident(name)} {typ}{default}")
    for name, typ in found.added:
        con.execute(f"alter table {target} add column {ident(name)} {typ}")
    if policy == "sync_all_columns":
        for name, _ in found.removed:
            con.execute(f"alter table {target} drop column {ident(name)}")
        for name, _, typ in found.retyped:
            con.execute(
                f"alter table {target} alter column {ident(name)} type {typ} using try_cast({ident(name)} as {typ})"
            )
    if found.added or (policy == "sync_all_columns" and found):  # columns append_new_columns kept are said once
        kept = (
            "" if policy == "sync_all_columns" or not found.removed else " (removed columns stay: append_new_columns)"
        )
        log.info(
            f"{model}: the columns of {target} changed; the table follows ({policy}){kept}:\n{found.lines().rstrip()}"
        )
    return False
