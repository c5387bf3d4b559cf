"""The ledger: the state tables of a schema (requests, jobs, locks, models), their migrations, their
state machine (status.py), and the only code that writes them. See ARCHITECTURE.md, "The ledger"."""

from dbt_llm_batch.ledger.store import IN_FLIGHT, Ledger, retry_on_conflict, transaction

__all__ = ["IN_FLIGHT", "Ledger", "retry_on_conflict", "transaction"]
