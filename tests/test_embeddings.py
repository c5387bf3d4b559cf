"""Embeddings at batch prices (llm_task = 'embed'): a FLOAT[n] column for every row, each distinct
text paid once, packed many to a request line, costed at the embedding model's batch price.

The workload: rows `id, prompt` whose texts repeat (`text <n>`), embedded through OpenAI's Batch API
(`/v1/embeddings` lines) against the sandbox, whose vectors are a pure function of (model, text).
"""

from __future__ import annotations

import collections
import json
from decimal import Decimal

import pytest
from conftest import failure_messages
from helpers import (
    append_result_lines,
    kill_then_run_on,
    line_for_an_unknown_custom_id,
    log_text,
    result_lines,
    sorted_batches,
)

from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.sandbox.embeddings import vector

MODEL = "text-embedding-3-small"
BATCH_PRICE_PER_TOKEN = Decimal("0.02") / Decimal(1_000_000) * Decimal("0.5")  # the shipped price table


def text_of(n: int) -> str:
    return f"text {n}: the export of report {n} times out after an upgrade"


def embed_model(extra: str = "", dimensions: int | None = 8) -> str:
    dims = f", llm_dimensions={dimensions}" if dimensions else ""
    return f"""
{{{{ config(materialized='llm_batch', unique_key='id', llm_task='embed', llm_model='{MODEL}'{dims}{extra}) }}}}
select * from {{{{ ref('docs') }}}}
"""


def write_docs(project, rows: dict[int, int]) -> None:
    """rows: {id: the text number it embeds}."""
    project.write("seeds/docs.csv", "id,prompt\n" + "".join(f'{i},"{text_of(n)}"\n' for i, n in rows.items()))
    project.dbt("seed")


# The model is named `triage` in the crash test: the crash helpers run `dbt run -s triage`.
NAME = "docs_embedded"


@pytest.fixture
def docs(project, emulator):
    project.write(f"models/{NAME}.sql", embed_model())
    return project


def table(project, name: str = NAME) -> dict[int, tuple]:
    rows = project.query(f"select id, prompt, llm_embedding, llm_status, llm_cost_usd, llm_route from main.{name}")
    return {r[0]: r[1:] for r in rows}


def assert_every_row_has_its_vector(rows: dict[int, tuple], count: int, size: int = 8) -> None:
    assert len(rows) == count
    for key, (prompt, embedding, status, *_) in rows.items():
        assert status == "succeeded", (key, status)
        assert embedding == pytest.approx(vector(MODEL, prompt, size), abs=1e-6), key


def ten_thousand_rows_30_percent_repeated() -> dict[int, int]:
    """7,000 distinct texts; the other 3,000 rows repeat one of them."""
    return {i: i if i < 7000 else (i * 7) % 7000 for i in range(10_000)}


def billed_texts(emulator) -> collections.Counter:
    return collections.Counter(t for b in emulator.billed() for t in b["prompt"].split("\n"))


def billed_cost(emulator) -> Decimal:
    return emulator.stats()["usage_by_face"]["openai"]["prompt_tokens"] * BATCH_PRICE_PER_TOKEN


def test_a_table_is_embedded_through_a_batch_each_distinct_text_paid_once(docs, emulator):
    write_docs(docs, {i: i % 7 for i in range(20)})
    docs.dbt("run", "-s", "docs_embedded")
    assert table(docs) == {}  # submitted, nothing merged yet
    emulator.complete_all()
    docs.dbt("run", "-s", "docs_embedded")

    rows = table(docs)
    assert len(rows) == 20
    for key, (prompt, embedding, status, _, route) in rows.items():
        assert status == "succeeded" and route == "batch", key
        assert embedding == pytest.approx(vector(MODEL, prompt, 8), abs=1e-6), key
    assert docs.query("select typeof(llm_embedding) from main.docs_embedded limit 1") == [("FLOAT[8]",)]
    # A similarity query works on the column as it is: the same text is similarity 1.
    same = docs.query("""select min(array_cosine_similarity(a.llm_embedding, b.llm_embedding))
                         from main.docs_embedded a join main.docs_embedded b on a.prompt = b.prompt""")[0][0]
    assert same == pytest.approx(1.0, abs=1e-5)
    # The ledger keeps each request's vector typed (FLOAT[], never JSON text): one per distinct text.
    stored = (
        "select count(*), count(vector), count(answer), min(len(vector)), max(len(vector)) from main.llm_batch_requests"
    )
    assert docs.query(stored) == [(7, 7, 0, 8, 8)]
    # Seven distinct texts, each billed once, packed into one request line of one batch.
    assert billed_texts(emulator) == {text_of(n): 1 for n in range(7)}
    assert emulator.stats()["batches_created"] == 1 and emulator.stats()["embedding_requests"] == 1
    assert sum(r[3] for r in rows.values()) == billed_cost(emulator) > 0
    # Another run asks nothing.
    docs.dbt("run", "-s", "docs_embedded")
    assert emulator.stats()["batches_created"] == 1


def test_a_line_the_batch_never_sent_beside_a_packed_line_is_reported_and_ignored(docs, emulator):
    """A packed line settles two requests (two distinct texts). With a line for a custom_id the batch
    never sent beside it, two lines settle two requests, as if each had settled one: that line is still
    counted and ignored (settle skips its check for unknown lines only when lines and settled requests
    are equal and a line answers one request)."""
    write_docs(docs, {i: i % 2 for i in range(20)})
    docs.dbt("run", "-s", "docs_embedded")
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    (packed,) = result_lines(emulator, batch)
    append_result_lines(emulator, batch, [line_for_an_unknown_custom_id(packed)])
    docs.dbt("run", "-s", "docs_embedded")
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in log_text(docs)
    assert_every_row_has_its_vector(table(docs), 20)


def test_a_provider_without_embeddings_refuses_the_config_naming_those_that_can():
    from dbt_llm_batch.config import parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config({"unique_key": "id", "llm_provider": "anthropic", "llm_model": "x", "llm_task": "embed"})
    assert "llm_provider 'anthropic' has no embeddings API" in str(refused.value)
    assert "'openai'" in str(refused.value) and "'openai_compatible'" in str(refused.value)


def test_a_chat_model_is_refused_for_embeddings_before_anything_is_sent(project, emulator):
    """llm_task = 'embed' with a model the provider knows as a chat model: refused by the run, naming
    the embedding models it knows, instead of sent and failed at harvest."""
    project.write(f"models/{NAME}.sql", embed_model().replace(MODEL, "gpt-4o-mini"))
    write_docs(project, {i: i for i in range(3)})
    message = failure_messages(project.dbt("run", "-s", NAME, expect_ok=False))
    assert (
        "llm_model 'gpt-4o-mini' is a chat model of llm_provider 'openai', not an embedding model: llm_task = "
        "'embed' needs one, such as 'text-embedding-3-small', 'text-embedding-3-large', 'text-embedding-ada-002'"
    ) in message
    assert emulator.stats()["batches_created"] == 0 and emulator.stats()["files_uploaded"] == 0


def test_ten_thousand_rows_30_percent_repeated_are_packed_embedded_once_each_and_cost_what_was_billed(docs, emulator):
    write_docs(docs, ten_thousand_rows_30_percent_repeated())
    docs.dbt("run", "-s", NAME)
    assert table(docs) == {} and emulator.stats()["batches_created"] == 1
    # The batch expires with part of its lines answered: those are kept (and paid), the rest sent again.
    (batch,) = emulator.batches()
    emulator.advance(batch["id"], to="expired", done_fraction=0.5)
    docs.dbt("run", "-s", NAME)
    assert 0 < len(table(docs)) < 10_000 and emulator.stats()["batches_created"] == 2
    # One line of the resubmitted batch fails (a 500 for one of its texts): its requests alone are asked again.
    pending = sorted(set(map(text_of, range(7000))) - {r[0] for r in table(docs).values()})
    emulator.add_fault(prompt_contains=pending[0], status_code=500, message="Upstream failure.", times=1)
    emulator.complete_all()
    docs.dbt("run", "-s", NAME)
    (failed,) = docs.query("select count(*) from main.llm_batch_requests where status = 'failed'")[0]
    assert 0 < failed <= 2048 and failed < len(pending)  # one line's requests, not the batch's
    assert emulator.stats()["batches_created"] == 3
    assert docs.query("select count(*) from main.llm_batch_requests where status = 'queued'") == [(failed,)]
    emulator.complete_all()
    docs.dbt("run", "-s", NAME)

    rows = table(docs)
    assert_every_row_has_its_vector(rows, 10_000)
    # Every distinct text billed once (across the expired batch and the one sent after it); 3,000 rows
    # reuse another row's request.
    assert billed_texts(emulator) == {text_of(n): 1 for n in range(7000)}
    assert docs.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(7000,)]
    assert docs.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(failed,)]
    assert sum(r[3] for r in rows.values()) == billed_cost(emulator) > 0
    # The saving is shown as answers' are: the batch discount is half of the realtime price.
    (cost, saved, dedup_saved), *_ = docs.query(
        "select sum(cost_usd), sum(savings_usd), sum(dedup_saved_usd) from main.llm_batch_costs"
    )
    assert cost == sum(r[3] for r in rows.values()) and saved == cost and dedup_saved > 0
    # Packed: the requests in a handful of lines (at most 2,048 inputs and 150,000 estimated tokens each),
    # against one line per input sent without packing (counted in the files the sandbox received: the
    # 7,000 distinct texts, the expired batch's unanswered ones again, the failed line's again).
    lines = emulator.stats()["request_lines"]
    sent = [
        json.loads(line)
        for b in emulator.batches()
        for line in emulator.file_bytes(b["input_file_id"]).splitlines()
        if line.strip()
    ]
    inputs = sum(len(line["body"]["input"]) for line in sent)
    assert len(sent) == lines and inputs == 7000 + len(pending) + failed
    print(f"\nrequest lines: {lines} packed against {inputs} unpacked (ratio {inputs / lines:.0f}x)")
    assert lines <= 9  # the first batch's lines, the expired ones' again, the failed line's again


def test_a_run_killed_after_the_batch_was_created_pays_nothing_twice(project, emulator, tmp_path):
    project.write("models/triage.sql", embed_model())
    write_docs(project, {i: i % 50 for i in range(80)})
    kill_then_run_on(project, emulator, tmp_path / "crash-marker", "after_create")

    assert_every_row_has_its_vector(table(project, "triage"), 80)
    assert emulator.stats()["batches_created"] == 1  # the killed run's batch was found, not created again
    assert billed_texts(emulator) == {text_of(n): 1 for n in range(50)}
    assert sum(r[3] for r in table(project, "triage").values()) == billed_cost(emulator)


def test_urgent_rows_are_embedded_in_realtime_and_the_rest_in_a_batch_at_half_price(project, emulator):
    project.write(f"models/{NAME}.sql", embed_model(", llm_realtime_when='id < 3'"))
    write_docs(project, {i: i for i in range(6)})
    project.dbt("run", "-s", NAME)
    rows = table(project)
    assert sorted(rows) == [0, 1, 2] and {r[4] for r in rows.values()} == {"realtime"}
    emulator.complete_all()
    project.dbt("run", "-s", NAME)

    rows = table(project)
    assert_every_row_has_its_vector(rows, 6)
    assert {k: r[4] for k, r in rows.items()} == {0: "realtime", 1: "realtime", 2: "realtime"} | {
        k: "batch" for k in (3, 4, 5)
    }
    assert billed_texts(emulator) == {text_of(n): 1 for n in range(6)}
    # Realtime rows cost the full price, batch rows half: the same texts' tokens, priced apart.
    usage = {b["prompt"]: (b["via"], b["usage"]["prompt_tokens"]) for b in emulator.billed()}
    expected = (
        sum(
            tokens * BATCH_PRICE_PER_TOKEN * (2 if via == "realtime" else 1)
            for text, (via, tokens) in ((t, usage[t]) for t in map(text_of, range(3)))
        )
        + sum(b["usage"]["prompt_tokens"] for b in emulator.billed() if b["via"] == "batch") * BATCH_PRICE_PER_TOKEN
    )
    assert sum(r[3] for r in rows.values()) == expected


def test_a_self_hosted_openai_compatible_engine_embeds_every_row_in_realtime(project, emulator):
    # The sandbox's /v1/embeddings stands in for the engine (a loopback OpenAI-compatible server); an
    # engine's model is unknown to the plugin, so llm_dimensions says its size (checked on every vector).
    project.write(
        f"models/{NAME}.sql",
        embed_model(
            f", llm_provider='openai_compatible', llm_base_url='{emulator.openai_base_url}', "
            "llm_api_key_env='OPENAI_API_KEY'",
            dimensions=None,
        ).replace(f"llm_model='{MODEL}'", "llm_model='text-embedding-ada-002', llm_dimensions=1536"),
    )
    write_docs(project, {i: i % 4 for i in range(6)})
    project.dbt("run", "-s", NAME)

    rows = table(project)
    assert len(rows) == 6
    for key, (prompt, embedding, status, _cost, route) in rows.items():
        assert (status, route) == ("succeeded", "realtime"), key
        assert embedding == pytest.approx(vector("text-embedding-ada-002", prompt, 1536), abs=1e-6)
    assert billed_texts(emulator) == {text_of(n): 1 for n in range(4)}
    # llm_dimensions was not sent (ada-002 refuses the parameter): it is the size every vector is checked against.
    assert {b["via"] for b in emulator.billed()} == {"realtime"}


def test_the_sandbox_embeds_as_the_real_models_do_through_the_official_sdk(client):
    import openai

    reply = client.embeddings.create(model=MODEL, input=["a", "b"], dimensions=4)
    assert [d.embedding for d in reply.data] == [vector(MODEL, "a", 4), vector(MODEL, "b", 4)]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 2
    assert len(client.embeddings.create(model="text-embedding-3-large", input="a").data[0].embedding) == 3072
    with pytest.raises(openai.BadRequestError, match="does not support specifying dimensions"):
        client.embeddings.create(model="text-embedding-ada-002", input="a", dimensions=4)
    with pytest.raises(openai.BadRequestError, match="must be an integer from 1 to 1536"):
        client.embeddings.create(model=MODEL, input="a", dimensions=2000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")
