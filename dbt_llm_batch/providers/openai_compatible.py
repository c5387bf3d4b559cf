"""A self-hosted OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server, ...): every row is sent
in realtime to `/v1/chat/completions` on the configured base URL(s); the engine batches continuously.

Requests and result lines have OpenAI's shapes (the engine speaks OpenAI's chat API), so they are
OpenAIChatProvider's. There is no batch API (this is not a BatchProvider) and no realtime
counterfactual: a row's cost comes from the price table (zero unless the user prices the engine
with llm_price_table).
"""

from __future__ import annotations

import os
from typing import Any

from dbt_llm_batch import config_values
from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.engine_load import EngineLoad, read_engine_load
from dbt_llm_batch.providers.openai_chat import OpenAIChatProvider


class OpenAICompatibleProvider(OpenAIChatProvider):
    name = "openai_compatible"
    key_env_var = ""  # the model's llm_api_key_env, if the engine wants a key at all
    self_hosted = True
    config_keys = {
        key.name: key
        for key in (
            Key(
                "llm_base_url",
                "URL or list of URLs",
                None,
                "the engine's OpenAI-compatible base URL (`http://host:8000/v1`); a list spreads requests over "
                "replicas by fewest outstanding requests",
                default_doc="required",
            ),
            Key(
                "llm_api_key_env",
                "environment variable name",
                None,
                "the variable holding the engine's key, if it wants one (the name, never the key)",
            ),
        )
    }

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        """llm_base_url (required: a URL or a list of replicas' URLs) and llm_api_key_env (the NAME of
        the variable holding the engine's key). Returns base_urls (a tuple, no trailing slash) and
        api_key_env."""
        urls = values["llm_base_url"]
        urls = [urls] if isinstance(urls, str) else urls
        if urls is None:
            errors.append(
                f"llm_provider {cls.name!r} needs llm_base_url: the engine's URL, e.g. "
                "'http://127.0.0.1:8000/v1', or a list of replicas"
            )
            urls = []
        elif (
            not isinstance(urls, list)
            or not urls
            or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls)
        ):
            errors.append(f"llm_base_url must be an http(s) URL or a list of them, got {values['llm_base_url']!r}")
            urls = []
        key_env = values["llm_api_key_env"]
        key_env = config_values.key_variable("llm_api_key_env", key_env, errors)
        return {"base_urls": tuple(u.rstrip("/") for u in urls), "api_key_env": key_env}

    @property
    def base_urls(self) -> tuple[str, ...]:
        return self.config.options["base_urls"]

    @property
    def api_key_env(self) -> str | None:
        return self.config.options["api_key_env"]

    def check_credentials(self) -> None:
        var = self.api_key_env
        if var and not os.environ.get(var):
            raise ConfigError(
                f"{var} is not set (named by llm_api_key_env): export it in the shell that runs "
                f"dbt, or drop llm_api_key_env if the engine needs no key"
            )

    def engine_load(self) -> EngineLoad | None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return read_engine_load(self.base_urls, key)

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.engine_http import engine_transports

        return engine_transports(self.base_urls, self.api_key_env, self.path)
