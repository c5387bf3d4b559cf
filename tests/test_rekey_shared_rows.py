"""A model whose rows are all answered by another model's requests (llm_dedup = 'ledger') has no request
of its own; changing its unique_key while those requests are in flight must still re-key its row
answers, or the harvest merges each row twice (once under the old key, once under the new)."""

from __future__ import annotations

import collections
import hashlib
import json

from helpers import MODEL, PRICES, batch_input_lines, prompt_of, sorted_batches, write_rows

from dbt_llm_batch.sandbox import expected_answer

N = 6


def keyed_model(provider: str, key: str) -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='{key}', llm_provider='{provider}', llm_model='{MODEL[provider]}',
            llm_max_tokens=50, llm_price_table='main.llm_prices', llm_dedup='ledger') }}}}
select id, id + 1000 as ticket_no, prompt from {{{{ ref('dup_rows') }}}}
"""


def rekey_twin_while_dup_is_in_flight(project, emulator, model_keyed_by) -> None:
    """Models dup and twin (`model_keyed_by(key)`, keyed by id) select the same rows: dup sends the
    requests, twin's rows wait on dup's batch with no request of its own; then twin is re-keyed by
    ticket_no and run while dup's batch is still in flight."""
    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", model_keyed_by("id"))
    write_rows(project, {i: i for i in range(N)})
    project.dbt("run", "-s", "dup")  # sends the requests
    project.dbt("run", "-s", "twin")  # its rows wait on dup's batch: no request of its own
    assert project.query("select count(*) from main.llm_batch_requests where model = 'main.twin'") == [(0,)]
    project.write("models/twin.sql", model_keyed_by("ticket_no"))
    project.dbt("run", "-s", "twin")  # re-keyed; dup's batch still in flight


def test_a_unique_key_change_of_a_model_answered_only_by_another_model_s_requests_keeps_one_row_per_key(
    project, emulator
):
    rekey_twin_while_dup_is_in_flight(project, emulator, lambda key: keyed_model("openai", key))
    emulator.complete_all()
    project.dbt("run", "-s", "twin")  # harvests dup's batch and merges twin's rows

    rows = project.query(
        "select ticket_no, count(*), count(*) filter (where llm_status = 'succeeded') from main.twin group by 1 order by 1"
    )
    assert rows == [(1000 + i, 1, 1) for i in range(N)], rows
    assert len(emulator.billed()) == N


TERSE = "Answer in one word."
SAMPLE = 0.5


def in_sample(key: int, fraction: float = SAMPLE) -> bool:
    """The documented rule, computed apart: the first 32 bits of md5 of the ledger key (["<key>"])."""
    return int(hashlib.md5(json.dumps([str(key)]).encode()).hexdigest()[:8], 16) / 2**32 < fraction


def variant_model(provider: str, key: str, sample: dict | None = None) -> str:
    """keyed_model with a challenger 'terse' (another system prompt), sampled when `sample` says so."""
    extra = f", llm_variant_sample={json.dumps(sample)}" if sample else ""
    return keyed_model(provider, key).replace(
        "llm_dedup='ledger'", f"llm_dedup='ledger', llm_variants={{'terse': {{'llm_system': {TERSE!r}}}}}{extra}"
    )


def test_a_unique_key_change_of_a_model_with_a_sampled_variant_answered_only_by_another_model_s_requests(
    project, emulator
):
    """dup asks both variants of every key; twin samples its challenger. A first round lands, so twin's
    table holds the challenger's rows of its sample under `id`. Then every prompt changes, dup asks again,
    and twin is re-keyed to `ticket_no` while dup's batch is in flight: the sample is now drawn on the new
    key, so some keys leave the challenger's sample (their rows are kept: docs/table.md, llm_on_unselected
    'keep') and others enter it (answered by dup's requests too). Once the batch lands: one row per
    (key, variant), under the new key, each with the answer to the prompt it shows, nothing billed twice."""
    n = 40
    provider = "openai"
    emulator.auto_advance_seconds = None
    old = {i for i in range(n) if in_sample(i)}  # the challenger's sample under `id`
    new = {i for i in range(n) if in_sample(1000 + i)}  # under `ticket_no`
    left, entered = old - new, new - old
    assert left and entered and old & new, (old, new)

    project.write("seeds/llm_prices.csv", PRICES)
    project.write("models/dup.sql", variant_model(provider, "id"))
    project.write("models/twin.sql", variant_model(provider, "id", {"terse": SAMPLE}))
    twin_requests = "select count(*) from main.llm_batch_requests where model like 'main.twin%'"
    for round_, shift in enumerate((0, 100)):
        write_rows(project, {i: i + shift for i in range(n)})
        project.dbt("run", "-s", "dup")  # sends both variants' requests of every key
        project.dbt("run", "-s", "twin")  # its rows wait on dup's batch: no request of its own
        assert project.query(twin_requests) == [(0,)]
        if round_ == 0:
            emulator.complete_all()
            project.dbt("run", "-s", "twin")
            rows = project.query("select id, llm_variant from main.twin where llm_status = 'succeeded'")
            assert sorted(rows) == sorted([(i, "default") for i in range(n)] + [(i, "terse") for i in old])

    project.write("models/twin.sql", variant_model(provider, "ticket_no", {"terse": SAMPLE}))
    project.dbt("run", "-s", "twin")  # re-keyed; dup's batch still in flight
    assert project.query(twin_requests) == [(0,)]  # the keys that entered the sample wait on dup's requests too
    emulator.complete_all()
    project.dbt("run", "-s", "twin")  # harvests dup's batch and merges twin's rows

    rows = project.query("select ticket_no, llm_variant, prompt, llm_output, llm_status from main.twin")
    per_key = collections.Counter((t, v) for t, v, *_ in rows)
    expected_keys = [(1000 + i, "default") for i in range(n)] + [(1000 + i, "terse") for i in new | left]
    assert sorted(per_key.items()) == sorted((k, 1) for k in expected_keys), per_key
    by_key = {(t, v): (p, o, s) for t, v, p, o, s in rows}
    for (t, v), (p, o, s) in by_key.items():
        i = t - 1000
        assert s == "succeeded", (t, v, s)
        assert o == expected_answer(TERSE if v == "terse" else None, p, None), (t, v)  # the answer to its prompt
        if v == "default" or i in new:
            assert p == prompt_of(i + 100), (t, v)  # asked now: the new prompt's answer
        else:  # left the sample: kept, with the answer of the first round or the one in flight for it
            assert p in (prompt_of(i), prompt_of(i + 100)), (t, v)
    assert project.query(twin_requests) == [(0,)]
    assert len(emulator.billed()) == 2 * 2 * n  # two rounds of dup's requests (both variants); twin's none


NESTED = {
    "owner": {"type": "object", "properties": {"name": "text", "team": "text"}, "required": ["name", "team"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "score": "integer",
}


def nested_model(provider: str, key: str) -> str:
    """keyed_model with nested outputs: an object, a list of strings and an integer."""
    return keyed_model(provider, key).replace(
        "llm_max_tokens=50", f"llm_max_tokens=300, llm_output={json.dumps(NESTED)}"
    )


def test_a_unique_key_change_of_a_model_with_nested_outputs_answered_only_by_another_model_s_requests(
    project, emulator
):
    """The same scenario with nested outputs: once dup's batch lands, twin holds one row per new key, its
    nested values in their typed columns (a STRUCT, a VARCHAR list), equal to the sandbox's answer."""
    rekey_twin_while_dup_is_in_flight(project, emulator, lambda key: nested_model("openai", key))
    (batch,) = sorted_batches(emulator)
    schema = batch_input_lines(emulator, batch)[0]["body"]["response_format"]["json_schema"]["schema"]
    emulator.complete_all()
    project.dbt("run", "-s", "twin")

    described = {name: typ for name, typ, *_ in project.query("describe main.twin")}
    assert {c: described[c] for c in NESTED} == {
        "owner": 'STRUCT("name" VARCHAR, team VARCHAR)',
        "tags": "VARCHAR[]",
        "score": "BIGINT",
    }
    rows = project.query("select ticket_no, prompt, owner, tags, score, llm_status from main.twin order by 1")
    assert [r[0] for r in rows] == [1000 + i for i in range(N)], rows  # one row per new key
    for ticket_no, prompt, owner, tags, score, status in rows:
        assert status == "succeeded" and prompt == prompt_of(ticket_no - 1000), ticket_no
        answer = json.loads(expected_answer(None, prompt, schema))
        assert (owner, tags, score) == (answer["owner"], answer["tags"], answer["score"]), ticket_no
    assert all(len(tags) > 1 for *_, tags, _score, _status in rows)  # lists of more than one item
    assert len(emulator.billed()) == N


def combined_model(key: str) -> str:
    """nested_model with a sampled challenger 'terse'; keyed by `id`, or by `tno`, a computed column
    the SELECT has only while it is the key (so the stored rows of requests made before lack it)."""
    text = nested_model("openai", "id").replace(
        "llm_dedup='ledger'",
        f"llm_dedup='ledger', llm_variants={{'terse': {{'llm_system': {TERSE!r}}}}}, "
        f"llm_variant_sample={{'terse': {SAMPLE}}}",
    )
    if key == "tno":
        text = text.replace("unique_key='id'", "unique_key='tno'").replace(
            "select id,", "select id * 7 + 100 as tno, id,"
        )
    return text


def test_a_key_changed_to_a_new_column_with_a_sampled_variant_nested_outputs_and_shared_requests_under_threads(
    project, emulator
):
    """Features together: two models select the same rows with nested outputs and a sampled
    challenger (llm_dedup = 'ledger', so one model's requests answer both), run together under
    `--threads 4`; with their batch in flight both change `unique_key` to a computed column the
    stored rows lack, run again, and the batches land. Each request is billed once; each model holds
    one row per (key, variant), its nested values the sandbox's answer to that variant's prompt, its
    key the computed one; the challenger answers at least the new key's sample."""
    n = 12
    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {i: i for i in range(n)})
    threads = ("--threads", "4")
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", combined_model("id"))
    project.dbt("run", "-s", "dup", "twin", *threads)
    (batch,) = sorted_batches(emulator)
    schema = batch_input_lines(emulator, batch)[0]["body"]["response_format"]["json_schema"]["schema"]
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", combined_model("tno"))
    project.dbt("run", "-s", "dup", "twin", *threads)  # re-keyed; the batch still in flight
    for _ in range(2):
        emulator.complete_all()
        project.dbt("run", "-s", "dup", "twin", *threads)

    bodies = collections.Counter(json.dumps(b["request"], sort_keys=True) for b in emulator.billed())
    assert max(bodies.values()) == 1, "a request billed twice"
    keys = {i * 7 + 100: i for i in range(n)}
    for name in ("dup", "twin"):
        described = {column: typ for column, typ, *_ in project.query(f"describe main.{name}")}
        assert described["owner"] == 'STRUCT("name" VARCHAR, team VARCHAR)' and described["score"] == "BIGINT"
        rows = project.query(f"select tno, id, llm_variant, prompt, owner, tags, score, llm_status from main.{name}")
        assert len(rows) == len({(tno, variant) for tno, _, variant, *_ in rows}), name
        by_variant = collections.defaultdict(set)
        for tno, i, variant, prompt, owner, tags, score, status in rows:
            assert (status, tno, prompt) == ("succeeded", i * 7 + 100, prompt_of(i)), (name, i, variant)
            answer = json.loads(expected_answer(TERSE if variant == "terse" else None, prompt, schema))
            assert (owner, tags, score) == (answer["owner"], answer["tags"], answer.get("score")), (name, i, variant)
            by_variant[variant].add(tno)
        assert by_variant["default"] == set(keys), name
        assert {k for k in keys if in_sample(k)} <= by_variant["terse"], name
