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


def test_the_cloud_batch_providers_state_each_capability_the_table_shows():
    """Gemini, Bedrock and Azure OpenAI (issue #32) each say how they take llm_output, what their prompt
    caching is and what becomes of a batch they did not finish: a column reading "not stated" is a
    capability the provider never declared."""
    from dbt_llm_batch.providers import get_provider

    for name in ("gemini", "bedrock", "azure_openai"):
        cls = get_provider(name)
        stated = {k: getattr(cls, k) for k in ("structured_output", "prompt_caching", "unfinished_batch")}
        assert "not stated" not in stated.values(), (name, stated)
