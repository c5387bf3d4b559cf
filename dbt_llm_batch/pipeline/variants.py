"""Evaluation variants (`llm_variants`, README "Evaluation runs"): one model asks each selected row of
several configs in the same run, and its table holds one row per (unique_key, variant).

A variant is not a model of its own: the ledger knows one model, and a *row answer* is (model, key,
variant), pointing at the request that answers it. The default variant (the model's own keys, named
by `llm_default_variant`) is stored as variant '' (so adding variants to a model keeps every answer it
has), the others under their names. The run (runner.py) harvests once for the whole model (each batch
through the provider it went to), then makes one pass per variant with that variant's config: its
selected rows and fingerprints (`Scratch.desired`), its plan, budget check, request files, submission
and realtime rows, through its own provider; then merges each variant's rows. A variant's fingerprint
is its own answer-defining fields, so editing one variant re-asks only its rows, and two variants that
would send identical requests share them (llm_dedup).
"""

from __future__ import annotations

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import in_list

DESIRED = Scratch.desired

# A key's place in [0, 1): the first 32 bits of the md5 of its ledger key (the JSON list of the key
# columns as text), the same on every run, machine and DuckDB version, unlike DuckDB's hash().
_KEY_POSITION = "cast(('0x' || substr(md5(key), 1, 8)) as ubigint) / 4294967296.0"


def sample_condition(fraction: float) -> str:
    """SQL over a relation with the ledger's `key`: true for the keys a variant sampled at `fraction`
    answers. The same keys for every variant of that fraction, so sampled challengers are compared on
    the same rows, and a larger fraction answers a superset of a smaller one's keys."""
    return f"({_KEY_POSITION}) < {float(fraction)!r}"


def sample_desired(con, config: ModelConfig) -> None:
    """Keep in the selected rows of this pass only the keys a sampled variant answers."""
    if config.variant_sample is not None and config.variant_sample < 1:
        con.execute(f"delete from {DESIRED} where not ({sample_condition(config.variant_sample)})")


def label(model: str, config: ModelConfig) -> str:
    """How the run log names a model's variant pass: the model, and the variant if it has variants."""
    return model if config.variant_name is None else f"{model} (variant {config.variant_name})"


def drop_removed(ledger: Ledger, config: ModelConfig, target: str) -> int:
    """Rows of variants the model no longer has leave the table (in one transaction); the
    ledger keeps their answers (paid for once) and marks them no longer shown, so a variant added back
    is merged again from the ledger without asking anything. Returns how many rows were removed."""
    names = [c.variant_name for c in config.all_variants() if c.variant_name is not None]
    if not names:
        return 0
    stored = [c.variant for c in config.all_variants()]
    nothing = "(select null::varchar as key, null::varchar as custom_id where false)"
    con = ledger.con

    def write() -> int:
        with transaction(con):
            removed = con.execute(
                f"delete from {target} where llm_variant is null or llm_variant not in {in_list(names)}"
            ).fetchall()[0][0]
            # A variant with no row in the table (the default variant renamed by llm_default_variant):
            # its answers are merged again from the ledger, under its name now.
            shown = {row[0] for row in con.execute(f"select distinct llm_variant from {target}").fetchall()}
            absent = [c.variant for c in config.all_variants() if c.variant_name not in shown]
            scope = f"emitted = 'merged' and variant not in {in_list(stored)}"
            if absent:
                scope += f" or emitted = 'merged' and variant in {in_list(absent)}"
            ledger.mark_emitted(nothing, scope)
            return removed

    return retry_on_conflict(write)
