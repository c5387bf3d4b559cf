"""Per-request rules of the sandbox: what one request line gets back.

- `expected_answer`: the sandbox never calls a model. Each answer is a pure
  function of (system text, user prompt, JSON schema), so tests and dry runs
  can predict every result. The formula is a package contract: other code
  recomputes it, so do not change it.
- `chat_inputs` / `simulate` / `answer_chat_request`: read a chat request,
  bill the answer (about 4 characters per token), cut it at max_tokens, and
  build the chat.completion body. `simulate` and `estimate_input_tokens` are
  provider-neutral: the Anthropic face (anthropic_messages.py) bills with them too.
- `check_lines`: which batch input lines the provider accepts.
- `Faults`: injected failures that replace the normal outcome (an HTTP error
  for a call, an errored or altered answer, a batch failing validation).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone

from .validation import Invalid, check_openai_chat


def expected_answer(system: str | None, prompt: str, schema: dict | None) -> str:
    """The sandbox's answer for one request: a hash-derived placeholder.

    Without a schema: "[sandbox] <16 hex>". With a JSON schema: a compact JSON
    object with one value per top-level property, typed after the property.
    Nested properties (objects, arrays, nullable or `anyOf` types, `format`
    date / date-time / time, each an RFC 3339 value) get values derived from
    the hash and their path: an array has 2 or 3 items, and an optional or
    nullable field is absent or null in about half of the answers, so tests
    see lists and NULLs.
    """
    h = hashlib.sha256(
        json.dumps([system or "", prompt, schema], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()
    if schema is None:
        return f"[sandbox] {h[:16]}"
    out = {}
    for i, (name, prop) in enumerate(schema.get("properties", {}).items()):
        n = int(h[(4 * i) % 60 : (4 * i) % 60 + 4], 16)
        if "enum" in prop:
            out[name] = prop["enum"][n % len(prop["enum"])]
        elif _nested(prop):
            out.update(_field(name, prop, f"{h}/{name}", required=name in schema.get("required", [name])))
        elif prop.get("type") == "integer":
            out[name] = n % 1000
        elif prop.get("type") == "number":
            out[name] = (n % 10000) / 100
        elif prop.get("type") == "boolean":
            out[name] = n % 2 == 1
        else:
            out[name] = f"sandbox-{h[:8]}-{name}"
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def _nested(prop: dict) -> bool:
    """A property the flat rules of expected_answer do not cover (their answers never change)."""
    kind = prop.get("type")
    return (
        "anyOf" in prop
        or isinstance(kind, list)
        or kind in ("object", "array")
        or (kind == "string" and "enum" not in prop and prop.get("format") in ("date", "date-time", "time"))
    )


def _field(name: str, prop: dict, seed: str, required: bool) -> dict:
    """{name: value} for one property, or {} when an optional property is left out."""
    h = hashlib.sha256(seed.encode()).hexdigest()
    options = [p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"]
    declared = options[0].get("type") if options else "null"
    types = declared if isinstance(declared, list) else [declared]
    may_be_null = "anyOf" in prop or "null" in types or not required
    if may_be_null and int(h[:2], 16) % 2 == 0:
        return {name: None} if required else {}
    return {name: _value(options[0] if options else {"type": "null"}, h)}


def _value(prop: dict, h: str) -> object:
    """A value of the (non-null) type of `prop`, derived from the hex digest `h`."""
    declared = prop.get("type")
    kind = next((t for t in (declared if isinstance(declared, list) else [declared]) if t != "null"), "null")
    n = int(h[2:10], 16)
    if "enum" in prop:
        values = [v for v in prop["enum"] if v is not None]
        return values[n % len(values)]
    if kind == "object":
        out: dict = {}
        for key, sub in prop.get("properties", {}).items():
            out.update(_field(key, sub, f"{h}/{key}", required=key in prop.get("required", [])))
        return out
    if kind == "array":
        item = prop.get("items", {})
        return [_value(item, hashlib.sha256(f"{h}[{i}]".encode()).hexdigest()) for i in range(2 + n % 2)]
    if kind == "integer":
        return n % 1000
    if kind == "number":
        return (n % 10000) / 100
    if kind == "boolean":
        return n % 2 == 1
    if kind == "null":
        return None
    if prop.get("format") == "date":
        return (date(2000, 1, 1) + timedelta(days=n % 10000)).isoformat()
    if prop.get("format") == "date-time":
        return (
            (datetime(2000, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=n % 10**9))
            .isoformat()
            .replace("+00:00", "Z")
        )
    if prop.get("format") == "time":
        return f"{n % 24:02d}:{n // 24 % 60:02d}:{n // 1440 % 60:02d}Z"
    return f"sandbox-{h[:8]}"


def answer_for(fault: dict | None, system: str | None, prompt: str, schema: dict | None) -> str:
    """The answer one request gets: the expected answer, unless a `content` fault replaces it or an
    `off_schema` fault breaks it (Faults.REQUEST_KINDS)."""
    if fault and fault["kind"] == "content":
        return fault["content"]
    answer = expected_answer(system, prompt, schema)
    if not fault or fault["kind"] != "off_schema":
        return answer
    value = json.loads(answer)
    props = (schema or {}).get("properties", {})
    if fault["code"] == "wrong_item_type":
        for item in value.values():
            if isinstance(item, list) and item:
                item[0] = "not a number" if isinstance(item[0], (int, float)) else 12345
                break
    else:
        for name, item in value.items():
            sub: dict = next(
                (p for p in props.get(name, {}).get("anyOf", [props.get(name, {})]) if "required" in p), {}
            )
            fields = sub.get("properties", {})
            required = [
                k
                for k in sub.get("required", [])
                if isinstance(item, dict) and k in item and not _nullable(fields.get(k, {}))
            ]
            if required:
                del item[required[0]]
                break
        else:
            value.pop(next(iter(value)), None)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _nullable(prop: dict) -> bool:
    """Whether null is a valid value of `prop` (a type list with 'null', or anyOf with a null branch)."""
    kind = prop.get("type")
    return (isinstance(kind, list) and "null" in kind) or any(p.get("type") == "null" for p in prop.get("anyOf", []))


def count_tokens(chars: int) -> int:
    """Rough tokenizer stand-in: 4 characters per token, rounded up."""
    return math.ceil(chars / 4)


def estimate_input_tokens(chars: int) -> int:
    """Input tokens of a request whose text totals `chars` characters; both faces bill with this."""
    return max(1, count_tokens(chars))


class InvalidBody(ValueError):
    """A request body the provider would reject with a 400 (becomes an error line)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ChatInputs:
    system: str | None
    prompt: str
    schema: dict | None
    prompt_chars: int  # all message text, for prompt_tokens
    max_tokens: int | None
    prefix: list[list[str]] = field(default_factory=list)  # [role, text] of the messages before the last user one


def _text(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts carry text
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise InvalidBody(param, f"Invalid type for '{param}': expected a string or an array of content parts.")


def chat_inputs(body: dict) -> ChatInputs:
    """Read what the answer depends on from a /v1/chat/completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidBody("messages", "Invalid 'messages': expected a non-empty array of messages.")
    texts, system, prompt, last_user = [], [], "", len(messages)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidBody(f"messages.[{i}].role", f"Missing required parameter: 'messages.[{i}].role'.")
        text = _text(msg.get("content"), f"messages.[{i}].content")
        texts.append(text)
        if msg["role"] in ("system", "developer"):
            system.append(text)
        elif msg["role"] == "user":
            prompt, last_user = text, i  # the last user message wins
    schema = None
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidBody(
                "response_format.json_schema", "Invalid 'response_format.json_schema': expected an object."
            )
        schema = spec.get("schema")
    limit = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if limit is None:
        limit, name = body.get("max_tokens"), "max_tokens"
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidBody(name, f"Invalid '{name}': expected an integer of at least 1.")
    prefix = [[m["role"], t] for m, t in zip(messages[:last_user], texts, strict=False)]  # what OpenAI can cache
    return ChatInputs("\n".join(system) if system else None, prompt, schema, sum(map(len, texts)), limit, prefix)


@dataclass
class Completion:
    content: str
    prompt_tokens: int
    completion_tokens: int
    truncated: bool  # True when max_tokens cut the answer (finish_reason "length")
    cached_tokens: int = 0  # part of prompt_tokens served from the prompt cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def simulate(answer: str, prompt_chars: int, max_tokens: int | None) -> Completion:
    """Bill an answer like a model would and cut it off at max_tokens.

    `answer` is normally `expected_answer(...)` but may be replaced by a fault.
    `prompt_chars` is the length of all message text sent in the request.
    """
    completion_tokens = count_tokens(len(answer))
    truncated = False
    if max_tokens is not None and completion_tokens > max_tokens:
        truncated = True
        # A real model stops mid-answer; a cut JSON answer is deliberately
        # left unparseable so clients exercise their "length" handling.
        answer = answer[: max_tokens * 4]
        completion_tokens = max_tokens
    return Completion(answer, estimate_input_tokens(prompt_chars), completion_tokens, truncated)


def answer_chat_request(
    body: dict,
    faults: Faults,
    new_id: Callable[..., str],
    created: int,
    cached_tokens: Callable[[ChatInputs], int] | None = None,
    null_details: bool = False,
) -> tuple[int, dict, Completion | None]:
    """Run one /v1/chat/completions request as the sandbox "model" would.

    Returns (status code, response body, completion or None on error); error
    bodies use the OpenAI envelope. A fault matching the prompt wins over the
    normal answer: it either fails the request or replaces the content.
    `cached_tokens(inputs)` (the face's prompt cache) is asked only for requests that succeed.
    `null_details`: the usage details objects are null (a vLLM server without
    --enable-prompt-tokens-details sends them so).
    """
    try:
        check_openai_chat(body)  # parameters and schemas, as the provider checks them
        ask = chat_inputs(body)
    except (InvalidBody, Invalid) as exc:
        return 400, _error_body(str(exc), "invalid_request_error", exc.param, None), None
    fault = faults.take_request(ask.prompt)
    if fault and fault["kind"] == "http_error":
        status = fault["status_code"]
        return (
            status,
            _error_body(
                fault["message"] or "Sandbox fault injected for this request.",
                fault["type"] or ("server_error" if status >= 500 else "invalid_request_error"),
                fault["param"],
                fault["code"],
            ),
            None,
        )
    answer = answer_for(fault, ask.system, ask.prompt, ask.schema)
    done = simulate(answer, ask.prompt_chars, ask.max_tokens)
    done.cached_tokens = cached_tokens(ask) if cached_tokens else 0
    return (
        200,
        {
            "id": new_id("chatcmpl-", 29),
            "object": "chat.completion",
            "created": created,
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done.content, "refusal": None, "annotations": []},
                    "logprobs": None,
                    "finish_reason": "length" if done.truncated else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.total_tokens,
                "prompt_tokens_details": None if null_details else {"cached_tokens": done.cached_tokens},
                "completion_tokens_details": None if null_details else {"reasoning_tokens": 0},
            },
            "system_fingerprint": "fp_sandbox",
            "service_tier": "default",
        },
        done,
    )


def _error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- batch input lines --------------------------------------------------------------
MAX_REPORTED_LINE_ERRORS = 100  # keep a garbage 50k-line file from producing a 50k-entry batch object


def batch_error(code: str, line: int | None, message: str, param: str | None = None) -> dict:
    """One entry of Batch.errors.data."""
    return {"code": code, "line": line, "message": message, "param": param}


def check_lines(data: bytes, endpoint: str, limit: int) -> tuple[list[dict], list[dict], str | None]:
    """Validate a batch input file -> (errors for Batch.errors.data, good request lines, the model)."""
    numbered = [(n, raw) for n, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
    if not numbered:
        return [batch_error("empty_file", None, "The batch input file is empty.")], [], None
    if len(numbered) > limit:
        message = f"The batch input file contains {len(numbered):,} requests; a batch may contain at most {limit:,}."
        return [batch_error("too_many_requests_in_batch", None, message)], [], None
    errors, requests = [], []
    seen: set[str] = set()
    model: str | None = None
    for n, raw in numbered:
        try:
            line = json.loads(raw)
        except ValueError:
            line = None
        if not isinstance(line, dict):
            errors.append(batch_error("invalid_json_line", n, "This line is not parseable as valid JSON."))
            continue
        body = line["body"] if isinstance(line.get("body"), dict) else {}
        model = model or (body["model"] if isinstance(body.get("model"), str) else None)  # first model wins
        problem = _line_problem(line, endpoint, seen, model)
        if isinstance(line.get("custom_id"), str):
            seen.add(line["custom_id"])
        if problem:
            errors.append(batch_error(problem[0], n, problem[1], problem[2]))
        else:
            requests.append(line)
    return errors[:MAX_REPORTED_LINE_ERRORS], requests, model


def faulted_lines(data: bytes, faults: Faults) -> list[dict]:
    """Batch.errors.data entries for valid lines an `invalid_line` fault rejects (1-based line numbers,
    counted like check_lines: over the file's lines, blank ones included)."""
    errors = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            prompt = chat_inputs(json.loads(raw)["body"]).prompt
        except (ValueError, KeyError, TypeError):
            continue  # check_lines reports it already
        fault = faults.take_invalid_line(prompt)
        if fault:
            errors.append(
                batch_error(
                    fault["code"] or "invalid_request",
                    n,
                    fault["message"] or "This line failed validation: the request body is invalid.",
                    fault["param"],
                )
            )
    return errors[:MAX_REPORTED_LINE_ERRORS]


def _line_problem(line: dict, endpoint: str, seen: set[str], model: str | None) -> tuple[str, str, str] | None:
    """The first reason the provider would reject this line: (code, message, param)."""
    custom_id, body = line.get("custom_id"), line.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "Missing required parameter: 'custom_id'.", "custom_id"
    if line.get("method") != "POST":
        return "invalid_method", "The method for this request must be POST.", "method"
    if line.get("url") != endpoint:
        return "invalid_url", f"The URL for this request does not match the batch endpoint {endpoint}.", "url"
    if not isinstance(body, dict):
        return "invalid_body", "The body of this request must be a JSON object.", "body"
    if not isinstance(body.get("model"), str):
        return "missing_required_parameter", "Missing required parameter: 'body.model'.", "body.model"
    if custom_id in seen:
        return "duplicate_custom_id", "The custom_id for this request is a duplicate of another request.", "custom_id"
    if body["model"] != model:
        return (
            "mismatched_model",
            "The provided model does not match the model of the other requests in the "
            "batch; a batch can only include requests to a single model.",
            "body.model",
        )
    return None


class Faults:
    """Injected failures. `times` counts uses left; None means forever."""

    # "off_schema": the normal answer, broken as `code` says: "missing_required" drops a required
    # field of the first object in it (else its first field), "wrong_item_type" puts a value of the
    # wrong type first in its first list; a model ignoring its schema answers so.
    REQUEST_KINDS = ("http_error", "content", "off_schema")
    OFF_SCHEMA = ("missing_required", "wrong_item_type")
    # "invalid_line": OpenAI validation rejects the lines whose prompt matches (Batch.errors.data
    # entries with their 1-based `line`); the batch ends `failed`. "disconnect": the endpoint drops
    # the connection without answering; "truncate": it answers with half the body, then drops it.
    # "batch_failed": the next batch to leave validation ends `failed` with one Batch.errors.data
    # entry that names no line (`code`, `message`), as for a problem with the file as a whole.
    VALIDATION_KINDS = ("invalid_line",)
    TRANSPORT_KINDS = ("disconnect", "truncate")
    # "proxy_error": a proxy or CDN in front of the API answers `status_code` (default 413) with an
    # HTML page, not the provider's JSON envelope (Anthropic's errors docs: a 413 comes from Cloudflare).
    # `when` ("before" | "after") says whether an endpoint fault fires before the handler runs (nothing
    # happened) or after it (the batch was created, the answer billed; the client still sees the fault).
    ENDPOINT_KINDS = ("http_error", "proxy_error", "disconnect", "truncate")

    def __init__(self) -> None:
        self._items: list[dict] = []
        self._next_id = 1

    def add(
        self,
        *,
        kind: str = "http_error",
        prompt_contains: str | None = None,
        endpoint: str | None = None,
        times: int | None = 1,
        status_code: int | None = None,
        type: str | None = None,
        message: str | None = None,
        code: str | None = None,
        param: str | None = None,
        content: str | None = None,
        retry_after: float | None = None,
        when: str = "before",
        path_contains: str | None = None,
    ) -> dict:
        if kind not in self.REQUEST_KINDS + self.VALIDATION_KINDS + self.ENDPOINT_KINDS + (
            "token_limit",
            "batch_failed",
        ):
            raise ValueError(f"unknown fault kind {kind!r}")
        if path_contains is not None and endpoint is None:  # e.g. one file's id on GET /v1/files/{id}/content
            raise ValueError("'path_contains' narrows an endpoint fault: it needs an 'endpoint'")
        if endpoint is not None and kind not in self.ENDPOINT_KINDS:
            raise ValueError(f"endpoint faults must be one of the kinds {', '.join(self.ENDPOINT_KINDS)}")
        if kind in self.ENDPOINT_KINDS[1:] and endpoint is None:
            raise ValueError(f"a {kind!r} fault needs an 'endpoint'")
        if when not in ("before", "after"):
            raise ValueError("'when' must be 'before' or 'after'")
        if when == "after" and endpoint is None:
            raise ValueError("only an endpoint fault can fire 'after' the handler")
        if kind == "content" and not isinstance(content, str):
            raise ValueError("a 'content' fault needs a string 'content'")
        if kind == "off_schema" and code not in self.OFF_SCHEMA:
            raise ValueError(f"an 'off_schema' fault needs a 'code', one of {', '.join(self.OFF_SCHEMA)}")
        if times is not None and (not isinstance(times, int) or times < 1):
            raise ValueError("'times' must be a positive integer or null")
        if status_code is not None and not 400 <= status_code <= 599:
            raise ValueError("'status_code' must be an HTTP error status (400-599)")
        scope = (
            "endpoint"
            if endpoint
            else {"token_limit": "batch", "invalid_line": "line", "batch_failed": "batch_failure"}.get(kind, "request")
        )
        fault = {
            "id": self._next_id,
            "scope": scope,
            "kind": kind,
            "endpoint": endpoint,
            "path_contains": path_contains,
            "prompt_contains": prompt_contains,
            "times": times,
            "status_code": status_code or (413 if kind == "proxy_error" else 500 if endpoint else 400),
            "type": type,
            "message": message,
            "code": code,
            "param": param,
            "content": content,
            "retry_after": retry_after,
            "when": when,
        }
        self._next_id += 1
        self._items.append(fault)
        return dict(fault)

    def _take(self, match: Callable[[dict], bool]) -> dict | None:
        for fault in self._items:
            if match(fault):
                if fault["times"] is not None:
                    fault["times"] -= 1
                    if fault["times"] == 0:
                        self._items.remove(fault)
                return fault
        return None

    def take_endpoint(self, route_key: str, path: str = "") -> dict | None:
        return self._take(
            lambda f: (
                f["scope"] == "endpoint" and f["endpoint"] in (route_key, "*") and (f["path_contains"] or "") in path
            )
        )

    def take_request(self, prompt: str) -> dict | None:
        return self._take(lambda f: f["scope"] == "request" and (f["prompt_contains"] or "") in prompt)

    def take_invalid_line(self, prompt: str) -> dict | None:
        return self._take(lambda f: f["scope"] == "line" and (f["prompt_contains"] or "") in prompt)

    def take_token_limit(self) -> dict | None:
        return self._take(lambda f: f["scope"] == "batch")

    def take_batch_failure(self) -> dict | None:
        return self._take(lambda f: f["scope"] == "batch_failure")

    def list(self) -> list[dict]:
        return [dict(f) for f in self._items]

    def clear(self) -> None:
        self._items.clear()
