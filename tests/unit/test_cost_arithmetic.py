"""Cost arithmetic on in-memory DuckDB: the price table, per-request cost from usage, the estimate
that gates a submission, and how amounts are shown."""

from __future__ import annotations

from decimal import Decimal

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.pipeline import costs
from dbt_llm_batch.sql import literal

# Round numbers, so each figure below is computed by hand.
PRICE = {
    "input": Decimal("2"),
    "output": Decimal("8"),
    "cache_write": Decimal("2.5"),
    "cache_read": Decimal("0.2"),
    "cache_write_1h": Decimal("4"),
    "batch_discount": Decimal("0.5"),
}


def usage(con, **tokens) -> str:
    """A one-row relation with the ledger's usage columns (missing ones NULL)."""
    names = ("input_tokens", "cached_tokens", "cache_write_tokens", "cache_write_1h_tokens", "output_tokens")
    values = {n: "null" if tokens.get(n) is None else int(tokens[n]) for n in names}
    cols = ", ".join(f"cast({values[n]} as bigint) as {n}" for n in names)
    con.execute(f"create or replace temp table usage as select {cols}")
    return "usage"


def test_each_token_is_priced_once_at_its_own_rate(memory_con):
    # 1M input tokens: 200k cache reads, 100k cache writes (40k of them 1 h), so 700k at the input rate.
    rel = usage(
        memory_con,
        input_tokens=1_000_000,
        cached_tokens=200_000,
        cache_write_tokens=100_000,
        cache_write_1h_tokens=40_000,
        output_tokens=500_000,
    )
    realtime, batch = memory_con.execute(
        f"select {costs.realtime_cost_sql(PRICE)}, {costs.batch_cost_sql(PRICE)} from {rel}"
    ).fetchone()
    # 0.7*2 + 0.2*0.2 + 0.06*2.5 + 0.04*4 + 0.5*8 = 1.4 + 0.04 + 0.15 + 0.16 + 4
    assert realtime == Decimal("5.750000000")
    assert batch == Decimal("2.875000000")  # half off


def test_missing_usage_counts_as_zero_not_null(memory_con):
    rel = usage(memory_con, input_tokens=1_000, output_tokens=None)
    assert memory_con.execute(f"select {costs.realtime_cost_sql(PRICE)} from {rel}").fetchone() == (
        Decimal("0.002000000"),
    )


def test_shipped_prices_match_dated_snapshots_by_prefix_and_unknown_models_have_none(memory_con):
    costs.load_prices(memory_con, None)
    mini = costs.price_of(memory_con, "openai", "gpt-4o-mini")
    assert mini is not None and (mini["input"], mini["output"], mini["batch_discount"]) == (
        Decimal("0.15"),
        Decimal("0.60"),
        Decimal("0.5"),
    )
    assert costs.price_of(memory_con, "openai", "gpt-4o-mini-2024-07-18") == mini
    assert costs.price_of(memory_con, "openai", "no-such-model") is None
    assert costs.price_of(memory_con, "vertex", "gpt-4o-mini") is None


def test_a_users_price_row_replaces_the_shipped_one_and_gets_the_1h_default(memory_con):
    memory_con.execute(
        """create table my_prices as select 'openai' as provider, 'gpt-4o-mini' as model, 'token' as unit,
           1.0 as input_per_mtok, 3.0 as output_per_mtok, null as cache_write_per_mtok,
           0.5 as cache_read_per_mtok, 0.25 as batch_discount"""
    )
    costs.load_prices(memory_con, "my_prices")
    price = costs.price_of(memory_con, "openai", "gpt-4o-mini")
    assert price == {
        "input": Decimal("1"),
        "output": Decimal("3"),
        "cache_write": Decimal("1"),  # no cache-write rate: the input rate
        "cache_read": Decimal("0.5"),
        "batch_discount": Decimal("0.25"),
        "cache_write_1h": Decimal("2"),  # the table has no 1 h column: twice the input rate
    }
    assert costs.price_of(memory_con, "openai", "gpt-4o") is not None  # other shipped rows stay


@pytest.mark.parametrize(
    ("route", "expected"), [("batch", Decimal("0.000033075")), ("realtime", Decimal("0.000066150"))]
)
def test_the_estimate_is_characters_over_four_plus_overhead_and_max_tokens_out(memory_con, route, expected):
    config = parse_config(
        {"unique_key": "id", "llm_model": "gpt-4o-mini", "llm_system": "You are brief.", "llm_max_tokens": 100}
    )
    prompt = "x" * 86  # with the 14-character system message: 100 characters, 25 tokens
    costs.load_prices(memory_con, None)
    price = costs.price_of(memory_con, "openai", "gpt-4o-mini")
    tokens, cost = memory_con.execute(
        f"select {costs.estimated_input_tokens_sql(config, '?')}, "
        f"{costs.estimated_cost_sql(config, price, '?', literal(route))}",
        [prompt, prompt],
    ).fetchone()
    assert tokens == 25 + 2 * costs.MESSAGE_OVERHEAD_TOKENS  # two messages: system and user
    # (41 input tokens * $0.15 + 100 output tokens * $0.60) per million, half off in a batch
    assert cost == expected


def test_a_self_hosted_engine_has_no_realtime_counterfactual():
    assert costs.cost_columns_sql(PRICE, self_hosted=True, route_sql="route").endswith("realtime_cost_usd = null,")
    assert "realtime_cost_usd = null" not in costs.cost_columns_sql(PRICE, self_hosted=False, route_sql="route")


def test_amounts_are_shown_to_the_millionth_and_no_price_is_never_zero():
    assert costs.fmt_usd(Decimal("1234.5678915")) == "$1,234.567892"
    assert costs.fmt_usd(Decimal("0.0000004")) == "$0.000000"
    assert costs.fmt_usd(None) == "unknown (no price)"


@pytest.mark.parametrize(("route", "expected"), [("batch", Decimal("0.000174")), ("realtime", Decimal("0.000348"))])
def test_the_uncached_cost_prices_every_input_token_at_the_input_rate(memory_con, route, expected):
    """The caching lever's counterfactual: 100 input tokens (60 of them cache reads, 20 cache writes)
    and 10 output tokens as if nothing were cached: (100 * $3 + 10 * $4.8) per million."""
    price = {"input": Decimal(3), "output": Decimal("4.8"), "batch_discount": Decimal("0.5")}
    (cost,) = memory_con.execute(
        f"""select {costs.uncached_cost_sql(price, literal(route))}
            from (select 100 as input_tokens, 60 as cached_tokens, 20 as cache_write_tokens, 10 as output_tokens)"""
    ).fetchone()
    assert cost == expected
