"""Provider-facing behaviour, once per provider: awkward keys, expired and cancelled items, prompt
caching whose savings are recorded per row and add up to what the provider reported."""

from __future__ import annotations

from helpers import PROVIDER_MODELS, batch_counts, sorted_batches

from dbt_llm_batch.sandbox import expected_answer

SYSTEM = "Summarise."


def lit(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def summary_model(provider: str, extra: str = "", name_source: str = "things", key: str = "['a', 'b']") -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key={key}, llm_provider='{provider}',
            llm_model='{PROVIDER_MODELS[provider]}', llm_system={SYSTEM!r}, llm_max_tokens=100, {extra}) }}}}
select * from {{{{ ref('{name_source}') }}}}
"""


def test_keys_that_are_not_provider_safe_round_trip(project, emulator, provider):
    # Spaces, unicode, quotes, a 500-character key, and composites that would collide if joined naively.
    long_key = "k" * 500
    rows = [
        ("a b", "c"),
        ("a", "b c"),
        ("ü ñ 中文", "x"),
        ('quote"s', "it's"),
        (long_key, "1"),
        ("a|b", "c"),
        ("a", "b|c"),
    ]
    values = ", ".join(f"({lit(a)}, {lit(b)}, {lit(f'Text for {a}/{b}')})" for a, b in rows)
    project.write("models/things.sql", f"select * from (values {values}) t(a, b, prompt)")
    project.write("models/keyed.sql", summary_model(provider))
    project.dbt("run", "-s", "things", "keyed")
    emulator.complete_all()
    project.dbt("run", "-s", "keyed")
    got = project.query("select a, b, prompt, llm_output from main.keyed")
    assert len(got) == len(rows)
    for a, b, prompt, output in got:
        assert prompt == f"Text for {a}/{b}"
        assert output == expected_answer(SYSTEM, prompt, None), (a, b)


def test_expired_and_cancelled_items_are_resubmitted_and_done_ones_merge(project, emulator, provider):
    values = ", ".join(f"({i}, 'row {i}')" for i in range(20))
    project.write("models/things.sql", f"select * from (values {values}) t(a, prompt)")
    project.write("models/partial.sql", summary_model(provider, key="'a'"))
    project.dbt("run", "-s", "things", "partial")
    first = sorted_batches(emulator)[0]["id"]
    emulator.advance(first, "expired", done_fraction=0.5)
    project.dbt("run", "-s", "partial")
    assert project.query("select count(*) from main.partial") == [(10,)]
    assert batch_counts(emulator) == [20, 10], "exactly the unfinished half is resubmitted"

    second = sorted_batches(emulator)[1]["id"]
    emulator.advance(second, "cancelled", done_fraction=0.4)
    project.dbt("run", "-s", "partial")
    assert project.query("select count(*) from main.partial") == [(14,)]
    assert batch_counts(emulator) == [20, 10, 6]
    emulator.complete_all()
    project.dbt("run", "-s", "partial")
    rows = project.query("select prompt, llm_output, llm_status from main.partial")
    assert len(rows) == 20 and all(s == "succeeded" and o == expected_answer(SYSTEM, p, None) for p, o, s in rows)
    # Expiry and cancellation never used up an attempt: every row succeeded at its first failure-free try.
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(0,)]


LONG_SYSTEM = "You classify support tickets. " + " ".join(
    f"Rule {i}: be consistent about case {i}." for i in range(530)
)


def cached_model(provider: str, cache: str) -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='{provider}',
            llm_model='{PROVIDER_MODELS[provider]}', llm_system={LONG_SYSTEM!r}, llm_max_tokens=100,
            llm_cache_prefix={cache}, llm_max_tokens_in_flight=5000000) }}}}
select * from {{{{ ref('many') }}}}
"""


def ledger_usage_totals(project, table: str) -> tuple:
    return project.query(f"""select sum(llm_input_tokens), sum(llm_output_tokens), sum(llm_cache_read_tokens),
                                    sum(llm_cache_write_tokens) from main.{table}""")[0]


def emulator_usage_totals(emulator, provider: str) -> tuple:
    usage = emulator.stats()["usage_by_face"][provider]
    if provider == "anthropic":
        total_input = usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
        return (
            total_input,
            usage["output_tokens"],
            usage["cache_read_input_tokens"],
            usage["cache_creation_input_tokens"],
        )
    return usage["prompt_tokens"], usage["completion_tokens"], usage["cached_tokens"], None


def test_prompt_cache_tokens_recorded_per_row_and_add_up(project, emulator, provider):
    """A ~5,000-token cacheable prefix over 500 rows: what the ledger records per row adds up exactly to
    what the provider reported, and turning the switch off re-asks nothing."""
    prefix_tokens = -(-len(LONG_SYSTEM) // 4)  # the emulator's estimator: ceil(chars / 4)
    assert 4900 <= prefix_tokens <= 5300
    project.write("models/many.sql", "select i as a, 'Ticket number ' || i as prompt from range(500) t(i)")
    project.write("models/cached.sql", cached_model(provider, "true"))
    project.dbt("run", "-s", "many", "cached")
    emulator.complete_all()
    project.dbt("run", "-s", "cached")

    assert project.query("select count(*) from main.cached where llm_status = 'succeeded'") == [(500,)]
    assert ledger_usage_totals(project, "cached")[:3] == emulator_usage_totals(emulator, provider)[:3]
    reads = project.query("select llm_cache_read_tokens, count(*) from main.cached group by 1 order by 1")
    if provider == "anthropic":
        # One request writes the prefix, the 499 others read it; input tokens include both.
        assert (
            ledger_usage_totals(project, "cached")[3] == emulator_usage_totals(emulator, provider)[3] == prefix_tokens
        )
        assert reads == [(0, 1), (prefix_tokens, 499)]
    else:
        assert reads == [(0, 1), (prefix_tokens // 128 * 128, 499)]

    # The switch is not part of the fingerprint: turning it off asks nothing again.
    calls = emulator.stats()["calls"]
    project.write("models/cached.sql", cached_model(provider, "false"))
    project.dbt("run", "-s", "cached")
    assert emulator.stats()["calls"] == calls
    assert project.query("select count(*) from main.cached") == [(500,)]

    if provider == "anthropic":
        # Without the switch Anthropic caches nothing: the same rows in another model report no reads.
        project.write("models/uncached.sql", cached_model(provider, "false"))
        project.dbt("run", "-s", "uncached")
        emulator.complete_all()
        project.dbt("run", "-s", "uncached")
        assert project.query(
            "select count(*), sum(llm_cache_read_tokens), sum(llm_cache_write_tokens) from main.uncached"
        ) == [(500, 0, 0)]


def test_short_cache_prefix_is_reported_not_promised(project, emulator, provider):
    project.write("models/many.sql", "select i as a, 'Ticket ' || i as prompt from range(3) t(i)")
    project.write("models/cached.sql", cached_model(provider, "true").replace(repr(LONG_SYSTEM), "'Be brief.'"))
    project.dbt("run", "-s", "many", "cached")
    log = (project.root / "logs" / "dbt.log").read_text()
    minimum = 1024
    assert (
        f"llm_cache_prefix is on, but the system prompt and examples are about 2 tokens, below the "
        f"{minimum}-token minimum {provider} caches"
    ) in log


def test_batch_created_but_not_recorded_is_adopted_not_resent(project, emulator, provider, monkeypatch):
    """The run dies between the provider's `create` and the ledger write: the next runs find that
    batch (OpenAI: by its metadata token; Anthropic: by its custom_ids once it ended) and never pay
    for those rows twice."""
    from dbt_llm_batch.ledger import Ledger

    values = ", ".join(f"({i}, 'row {i}')" for i in range(5))
    project.write("models/things.sql", f"select * from (values {values}) t(a, prompt)")
    project.write("models/adopt.sql", summary_model(provider, key="'a'"))
    project.dbt("run", "-s", "things")

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash after create")

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "record_submission", crash)
        project.dbt("run", "-s", "adopt", expect_ok=False)
    assert batch_counts(emulator) == [5]
    assert project.query("select status, batch_id from main.llm_batch_jobs") == [("submitting", None)]

    project.dbt("run", "-s", "adopt")
    if provider == "anthropic":  # still running: nothing can confirm it yet, so nothing is resent
        assert project.query("select status from main.llm_batch_jobs") == [("submitting",)]
        emulator.complete_all()
        project.dbt("run", "-s", "adopt")
    else:
        emulator.complete_all()
        project.dbt("run", "-s", "adopt")
    assert batch_counts(emulator) == [5], "the interrupted submission must not be sent again"
    assert project.query("select count(*) from main.adopt where llm_status = 'succeeded'") == [(5,)]
    assert project.query("select batch_id from main.llm_batch_jobs") == [(sorted_batches(emulator)[0]["id"],)]
