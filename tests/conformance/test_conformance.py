"""The provider conformance suite: what every batch provider must do, through real dbt against the
provider's sandbox face, run once per kit (conformance_kits.py; the interface is conformance_kit.py).

Cases (the matrix is providers x these; `pytest tests/conformance --collect-only -q` lists it). Each
story covers several checks, so that the matrix stays quick (every dbt run costs seconds):
- lifecycle, poll fault, structured output and cost: a run submits and returns; the provider's poll
  fails twice, overloaded, and the next run retries within its budget and merges every row with its
  structured answer (llm_output, asked through the provider's own mechanism, which the face checks and
  answers by); a run with nothing new asks nothing; the table's cost equals the usage the face billed at
  the provider's shipped batch price;
- crash: a run SIGKILLed at each of the kit's crash points (at least right after the provider's create)
  is finished by later runs, with one batch and nothing paid twice;
- lost create, then an unfinished batch: the create's answer is lost after the provider created the
  batch, which then ends with half its requests done (expiry, or a cancel where the provider never
  expires a job): the batch is found again (never created and paid a second time), its finished
  results are kept and paid once, the rest are sent again, and the cost equals what was billed at the
  price of the user's own price table (a seed overriding the shipped row, discount included).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import duckdb
import pytest
from conformance_kits import all_kits
from helpers import THINGS_SYSTEM, TRIAGE_OUTPUT, TRIAGE_SCHEMA

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.pipeline import costs
from dbt_llm_batch.providers import BatchProvider, get_provider, provider_names
from dbt_llm_batch.sandbox import expected_answer

ROWS = 6  # the stories' rows, unless the provider needs more in a batch (row_count)

KITS = all_kits()


def pytest_generate_tests(metafunc):
    """Each test once per kit; a test taking `crash_point` once per kit and each of its crash points."""
    if "kit" not in metafunc.fixturenames:
        return
    if "crash_point" in metafunc.fixturenames:
        cases = [(name, point) for name in sorted(KITS) for point in KITS[name].crash_points]
        metafunc.parametrize("kit,crash_point", cases, indirect=["kit"], ids=[f"{n}-{p}" for n, p in cases])
    else:
        metafunc.parametrize("kit", sorted(KITS), indirect=True)


@pytest.fixture
def kit(request, monkeypatch):
    """One provider's kit with its face started (and the provider pointed at it), stopped afterwards."""
    instance = KITS[request.param]()
    instance.start(monkeypatch)
    yield instance
    instance.stop()


# The user's own price for the kit's model in the lost-create story: unlike any shipped row (and its
# discount unlike every provider's 50 %), so a cost at it shows the user's seed is what priced the run.
USER_PRICE = {"input": "7.00", "output": "11.00", "batch_discount": "0.25"}
PRICE_HEADER = (
    "provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,"
    "cache_write_1h_per_mtok,per_hour,batch_discount,as_of,source\n"
)


def user_prices(kit) -> str:
    """A user's price table (a seed's CSV) pricing the kit's model at USER_PRICE, under the provider's
    own price key (Azure: the model behind the deployment; a host: the host's name)."""
    provider, model = get_provider(kit.provider).price_key(kit_config(kit))
    p = USER_PRICE
    return (
        PRICE_HEADER
        + f"{provider},{model},token,{p['input']},{p['output']},0,0,0,,{p['batch_discount']},2026-12-05,a user's seed\n"
    )


def kit_config(kit, structured: bool = False):
    raw = {"unique_key": "a", "llm_provider": kit.provider, "llm_model": kit.model, **kit.config}
    return parse_config({**raw, **({"llm_output": TRIAGE_OUTPUT} if structured else {})})


def model_sql(kit, prices: str | None, structured: bool) -> str:
    keys = {**kit.config, **({"llm_price_table": "main.llm_prices"} if prices else {})}
    extra = "".join(f"{name}={value!r}, " for name, value in keys.items())
    if structured:
        extra += f"llm_output={TRIAGE_OUTPUT!r}, "
    return f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='{kit.provider}', llm_model='{kit.model}',
            llm_system={THINGS_SYSTEM!r}, llm_max_tokens=100, llm_retry_budget_seconds=60, {extra}) }}}}
select * from {{{{ ref('things') }}}}
"""


def row_count(kit) -> int:
    """The stories' rows for a kit: enough that half of them (what the unfinished batch sends again) still
    make a batch of the provider's declared minimum (Bedrock: 100 records a job)."""
    return max(ROWS, 2 * get_provider(kit.provider).min_requests_per_batch)


def setup(project, kit, prices: str | None = None, structured: bool = False) -> None:
    """The story's rows and model; `prices`: a user's price table seeded as the model's llm_price_table
    (else the kit's own, for a model the shipped table does not price); `structured`: llm_output."""
    prices = prices or kit.price_table
    project.write(
        "models/things.sql",
        f"select i as a, 'conformance row ' || i as prompt from range({row_count(kit)}) t(i)",
    )
    project.write("models/m.sql", model_sql(kit, prices, structured))
    if prices:
        project.write("seeds/llm_prices.csv", prices)
        project.dbt("seed", "-s", "llm_prices")
    project.dbt("run", "-s", "things")


def run(project) -> None:
    project.dbt("run", "-s", "m")


def rows(project) -> list[tuple]:
    return project.query("select prompt, llm_status, llm_output from main.m order by a")


def assert_every_row_answered(project, kit) -> None:
    got = rows(project)
    assert len(got) == row_count(kit), got
    for prompt, status, output in got:
        assert (status, output) == ("succeeded", expected_answer(THINGS_SYSTEM, prompt, None)), (prompt, status)


def assert_every_row_answered_to_its_schema(project, kit) -> None:
    """Each row holds the face's answer to the schema it was asked for: the face answers a request that
    carried no schema (or another one) with other values, and fails a malformed one."""
    got = project.query("select prompt, llm_status, category, urgent, summary from main.m order by a")
    assert len(got) == row_count(kit), got
    for prompt, status, *fields in got:
        answer = json.loads(expected_answer(THINGS_SYSTEM, prompt, TRIAGE_SCHEMA))
        assert (status, *fields) == ("succeeded", answer["category"], answer["urgent"], answer["summary"]), prompt


def assert_paid_once(kit) -> None:
    """Every row's request was billed exactly once, however many batches and runs it took."""
    kit.complete_all()  # a batch a run left open bills when it ends
    per_prompt = collections.Counter(b.prompt for b in kit.billed())
    assert sorted(per_prompt.values()) == [1] * row_count(kit), f"billed more than once (or never): {per_prompt}"


def assert_cost_is_billed_usage(project, kit) -> dict:
    """The ledger's cost equals the usage the face billed at the provider's batch price from the price
    table the run used (the shipped one, or the seeded one): each request rounded to the ledger's 9
    decimal places, so the sums agree within 1e-9 a request (a token of the cheapest priced model costs
    more than 5e-8)."""
    billed = kit.billed()
    assert billed and all(b.cached_tokens == 0 for b in billed)  # the short prompts are never cached
    config = kit_config(kit)
    seeded = (project.root / "seeds" / "llm_prices.csv").exists()
    with duckdb.connect() as con:
        if seeded:
            con.execute(
                "create table kit_prices as select * from read_csv(?, header = true, all_varchar = true)",
                [str(project.root / "seeds" / "llm_prices.csv")],
            )
        costs.load_prices(con, "kit_prices" if seeded else None)
        price = costs.price_of(con, *get_provider(kit.provider).price_key(config))
    assert price is not None, f"{kit.provider} {kit.model} has no row in the price table"
    discount = 1 - Decimal(str(price["batch_discount"]))
    expected = sum(
        (b.input_tokens * Decimal(str(price["input"])) + b.output_tokens * Decimal(str(price["output"])))
        / Decimal(1_000_000)
        * discount
        for b in billed
    )
    (ledger,) = project.query("select sum(cost_usd) from main.llm_batch_requests where cost_usd is not null")[0]
    assert ledger is not None and abs(Decimal(ledger) - expected) <= Decimal("1e-9") * len(billed), (ledger, expected)
    return price


# Batch providers registered without a kit yet, each with why: the gap is declared here, and this list
# must shrink (the test fails when a listed provider gets its kit, or another one has none).
NO_KIT_YET = {
    "ray": (
        "needs a kit: its face is a local Ray cluster (tests/test_ray.py, one xdist group), whose create and"
        " poll (the Ray dashboard) the sandbox cannot fault, and whose jobs run on their own (no expiry; a"
        " stop ends them unfinished); its stories are tests/test_ray.py's"
    ),
}


def test_every_registered_batch_provider_has_a_kit():
    batch_providers = {n for n in provider_names() if issubclass(get_provider(n), BatchProvider)}
    assert batch_providers - set(KITS) == set(NO_KIT_YET) & batch_providers, (
        f"batch providers without a conformance kit: {batch_providers - set(KITS)}; declared: {NO_KIT_YET}"
    )
    assert not set(NO_KIT_YET) & set(KITS), "a provider got its kit: remove it from NO_KIT_YET"


def test_lifecycle_poll_fault_structured_output_and_cost(project, kit):
    setup(project, kit, structured=True)
    run(project)  # submits and returns
    assert kit.batches_created() == 1
    assert project.query("select count(*) from main.m") == [(0,)]
    kit.complete_all()
    kit.inject_fault("poll", "overloaded", "before", times=2)  # retried within the run's budget
    run(project)  # merges every row
    assert kit.faults_pending() == 0, "the fault never fired"
    assert_every_row_answered_to_its_schema(project, kit)
    run(project)  # nothing new: nothing sent
    assert kit.batches_created() == 1
    assert_paid_once(kit)
    assert_cost_is_billed_usage(project, kit)


def test_a_run_killed_at_a_crash_point_pays_nothing_twice(project, kit, crash_point, tmp_path):
    setup(project, kit)
    project.release_database()
    marker = tmp_path / "crash-marker"
    dbt = str(Path(sys.executable).parent / "dbt")
    killed = subprocess.run(
        [dbt, "run", "-s", "m", "--project-dir", str(project.root), "--profiles-dir", str(project.root)],
        env={**os.environ, "DBT_LLM_BATCH_CRASH_AT": crash_point, "DBT_LLM_BATCH_CRASH_MARKER": str(marker)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9 and marker.read_text() == crash_point, killed.stdout[-2000:]
    run(project)  # finds what the killed run left (reconciliation), sends what it did not
    kit.complete_all()
    run(project)
    assert_every_row_answered(project, kit)
    assert kit.batches_created() == 1, "a second batch was created for the same rows"
    assert_paid_once(kit)


def test_a_lost_create_then_an_unfinished_batch_pay_nothing_twice_and_cost_what_was_billed(project, kit):
    setup(project, kit, prices=user_prices(kit))  # the user's own price for the model
    kit.inject_fault("create", "disconnect", "after", times=1)  # the batch exists; its answer never came
    run(project)
    assert kit.faults_pending() == 0, "the fault never fired"
    assert kit.batches_created() == 1
    kit.end_unfinished(done_fraction=0.5)  # half its requests answered (and billed), then it ends
    billed_first = {b.prompt for b in kit.billed()}
    assert len(billed_first) == row_count(kit) // 2
    run(project)  # finds the lost batch, keeps its finished half, sends the other half again
    assert {p for p, s, _ in rows(project) if s == "succeeded"} == billed_first
    assert kit.batches_created() == 2, "the lost batch was created again, or the rest was not resent"
    kit.complete_all()
    run(project)
    assert_every_row_answered(project, kit)
    assert_paid_once(kit)
    price = assert_cost_is_billed_usage(project, kit)
    used = tuple(Decimal(str(price[k])) for k in ("input", "output", "batch_discount"))
    assert used == tuple(Decimal(USER_PRICE[k]) for k in ("input", "output", "batch_discount")), price
