"""Money: the price table, per-request cost at harvest, and the estimate that gates a submission.

Prices are per million tokens (unit 'token'); `batch_discount` is the share taken off for batch
processing (0.5 = half price). A request's realtime cost is its tokens at list price; its cost is
that times (1 - batch_discount). Cached tokens are priced at the cache rates, and each token counts
once: input_tokens includes cache reads and writes, so only the rest is priced at the input rate.
Cache writes with Anthropic's 1 h TTL (cache_write_1h_tokens, part of cache_write_tokens) have their
own rate, cache_write_1h_per_mtok: 2x the input price by Anthropic's prompt-caching pricing (a 5 min
write is 1.25x), which is also what a price table without that column (older user tables) gets.
Amounts are DECIMAL(18, 9) dollars: exact to well below a millionth of a dollar.
A model without a price has NULL cost (and a warning), never $0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.status import RequestStatus, sql
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import literal

PRICES_CSV = Path(__file__).with_name("prices.csv")
PRICES = Scratch.prices
MONEY = "decimal(18, 9)"
# Estimated output tokens when llm_max_tokens is not set (the estimate is then a guess, not a bound).
DEFAULT_OUTPUT_ESTIMATE = 1000
# Per-request overhead of chat formatting, added to the character-based estimate.
MESSAGE_OVERHEAD_TOKENS = 8
# The expected output of a request: this percentile of the model's recent succeeded answers' output
# tokens. A high one, so an estimate is rarely under the bill; answers much longer than most are rare.
OUTPUT_PERCENTILE = 0.95
OUTPUT_HISTORY = 1000  # the most recent succeeded answers it is taken from


@dataclass(frozen=True)
class OutputEstimate:
    """Output tokens per request: `expected` from the model's own answers (`history` of them; 0: none
    yet, and expected is the ceiling), `ceiling` the most a request may produce (llm_max_tokens, or
    DEFAULT_OUTPUT_ESTIMATE when unset). `basis` is the one estimates and budgets count."""

    expected: int
    ceiling: int
    history: int
    basis: int


def output_estimate(ledger: Ledger, config: ModelConfig) -> OutputEstimate:
    """The model's expected and ceiling output tokens per request (llm_budget_basis picks the basis),
    from the answers asked with `config`'s output schema (or before schemas were recorded): a request
    asking only the fields added since (added_fields.py) expects the output of those alone."""
    ceiling = config.max_tokens or DEFAULT_OUTPUT_ESTIMATE
    percentile, history = ledger.con.execute(
        f"""select quantile_cont(output_tokens, {OUTPUT_PERCENTILE}), count(*)
            from (select output_tokens from {ledger.table("llm_batch_requests")}
                  where model = ? and status = {sql(RequestStatus.SUCCEEDED)} and output_tokens is not null
                    and coalesce(job_id, '') not in (select job_id from {ledger.table("llm_batch_jobs")}
                                       where output_schema is distinct from ? and output_schema is not null)
                  order by completed_at desc limit {OUTPUT_HISTORY})""",
        [ledger.model, output_schema.recorded(config.output_json_schema())],
    ).fetchall()[0]
    expected = min(ceiling, math.ceil(percentile)) if history else ceiling
    return OutputEstimate(expected, ceiling, history, expected if config.budget_basis == "expected" else ceiling)


def estimate_range(
    price: dict, output: OutputEstimate, total, n_batch: int, n_realtime: int = 0
) -> tuple[Decimal, Decimal]:
    """(expected, ceiling) of requests whose estimate at the basis is `total`: they differ only in the
    output tokens each request counts, at the output price (batch requests with the batch discount)."""
    per_token = Decimal(str(price["output"])) / 1_000_000
    discounted = per_token * (1 - Decimal(str(price["batch_discount"])))
    delta = (output.ceiling - output.expected) * (n_batch * discounted + n_realtime * per_token)
    total = Decimal(str(total or 0))
    if output.basis == output.ceiling:
        return total - delta, total
    return total, total + delta


ONE_HOUR_WRITE_MULTIPLIER = 2  # a 1 h cache write, times the input price, when the table names no rate


def load_prices(con, user_table: str | None) -> None:
    """The shipped price table, with the user's rows (same columns) replacing or extending it. The
    1 h cache-write column is optional in a user's table."""

    def columns(one_hour_column: bool) -> str:
        one_hour = f"{ONE_HOUR_WRITE_MULTIPLIER} * cast(input_per_mtok as decimal(18,6))"
        if one_hour_column:
            one_hour = f"coalesce(cast(cache_write_1h_per_mtok as decimal(18,6)), {one_hour})"
        return (
            "provider, model, unit, cast(input_per_mtok as decimal(18,6)) as input_per_mtok, "
            "cast(output_per_mtok as decimal(18,6)) as output_per_mtok, "
            "cast(coalesce(cache_write_per_mtok, input_per_mtok) as decimal(18,6)) as cache_write_per_mtok, "
            f"cast({one_hour} as decimal(18,6)) as cache_write_1h_per_mtok, "
            "cast(coalesce(cache_read_per_mtok, input_per_mtok) as decimal(18,6)) as cache_read_per_mtok, "
            "cast(batch_discount as decimal(6,4)) as batch_discount"
        )

    shipped = f"select {columns(True)}, 1 as priority from read_csv({literal(PRICES_CSV.as_posix())}, header = true, all_varchar = true)"
    user = ""
    if user_table:
        names = {d[0].lower() for d in con.execute(f"select * from {user_table} limit 0").description}
        user = (
            f" union all by name select {columns('cache_write_1h_per_mtok' in names)}, 0 as priority from {user_table}"
        )
    con.execute(f"""create or replace temp table {PRICES} as
                    select * exclude (priority) from ({shipped}{user})
                    qualify row_number() over (partition by provider, model order by priority) = 1""")


def price_of(con, provider: str, model: str) -> dict | None:
    """The price row for a model: an exact name, else the longest listed prefix (dated snapshots
    such as 'gpt-4o-mini-2024-07-18' take the price of 'gpt-4o-mini'); an empty model prices every
    model of its provider (the shipped zero price of a self-hosted engine)."""
    rows = con.execute(
        f"""select input_per_mtok, output_per_mtok, cache_write_per_mtok, cache_read_per_mtok,
                                  batch_discount, cache_write_1h_per_mtok from {PRICES}
                           where provider = ? and unit = 'token' and starts_with(?, coalesce(model, ''))
                           order by length(coalesce(model, '')) desc limit 1""",
        [provider, model],
    ).fetchall()
    if not rows:
        return None
    return dict(
        zip(("input", "output", "cache_write", "cache_read", "batch_discount", "cache_write_1h"), rows[0], strict=True)
    )


def realtime_cost_sql(price: dict, alias: str = "") -> str:
    """SQL: a request's cost at list (realtime) prices, from its normalised usage columns."""
    t = lambda c: f"coalesce({alias}{c}, 0)"  # noqa: E731
    uncached = f"({t('input_tokens')} - {t('cached_tokens')} - {t('cache_write_tokens')})"
    five_minute_writes = f"({t('cache_write_tokens')} - {t('cache_write_1h_tokens')})"
    total = (
        f"{uncached} * {price['input']} + {t('cached_tokens')} * {price['cache_read']} + "
        f"{five_minute_writes} * {price['cache_write']} + {t('cache_write_1h_tokens')} * {price['cache_write_1h']} + "
        f"{t('output_tokens')} * {price['output']}"
    )
    return f"cast(({total}) / 1000000 as {MONEY})"


def batch_cost_sql(price: dict, alias: str = "") -> str:
    return f"cast({realtime_cost_sql(price, alias)} * (1 - {price['batch_discount']}) as {MONEY})"


def uncached_cost_sql(price: dict, route_sql: str, alias: str = "") -> str:
    """SQL: what a request would have cost without prompt caching (every input token at the input
    rate), at its route's prices: the caching lever of the report is this minus its cost."""
    t = lambda c: f"coalesce({alias}{c}, 0)"  # noqa: E731
    total = f"({t('input_tokens')} * {price['input']} + {t('output_tokens')} * {price['output']}) / 1000000"
    discount = f"case when {route_sql} = 'realtime' then 0 else {price['batch_discount']} end"
    return f"cast({total} * (1 - {discount}) as {MONEY})"


def estimated_input_tokens_sql(config: ModelConfig, prompt_sql: str = "prompt", chars_sql: str | None = None) -> str:
    """Approximate input tokens of a request: 4 characters a token over system, examples and prompt,
    plus a small per-message overhead. (No tokenizer download is needed; documented in docs/costs.md.)
    `chars_sql`, if given, is the prompt's length already computed (the planner's prompt_chars)."""
    fixed_chars = len(config.system or "") + sum(len(a) + len(b) for a, b in config.examples)
    messages = 1 + (1 if config.system else 0) + 2 * len(config.examples)
    chars = chars_sql or f"length({prompt_sql})"
    return f"cast(ceil(({fixed_chars} + {chars}) / 4.0) + {MESSAGE_OVERHEAD_TOKENS * messages} as bigint)"


def estimated_cost_sql(
    config: ModelConfig,
    price: dict,
    prompt_sql: str = "prompt",
    route_sql: str = "'batch'",
    chars_sql: str | None = None,
    output_tokens: int | None = None,
) -> str:
    """SQL: what a request is estimated to cost (input estimate, plus `output_tokens` output tokens:
    OutputEstimate.basis; default llm_max_tokens), at batch prices, or at list prices where
    `route_sql` is 'realtime'."""
    output = output_tokens if output_tokens is not None else config.max_tokens or DEFAULT_OUTPUT_ESTIMATE
    tokens = estimated_input_tokens_sql(config, prompt_sql, chars_sql)
    total = f"{tokens} * {price['input']} + {output} * {price['output']}"
    discount = f"case when {route_sql} = 'realtime' then 0 else {price['batch_discount']} end"
    return f"cast(({total}) / 1000000 * (1 - {discount}) as {MONEY})"


def cost_columns_sql(price: dict, self_hosted: bool, route_sql: str, alias: str = "") -> str:
    """SQL SET list for a settled request's cost: batch rows at batch prices, realtime rows at list
    prices; the realtime counterfactual is list price, and none for a self-hosted engine."""
    realtime = realtime_cost_sql(price, alias)
    cost = f"case when {route_sql} = 'realtime' then {realtime} else {batch_cost_sql(price, alias)} end"
    uncached = uncached_cost_sql(price, route_sql, alias)
    return (
        f"cost_usd = {cost}, uncached_cost_usd = {uncached}, realtime_cost_usd = {'null' if self_hosted else realtime},"
    )


def fmt_usd(value) -> str:
    if value is None:
        return "unknown (no price)"
    return f"${Decimal(str(value)).quantize(Decimal('0.000001'), rounding=ROUND_HALF_UP):,}"
