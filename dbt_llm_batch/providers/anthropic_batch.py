"""Anthropic Message Batches, through the official `anthropic` SDK (`client.messages.batches`).

The SDK reads ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL at run time; behaviour follows the Anthropic
Message Batches docs. Differences from OpenAI that shape this module:
requests go inline in the create call (no file upload); results appear only once the whole batch
ended; a batch carries no metadata, so an interrupted submission is recognised by its custom_ids.
"""

from __future__ import annotations

import json
from datetime import datetime

from dbt_llm_batch.providers.base import (
    CUSTOM_ID_MARK,
    PROMPT_MARK,
    REFUSED,
    REJECTED,
    UNRESOLVED,
    BatchProvider,
    BatchState,
    Submission,
    json_object_text,
    spliced_line_sql,
)
from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.sql import literal

TOOL_NAME = "llm_output"
# Anthropic requires max_tokens; used when llm_max_tokens is not set.
DEFAULT_MAX_TOKENS = 1024
# A batch created up to this long before the intent (by the provider's clock) may still be the
# submission's: room for a difference between this machine's clock and the provider's.
CLOCK_GRACE_SECONDS = 3600  # as for OpenAI: custom_ids rule out a wrong batch, so a wide window only holds longer


class AnthropicBatchProvider(BatchProvider):
    name = "anthropic"
    key_env_var = "ANTHROPIC_API_KEY"
    structured_output = "a forced tool's `input_schema`"
    prompt_caching = "`cache_control` on the system and examples prefix (llm_cache_prefix)"
    unfinished_batch = "expires after 24 h; finished requests are returned (and billed), the rest sent again"
    max_requests_per_batch = 100_000
    # 256 MB for the whole create body (Anthropic batch docs), read as decimal megabytes, the lower of
    # the two readings; keep room for the JSON wrapper around the lines.
    max_bytes_per_batch = 256_000_000 - 64 * 1024
    # Batch requests in the processing queue: 100,000 at the lowest published tier.
    max_requests_in_flight = 100_000
    context_windows = {"claude-": 200_000}  # every Claude model (Anthropic's model overview)
    default_output_tokens = DEFAULT_MAX_TOKENS  # what params() sends without llm_max_tokens
    environment_hint = "Anthropic reads ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL from the environment"
    # `stop_reason` of a message (Anthropic Messages API reference). A structured answer is a forced
    # tool call (tool_choice names the one tool; `tools` cannot be set otherwise, see RESERVED_PARAMS),
    # so `tool_use` is the normal end of such an answer: `stop`, as OpenAI's structured answers end.
    finish_reasons = {
        "end_turn": "stop",
        "stop_sequence": "stop",
        "tool_use": "stop",
        "max_tokens": "length",
        "refusal": "content_filter",
        "pause_turn": "pause",
    }

    def __init__(self, config):
        super().__init__(config)
        self._client = None
        # Haiku models need a longer prefix before they cache anything.
        self.min_cacheable_tokens = 2048 if "haiku" in config.model else 1024

    @property
    def client(self):
        if self._client is None:
            import anthropic

            # No SDK retries (it would honour any retry-after, however long): self.calls retries
            # inside the run's budget (calls.py).
            self._client = anthropic.Anthropic(max_retries=0, timeout=120)
        return self._client

    def params(self) -> dict:
        cfg = self.config
        cache = {"type": "ephemeral", "ttl": cfg.cache_prefix} if cfg.cache_prefix else None
        messages = [
            {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in self.render_messages()
        ]
        params: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens or DEFAULT_MAX_TOKENS}
        if cfg.system:
            params["system"] = [{"type": "text", "text": cfg.system}]
        if cache:
            # One breakpoint at the end of the shared prefix (system, then examples), identical in
            # every request of the batch, so every request after the first can read it.
            last = messages[-1]["content"][-1] if messages else params.get("system", [{}])[-1]
            if last:
                last["cache_control"] = cache
        params["messages"] = messages + [{"role": "user", "content": PROMPT_MARK}]
        if cfg.temperature is not None:
            params["temperature"] = cfg.temperature
        schema = cfg.output_json_schema()
        if schema is not None:
            # Structured output as a forced tool call: the tool's input is the answer.
            params["tools"] = [{"name": TOOL_NAME, "description": "Record the answer.", "input_schema": schema}]
            params["tool_choice"] = {"type": "tool", "name": TOOL_NAME}
        params.update(cfg.params)
        return params

    def realtime_body(self) -> dict:
        return self.params()

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.realtime_transport import anthropic_transports

        return anthropic_transports(concurrency=self.config.concurrency)

    def realtime_result_line(self, custom_id, status, text):
        # As a line of the batch results: {"custom_id", "result": {"type": "succeeded", "message"} or
        # {"type": "errored", "error": <the error envelope>}}.
        body = json_object_text(text)
        if status == 200 and body:
            result = f'{{"type":"succeeded","message":{body}}}'
        else:
            error = body or json.dumps(
                {"type": "error", "error": {"type": "api_error", "message": f"HTTP {status}: {text[:500]}"}}
            )
            result = f'{{"type":"errored","error":{error}}}'
        return f'{{"custom_id":{json.dumps(custom_id)},"result":{result}}}'

    def request_line_sql(self) -> str:
        return spliced_line_sql({"custom_id": CUSTOM_ID_MARK, "params": self.params()})

    def create(self, jsonl_path, file_id, token, model_name):
        # The network edge: the SDK takes the requests as a list.
        with open(jsonl_path, encoding="utf-8") as f:
            requests = [json.loads(line) for line in f if line.strip()]
        # Not idempotent: no SDK retry (see OpenAIBatchProvider.create); reconciliation covers a lost response.
        batch = self.client.messages.batches.create(requests=requests)
        return Submission(batch_id=batch.id, status=batch.processing_status)

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        """No metadata on Anthropic batches: a candidate is a batch created since the intent (less
        CLOCK_GRACE_SECONDS) with the same request count that no other job of the ledger owns; once
        it ended, its result custom_ids confirm it (adopted) or rule it out. UNRESOLVED (held) only
        while a candidate has not ended; with none left, None: no batch can be this submission."""
        return self.calls.call("list message batches", lambda: self._find(since_epoch, custom_ids, known_batch_ids))

    def _find(self, since_epoch, custom_ids, known_batch_ids):
        undecided = False
        for batch in self.client.messages.batches.list(limit=100):  # newest first; the SDK pages on
            if _epoch(batch.created_at) < since_epoch - CLOCK_GRACE_SECONDS:
                break
            if batch.id in known_batch_ids:
                continue
            counts = batch.request_counts
            total = counts.processing + counts.succeeded + counts.errored + counts.canceled + counts.expired
            if total != len(custom_ids):
                continue
            if batch.processing_status != "ended":
                undecided = True
                continue
            if batch.archived_at is not None:
                continue  # its results are gone: it can confirm nothing
            try:
                seen = {r.custom_id for r in self.client.messages.batches.results(batch.id)}
            except Exception as exc:
                if status_of(exc) != 404:
                    raise
                continue  # its results are gone: it can confirm nothing
            if seen == custom_ids:
                return Submission(batch_id=batch.id, status=batch.processing_status)
        return UNRESOLVED if undecided else None

    def poll(self, batch_id):
        b = self.calls.call(f"poll batch {batch_id}", lambda: self.client.messages.batches.retrieve(batch_id))
        # `archived_at` set: the results are no longer available (kept 29 days after creation), whatever
        # the results endpoint would answer; treated like its 404.
        return BatchState(
            status=b.processing_status,
            ended=b.processing_status == "ended",
            counts=b.request_counts.model_dump(),
            requests_done=b.request_counts.succeeded
            + b.request_counts.errored
            + b.request_counts.canceled
            + b.request_counts.expired,
            results_gone=b.archived_at is not None,
        )

    def download_results(self, state, batch_id, directory):
        if state.results_gone:  # archived: nothing to fetch
            return []
        path = f"{directory}/{batch_id}-results.jsonl"

        def download():  # a stream cut off midway raises; the retry rewrites the file from the start
            decoder = self.client.messages.batches.results(batch_id)
            try:  # the raw lines, as the provider sent them, are what the ledger stores
                with open(path, "wb") as f:
                    for chunk in decoder.http_response.iter_bytes():
                        f.write(chunk)
            finally:
                decoder.close()

        try:
            self.calls.call(f"download results of {batch_id}", download)
        except Exception as exc:
            if status_of(exc) != 404:
                raise
            state.results_gone = True  # archived: results are kept 29 days after creation
            return []
        return [("results", path)]

    def cancel(self, batch_id):
        return self.client.messages.batches.cancel(batch_id).processing_status

    def delete_files(self, batch_id, file_ids):
        """Requests travel inline and results belong to the batch: deleting the ended batch deletes both."""
        import anthropic

        try:
            self.client.messages.batches.delete(batch_id)
        except anthropic.NotFoundError:
            pass  # already deleted
        return [batch_id]

    result_structure = {
        "custom_id": "VARCHAR",
        "result": {
            "type": "VARCHAR",
            "message": {
                "content": [{"type": "VARCHAR", "text": "VARCHAR", "input": "JSON"}],
                "stop_reason": "VARCHAR",
                "usage": {
                    "input_tokens": "BIGINT",
                    "output_tokens": "BIGINT",
                    "cache_creation_input_tokens": "BIGINT",
                    "cache_read_input_tokens": "BIGINT",
                    "cache_creation": {"ephemeral_5m_input_tokens": "BIGINT", "ephemeral_1h_input_tokens": "BIGINT"},
                },
            },
            "error": {"type": "VARCHAR", "message": "VARCHAR", "error": {"type": "VARCHAR", "message": "VARCHAR"}},
        },
    }

    def outcomes_sql(self, r):
        result, message = f"{r}.result", f"{r}.result.message"
        usage = f"{message}.usage"
        blocks = f"{message}.content"
        if self.config.structured:  # the forced tool call's input is the answer
            answer = f"cast(list_filter({blocks}, lambda b: b.type = 'tool_use')[1].input as varchar)"
        else:
            answer = f"array_to_string(list_transform(list_filter({blocks}, lambda b: b.type = 'text'), lambda b: b.text), '')"
        return f"""
            {r}.custom_id as custom_id,
            case when {message}.stop_reason = 'refusal' then 'error'
                 when {result}.type = 'succeeded' then 'ok' when {result}.type = 'errored' then 'error' else 'void' end
                as outcome,
            case when {result}.type = 'succeeded' then {answer} end as answer,
            {message}.stop_reason as finish_reason,
            coalesce({message}.stop_reason = 'max_tokens', false) as truncated,
            coalesce({result}.error.error.message, {result}.error.message,
                     case when {message}.stop_reason = 'refusal' then 'model refused (stop reason refusal)' end) as error,
            -- Anthropic's input_tokens excludes cache reads and writes: add them back, once each.
            case when {usage} is not null then coalesce({usage}.input_tokens, 0)
                 + coalesce({usage}.cache_creation_input_tokens, 0) + coalesce({usage}.cache_read_input_tokens, 0) end
                as input_tokens,
            {usage}.output_tokens as output_tokens,
            {usage}.cache_read_input_tokens as cached_tokens,
            {usage}.cache_creation_input_tokens as cache_write_tokens,
            -- A refusal, and a request the API rejects as invalid, would come back the same; api_error,
            -- overloaded_error and the like are transient.
            case when {message}.stop_reason = 'refusal' then {literal(REFUSED)}
                 when {result}.error.error.type in ('invalid_request_error', 'not_found_error', 'request_too_large')
                 then {literal(REJECTED)} end as not_retried,
            -- The 1 h TTL's share of the writes (usage.cache_creation), billed at 2x input, not 1.25x.
            case when {usage} is not null then coalesce({usage}.cache_creation.ephemeral_1h_input_tokens, 0) end
                as cache_write_1h_tokens"""


def _epoch(value) -> float:
    return value.timestamp() if isinstance(value, datetime) else datetime.fromisoformat(str(value)).timestamp()
