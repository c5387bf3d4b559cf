"""The provider clients, prices and provider availability of one run (ARCHITECTURE.md, "The run").

A run asks through one client per config it sends with (the model's own, each evaluation variant's)
and polls, harvests and reconciles each older job through the provider and model it was sent with.
The pool owns those clients, so every step (reconcile, harvest, submit, realtime) reaches a provider
the same way, and no step needs the run that holds it: reconciliation takes (ledger, pool).

A client is created on first use, so a run with nothing to do needs no key and makes no call; it is
kept only once its key is found, so a missing key is a ConfigError every time it is asked for, never
a client that fails later inside the SDK.
"""

from __future__ import annotations

import dataclasses
import json

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.pipeline import costs
from dbt_llm_batch.providers import get_provider


class Pool:
    """Clients by config (variant) and by (provider, model), prices by (provider, model), and whether a
    provider stayed down for the run's retry budget."""

    def __init__(self, con, default: ModelConfig, client=None):
        self.con, self.default = con, default
        self._clients: dict[tuple, object] = {}
        self._prices: dict[tuple[str, str], dict | None] = {}
        if client is not None:  # a client the caller made (benchmarks pass one that stays offline)
            self._clients[self._config_key(default)] = client

    @staticmethod
    def _config_key(config: ModelConfig) -> tuple:
        # An added-fields pass's config (added_fields.py) renders and records its own output schema.
        return ("config", config.variant, output_schema.recorded(config.output_json_schema()))

    def client(self, config: ModelConfig):
        """`config`'s client (the model's own or a variant's): its provider with its provider keys."""
        return self._get(self._config_key(config), config)

    def client_for_job(self, job: dict):
        """The client a job was sent through: its provider, model and host (a batch in flight is
        polled, harvested and cleaned up there even after the model switched provider, model or
        llm_base_url); a variant's config when one sends there, else the model's own, moved."""
        config = self.config_for_job(job)
        if any(config is v for v in self.default.all_variants()):
            return self.client(config)
        return self._get(("job", *sender(job, self.default.model)), config)

    def config_for_job(self, job: dict) -> ModelConfig:
        """The model's config as the job was sent (sent_with): a variant's when one sends there now (a
        job from before ledger version 34, with no provider keys recorded: one of its provider and model)."""
        provider, llm_model, recorded = sender(job, self.default.model)
        for variant in self.default.all_variants():
            if (variant.provider, variant.model) == (provider, llm_model) and recorded in (
                None,
                recorded_options(variant),
            ):
                return variant
        return sent_with(self.default, job)

    def _get(self, key: tuple, config: ModelConfig):
        if key not in self._clients:
            client = get_provider(config.provider)(config)
            client.check_credentials()  # raises ConfigError: the client is not kept, asked again next time
            self._clients[key] = client
        return self._clients[key]

    def check(self, configs: list[ModelConfig]) -> None:
        """Every config's provider key, before anything is sent (a ConfigError names the first missing)."""
        for config in configs:
            self.client(config)

    def price(self, provider: str, llm_model: str) -> dict | None:
        """The price row of a provider's model (costs.price_of), read once per run."""
        if (provider, llm_model) not in self._prices:
            self._prices[(provider, llm_model)] = costs.price_of(self.con, provider, llm_model)
        return self._prices[(provider, llm_model)]

    def price_of_config(self, config: ModelConfig) -> dict | None:
        """The price row `config`'s provider says it bills by (Provider.price_key: an Azure deployment is
        priced as the model it serves, an OpenAI-compatible host at its own row)."""
        return self.price(*get_provider(config.provider).price_key(config))

    def price_for_job(self, job: dict) -> dict | None:
        """The price of the provider and model a job was sent with (not the model's current ones)."""
        return self.price_of_config(self.config_for_job(job))

    def unavailable(self) -> str | None:
        """The last error of a provider that kept failing for llm_retry_budget_seconds, else None: the
        run then stops asking (open batches stay pending, nothing new is submitted)."""
        for client in self._clients.values():
            calls = getattr(client, "calls", None)
            if calls is not None and calls.spent:
                return calls.last_error or "the provider kept failing"
        return None


def recorded_options(config: ModelConfig) -> str | None:
    """The provider's own keys `config` sends with (ModelConfig.options: a host's URL, the NAME of its
    key's variable, a region; never a key), as the ledger records them on each job. None when they
    are not plain JSON values (a provider plugin's own objects): its jobs use the model's keys."""
    try:
        return json.dumps(config.options, sort_keys=True)
    except (TypeError, ValueError):
        return None


def sent_with(config: ModelConfig, job: dict) -> ModelConfig:
    """`config` as `job` was sent with it: the job's provider, model and provider keys (recorded since
    ledger version 34; an older job's are `config`'s, as they were), whatever the model says now."""
    recorded = job.get("provider_options")
    return dataclasses.replace(
        config,
        provider=job["provider"],
        model=job.get("llm_model") or config.model,
        options=json.loads(recorded) if recorded is not None else config.options,
    )


def sender(job: dict, default_model: str) -> tuple[str, str, str | None]:
    """Where a job was sent (provider, model, recorded provider keys): the jobs polled by one client."""
    return job["provider"], job.get("llm_model") or default_model, job.get("provider_options")
