"""Money, checked against figures computed by hand: per-row cost and the realtime counterfactual,
aggregates in the llm_batch_costs view, the budget gate and the dry run.

The workload (both providers): a 512-character system prompt (the cacheable prefix: 128 tokens at the
emulator's 4 characters a token), and three prompts of 20, 40 and 60 characters, whose sandbox answers
are 26 characters (7 output tokens). Row 1 runs alone first; rows 2 and 3 then read the cached prefix.
Input tokens per row: ceil((512 + 20) / 4) = 133, ceil(552 / 4) = 138, ceil(572 / 4) = 143.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from conftest import failure_messages
from helpers import batch_counts

SYSTEM = "Be concise. " * 42 + "Be brief"  # 512 characters
PROMPTS = {
    1: "Where is my invoice?",
    2: "My card was charged twice this month ok.",
    3: "The export button does nothing when I click it on Safari 17.",
}
PRICES = """provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,per_hour,batch_discount,as_of,source
openai,gpt-test,token,2.00,8.00,0,1.00,,0.5,2026-11-29,test prices
anthropic,claude-test,token,3.00,15.00,3.75,0.30,,0.5,2026-11-29,test prices
"""
MODEL = {"openai": "gpt-test", "anthropic": "claude-test"}

# Per row: (input, output, cache read, cache write, cost at batch prices, realtime cost), by hand.
EXPECTED = {
    "openai": {
        # 133 * $2 + 7 * $8 = $322 per million tokens -> $0.000322 realtime, half in batch
        1: (133, 7, 0, None, Decimal("0.000161"), Decimal("0.000322")),
        # (138 - 128) * $2 + 128 * $1 (cache read) + 7 * $8 = $204 per million
        2: (138, 7, 128, None, Decimal("0.000102"), Decimal("0.000204")),
        # (143 - 128) * $2 + 128 * $1 + 7 * $8 = $214 per million
        3: (143, 7, 128, None, Decimal("0.000107"), Decimal("0.000214")),
    },
    "anthropic": {
        # 5 * $3 + 128 * $3.75 (cache write) + 7 * $15 = $600 per million
        1: (133, 7, 0, 128, Decimal("0.000300"), Decimal("0.000600")),
        # 10 * $3 + 128 * $0.30 (cache read) + 7 * $15 = $173.4 per million
        2: (138, 7, 128, 0, Decimal("0.0000867"), Decimal("0.0001734")),
        # 15 * $3 + 128 * $0.30 + 7 * $15 = $188.4 per million
        3: (143, 7, 128, 0, Decimal("0.0000942"), Decimal("0.0001884")),
    },
}
# Aggregates: (cost, realtime, savings) over the three rows.
EXPECTED_TOTALS = {
    "openai": (Decimal("0.000370"), Decimal("0.000740"), Decimal("0.000370")),
    "anthropic": (Decimal("0.0004809"), Decimal("0.0009618"), Decimal("0.0004809")),
}
# What prompt caching saved (the report's caching lever): the same tokens with every input token at the
# input rate, at batch prices, minus the cost. OpenAI: (322 + 332 + 342) / 2 = $498 per million - $370.
# Anthropic: (504 + 519 + 534) / 2 = $778.5 - $480.9 (row 1's cache write cost more than input: counted).
EXPECTED_CACHE_SAVED = {"openai": Decimal("0.000128"), "anthropic": Decimal("0.0002976")}


def costed_model(provider: str, extra: str = "") -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='id', llm_provider='{provider}', llm_model='{MODEL[provider]}',
            llm_system={SYSTEM!r}, llm_max_tokens=50, llm_cache_prefix=true,
            llm_price_table='main.llm_prices', {extra}) }}}}
select * from {{{{ ref('questions') }}}}
"""


def write_questions(project, ids) -> None:
    project.write("seeds/questions.csv", "id,prompt\n" + "".join(f'{i},"{PROMPTS[i]}"\n' for i in ids))


@pytest.fixture
def costed(project, emulator, provider):
    emulator.min_cache_tokens = 128  # the 128-token prefix is cacheable (real minimums are higher)
    project.write("seeds/llm_prices.csv", PRICES)
    project.write("models/costed.sql", costed_model(provider))
    return project


def test_costs_per_row_and_aggregated_equal_hand_computed_figures(costed, emulator, provider):
    project = costed
    write_questions(project, [1])
    project.dbt("seed")
    project.dbt("run", "-s", "costed")
    emulator.complete_all()
    project.dbt("run", "-s", "costed")  # row 1 merged; it wrote the prefix to the cache
    write_questions(project, [1, 2, 3])
    project.dbt("seed")
    project.dbt("run", "-s", "costed")
    emulator.complete_all()
    project.dbt("run", "-s", "costed")

    rows = project.query("""select id, llm_input_tokens, llm_output_tokens, llm_cache_read_tokens,
                                   llm_cache_write_tokens, llm_cost_usd, llm_realtime_cost_usd
                            from main.costed order by id""")
    assert {r[0]: r[1:] for r in rows} == EXPECTED[provider]

    view = project.query("""select sum(rows_succeeded), sum(input_tokens), sum(output_tokens), sum(cache_read_tokens),
                                   sum(cost_usd), sum(realtime_cost_usd), sum(savings_usd),
                                   sum(committed_not_billed_usd), sum(rows_without_price), sum(cache_saved_usd)
                            from main.llm_batch_costs where model = 'main.costed'""")[0]
    cost, realtime, savings = EXPECTED_TOTALS[provider]
    assert view == (3, 414, 21, 256, cost, realtime, savings, 0, 0, EXPECTED_CACHE_SAVED[provider])

    # The provider's own usage totals equal the ledger's.
    usage = emulator.stats()["usage_by_face"][provider]
    if provider == "openai":
        reported = (usage["prompt_tokens"], usage["completion_tokens"], usage["cached_tokens"])
    else:
        reported = (
            usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"],
            usage["output_tokens"],
            usage["cache_read_input_tokens"],
        )
    assert reported == (414, 21, 256)


def test_budget_below_estimate_refuses_before_upload(costed, emulator, provider):
    # Estimate per row: ceil((512 + n) / 4) + 16 overhead input tokens and 50 (llm_max_tokens) output.
    # openai: (149 + 154 + 159) * $2 + 150 * $8 = $2,124 per million, half in batch = $0.001062
    # anthropic: 462 * $3 + 150 * $15 = $3,636 per million, half = $0.001818
    estimate = {"openai": "$0.001062", "anthropic": "$0.001818"}[provider]
    write_questions(costed, [1, 2, 3])
    costed.dbt("seed")
    costed.write("models/costed.sql", costed_model(provider, "llm_max_cost_usd=0.001"))
    message = failure_messages(costed.dbt("run", "-s", "costed", expect_ok=False))
    assert (
        f"refusing to submit 3 request(s): estimated {estimate} plus $0.000000 already in flight exceeds "
        f"llm_max_cost_usd (this model) = $0.001000; nothing was sent"
    ) in message
    assert emulator.stats()["calls"] == {}

    # The project-wide var counts what every model already has in flight.
    costed.write("models/costed.sql", costed_model(provider))
    costed.dbt("run", "-s", "costed", "--vars", "{llm_batch_max_cost_usd: 0.01}")
    assert len(emulator.batches()) == 1
    write_questions(costed, [1, 2, 3])
    costed.write(
        "models/other.sql",
        costed_model(provider).replace("{{ ref('questions') }}", "{{ ref('questions') }} where id = 1"),
    )
    message = failure_messages(
        costed.dbt("run", "-s", "other", "--vars", "{llm_batch_max_cost_usd: 0.0013}", expect_ok=False)
    )
    assert f"plus {estimate} already in flight exceeds var llm_batch_max_cost_usd = $0.001300" in message
    assert len(emulator.batches()) == 1


def test_dry_run_sends_nothing_and_reports_the_estimate(costed, emulator, provider):
    estimate = {"openai": "$0.001062", "anthropic": "$0.001818"}[provider]
    write_questions(costed, [1, 2, 3])
    costed.dbt("seed")
    costed.dbt("run", "-s", "costed", "--vars", "{llm_batch_dry_run: true}")
    assert emulator.stats()["calls"] == {}
    log = (costed.root / "logs" / "dbt.log").read_text()
    assert f"DRY RUN: would submit 3 request(s) in 1 batch(es), estimated {estimate} at batch prices" in log
    assert costed.query("select count(*) from main.llm_batch_requests") == [(0,)]


def submit_unpriced(project) -> None:
    """Run `things` (written by the test) and `unpriced`, a model whose llm_model has no price."""
    project.write(
        "models/unpriced.sql",
        """
{{ config(materialized='llm_batch', unique_key='id', llm_model='gpt-from-the-future') }}
select * from {{ ref('things') }}""",
    )
    project.dbt("run", "-s", "things", "unpriced")


def test_unknown_price_is_null_and_warned_never_zero(project, emulator):
    project.write("models/things.sql", "select 1 as id, 'hello' as prompt")
    submit_unpriced(project)
    emulator.complete_all()
    project.dbt("run", "-s", "unpriced")
    assert project.query("select llm_status, llm_cost_usd, llm_realtime_cost_usd from main.unpriced") == [
        ("succeeded", None, None)
    ]
    assert "no price known for openai model 'gpt-from-the-future'" in (project.root / "logs" / "dbt.log").read_text()
    assert project.query("select rows_without_price from main.llm_batch_costs") == [(1,)]


def test_realtime_rows_count_at_list_price_toward_the_budget(costed, emulator, provider):
    # Row 3 goes realtime, at list price (no batch discount); rows 1 and 2 are batched.
    # openai: 149 * $2 + 50 * $8 = $698 and 154 * $2 + $400 = $708 per million at list price, half in batch;
    #   row 3 at list price: 159 * $2 + $400 = $718. (349 + 354 + 718) -> $0.001421.
    # anthropic: (1197 + 1212) / 2 + 1227 = $2,431.5 per million -> $0.0024315 (shown rounded: $0.002432).
    # All three at batch prices would be $0.001062 / $0.001818: under these budgets.
    estimate, budget = {"openai": ("$0.001421", "0.0012"), "anthropic": ("$0.002432", "0.0020")}[provider]
    write_questions(costed, [1, 2, 3])
    costed.dbt("seed")
    costed.write("models/costed.sql", costed_model(provider, f"llm_realtime_when='id = 3', llm_max_cost_usd={budget}"))
    message = failure_messages(costed.dbt("run", "-s", "costed", expect_ok=False))
    assert (
        f"refusing to submit 3 request(s): estimated {estimate} plus $0.000000 already in flight exceeds "
        f"llm_max_cost_usd (this model) = ${budget}00; nothing was sent"
    ) in message
    assert emulator.stats()["calls"] == {}  # no batch, and no realtime request either
    assert costed.query("select count(*) from main.llm_batch_requests") == [(0,)]

    # Without the realtime row the same budget lets the batch go.
    costed.write("models/costed.sql", costed_model(provider, f"llm_max_cost_usd={budget}"))
    costed.dbt("run", "-s", "costed")
    assert len(emulator.batches()) == 1 and emulator.stats()["realtime_requests"][provider] == 0


def test_a_budget_on_an_unpriced_model_refuses_before_any_call(project, emulator, provider):
    project.write("models/things.sql", "select 1 as id, 'hello' as prompt union all select 2, 'urgent hello'")
    project.write(
        "models/unpriced.sql",
        f"""
{{{{ config(materialized='llm_batch', unique_key='id', llm_provider='{provider}', llm_model='model-from-the-future',
            llm_max_cost_usd=5, llm_realtime_when="prompt like 'urgent%'") }}}}
select * from {{{{ ref('things') }}}}""",
    )
    project.dbt("run", "-s", "things")
    message = failure_messages(project.dbt("run", "-s", "unpriced", expect_ok=False))
    assert (
        f"llm_max_cost_usd (this model) is set to $5.000000 but there is no price for {provider} model "
        f"'model-from-the-future', so the cost of 2 request(s) cannot be estimated; nothing was sent. "
        f"Add a price with llm_price_table."
    ) in message
    assert emulator.stats()["calls"] == {}
    assert project.query("select count(*) from main.llm_batch_requests") == [(0,)]


# The test price table with a 1 h cache-write column (a user table may also leave it out: see below).
PRICES_1H = (
    PRICES.replace("cache_read_per_mtok,", "cache_read_per_mtok,cache_write_1h_per_mtok,")
    .replace("8.00,0,1.00,", "8.00,0,1.00,0,")
    .replace("15.00,3.75,0.30,", "15.00,3.75,0.30,6.60,")
)


@pytest.mark.parametrize("route", ["batch", "realtime"])
def test_one_hour_cache_writes_are_priced_at_the_one_hour_rate(project, emulator, route):
    """Anthropic bills a 1 h cache write at 2x the input price (a 5 min one at 1.25x). The batch case
    prices it from a user price table with the old columns (no 1 h rate: 2x input, $6); the realtime
    case from one that names the rate ($6.60)."""
    emulator.min_cache_tokens = 128
    project.write("seeds/llm_prices.csv", PRICES if route == "batch" else PRICES_1H)
    extra = "llm_realtime_when='true'," if route == "realtime" else ""
    project.write(
        "models/costed.sql", costed_model("anthropic", extra).replace("llm_cache_prefix=true", "llm_cache_prefix='1h'")
    )
    write_questions(project, [1, 2])
    project.dbt("seed")
    project.dbt("run", "-s", "costed")
    emulator.complete_all()
    project.dbt("run", "-s", "costed")
    rows = {
        r[0]: r[1:]
        for r in project.query("""select id, llm_input_tokens, llm_cache_read_tokens,
        llm_cache_write_tokens, llm_cost_usd, llm_realtime_cost_usd from main.costed order by id""")
    }
    ledger = dict(
        project.query("""select json_extract_string(key, '$[0]'), cache_write_1h_tokens
                                   from main.llm_batch_requests""")
    )
    # One of the two rows wrote the 128-token prefix with the 1 h TTL, the other read it.
    writer = next(i for i, r in rows.items() if r[2] == 128)
    reader = 3 - writer
    assert ledger == {str(writer): 128, str(reader): 0}
    uncached = rows[writer][0] - 128
    one_hour = {"batch": Decimal("6.00"), "realtime": Decimal("6.60")}[route]
    at_list = (uncached * 3 + 128 * one_hour + 7 * 15) / Decimal(1_000_000)
    assert rows[writer][4] == at_list  # realtime cost: list price
    assert rows[writer][3] == (at_list / 2 if route == "batch" else at_list)
    assert project.query("select sum(cache_write_1h_tokens), sum(cache_write_tokens) from main.llm_batch_costs") == [
        (128, 128)
    ]


def test_a_billed_failed_attempt_shows_its_cost_in_the_views(costed, emulator, provider):
    # The answer runs past llm_max_tokens=50: cut off, so the attempt fails, but the provider billed it
    # (133 input and 50 output tokens).
    emulator.add_fault(kind="content", prompt_contains="invoice", content="x" * 400, times=None)
    costed.write("models/costed.sql", costed_model(provider, "llm_max_attempts=1"))
    write_questions(costed, [1])
    costed.dbt("seed")
    costed.dbt("run", "-s", "costed")
    emulator.complete_all()
    costed.dbt("run", "-s", "costed")
    assert costed.query("select llm_status, llm_error from main.costed") == [
        (
            "failed",
            "answer was cut off at llm_max_tokens=50 (finish reason "
            + ("length)" if provider == "openai" else "max_tokens)")
            + "; not retried: the same request would be cut off again. Raise llm_max_tokens (that asks again)",
        )
    ]
    # openai: 133 * $2 + 50 * $8 = $666 per million; anthropic (writes the 128-token prefix, 5 min):
    # 5 * $3 + 128 * $3.75 + 50 * $15 = $1,245 per million. Half of that in batch.
    realtime = {"openai": Decimal("0.000666"), "anthropic": Decimal("0.001245")}[provider]
    view = costed.query("""select rows_failed, rows_succeeded, input_tokens, output_tokens, cost_usd, realtime_cost_usd
                           from main.llm_batch_costs where model = 'main.costed'""")
    assert view == [(1, 0, 133, 50, realtime / 2, realtime)]
    assert costed.query("select cost_usd from main.llm_batch_progress") == [(realtime / 2,)]


def test_rows_pending_and_rows_without_price_count_the_rows_a_shared_request_answers(project, emulator):
    """Three rows, two asking the same prompt (one request with llm_dedup, on by default at
    temperature 0): llm_batch_costs counts three rows pending, then three rows without a price; it
    counted the two requests."""
    project.write("models/things.sql", "select * from (values (1, 'hello'), (2, 'hello'), (3, 'bye')) t(id, prompt)")
    submit_unpriced(project)
    assert batch_counts(emulator) == [2]
    assert project.query("select sum(rows_pending) from main.llm_batch_costs") == [(3,)]
    assert project.query("select sum(rows_pending) from main.llm_batch_progress") == [(3,)]
    emulator.complete_all()
    project.dbt("run", "-s", "unpriced")
    assert project.query("select count(*) from main.unpriced where llm_status = 'succeeded'") == [(3,)]
    assert project.query(
        "select sum(rows_pending), sum(rows_without_price), sum(rows_succeeded) from main.llm_batch_costs"
    ) == [(0, 3, 3)]


def test_a_row_re_asked_after_a_prompt_edit_is_pending_once(project, emulator):
    """Three rows sent, then their prompts edited while the batch is in flight: each row is asked
    again, and its old request stays in flight too. llm_batch_costs counts three rows pending, as
    llm_batch_progress does; it counted six (each row once per request in flight)."""
    project.write("models/things.sql", "select * from (values (1, 'one'), (2, 'two'), (3, 'three')) t(id, prompt)")
    submit_unpriced(project)
    project.write("models/things.sql", "select * from (values (1, 'uno'), (2, 'dos'), (3, 'tres')) t(id, prompt)")
    project.dbt("run", "-s", "things", "unpriced")
    assert batch_counts(emulator) == [3, 3]  # the old requests are still in flight
    assert project.query("select sum(rows_pending) from main.llm_batch_costs") == [(3,)]
    assert project.query("select sum(rows_pending) from main.llm_batch_progress") == [(3,)]
    emulator.complete_all()
    project.dbt("run", "-s", "unpriced")
    assert project.query("select prompt from main.unpriced where llm_status = 'succeeded' order by id") == [
        ("uno",),
        ("dos",),
        ("tres",),
    ]
    assert project.query("select sum(rows_pending), sum(rows_succeeded) from main.llm_batch_costs") == [(0, 3)]
