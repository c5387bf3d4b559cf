"""Request-body validation of both faces: the parameters each provider accepts, and the JSON Schemas
of structured output (OpenAI `response_format`, Anthropic tool `input_schema`).

At the providers an invalid body is a 400 for a realtime call, an error-file line (OpenAI batch) or
an `errored` result (Anthropic batch); the callers turn the exceptions raised here into those.

- The accepted top-level parameters are the installed SDKs' own request types (the SDK is generated
  from the provider's API definition), so a parameter the provider does not know, such as `top_k` at
  OpenAI, is refused as the provider refuses it. Anthropic's sampling parameters (`temperature`,
  `top_p`, `top_k`, documented in the Messages API reference) are accepted even where an SDK no
  longer types them.
- Schemas must be valid JSON Schema (checked with `jsonschema`, draft 2020-12). OpenAI's strict mode
  (`strict: true`) adds its own rules (OpenAI structured outputs guide): the root is an object, every
  object lists all its properties in `required` and sets `additionalProperties: false`, at most 10
  levels of nesting and 5,000 properties, and some keywords are not supported.
"""

from __future__ import annotations

import re
import typing
from functools import cache

import jsonschema

SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Keywords OpenAI's strict mode does not support (OpenAI structured outputs guide, "Supported schemas").
OPENAI_STRICT_UNSUPPORTED = (
    "allOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "patternProperties",
    "unevaluatedProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "unevaluatedItems",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
)
OPENAI_STRICT_MAX_DEPTH = 10
OPENAI_STRICT_MAX_PROPERTIES = 5000
ANTHROPIC_SAMPLING = ("temperature", "top_p", "top_k")


class Invalid(ValueError):
    """A body the provider refuses: `param` names the offending parameter (OpenAI's `param`)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@cache
def openai_chat_params() -> frozenset[str]:
    from openai.types.chat import completion_create_params as p

    return frozenset(typing.get_type_hints(p.CompletionCreateParamsNonStreaming)) | {"stream"}


@cache
def anthropic_message_params() -> frozenset[str]:
    from anthropic.types import message_create_params as p

    return frozenset(typing.get_type_hints(p.MessageCreateParamsNonStreaming)) | {"stream", *ANTHROPIC_SAMPLING}


def _number(body: dict, name: str, low: float, high: float, where: str, integer: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise Invalid(name, f"Invalid '{where}': expected {kind} between {low:g} and {high:g}, got {value!r}.")


# -- OpenAI chat completions ---------------------------------------------------------------------


def check_openai_chat(body: dict) -> None:
    """Raise Invalid for a /v1/chat/completions body OpenAI would refuse (the messages' content and the
    token limits are checked where they are read, answers.chat_inputs)."""
    for name in body:
        if name not in openai_chat_params():
            raise Invalid(None, f"Unrecognized request argument supplied: {name}")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise Invalid("model", "Missing required parameter: 'model'.")
    for i, msg in enumerate(body.get("messages") or []):
        if isinstance(msg, dict) and isinstance(msg.get("role"), str) and msg["role"] not in OPENAI_ROLES:
            raise Invalid(
                f"messages.[{i}].role",
                f"Invalid value: '{msg['role']}'. Supported values are: "
                + ", ".join(f"'{r}'" for r in OPENAI_ROLES)
                + ".",
            )
    _number(body, "temperature", 0, 2, "temperature")
    _number(body, "top_p", 0, 1, "top_p")
    _number(body, "presence_penalty", -2, 2, "presence_penalty")
    _number(body, "frequency_penalty", -2, 2, "frequency_penalty")
    _number(body, "n", 1, 128, "n", integer=True)
    fmt = body.get("response_format")
    if fmt is not None:
        _openai_response_format(fmt)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Invalid("tools", "Invalid type for 'tools': expected an array of objects.")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise Invalid(f"tools[{i}].function", f"Missing required parameter: 'tools[{i}].function.name'.")
            if fn.get("parameters") is not None:
                _openai_schema(
                    fn["parameters"],
                    bool(fn.get("strict")),
                    f"tools[{i}].function.parameters",
                    f"Invalid schema for function '{fn['name']}'",
                )


def _openai_response_format(fmt: object) -> None:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise Invalid(
            "response_format.type",
            f"Invalid value: '{kind}'. Supported values are: 'text', 'json_object', and 'json_schema'.",
        )
    if fmt["type"] != "json_schema":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise Invalid("response_format.json_schema", "Missing required parameter: 'response_format.json_schema'.")
    name = spec.get("name")
    if not isinstance(name, str):
        raise Invalid(
            "response_format.json_schema.name", "Missing required parameter: 'response_format.json_schema.name'."
        )
    if not SCHEMA_NAME.match(name):
        raise Invalid(
            "response_format.json_schema.name",
            f"Invalid 'response_format.json_schema.name': string "
            f"does not match pattern. Expected a string that matches the pattern '{SCHEMA_NAME.pattern}'.",
        )
    if spec.get("schema") is not None:
        _openai_schema(
            spec["schema"],
            spec.get("strict") is True,
            "response_format",
            f"Invalid schema for response_format '{name}'",
        )


def _openai_schema(schema: object, strict: bool, param: str, lead: str) -> None:
    if not isinstance(schema, dict):
        raise Invalid(param, f"{lead}: schema must be a JSON Schema of 'type: \"object\"'.")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise Invalid(param, f"{lead}: {exc.message}") from None
    if strict:
        if schema.get("type") != "object":
            raise Invalid(
                param,
                f"{lead}: schema must be a JSON Schema of 'type: \"object\"', got "
                f"'type: {json_type(schema.get('type'))}'.",
            )
        count = [0]
        _strict(schema, (), count, param, lead)
        if count[0] > OPENAI_STRICT_MAX_PROPERTIES:
            raise Invalid(
                param,
                f"{lead}: a schema may have at most {OPENAI_STRICT_MAX_PROPERTIES} "
                f"properties in total, found {count[0]}.",
            )


def json_type(value: object) -> str:
    return repr(value) if value is not None else "None"


def _strict(node: object, path: tuple, count: list[int], param: str, lead: str) -> None:
    """OpenAI strict-mode rules, recursively (the messages follow OpenAI's own wording)."""
    if not isinstance(node, dict):
        return
    context = f"In context=({', '.join(repr(p) for p in path)})"
    depth = sum(1 for p in path if p == "properties")
    if depth > OPENAI_STRICT_MAX_DEPTH:
        raise Invalid(
            param, f"{lead}: {context}, the schema exceeds the maximum nesting depth of {OPENAI_STRICT_MAX_DEPTH}."
        )
    for keyword in OPENAI_STRICT_UNSUPPORTED:
        if keyword in node:
            raise Invalid(param, f"{lead}: {context}, '{keyword}' is not permitted.")
    declared = node.get("type")
    types = declared if isinstance(declared, list) else [declared]
    if "object" in types or "properties" in node:
        props = node.get("properties") or {}
        count[0] += len(props)
        if node.get("additionalProperties") is not False:
            raise Invalid(
                param, f"{lead}: {context}, 'additionalProperties' is required to be supplied and to be false."
            )
        required = node.get("required") or []
        missing = [name for name in props if name not in required]
        if missing:
            raise Invalid(
                param,
                f"{lead}: {context}, 'required' is required to be supplied and to be an array "
                f"including every key in properties. Missing '{missing[0]}'.",
            )
        for name, sub in props.items():
            _strict(sub, path + ("properties", name), count, param, lead)
    if isinstance(node.get("items"), dict):
        _strict(node["items"], path + ("items",), count, param, lead)
    for keyword in ("anyOf",):
        for i, sub in enumerate(node.get(keyword) or []):
            _strict(sub, path + (keyword, str(i)), count, param, lead)
    for keyword in ("$defs", "definitions"):
        for name, sub in (node.get(keyword) or {}).items():
            _strict(sub, path + (keyword, name), count, param, lead)


# -- Anthropic messages --------------------------------------------------------------------------


def check_anthropic_params(params: dict) -> None:
    """Raise Invalid (param None; the message is Anthropic's `loc: message`) for Messages params the
    provider refuses (model, max_tokens, messages and cache_control are checked where they are read)."""
    for name in params:
        if name not in anthropic_message_params():
            raise Invalid(name, f"{name}: Extra inputs are not permitted")
    for name, high in (("temperature", 1), ("top_p", 1)):
        value = params.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high
        ):
            raise Invalid(name, f"{name}: Input should be less than or equal to {high} and greater than or equal to 0")
    top_k = params.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise Invalid("top_k", "top_k: Input should be a valid integer greater than or equal to 0")
    stops = params.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) for x in stops)):
        raise Invalid("stop_sequences", "stop_sequences: Input should be a valid list of strings")
    tools = params.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Invalid("tools", "tools: Input should be a valid list")
        for i, tool in enumerate(tools):
            _anthropic_tool(tool, i)
    choice = params.get("tool_choice")
    if choice is not None and (
        not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none")
    ):
        raise Invalid(
            "tool_choice",
            "tool_choice: Input tag does not match any of the expected tags: 'auto', 'any', 'tool', 'none'",
        )


def _anthropic_tool(tool: object, i: int) -> None:
    if not isinstance(tool, dict):
        raise Invalid("tools", f"tools.{i}: Input should be a valid dictionary")
    if tool.get("type") not in (None, "custom"):
        return  # a server tool (web search, ...): its own fields, no input_schema
    where = f"tools.{i}.custom"
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise Invalid("tools", f"{where}.name: Field required")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise Invalid("tools", f"{where}.input_schema: Field required")
    if schema.get("type") != "object":
        raise Invalid("tools", f"{where}.input_schema.type: Input should be 'object'")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise Invalid(
            "tools",
            f"{where}.input_schema: JSON schema is invalid. It must match JSON Schema draft "
            f"2020-12 (https://json-schema.org/draft/2020-12). Learn more about tool use at "
            f"https://docs.claude.com/en/docs/tool-use. ({exc.message})",
        ) from None
