"""Provider registry: the core asks for a provider by its config name and never imports one directly.

Providers are registered in the entry-point group `dbt_llm_batch.providers` (see registry.py), the
built-in ones in this package's metadata, a third-party one in its own package's.
"""

from __future__ import annotations

from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.base import BatchProvider, Provider
from dbt_llm_batch.registry import load_provider, provider_names

__all__ = ["BatchProvider", "Provider", "get_provider", "provider_names"]


def get_provider(name: str) -> type[Provider]:
    """The provider class registered as `name`, imported on first use. An unknown name is a
    ConfigError listing the registered ones."""
    cls = load_provider(name)
    if not issubclass(cls, Provider):  # registry.load_provider checked it is a class
        raise ConfigError(
            f"llm_provider {name!r} is registered (entry point group dbt_llm_batch.providers) as "
            f"{cls!r}, which is not a subclass of dbt_llm_batch.providers.base.Provider"
        )
    return cls
