"""OpenAI Files + Batch API, through the official `openai` SDK.

The SDK reads OPENAI_API_KEY and OPENAI_BASE_URL from the environment at run time, which is also how
tests point it at the local emulator. Behaviour follows the OpenAI Batch API docs.
"""

from __future__ import annotations

import json
import os

from dbt_llm_batch.providers.base import (
    CUSTOM_ID_MARK,
    PROMPT_MARK,
    REFUSED,
    REJECTED,
    BatchProvider,
    BatchState,
    Submission,
    json_object_text,
    spliced_line_sql,
)
from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.sql import literal

ENDPOINT = "/v1/chat/completions"
TOKEN_KEY = "dbt_llm_batch_token"  # batch metadata key carrying the ledger's job id
ENDED = ("completed", "failed", "expired", "cancelled")


def upload_name(token: str) -> str:
    """The uploaded request file's name: the job id, so an upload whose id the ledger never learned
    (a run killed right after it) can be found and deleted."""
    return f"dbt_llm_batch-{token}.jsonl"


class OpenAIBatchProvider(BatchProvider):
    name = "openai"
    key_env_var = "OPENAI_API_KEY"
    max_requests_per_batch = 50_000
    # "up to 200 MB" (OpenAI Batch API docs): read as decimal megabytes, the lower of the two readings,
    # so a file under it is under the real limit either way.
    max_bytes_per_batch = 200_000_000
    # Enqueued prompt tokens per model: 2,000,000 at usage tier 1 for gpt-4o-mini; going over fails
    # the batch with token_limit_exceeded. Raise llm_max_tokens_in_flight on a higher tier.
    default_max_tokens_in_flight = 2_000_000

    def __init__(self, config):
        super().__init__(config)
        self._client = None

    @property
    def client(self):
        if self._client is None:
            import openai

            # No SDK retries: self.calls retries inside the run's budget (calls.py).
            self._client = openai.OpenAI(max_retries=0, timeout=120)
        return self._client

    def request_body(self) -> dict:
        cfg = self.config
        # System and examples first and identical in every request: OpenAI caches such a prefix
        # automatically; prompt_cache_key keeps the batch's requests on the same cache.
        messages = (
            ([{"role": "system", "content": cfg.system}] if cfg.system else [])
            + self.render_messages()
            + [{"role": "user", "content": PROMPT_MARK}]
        )
        body: dict = {"model": cfg.model, "messages": messages}
        if cfg.cache_prefix:
            body["prompt_cache_key"] = "dbt-llm-batch-" + cfg.fingerprint_prefix()[:32]
        if cfg.max_tokens is not None:
            body["max_completion_tokens"] = cfg.max_tokens
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        schema = cfg.output_json_schema()
        if schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "llm_output", "strict": True, "schema": schema},
            }
        body.update(cfg.params)
        return body

    def request_line_sql(self) -> str:
        return spliced_line_sql(
            {"custom_id": CUSTOM_ID_MARK, "method": "POST", "url": ENDPOINT, "body": self.request_body()}
        )

    def realtime_body(self) -> dict:
        return self.request_body()

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.realtime_transport import openai_transports

        return openai_transports(concurrency=self.config.concurrency)

    def realtime_result_line(self, custom_id, status, text):
        # As a line of the batch output file: {"custom_id", "response": {"status_code", "body"}}.
        body = json_object_text(text) or json.dumps({"error": {"message": f"HTTP {status}: {text[:500]}"}})
        return f'{{"custom_id":{json.dumps(custom_id)},"response":{{"status_code":{int(status)},"body":{body}}},"error":null}}'

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
            endpoint=ENDPOINT,
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
        for batch in self.client.batches.list(limit=100):  # newest first; the SDK pages on
            if (batch.metadata or {}).get(TOKEN_KEY) == token:
                return Submission(batch_id=batch.id, status=batch.status, input_file_id=batch.input_file_id)
            if batch.created_at < since_epoch - 3600:  # tolerate clock skew
                return None
        return None

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
            error=error,
            counts=counts,
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

    # One parse per result line (json_transform), then cheap struct access. `error` stays JSON: the
    # error file has an object there, an OpenAI-compatible server may put a plain string.
    result_structure = {
        "custom_id": "VARCHAR",
        "response": {
            "status_code": "INTEGER",
            "body": {
                "choices": [{"finish_reason": "VARCHAR", "message": {"content": "VARCHAR", "refusal": "VARCHAR"}}],
                "usage": {
                    "prompt_tokens": "BIGINT",
                    "completion_tokens": "BIGINT",
                    "prompt_tokens_details": {"cached_tokens": "BIGINT", "cache_write_tokens": "BIGINT"},
                },
                "error": {"message": "VARCHAR", "code": "VARCHAR"},
            },
        },
        "error": "JSON",
    }

    def outcomes_sql(self, r):
        body, choice = f"{r}.response.body", f"{r}.response.body.choices[1]"
        error_code = f"coalesce(json_extract_string({r}.error, '$.code'), {body}.error.code)"
        return f"""
            {r}.custom_id as custom_id,
            case when {error_code} = 'batch_expired' then 'void'
                 when {r}.response.status_code = 200 and {choice}.message.content is not null then 'ok'
                 else 'error' end as outcome,
            {choice}.message.content as answer,
            {choice}.finish_reason as finish_reason,
            coalesce({choice}.finish_reason = 'length', false) as truncated,
            coalesce({body}.error.message, json_extract_string({r}.error, '$.message'),
                     case when json_type({r}.error) = 'VARCHAR' then json_extract_string({r}.error, '$') end,
                     case when {choice}.message.refusal is not null then 'model refused: ' || {choice}.message.refusal end,
                     case when {r}.response.status_code <> 200 then 'HTTP ' || {r}.response.status_code end) as error,
            {body}.usage.prompt_tokens as input_tokens,
            {body}.usage.completion_tokens as output_tokens,
            {body}.usage.prompt_tokens_details.cached_tokens as cached_tokens,
            {body}.usage.prompt_tokens_details.cache_write_tokens as cache_write_tokens,
            -- A refusal, and a request the API rejects (400 invalid_request_error, 404 unknown model,
            -- 413 too large, 422), would come back the same; 408, 409, 429 and 5xx are transient.
            case when {choice}.message.refusal is not null and {choice}.message.content is null then {literal(REFUSED)}
                 when {r}.response.status_code in (400, 404, 413, 422) then {literal(REJECTED)} end as not_retried,
            null::bigint as cache_write_1h_tokens"""
