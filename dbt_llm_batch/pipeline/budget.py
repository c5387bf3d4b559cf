"""The budget gate: before anything is uploaded, a plan whose estimate would take the money committed
in flight over a limit is refused (llm_max_cost_usd for the model, var llm_batch_max_cost_usd for all
models of the ledger). A refused run still merges what is already final, then fails saying so.

The model's own limit needs nothing more than the model's lock: one run of a model at a time. The
project's is shared by models that dbt runs in parallel threads: a run reserves its estimate in the
ledger, granted in one step against what is in flight and what the other running models reserved
(Ledger.reserve_budget, ledger/claims.py), so two models cannot both pass on the same headroom."""

from __future__ import annotations

from decimal import Decimal

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.errors import BudgetError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import costs


def committed(ledger: Ledger, all_models: bool = False) -> Decimal:
    """Money committed in flight: the estimate of requests submitted and not yet billed."""
    return ledger.committed_usd(all_models=all_models)


def check_budget(
    ledger: Ledger,
    config: ModelConfig,
    project_max_cost,
    n: int,
    estimate: Decimal | int | None,
    output: costs.OutputEstimate | None = None,
) -> None:
    """Refuse, before any upload, a plan of `n` requests that would take committed spend over a budget.
    `estimate` counts each answer's output at `output.basis` (llm_budget_basis: the ceiling by default)."""
    limits = [
        (config.max_cost_usd, False, "llm_max_cost_usd (this model)"),
        (project_max_cost, True, "var llm_batch_max_cost_usd"),
    ]
    for limit, all_models, name in limits:
        if limit is None:
            continue
        if estimate is None:
            raise BudgetError(
                f"{ledger.model}: {name} is set to {costs.fmt_usd(limit)} but there is no price "
                f"for {config.provider} model '{config.model}', so the cost of {n} "
                f"request(s) cannot be estimated; nothing was sent. Add a price with llm_price_table."
            )
        reserved = Decimal(0)
        if all_models and ledger.owner is not None:  # a run holding its lock (a dry run reserves nothing)
            refused = ledger.reserve_budget(Decimal(estimate), Decimal(str(limit)))
            if refused is None:
                continue
            spent, reserved = refused
        else:
            spent = committed(ledger, all_models)
            if spent + estimate <= Decimal(str(limit)):
                continue
        others = f" and {costs.fmt_usd(reserved)} reserved by models submitting now" if reserved else ""
        raise BudgetError(
            f"{ledger.model}: refusing to submit {n} request(s): estimated {costs.fmt_usd(estimate)} "
            f"plus {costs.fmt_usd(spent)} already in flight{others} exceeds {name} = {costs.fmt_usd(limit)}; "
            f"nothing was sent. Raise the limit, or select fewer rows.{_basis_hint(config, output)}"
        )


def _basis_hint(config: ModelConfig, output: costs.OutputEstimate | None) -> str:
    """Say what the estimate counted, and the other choice, when the expected figure is lower."""
    if output is None or config.budget_basis == "expected" or output.expected >= output.ceiling:
        return ""
    return (
        f" (The estimate counts every answer at {output.ceiling} output tokens, the ceiling; this model's "
        f"answers have been up to about {output.expected}: llm_budget_basis = 'expected' counts that instead.)"
    )


def also_unavailable(refused: BudgetError, down: Exception) -> BudgetError:
    """A refused run whose provider also stayed down: one failure that says both."""
    return BudgetError(f"{refused} Also: {down}")


def refused_after_merge(refused: BudgetError, merged: int) -> BudgetError:
    """The refusal as the run ends with it, after merging what was final."""
    return BudgetError(f"{refused} (Results that were final are merged: {merged} row(s).)")
