"""Errors that reach the user. Each message says what is wrong and how to fix it."""


class LlmBatchError(Exception):
    """Base class: dbt shows the message as the model's failure reason."""


class ConfigError(LlmBatchError):
    """The model's llm_* config is invalid. Raised before any request is paid for."""


class InputError(LlmBatchError):
    """The rows the model selected cannot be sent (NULL or duplicate keys, missing columns)."""


class ProviderError(LlmBatchError):
    """A provider call failed in a way the run cannot recover from on its own."""


class BudgetError(LlmBatchError):
    """A submission would exceed a cost budget. Raised before anything is uploaded."""


class PollError(LlmBatchError):
    """`dbt-llm-batch poll` cannot poll (no such file, an unknown model, a --then it cannot expand)."""


class LedgerInvariantError(LlmBatchError):
    """A ledger write refused because it would break an invariant of the ledger (ARCHITECTURE.md,
    "Invariants"): nothing was written. A bug of dbt-llm-batch, never of the model."""


class VersionMismatchError(LlmBatchError):
    """The dbt package (macros) and the installed Python package are different versions."""


class ContractError(LlmBatchError):
    """An enforced contract (`contract: {enforced: true}`) disagrees with the table the model makes.

    Carries both column lists in the shape dbt's own contract error takes (name, data_type,
    formatted), so the materialization raises dbt's ContractError with its table of mismatches.
    """

    def __init__(self, message: str, declared: list[dict], produced: list[dict]):
        super().__init__(message)
        self.declared, self.produced = declared, produced
