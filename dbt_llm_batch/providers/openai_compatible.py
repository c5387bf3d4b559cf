"""A self-hosted OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server, ...): every row is sent
in realtime to `/v1/chat/completions` on the configured base URL(s); the engine batches continuously.

Requests and result lines have OpenAI's shapes (the engine speaks OpenAI's chat API), so storing and
settling are the OpenAI provider's. There is no batch API and no realtime counterfactual: a row's
cost comes from the price table (zero unless the user prices the engine with llm_price_table).
"""

from __future__ import annotations

import os

from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider


class OpenAICompatibleProvider(OpenAIBatchProvider):
    name = "openai_compatible"
    key_env_var = ""  # the model's llm_api_key_env, if the engine wants a key at all
    batch_capable = False

    def check_credentials(self) -> None:
        var = self.config.api_key_env
        if var and not os.environ.get(var):
            raise ConfigError(
                f"{var} is not set (named by llm_api_key_env): export it in the shell that runs "
                f"dbt, or drop llm_api_key_env if the engine needs no key"
            )

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.engine_http import engine_transports

        return engine_transports(self.config.base_urls, self.config.api_key_env)

    def upload(self, jsonl_path, token):
        raise NotImplementedError("a self-hosted engine has no batch API; its rows are sent in realtime")

    def create(self, jsonl_path, file_id, token, model_name):
        raise NotImplementedError("a self-hosted engine has no batch API; its rows are sent in realtime")

    def find_upload(self, token, since_epoch):
        return None

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        return None  # never submits batches, so an intent of this provider never reached one

    def poll(self, batch_id):
        raise NotImplementedError("a self-hosted engine has no batch API")
