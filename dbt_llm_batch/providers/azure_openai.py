"""Azure OpenAI Global Batch, through the official `openai` SDK's AzureOpenAI client.

Azure serves OpenAI's Files + Batches API (the same objects, lifecycle, result files and error lines;
see openai_batch.py) at the resource's endpoint under `/openai/...?api-version=...`, authenticated by
an `api-key` header or a Microsoft Entra ID token. What differs, per Azure's batch guide
(learn.microsoft.com, azure ai-foundry openai how-to batch):
- `llm_model` is a *deployment* name (a Global Batch deployment), written as each line's `model`; the
  model behind it, for prices, is `llm_azure_model` (default: the deployment name);
- lines go to `/chat/completions` (no `/v1`), and batches are created for that endpoint;
- jobs do not expire ("we do not expire the jobs that take longer"): a batch stays open until it
  completes, fails or is cancelled (a cancel returns the finished work, which is billed);
- quota is enqueued tokens per deployment; a batch past it fails with `token_limit_exceeded`, which
  the run treats as OpenAI's (the requests wait and are resubmitted later; nothing is paid twice).
A create whose answer was lost is found again as at OpenAI (openai_batch._find): by the job id in the
batch's metadata, or by its input file, named after the job id (an API version without metadata).
"""

from __future__ import annotations

import os
from typing import Any

from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

DEFAULT_API_VERSION = "2024-10-21"  # the GA version that serves Global Batch
KEY_VARS = ("AZURE_OPENAI_API_KEY", "AZURE_OPENAI_AD_TOKEN")  # a key, or an Entra ID token (either one)
ENDPOINT_VAR = "AZURE_OPENAI_ENDPOINT"


class AzureOpenAIBatchProvider(OpenAIBatchProvider):
    name = "azure_openai"
    key_env_var = "AZURE_OPENAI_API_KEY"  # or AZURE_OPENAI_AD_TOKEN: see check_credentials
    environment_hint = "Azure OpenAI reads AZURE_OPENAI_ENDPOINT and AZURE_OPENAI_API_KEY (or AZURE_OPENAI_AD_TOKEN)"
    # Azure's Global Batch limits (batch guide, "Batch limits"): 100,000 requests and 200 MB per file.
    unfinished_batch = "never expires (24 h is a target); a cancel returns the finished requests, the rest sent again"
    max_requests_per_batch = 100_000
    # Embeddings through Azure's batch are not built (nor emulated) yet: chat completions only.
    has_embeddings = False
    embedding_models = {}
    max_inputs_per_line = 1
    max_bytes_per_batch = 200_000_000
    # Enqueued tokens are a per-deployment quota the user sets in the portal (Global Batch defaults start
    # at a few million for gpt-4o-mini); keep under the lowest default and let llm_max_tokens_in_flight raise it.
    default_max_tokens_in_flight = 2_000_000
    config_keys = {
        key.name: key
        for key in (
            Key(
                "llm_azure_endpoint",
                "URL",
                None,
                "the Azure OpenAI resource's endpoint (`https://NAME.openai.azure.com`); unset: the "
                "AZURE_OPENAI_ENDPOINT variable",
                default_doc="AZURE_OPENAI_ENDPOINT",
            ),
            Key(
                "llm_azure_api_version",
                "string",
                DEFAULT_API_VERSION,
                "the `api-version` every call sends (one that serves Global Batch)",
            ),
            Key(
                "llm_azure_model",
                "model name",
                None,
                "the model the deployment (`llm_model`) serves, for prices",
                default_doc="`llm_model`",
            ),
        )
    }

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        endpoint, version, model = (
            values["llm_azure_endpoint"],
            values["llm_azure_api_version"],
            values["llm_azure_model"],
        )
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint.startswith(("https://", "http://"))):
            errors.append(f"llm_azure_endpoint must be the resource's https:// URL, got {endpoint!r}")
            endpoint = None
        if not isinstance(version, str) or not version:
            errors.append(f"llm_azure_api_version must be an API version string such as {DEFAULT_API_VERSION!r}")
            version = DEFAULT_API_VERSION
        if model is not None and (not isinstance(model, str) or not model):
            errors.append(f"llm_azure_model must be a model name such as 'gpt-4o-mini', got {model!r}")
            model = None
        return {"endpoint": endpoint, "api_version": version, "model": model}

    @classmethod
    def price_key(cls, config) -> tuple[str, str]:
        return cls.name, config.options.get("model") or config.model

    @classmethod
    def batch_limits(cls, config) -> tuple[int, int]:
        return cls.max_requests_per_batch, cls.max_bytes_per_batch

    @property
    def key_variable(self) -> str:
        return self.key_env_var

    def resource_url(self) -> str:
        endpoint = self.config.options.get("endpoint") or os.environ.get(ENDPOINT_VAR)
        if not endpoint:
            raise ConfigError(
                f"llm_provider 'azure_openai' needs the resource's endpoint: set llm_azure_endpoint or export "
                f"{ENDPOINT_VAR} (https://NAME.openai.azure.com)"
            )
        return endpoint.rstrip("/")

    def check_credentials(self) -> None:
        self.resource_url()
        if not any(os.environ.get(var) for var in KEY_VARS):
            raise ConfigError(
                "AZURE_OPENAI_API_KEY is not set (nor AZURE_OPENAI_AD_TOKEN, an Entra ID token): export one in "
                "the shell that runs dbt (never put the key in dbt config; dbt writes config into target/)"
            )

    @property
    def client(self):
        if self._client is None:
            import openai

            # The SDK reads AZURE_OPENAI_API_KEY or AZURE_OPENAI_AD_TOKEN at call time. No SDK retries:
            # self.calls retries idempotent calls inside the run's budget (calls.py); create is never retried.
            self._client = openai.AzureOpenAI(
                azure_endpoint=self.resource_url(),
                api_version=self.config.options.get("api_version", DEFAULT_API_VERSION),
                max_retries=0,
                timeout=120,
            )
        return self._client

    @property
    def endpoint(self) -> str:
        """Azure's batch endpoint and each line's `url`: the API path without OpenAI's /v1."""
        return self.path

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.realtime_transport import azure_openai_transports

        return azure_openai_transports(
            self.resource_url(),
            self.config.options.get("api_version", DEFAULT_API_VERSION),
            self.config.model,
            self.config.concurrency,
        )
