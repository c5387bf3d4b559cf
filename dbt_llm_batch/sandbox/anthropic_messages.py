"""What one Anthropic batch request gets back: the `result` of its results line.

Batch `params` are checked only here, when the request is processed (the
provider validates them asynchronously): bad params give an `errored` result.

- Answer: `expected_answer(system, prompt, schema)` where system is the text of
  `params.system`, prompt the text of the LAST user message and schema the
  `input_schema` of the tool forced by `tool_choice: {"type": "tool", "name": N}`.
  Text answers are a text block (stop_reason "end_turn"), forced-tool answers a
  tool_use block (stop_reason "tool_use"); over `max_tokens` the text is cut at
  max_tokens*4 characters (an incomplete tool call has input {}) and
  stop_reason is "max_tokens".
- Usage: total input = estimate_input_tokens(characters of the system text and
  all message text), as for OpenAI. The cacheable prefix runs from the system
  blocks through the message blocks up to and including the LAST block with
  `cache_control`; when ceil(its characters / 4) >= the model's minimum
  (caching.min_cache_tokens), the first
  request with that (model, tools, tool_choice, prefix) writes the cache
  (cache_creation_input_tokens) and later ones within the TTL read it
  (cache_read_input_tokens); `input_tokens` is the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .answers import Faults, answer_for, count_tokens, simulate
from .caching import PromptCache, min_cache_tokens
from .validation import Invalid, check_anthropic_params

CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CACHE_TTLS = {"5m": 300, "1h": 3600}
MAX_CACHE_BREAKPOINTS = 4
STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type_for(status: int) -> str:
    return STATUS_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class BadParams(ValueError):
    """Params the provider rejects; the message is the errored line's message."""


@dataclass
class Ask:
    model: str
    system: str | None
    prompt: str
    tool: str | None  # the forced tool's name
    schema: dict | None
    total_chars: int
    max_tokens: int
    prefix_chars: int = 0
    prefix_key: str | None = None  # None: nothing marked for caching
    ttl: str = "5m"


def _blocks(content: object, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    raise BadParams(f"{where}: Input should be a valid string or a list of content blocks")


def _text(blocks: list[dict]) -> str:
    return "\n".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))


def _int(params: dict, name: str) -> int:
    value = params.get(name)
    if value is None:
        raise BadParams(f"{name}: Field required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadParams(f"{name}: Input should be a valid integer")
    if value < 1:
        raise BadParams(f"{name}: Input should be greater than or equal to 1")
    return value


def read_params(params: dict) -> Ask:
    """Check one request's params as the provider would and read what the answer depends on."""
    try:
        check_anthropic_params(params)
    except Invalid as exc:
        raise BadParams(str(exc)) from None
    if not isinstance(params.get("model"), str) or not params["model"]:
        raise BadParams("model: Field required")
    max_tokens = _int(params, "max_tokens")
    if params.get("stream"):
        raise BadParams("stream: Streaming is not supported in the Message Batches API")
    messages = params.get("messages")
    if messages is None:
        raise BadParams("messages: Field required")
    if not isinstance(messages, list) or not messages:
        raise BadParams("messages: List should have at least 1 item after validation, not 0")
    containers = []  # (where, role, blocks): the system, then each message, in prompt order
    if params.get("system") is not None:
        containers.append(("system", "system", _blocks(params["system"], "system")))
    prompt = ""
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise BadParams(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        if "content" not in msg:
            raise BadParams(f"messages.{i}.content: Field required")
        blocks = _blocks(msg["content"], f"messages.{i}.content")
        containers.append((f"messages.{i}", msg["role"], blocks))
        if msg["role"] == "user":
            prompt = _text(blocks)
    tool, schema = _forced_tool(params)
    system = _text(containers[0][2]) if params.get("system") is not None else None
    ask = Ask(params["model"], system, prompt, tool, schema, sum(len(_text(c[2])) for c in containers), max_tokens)
    _read_cache_control(ask, params, containers)
    return ask


def _forced_tool(params: dict) -> tuple[str | None, dict | None]:
    choice, tools = params.get("tool_choice"), params.get("tools") or []
    if not isinstance(choice, dict) or choice.get("type") != "tool":
        return None, None
    name = choice.get("name")
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and tool.get("name") == name:
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise BadParams(f"tools.{tools.index(tool)}.input_schema: Field required")
            return name, schema
    raise BadParams(f"tool_choice: Tool '{name}' not found in the provided tools")


def _read_cache_control(ask: Ask, params: dict, containers: list[tuple[str, str, list[dict]]]) -> None:
    marks = [
        (ci, bi)
        for ci, (_, _, blocks) in enumerate(containers)
        for bi, b in enumerate(blocks)
        if b.get("cache_control") is not None
    ]
    if not marks:
        return
    if len(marks) > MAX_CACHE_BREAKPOINTS:
        raise BadParams(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {len(marks)}."
        )
    for ci, bi in marks:
        control = containers[ci][2][bi]["cache_control"]
        where = containers[ci][0] + (f".{bi}" if ci == 0 and containers[0][0] == "system" else f".content.{bi}")
        where += ".cache_control"
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise BadParams(f"{where}.type: Input should be 'ephemeral'")
        if control.get("ttl", "5m") not in CACHE_TTLS:
            raise BadParams(f"{where}.ttl: Input should be '5m' or '1h'")
    last_ci, last_bi = marks[-1]
    ask.ttl = containers[last_ci][2][last_bi]["cache_control"].get("ttl", "5m")
    cut = [
        (where, role, blocks if ci < last_ci else blocks[: last_bi + 1])
        for ci, (where, role, blocks) in enumerate(containers[: last_ci + 1])
    ]
    ask.prefix_chars = sum(len(_text(blocks)) for _, _, blocks in cut)
    bare = [[role, [{k: v for k, v in b.items() if k != "cache_control"} for b in blocks]] for _, role, blocks in cut]
    ask.prefix_key = json.dumps(
        ["anthropic", ask.model, params.get("tools"), params.get("tool_choice"), bare],
        sort_keys=True,
        ensure_ascii=False,
    )


def cache_usage(ask: Ask, total: int, cache: PromptCache, min_tokens: int | None, now: float) -> dict:
    """The usage fields about input, with the prompt cache read or written as the provider would."""
    usage: dict[str, Any] = {
        "input_tokens": total,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
    }
    prefix = count_tokens(ask.prefix_chars)
    if ask.prefix_key is None or prefix < min_cache_tokens("anthropic", ask.model, min_tokens):
        return usage
    if cache.use(ask.prefix_key, now, CACHE_TTLS[ask.ttl]):
        usage["cache_read_input_tokens"] = prefix
    else:
        usage["cache_creation_input_tokens"] = prefix
        usage["cache_creation"][f"ephemeral_{ask.ttl}_input_tokens"] = prefix
    usage["input_tokens"] = total - prefix
    return usage


def errored(type_: str, message: str, new_id: Callable[..., str]) -> dict:
    return {
        "type": "errored",
        "error": {"type": "error", "error": {"type": type_, "message": message}, "request_id": new_id("req_011C", 20)},
    }


def run_request(
    params: object,
    faults: Faults,
    cache: PromptCache,
    min_tokens: int | None,
    now: float,
    new_id: Callable[..., str],
    null_details: bool = False,
) -> tuple[dict, dict | None]:
    """Process one request -> (its `result` object, its billed usage or None when not billed).
    `null_details`: the cache_* usage fields are null (the SDK types them optional; a vLLM server's
    Anthropic endpoint leaves them so)."""
    try:
        if not isinstance(params, dict):
            raise BadParams("params: Input should be a valid dictionary")
        ask = read_params(params)
    except BadParams as exc:
        return errored("invalid_request_error", str(exc), new_id), None
    fault = faults.take_request(ask.prompt)
    if fault and fault["kind"] == "http_error":
        status = fault["status_code"]
        return errored(
            fault["type"] or error_type_for(status),
            fault["message"] or "Sandbox fault injected for this request.",
            new_id,
        ), None
    answer = answer_for(fault, ask.system, ask.prompt, ask.schema)
    done = simulate(answer, ask.total_chars, ask.max_tokens)
    content: list[dict[str, Any]] = [{"type": "text", "text": done.content}]
    stop = "end_turn"
    if ask.tool is not None:
        try:
            tool_input = {} if done.truncated else json.loads(done.content)
        except ValueError:
            tool_input = None
        if isinstance(tool_input, dict):  # a content fault that is not a JSON object stays text
            content = [{"type": "tool_use", "id": new_id("toolu_01", 22), "name": ask.tool, "input": tool_input}]
            stop = "tool_use"
    if done.truncated:
        stop = "max_tokens"
    usage: dict[str, Any] = {
        **cache_usage(ask, done.prompt_tokens, cache, min_tokens, now),
        "output_tokens": done.completion_tokens,
        "service_tier": "batch",
    }
    if null_details:
        usage.update(cache_creation_input_tokens=None, cache_read_input_tokens=None, cache_creation=None)
    message = {
        "id": new_id("msg_01", 22),
        "type": "message",
        "role": "assistant",
        "model": ask.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    return {"type": "succeeded", "message": message}, usage
