"""Writes to `llm_batch_settled`: per model, the selection a run left complete (pipeline/settled.py).

One row per model at most. A run that leaves every selected row answered for its config records the
selection's signature; a run that does anything else deletes it before it writes (so a run killed
half-way, or one that leaves work behind, never leaves a signature a later run could skip on), and so
do the operator commands that make a settled row due again (`release`, `requeue`, `cancel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from dbt_llm_batch.ledger.base import LedgerBase, retry_on_conflict, transaction


@dataclass(frozen=True)
class Signature:
    """What a settled selection is known by: its config (config, SQL, columns, plugin version, hashed),
    its row count and the order-independent hash of its rows' (key columns, updated_at)."""

    config: str
    rows: int
    rows_hash: int


@dataclass(frozen=True)
class Settled:
    signature: Signature
    updated_at_column: str
    recorded_at: datetime


class SettledWrites(LedgerBase):
    def settled(self) -> Settled | None:
        """This model's settled selection, if a run recorded one and nothing deleted it since."""
        rows = self.con.execute(
            f"""select config_signature, row_count, rows_hash, updated_at_column, recorded_at
                from {self.table("llm_batch_settled")} where model = ?""",
            [self.model],
        ).fetchall()
        if len(rows) != 1:
            return None
        config, count, rows_hash, column, when = rows[0]
        return Settled(Signature(config, count, int(rows_hash)), column, when)

    def record_settled(self, signature: Signature, updated_at_column: str) -> None:
        """The model is complete for `signature`: the next run with the same one may skip."""
        table = self.table("llm_batch_settled")

        def write():
            with transaction(self.con):
                self.con.execute(f"delete from {table} where model = ?", [self.model])
                self.con.execute(
                    f"insert into {table} values (?, ?, ?, ?::hugeint, ?, now())",
                    [self.model, signature.config, signature.rows, str(signature.rows_hash), updated_at_column],
                )

        retry_on_conflict(write)

    def forget_settled(self) -> None:
        """The model may no longer be complete (a run is about to change it, or an operator made rows
        due again): no run skips until one records a new signature."""
        self.execute(f"delete from {self.table('llm_batch_settled')} where model = ?", [self.model])
