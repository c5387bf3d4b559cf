"""OpenAI Files + Batch API, through the official `openai` SDK; also a host of open models that serves
the same API (llm_base_url, llm_api_key_env; what differs per host is in openai_hosts.py).

Without llm_base_url the SDK reads OPENAI_API_KEY and OPENAI_BASE_URL from the environment at run
time, which is also how tests point it at the local emulator. Behaviour follows the OpenAI Batch API docs.
"""

from __future__ import annotations

import os
from typing import Any

from dbt_llm_batch import config_values
from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers import openai_embeddings
from dbt_llm_batch.providers.base import (
    CUSTOM_ID_MARK,
    BatchProvider,
    BatchState,
    Submission,
    line_parts,
    spliced_line_sql,
)
from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.providers.openai_chat import OpenAIChatProvider
from dbt_llm_batch.providers.openai_hosts import HOSTS, host_for

TOKEN_KEY = "dbt_llm_batch_token"  # batch metadata key carrying the ledger's job id
ENDED = ("completed", "failed", "expired", "cancelled")


def upload_name(token: str) -> str:
    """The uploaded request file's name: the job id, so an upload whose id the ledger never learned
    (a run killed right after it) can be found and deleted."""
    return f"dbt_llm_batch-{token}.jsonl"


class OpenAIBatchProvider(OpenAIChatProvider, BatchProvider):
    name = "openai"
    key_env_var = "OPENAI_API_KEY"
    max_requests_per_batch = 50_000
    # "up to 200 MB" (OpenAI Batch API docs): read as decimal megabytes, the lower of the two readings,
    # so a file under it is under the real limit either way.
    max_bytes_per_batch = 200_000_000
    # Enqueued prompt tokens per model: 2,000,000 at usage tier 1 for gpt-4o-mini; going over fails
    # the batch with token_limit_exceeded. Raise llm_max_tokens_in_flight on a higher tier.
    default_max_tokens_in_flight = 2_000_000
    # Context windows (input + output), from OpenAI's model pages. Without llm_max_tokens OpenAI
    # reserves no output in advance (default_output_tokens None), so only the input is checked.
    context_windows = {
        "gpt-4o": 128_000,
        "gpt-4o-mini": 128_000,
        "gpt-4.1": 1_047_576,
        "gpt-4.1-mini": 1_047_576,
        "gpt-4.1-nano": 1_047_576,
    }
    environment_hint = "OpenAI reads OPENAI_API_KEY and OPENAI_BASE_URL from the environment"
    embedding_models = openai_embeddings.OPENAI_MODELS
    # Packing: an embeddings request line carries an array of inputs (see openai_embeddings.py). Under
    # the API's per-request limits, with room for the 4-characters-a-token estimate being low.
    max_inputs_per_line = openai_embeddings.MAX_INPUTS_PER_REQUEST
    max_tokens_per_line = openai_embeddings.MAX_TOKENS_PER_REQUEST // 2
    unfinished_batch = "expires after 24 h; finished requests are returned (and billed), the rest sent again"
    config_keys = {
        key.name: key
        for key in (
            Key(
                "llm_base_url",
                "URL",
                None,
                "the batch API of a host that serves OpenAI's (`https://api.groq.com/openai/v1`); unset: "
                "OPENAI_BASE_URL, else OpenAI",
                default_doc="OpenAI",
            ),
            Key(
                "llm_api_key_env",
                "environment variable name",
                None,
                "the variable holding the host's key (the name, never the key)",
                default_doc="`OPENAI_API_KEY`",
            ),
            Key(
                "llm_batch_host",
                f"one of {', '.join(repr(h) for h in HOSTS)}",
                None,
                "which listed host llm_base_url is (its limits; its models are priced under this name)",
                default_doc="from llm_base_url's host name",
            ),
        )
    }

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        """llm_base_url (an http(s) URL), llm_api_key_env (a variable's NAME) and llm_batch_host (a listed
        host); returns them with the host's name (`host`)."""
        url, key_env, named = values["llm_base_url"], values["llm_api_key_env"], values["llm_batch_host"]
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            errors.append(f"llm_base_url must be an http(s) URL such as 'https://api.groq.com/openai/v1', got {url!r}")
            url = None
        key_env = config_values.key_variable("llm_api_key_env", key_env, errors)
        if named is not None and named not in HOSTS:
            errors.append(f"llm_batch_host must be one of {list(HOSTS)}, got {named!r}")
            named = None
        return {"base_url": url, "api_key_env": key_env, "host": host_for(url, named).name}

    @classmethod
    def price_key(cls, config) -> tuple[str, str]:
        return config.options.get("host") or cls.name, config.model

    @classmethod
    def batch_limits(cls, config) -> tuple[int, int]:
        host = HOSTS.get(config.options.get("host") or "openai")
        if host is None or host.name == "openai":  # OpenAI, or a host not listed: OpenAI's limits, this class's
            return cls.max_requests_per_batch, cls.max_bytes_per_batch
        return host.max_requests_per_batch, host.max_bytes_per_batch

    def __init__(self, config):
        super().__init__(config)
        self._client = None

    @property
    def key_variable(self) -> str:
        return self.config.options.get("api_key_env") or self.key_env_var

    def check_credentials(self) -> None:
        if not os.environ.get(self.key_variable):
            named = " (named by llm_api_key_env)" if self.config.options.get("api_key_env") else ""
            raise ConfigError(
                f"{self.key_variable} is not set{named}: export it in the shell that runs dbt "
                f"(never put the key in dbt config; dbt writes config into target/)"
            )

    @property
    def client(self):
        if self._client is None:
            import openai

            # No SDK retries: self.calls retries inside the run's budget (calls.py). Without
            # llm_base_url the SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself.
            options = self.config.options
            self._client = openai.OpenAI(
                base_url=options.get("base_url"),
                api_key=os.environ.get(self.key_variable) if options.get("api_key_env") else None,
                max_retries=0,
                timeout=120,
            )
        return self._client

    @property
    def endpoint(self) -> str:
        """The batch's endpoint, which every line's `url` must equal."""
        return "/v1" + self.path

    def request_line(self) -> dict:
        return {"custom_id": CUSTOM_ID_MARK, "method": "POST", "url": self.endpoint, "body": self.request_body()}

    def request_line_sql(self) -> str:
        return spliced_line_sql(self.request_line())

    def request_line_parts(self) -> tuple[str, str, str]:
        return line_parts(self.request_line())

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.realtime_transport import openai_transports

        options = self.config.options
        return openai_transports(
            concurrency=self.config.concurrency,
            path=self.path,
            base_url=options.get("base_url"),
            api_key_env=options.get("api_key_env"),
        )

    def upload(self, jsonl_path, token):
        def upload():  # safe to repeat: an unused input file bills nothing
            with open(jsonl_path, "rb") as f:
                return self.client.files.create(file=(upload_name(token), f), purpose="batch")

        return self.calls.call("upload the request file", upload).id

    def create(self, jsonl_path, file_id, token, model_name):
        # `create` is not idempotent: never retried (a retry after a lost response would create and
        # bill a second batch; the client has no SDK retries). A failure here is left to
        # submit.py and reconciliation.
        batch = self.client.batches.create(
            input_file_id=file_id,
            endpoint=self.endpoint,
            completion_window="24h",
            metadata={TOKEN_KEY: token, "dbt_model": model_name[:512]},
        )
        return Submission(batch_id=batch.id, status=batch.status, input_file_id=file_id)

    def find_upload(self, token, since_epoch):
        name = upload_name(token)

        def find():
            # Every page: the Files API's order is not relied on (the SDK pages on).
            for f in self.client.files.list(purpose="batch"):
                if f.filename == name and f.created_at >= since_epoch - 3600:
                    return f.id
            return None

        return self.calls.call("list files", find)

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        return self.calls.call("list batches", lambda: self._find(token, since_epoch))

    def _find(self, token, since_epoch):
        # By the job id in the metadata, or by the input file named after it (a host or an API version
        # that does not keep metadata still keeps the file's name).
        uploaded = None
        for batch in self.client.batches.list(limit=100):  # newest first; the SDK pages on
            if (batch.metadata or {}).get(TOKEN_KEY) == token:
                return Submission(batch_id=batch.id, status=batch.status, input_file_id=batch.input_file_id)
            if batch.created_at < since_epoch - 3600:  # tolerate clock skew
                return None
            if uploaded is None:
                uploaded = self._uploads_named(upload_name(token), since_epoch)
            if batch.input_file_id in uploaded:
                return Submission(batch_id=batch.id, status=batch.status, input_file_id=batch.input_file_id)
        return None

    def _uploads_named(self, name: str, since_epoch: float) -> set[str]:
        return {
            f.id
            for f in self.client.files.list(purpose="batch")
            if f.filename == name and f.created_at >= since_epoch - 3600
        }

    def poll(self, batch_id):
        b = self.calls.call(f"poll batch {batch_id}", lambda: self.client.batches.retrieve(batch_id))
        error, line_errors, token_limit = None, {}, False
        if b.errors and b.errors.data:
            error = "; ".join(f"{e.code}: {e.message}" + (f" (line {e.line})" if e.line else "") for e in b.errors.data)
            # Validation errors that name lines fail those requests alone (the rest are resubmitted).
            # `line` is 1-based, counted over the file we uploaded (the ledger's file_line).
            line_errors = {
                e.line: f"{e.code}: {e.message}" if e.code else e.message for e in b.errors.data if e.line is not None
            }
            token_limit = any(e.code == "token_limit_exceeded" for e in b.errors.data)
        counts = b.request_counts.model_dump() if b.request_counts else {}
        return BatchState(
            status=b.status,
            ended=b.status in ENDED,
            failed=b.status == "failed",
            error=error,
            counts=counts,
            requests_done=(counts.get("completed") or 0) + (counts.get("failed") or 0),
            output_file_id=b.output_file_id,
            error_file_id=b.error_file_id,
            line_errors=line_errors,
            token_limit=token_limit,
        )

    def download_results(self, state, batch_id, directory):
        files = []
        for source, file_id in (("output", state.output_file_id), ("error", state.error_file_id)):
            if file_id:  # a batch whose requests all failed has no output file, one with none failed no error file
                path = os.path.join(directory, f"{batch_id}-{source}.jsonl")
                try:
                    self.calls.call(
                        f"download {source} file of {batch_id}",
                        lambda file_id=file_id, path=path: self.client.files.content(file_id).write_to_file(path),
                    )
                except Exception as exc:
                    if status_of(exc) != 404:
                        raise
                    state.results_gone = True  # deleted (retention ended): the other file still counts
                    continue
                files.append((source, path))
        return files

    def cancel(self, batch_id):
        return self.client.batches.cancel(batch_id).status

    def delete_files(self, batch_id, file_ids):
        import openai

        deleted = []
        for file_id in file_ids:  # the uploaded input, and the output and error files
            try:
                self.client.files.delete(file_id)
            except openai.NotFoundError:
                pass  # already gone (deleted before, or expired after 30 days)
            deleted.append(file_id)
        return deleted
