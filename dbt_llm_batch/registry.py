"""Where providers are found: the Python entry-point group `dbt_llm_batch.providers`.

Each entry point maps an `llm_provider` name to a provider class ("module:Class"); the built-in
providers are declared in this package's own metadata exactly as a third-party package declares
one, so adding a provider needs no change here. A provider's module is imported only when a model
names it.

This module sits below the config layer so that config validation can ask a provider to check its
own keys; it never imports a provider module itself (the entry point does, when loaded), and the
typed accessor the rest of the code uses is `dbt_llm_batch.providers.get_provider`.
"""

from __future__ import annotations

import sys
from functools import cache, lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from dbt_llm_batch.errors import ConfigError

GROUP = "dbt_llm_batch.providers"


@lru_cache(maxsize=8)
def _entry_points(search_path: tuple[str, ...]) -> dict[str, EntryPoint]:
    # Keyed on sys.path: reading every installed distribution's metadata costs milliseconds, and
    # the answer only changes when something is put on the path (a plugin, or a test's temp dir).
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return found


def provider_names() -> list[str]:
    """The registered provider names, in registration order (the built-in ones first)."""
    return list(_entry_points(tuple(sys.path)))


def known_providers_message(name: object) -> str:
    return f"llm_provider must be one of {provider_names()}, got {name!r}"


def is_registered(name: object) -> bool:
    return isinstance(name, str) and name in _entry_points(tuple(sys.path))


@cache
def _load(ep: EntryPoint) -> Any:
    return ep.load()


def load_provider(name: str) -> Any:
    """The class registered as `name`. An unknown name, or a registration that cannot be loaded,
    is a ConfigError saying what to do."""
    ep = _entry_points(tuple(sys.path)).get(name) if isinstance(name, str) else None
    if ep is None:
        raise ConfigError(known_providers_message(name))
    try:
        cls = _load(ep)
    except Exception as exc:  # a plugin's import error: say which registration is broken
        raise ConfigError(
            f"llm_provider {name!r} is registered as {ep.value!r} (entry point group {GROUP}), "
            f"which cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(cls, type) or not all(hasattr(cls, a) for a in ("parse_options", "has_batch_api")):
        raise ConfigError(
            f"llm_provider {name!r} is registered as {ep.value!r}, which is not a provider class "
            f"(a subclass of dbt_llm_batch.providers.base.Provider)"
        )
    if getattr(cls, "name", None) != name:
        raise ConfigError(
            f"llm_provider {name!r} is registered as {ep.value!r}, whose `name` is "
            f"{getattr(cls, 'name', None)!r}: a provider class's `name` must be the name it is registered under"
        )
    return cls
