"""The ledger's costs as a FinOps FOCUS dataset (FOCUS_VERSION): the view `llm_batch_focus`, one row
per charge: a day's settled requests of one dbt model (and evaluation variant), provider, LLM model
and route. `dbt-llm-batch report --focus FILE.csv` writes it as it is.

How the ledger maps onto FOCUS (each column's requirements: the specification's columns/*.md):
- BilledCost, EffectiveCost and ContractedCost are what the requests cost (cost_usd: batch prices
  for the batch route, list prices for realtime); ListCost is the same tokens at realtime (list)
  prices (realtime_cost_usd; for a self-hosted engine, which has no list price, its cost).
- The charge period is the UTC day the requests settled (ChargePeriodEnd exclusive); the billing
  period is that day's calendar month.
- The provider (openai, anthropic, ...) is ServiceName, ProviderName, PublisherName,
  InvoiceIssuerName and the billing account (the ledger does not know the account's id); the LLM
  model is SkuId; the dbt model is ResourceId and ResourceName.
- PricingQuantity and ConsumedQuantity are the tokens billed (input + output; cache reads and
  writes are part of the input), in PricingUnit / ConsumedUnit 'Tokens'.
- Tags (JSON, the one user-defined tag scheme, so no prefix): dbt_model, variant (the evaluation
  variant; 'default' for the model's own config) and route (batch or realtime).
Columns of the specification that do not apply (commitment discounts, capacity reservations,
regions, availability zones, sub-accounts, invoices, unit prices that mix input and output rates)
are left out, as FOCUS allows for Conditional and Recommended columns.
"""

from __future__ import annotations

from typing import Final

from dbt_llm_batch.ledger.status import RequestStatus, sql
from dbt_llm_batch.ledger.variant_names import VARIANT_NAMES, shown_variant_sql

FOCUS_VERSION: Final = "1.2"

_OUTCOMES = f"{sql(RequestStatus.SUCCEEDED)}, {sql(RequestStatus.FAILED)}"

# `{s}` is the ledger's schema (store.VIEWS). Only settled requests with a cost are charges: an
# unpriced model's requests (cost NULL) are unknown, not $0, and are left out rather than reported free.
FOCUS_VIEW: Final = f"""create or replace view {{s}}.llm_batch_focus as
    with charges as (
        select cast(coalesce(r.completed_at, r.queued_at) at time zone 'UTC' as date) as day,
               coalesce(j.provider, '') as provider, coalesce(j.llm_model, '') as llm_model,
               r.model, coalesce(nullif({shown_variant_sql("r.variant")}, ''), 'default') as variant, coalesce(r.route, 'batch') as route,
               sum(r.cost_usd) as cost_usd, sum(coalesce(r.realtime_cost_usd, r.cost_usd)) as list_cost_usd,
               sum(coalesce(r.input_tokens, 0) + coalesce(r.output_tokens, 0)) as tokens
        from {{s}}.llm_batch_requests r join {{s}}.llm_batch_jobs j using (job_id)
             left join {VARIANT_NAMES} n on n.model = r.model
        where r.status in ({_OUTCOMES}) and r.cost_usd is not null
        group by all
    )
    select cast(cost_usd as decimal(18, 9)) as BilledCost,
           provider as BillingAccountId,
           provider as BillingAccountName,
           'USD' as BillingCurrency,
           cast(date_trunc('month', day) + interval 1 month as timestamp) as BillingPeriodEnd,
           cast(date_trunc('month', day) as timestamp) as BillingPeriodStart,
           'Usage' as ChargeCategory,
           cast(null as varchar) as ChargeClass,
           route || ' requests to ' || provider || ' ' || llm_model || ' for dbt model ' || model
               || case when variant = 'default' then '' else ' (variant ' || variant || ')' end as ChargeDescription,
           'Usage-Based' as ChargeFrequency,
           cast(day + interval 1 day as timestamp) as ChargePeriodEnd,
           cast(day as timestamp) as ChargePeriodStart,
           cast(tokens as decimal(18, 0)) as ConsumedQuantity,
           'Tokens' as ConsumedUnit,
           cast(cost_usd as decimal(18, 9)) as ContractedCost,
           cast(cost_usd as decimal(18, 9)) as EffectiveCost,
           provider as InvoiceIssuerName,
           cast(list_cost_usd as decimal(18, 9)) as ListCost,
           'Standard' as PricingCategory,
           cast(tokens as decimal(18, 0)) as PricingQuantity,
           'Tokens' as PricingUnit,
           provider as ProviderName,
           provider as PublisherName,
           model as ResourceId,
           model as ResourceName,
           'dbt model' as ResourceType,
           'AI and Machine Learning' as ServiceCategory,
           provider as ServiceName,
           'Generative AI' as ServiceSubcategory,
           llm_model as SkuId,
           cast(json_object('dbt_model', model, 'variant', variant, 'route', route) as json) as Tags
    from charges"""
