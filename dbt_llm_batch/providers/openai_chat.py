"""OpenAI's chat-completions format, shared by the OpenAI Batch API provider and self-hosted
OpenAI-compatible engines: the request body, a realtime reply as a result line, and how result lines
read. Behaviour follows the OpenAI Chat Completions and Batch API docs (a batch output line is
{"custom_id", "response": {"status_code", "body"}, "error"}).

No batch methods here: a provider with a batch API adds them (OpenAIBatchProvider).
"""

from __future__ import annotations

import json

from dbt_llm_batch.providers import openai_embeddings
from dbt_llm_batch.providers.base import PROMPT_MARK, REFUSED, REJECTED, Provider, json_object_text
from dbt_llm_batch.sql import literal

# OpenAI structured outputs guide ("Supported schemas"), strict mode: what a schema may use.
STRICT_MAX_DEPTH = 10  # levels of object nesting
STRICT_MAX_PROPERTIES = 5000  # object properties in total
STRICT_MAX_ENUM_VALUES = 1000  # enum values across all enum properties
STRICT_FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
# Keywords the canonical schema may carry that strict mode does not support (strings take only
# `pattern` and `format`).
STRICT_UNSUPPORTED = ("minLength", "maxLength")


def strict_schema(node: dict, required: bool = True) -> dict:
    """The canonical schema in OpenAI's strict form: every object lists all its properties in
    `required` with `additionalProperties: false`; a property the user left optional becomes
    nullable (a type with 'null', or anyOf with null for an object or array), NULL when the model
    has no value for it."""
    out = dict(node)
    declared = out.get("type")
    types = declared if isinstance(declared, list) else [declared]
    kind = next(t for t in types if t != "null")
    if kind == "object":
        optional = set(out["properties"]) - set(out.get("required", []))
        out["properties"] = {n: strict_schema(sub, n not in optional) for n, sub in out["properties"].items()}
        out["required"] = list(out["properties"])
        out["additionalProperties"] = False
    elif kind == "array":
        out["items"] = strict_schema(out["items"])
    if required and "null" not in types:
        return out
    if kind in ("object", "array"):
        out["type"] = kind
        return {"anyOf": [out, {"type": "null"}]}
    out["type"] = [kind, "null"]
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def strict_problems(schema: dict) -> list[str]:
    """Why OpenAI's strict mode would refuse the canonical `schema`, each naming the field and the rule."""
    problems: list[str] = []
    counts = {"properties": 0, "enum": 0}

    def walk(node: dict, where: str, depth: int) -> None:
        rule = "OpenAI strict structured outputs"
        for keyword in STRICT_UNSUPPORTED:
            if keyword in node:
                problems.append(
                    f"{where}: {rule} do not support '{keyword}' (strings take 'pattern' and 'format'): remove it"
                )
        fmt = node.get("format")
        if fmt is not None and fmt not in STRICT_FORMATS:
            problems.append(f"{where}: {rule} do not support format {fmt!r} (supported: {', '.join(STRICT_FORMATS)})")
        counts["enum"] += len([v for v in node.get("enum", []) if v is not None])
        if "properties" in node:
            if depth > STRICT_MAX_DEPTH:
                problems.append(f"{where}: {rule} allow at most {STRICT_MAX_DEPTH} levels of nested objects")
                return
            counts["properties"] += len(node["properties"])
            for name, sub in node["properties"].items():
                walk(sub, f"{where}.{name}" if where else f"llm_output['{name}']", depth + 1)
        if "items" in node:
            walk(node["items"], f"{where}.items", depth)

    walk(schema, "", 1)
    if counts["properties"] > STRICT_MAX_PROPERTIES:
        problems.append(
            f"llm_output: OpenAI strict structured outputs allow at most {STRICT_MAX_PROPERTIES} object "
            f"properties in total, this schema has {counts['properties']}"
        )
    if counts["enum"] > STRICT_MAX_ENUM_VALUES:
        problems.append(
            f"llm_output: OpenAI strict structured outputs allow at most {STRICT_MAX_ENUM_VALUES} enum values "
            f"in total, this schema has {counts['enum']}"
        )
    return problems


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

    structured_output = "JSON Schema in strict mode (`response_format`)"
    prompt_caching = "automatic for a shared prefix (`prompt_cache_key`)"

    @classmethod
    def check_output_schema(cls, schema: dict, errors: list[str]) -> None:
        errors += [f"{p} (llm_provider {cls.name!r})" for p in strict_problems(schema)]

    # Embeddings (llm_task = 'embed') through the same API's /v1/embeddings (openai_embeddings.py).
    has_embeddings = True

    @property
    def path(self) -> str:
        """The API path a request of this model goes to (under /v1)."""
        return "/embeddings" if self.config.embeds else "/chat/completions"

    def request_body(self) -> dict:
        cfg = self.config
        if cfg.embeds:
            return openai_embeddings.request_body(cfg, self.dimensions_param())
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
                "json_schema": {"name": "llm_output", "strict": True, "schema": strict_schema(schema)},
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
                **openai_embeddings.RESULT_STRUCTURE,
            },
        },
        "error": "JSON",
    }

    def outcomes_sql(self, r):
        if self.config.embeds:
            return openai_embeddings.outcomes_sql(r, _error_sql(r))
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
            coalesce({_error_sql(r)},
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


def _error_sql(r: str) -> str:
    """The error text of a result line `r`: the API's error envelope, or the error file's, or an
    OpenAI-compatible server's plain string; NULL for a success."""
    return f"""coalesce({r}.response.body.error.message, json_extract_string({r}.error, '$.message'),
                     case when json_type({r}.error) = 'VARCHAR' then json_extract_string({r}.error, '$') end,
                     case when {r}.response.status_code <> 200 then 'HTTP ' || {r}.response.status_code end)"""
