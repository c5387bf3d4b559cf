"""OpenAI-compatible batch hosts (llm_provider = 'openai' with llm_base_url and llm_api_key_env): the
OpenAI batch provider sends to the host with the host's key, sizes batches by the host's limits and
prices them under the host's name (openai_hosts.py)."""

from __future__ import annotations

import collections
import json
from decimal import Decimal

import duckdb
import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ledger.store import SCHEMA_VERSION
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sandbox import expected_answer

SYSTEM = "Summarise."
PRICES = """provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,per_hour,batch_discount,as_of,source
groq,llama-3.1-8b-instant,token,0.05,0.08,0,0.05,,0.5,2026-12-05,test prices
"""


def config(**keys):
    return parse_config({"unique_key": "a", "llm_provider": "openai", "llm_model": "m", **keys})


def test_a_host_is_known_by_its_url_or_its_name_and_sets_limits_and_the_price_row():
    openai_cls = get_provider("openai")
    assert openai_cls.price_key(config()) == ("openai", "m")
    assert openai_cls.batch_limits(config()) == (50_000, 200_000_000)
    together = config(llm_base_url="https://api.together.xyz/v1", llm_api_key_env="TOGETHER_API_KEY")
    assert openai_cls.price_key(together) == ("together", "m")
    assert openai_cls.batch_limits(together) == (50_000, 100_000_000)
    groq = config(llm_base_url="https://api.groq.com/openai/v1")
    assert openai_cls.price_key(groq) == ("groq", "m")
    proxy = config(llm_base_url="https://llm.internal.example/v1")  # not listed: OpenAI's limits, its own name
    assert openai_cls.price_key(proxy) == ("llm.internal.example", "m")
    assert openai_cls.batch_limits(proxy) == (50_000, 200_000_000)
    assert openai_cls.price_key(config(llm_base_url="http://10.0.0.1/v1", llm_batch_host="groq"))[0] == "groq"


def test_host_keys_are_checked_and_the_key_is_asked_for_by_its_variable(monkeypatch):
    with pytest.raises(ConfigError) as error:
        config(llm_base_url="api.groq.com", llm_api_key_env="gsk-not-a-name", llm_batch_host="mistral")
    message = str(error.value)
    assert "llm_base_url must be an http(s) URL" in message
    assert "llm_api_key_env must be the NAME of an environment variable" in message
    assert "llm_batch_host must be one of ['openai', 'groq', 'together'], got 'mistral'" in message
    monkeypatch.delenv("GROQ_API_KEY", raising=False)
    provider = get_provider("openai")(
        config(llm_base_url="https://api.groq.com/openai/v1", llm_api_key_env="GROQ_API_KEY")
    )
    with pytest.raises(ConfigError, match="GROQ_API_KEY is not set \\(named by llm_api_key_env\\)"):
        provider.check_credentials()


def test_a_host_gets_the_batch_with_its_own_key_and_the_cost_is_its_price(project, emulator, monkeypatch, api_key):
    # The host is the sandbox's OpenAI face; OpenAI's own variables are unset, so only the host's are used.
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL")
    monkeypatch.setenv("GROQ_API_KEY", api_key)
    project.write("seeds/llm_prices.csv", PRICES)
    project.write("models/things.sql", "select * from (values (1, 'row 1'), (2, 'row 2'), (3, 'row 3')) t(a, prompt)")
    project.write(
        "models/m.sql",
        f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='openai', llm_model='llama-3.1-8b-instant',
            llm_base_url='{emulator.openai_base_url}', llm_api_key_env='GROQ_API_KEY', llm_batch_host='groq',
            llm_system={SYSTEM!r}, llm_max_tokens=50, llm_price_table='main.llm_prices',
            llm_realtime_when='a = 3') }}}}
select * from {{{{ ref('things') }}}}
""",
    )
    project.dbt("seed")
    project.dbt("run", "-s", "things", "m")  # row 3 in realtime at the host, rows 1-2 in a batch
    emulator.complete_all()
    project.dbt("run", "-s", "m")
    got = project.query("select prompt, llm_status, llm_output from main.m order by a")
    assert got == [(p, "succeeded", expected_answer(SYSTEM, p, None)) for p in ("row 1", "row 2", "row 3")]

    billed = emulator.billed()
    assert sorted(collections.Counter(b["prompt"] for b in billed).values()) == [1, 1, 1]
    price = {"batch": Decimal("0.5"), "realtime": Decimal(1)}
    expected = sum(
        (b["usage"]["prompt_tokens"] * Decimal("0.05") + b["usage"]["completion_tokens"] * Decimal("0.08"))
        / 1_000_000
        * price[b["via"]]
        for b in billed
    )
    (cost,) = project.query("select sum(cost_usd) from main.llm_batch_requests")[0]
    assert abs(Decimal(cost) - expected) <= Decimal("3e-9"), (cost, expected)


@pytest.fixture
def second_host(api_key):
    """Another OpenAI-compatible host: a second sandbox, taking the same key."""
    from dbt_llm_batch.sandbox import Emulator

    host = Emulator(api_key=api_key).start()
    host.auto_advance_seconds = None
    yield host
    host.stop()


def hosted_model(base_url: str) -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='openai', llm_model='gpt-test',
            llm_base_url='{base_url}', llm_system={SYSTEM!r}, llm_max_tokens=50) }}}}
select * from {{{{ ref('things') }}}}
"""


def write_things(project, n: int) -> None:
    rows = ", ".join(f"({i}, 'row {i}')" for i in range(1, n + 1))
    project.write("models/things.sql", f"select * from (values {rows}) t(a, prompt)")


def assert_answered(project, n: int) -> None:
    got = project.query("select a, prompt, llm_status, llm_output from main.m order by a")
    assert got == [(i, f"row {i}", "succeeded", expected_answer(SYSTEM, f"row {i}", None)) for i in range(1, n + 1)]


@pytest.mark.parametrize("late", [False, True], ids=["same_day", "a_day_later"])
def test_a_batch_in_flight_is_harvested_where_it_was_sent_after_llm_base_url_moves(
    project, emulator, second_host, late
):
    """The model moves to another host (llm_base_url) while its batch is in flight: the batch is
    polled and harvested at the first host (the job records the provider keys it was sent with), a
    day later too (not taken for gone and sent again), and only new rows go to the second host.
    Each prompt is billed once, by one host."""
    emulator.auto_advance_seconds = None
    write_things(project, 3)
    project.write("models/m.sql", hosted_model(emulator.openai_base_url))
    project.dbt("run", "-s", "things", "m")
    assert len(emulator.batches()) == 1
    project.write("models/m.sql", hosted_model(second_host.openai_base_url))
    project.dbt("run", "-s", "m")  # the batch still in flight at the first host
    if late:
        project.release_database()
        project.query("update main.llm_batch_jobs set created_at = created_at - interval 2 day")
        project.dbt("run", "-s", "m")
    assert project.query("select count(*) from main.m") == [(0,)]  # nothing answered yet
    emulator.complete_all()
    project.dbt("run", "-s", "m")
    assert_answered(project, 3)
    assert sorted(b["prompt"] for b in emulator.billed()) == ["row 1", "row 2", "row 3"]
    assert second_host.billed() == []

    write_things(project, 4)  # a new row: sent to the host the model names now
    project.dbt("run", "-s", "things", "m")
    second_host.complete_all()
    project.dbt("run", "-s", "m")
    assert_answered(project, 4)
    assert [b["prompt"] for b in second_host.billed()] == ["row 4"]
    assert len(emulator.billed()) == 3
    recorded = project.query("select provider_options from main.llm_batch_jobs order by created_at")
    assert [json.loads(o)["base_url"] for (o,) in recorded] == [emulator.openai_base_url, second_host.openai_base_url]


def test_a_v33_ledger_with_a_batch_in_flight_migrates_and_harvests_it(project, emulator):
    """The ledger the previous schema version (33) left, with a batch in flight: migration 34 only adds
    llm_batch_jobs.provider_options, so dropping it (and the version row) gives that ledger. The job
    has no provider keys recorded: it is polled with the model's own, as before, harvested once."""
    emulator.auto_advance_seconds = None
    write_things(project, 3)
    project.write("models/m.sql", hosted_model(emulator.openai_base_url))
    project.dbt("run", "-s", "things", "m")
    project.release_database()
    with duckdb.connect(str(project.db_path)) as con:
        con.execute("alter table main.llm_batch_jobs drop column provider_options")
        con.execute("delete from main.llm_batch_meta where schema_version >= 34")
        assert con.execute("select max(schema_version) from main.llm_batch_meta").fetchall() == [(33,)]
    project.dbt("run", "-s", "m")  # migrated; the batch still in flight
    assert project.query("select max(schema_version) from main.llm_batch_meta") == [(SCHEMA_VERSION,)]
    assert project.query("select provider_options from main.llm_batch_jobs") == [(None,)]
    emulator.complete_all()
    project.dbt("run", "-s", "m")
    assert_answered(project, 3)
    assert len(emulator.batches()) == 1 and len(emulator.billed()) == 3


def test_the_poller_harvests_a_batch_where_it_was_sent_after_llm_base_url_moves(project, emulator, second_host, capsys):
    """`dbt-llm-batch poll` between runs, after the model moved host: it polls the batch at the host
    it was sent to, and the next run merges it without asking anything again."""
    from dbt_llm_batch.ops.cli import main as cli
    from dbt_llm_batch.ops.poller import EXIT_DONE

    emulator.auto_advance_seconds = None
    write_things(project, 3)
    project.write("models/m.sql", hosted_model(emulator.openai_base_url))
    project.dbt("run", "-s", "things", "m")
    project.write("models/m.sql", hosted_model(second_host.openai_base_url))
    project.dbt("run", "-s", "m")  # the model's settled config now names the second host
    emulator.complete_all()
    capsys.readouterr()
    assert cli(["poll", "--database", str(project.db_path)]) == EXIT_DONE, capsys.readouterr().out
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("succeeded", 3)]
    project.dbt("run", "-s", "m")
    assert_answered(project, 3)
    assert len(emulator.billed()) == 3 and second_host.billed() == []
