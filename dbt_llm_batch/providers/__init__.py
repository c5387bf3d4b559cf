"""Provider registry: the core asks for a provider by its config name and never imports one directly."""

from __future__ import annotations

import importlib

from dbt_llm_batch.providers.base import BatchProvider

# config name -> "module:Class"; modules are imported only when a model uses them.
PROVIDERS = {
    "openai": "dbt_llm_batch.providers.openai_batch:OpenAIBatchProvider",
    "anthropic": "dbt_llm_batch.providers.anthropic_batch:AnthropicBatchProvider",
    "openai_compatible": "dbt_llm_batch.providers.openai_compatible:OpenAICompatibleProvider",
}


def get_provider(name: str) -> type[BatchProvider]:
    module_name, class_name = PROVIDERS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
