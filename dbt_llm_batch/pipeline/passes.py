"""A run's passes: the configs it asks each selected row with (ARCHITECTURE.md, "The run").

A model without evaluation variants is a run with one pass, its own config; a model with
`llm_variants` has one pass per variant, the model's own first (pipeline/variants.py). A pass is
immutable: its variant, config, price and the pool its provider client comes from. Entering a pass
is the one place the run's selected rows (Scratch.desired) and the ledger's variant change to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import added_fields, plan, variants
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.pipeline.scratch import Scratch


@dataclasses.dataclass(frozen=True)
class Pass:
    """One config the run asks with: its place among the passes, config, price and client."""

    index: int
    config: ModelConfig
    price: dict | None
    pool: Pool = dataclasses.field(repr=False, compare=False)
    # An added-fields pass (added_fields.py): the output fields it asks, of the rows holding the others.
    delta: tuple[str, ...] | None = None

    @property
    def variant(self) -> str:
        """The variant as the ledger stores it ('' the default variant, and a model without)."""
        return self.config.variant

    @property
    def client(self):
        """Its provider client, created on first use (Pool.client: a missing key is a ConfigError)."""
        return self.pool.client(self.config)

    def label(self, model: str) -> str:
        """The model, and the variant if the model has variants, as the run log names them."""
        return variants.label(model, self.config)


def passes_of(default: ModelConfig, pool: Pool) -> tuple[Pass, ...]:
    """The model's passes: its own config, then each variant's."""
    return tuple(Pass(i, config, pool.price_of_config(config), pool) for i, config in enumerate(default.all_variants()))


def enter(con, ledger: Ledger, current: Pass, input_columns, precomputed: bool) -> None:
    """Make `current` the pass the ledger writes for and whose selected rows (with its fingerprints
    and sample) are in Scratch.desired. `precomputed`: the input carries plan.PRECOMPUTED for the
    model's own config (runner.load_input), which only the first pass asks with."""
    ledger.variant = current.variant
    plan.build_desired(con, Scratch.input, input_columns, current.config, ledger, precomputed and current.index == 0)
    variants.sample_desired(con, current.config)
    if current.delta is not None:
        added_fields.keep_rows(con, current.variant, current.delta)


def each(con, ledger: Ledger, passes: tuple[Pass, ...], input_columns, precomputed: bool) -> Iterator[Pass]:
    """Each pass, entered (`enter`); once all were, the first again: its rows are the model's own,
    built when the run started, so a model without variants enters nothing and builds nothing again."""
    several = len(passes) > 1
    for p in passes:
        if several:
            enter(con, ledger, p, input_columns, precomputed)
        yield p
    if several:
        enter(con, ledger, passes[0], input_columns, precomputed)


def added_passes(con, base: tuple[Pass, ...]) -> tuple[Pass, ...]:
    """The added-fields passes of the rows the `base` passes' plans left to them (added_fields.prepare
    listed them in Scratch.added_rows): one per variant and set of missing fields, numbered after `base`."""
    found = con.execute(
        f"select distinct variant, missing from {Scratch.added_rows} where asked order by all"
    ).fetchall()
    by_variant = {p.variant: p for p in base if p.delta is None}
    out: list[Pass] = []
    for variant, missing in found:
        owner = by_variant[variant]
        fields = tuple(missing)
        config = added_fields.delta_config(owner.config, fields)
        out.append(Pass(len(base) + len(out), config, owner.price, owner.pool, delta=fields))
    return tuple(out)
