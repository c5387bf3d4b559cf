"""docs/providers/index.md's capability table is what the registered providers declare."""

from __future__ import annotations

from dbt_llm_batch.ops import provider_table


def test_the_capability_table_is_what_the_providers_declare():
    page = provider_table.PAGE.read_text()
    assert page == provider_table.with_table(page), f"run `{provider_table.COMMAND}`"


def test_the_table_has_a_row_per_provider_of_this_package_with_its_declared_limits():
    from dbt_llm_batch.providers import get_provider

    rows = {row[0]: row for row in provider_table.rows()}
    assert {"`openai`", "`anthropic`", "`azure_openai`", "`openai_compatible`"} <= set(rows)
    azure = get_provider("azure_openai")
    assert rows["`azure_openai`"][2] == f"{azure.max_requests_per_batch:,}"
    assert "never expires" in rows["`azure_openai`"][5]
    assert rows["`openai_compatible`"][1] == "no (self-hosted engine)"
