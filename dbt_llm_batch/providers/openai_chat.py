"""OpenAI's chat-completions format, shared by the OpenAI Batch API provider and self-hosted
OpenAI-compatible engines: the request body, a realtime reply as a result line, and how result lines
read. Behaviour follows the OpenAI Chat Completions and Batch API docs (a batch output line is
{"custom_id", "response": {"status_code", "body"}, "error"}).

No batch methods here: a provider with a batch API adds them (OpenAIBatchProvider).
"""

from __future__ import annotations

import json

from dbt_llm_batch.providers.base import PROMPT_MARK, REFUSED, REJECTED, Provider, json_object_text
from dbt_llm_batch.sql import literal


class OpenAIChatProvider(Provider):
    """A provider speaking OpenAI's chat-completions API (abstract: its subclasses say where to send)."""

    # `finish_reason` of a chat completion choice (OpenAI API reference); `function_call` is the
    # deprecated name of `tool_calls`.
    finish_reasons = {
        "stop": "stop",
        "length": "length",
        "content_filter": "content_filter",
        "tool_calls": "tool_call",
        "function_call": "tool_call",
    }

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

    def realtime_body(self) -> dict:
        return self.request_body()

    def realtime_result_line(self, custom_id, status, text):
        # As a line of the batch output file: {"custom_id", "response": {"status_code", "body"}}.
        body = json_object_text(text) or json.dumps({"error": {"message": f"HTTP {status}: {text[:500]}"}})
        return f'{{"custom_id":{json.dumps(custom_id)},"response":{{"status_code":{int(status)},"body":{body}}},"error":null}}'

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
