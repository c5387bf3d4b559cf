"""A model whose rows are all answered by another model's requests (llm_dedup = 'ledger') has no request
of its own; changing its unique_key while those requests are in flight must still re-key its row
answers, or the harvest merges each row twice (once under the old key, once under the new)."""

from __future__ import annotations

from helpers import MODEL, PRICES, write_rows

N = 6


def keyed_model(provider: str, key: str) -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='{key}', llm_provider='{provider}', llm_model='{MODEL[provider]}',
            llm_max_tokens=50, llm_price_table='main.llm_prices', llm_dedup='ledger') }}}}
select id, id + 1000 as ticket_no, prompt from {{{{ ref('dup_rows') }}}}
"""


def test_a_unique_key_change_of_a_model_answered_only_by_another_model_s_requests_keeps_one_row_per_key(
    project, emulator
):
    provider = "openai"
    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", keyed_model(provider, "id"))
    write_rows(project, {i: i for i in range(N)})
    project.dbt("run", "-s", "dup")  # sends the requests
    project.dbt("run", "-s", "twin")  # its rows wait on dup's batch: no request of its own
    assert project.query("select count(*) from main.llm_batch_requests where model = 'main.twin'") == [(0,)]

    project.write("models/twin.sql", keyed_model(provider, "ticket_no"))
    project.dbt("run", "-s", "twin")  # re-keyed; dup's batch still in flight
    emulator.complete_all()
    project.dbt("run", "-s", "twin")  # harvests dup's batch and merges twin's rows

    rows = project.query(
        "select ticket_no, count(*), count(*) filter (where llm_status = 'succeeded') from main.twin group by 1 order by 1"
    )
    assert rows == [(1000 + i, 1, 1) for i in range(N)], rows
    assert len(emulator.billed()) == N
