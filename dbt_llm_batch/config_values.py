"""How each config key's value is validated (the validators config_keys.py's table names).

A validator takes (key name, value with its default filled in, errors), appends one message per
problem to `errors` (all of a model's problems are reported at once) and returns the parsed value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Validator = Callable[[str, Any, list[str]], Any]

# Request parameters the plugin sets itself: `llm_params` may not override them silently.
RESERVED_PARAMS = (
    "model",
    "messages",
    "system",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "response_format",
    "tools",
    "tool_choice",
    "prompt_cache_key",
    "stream",
)
CACHE_TTLS = ("5m", "1h")
OUTPUT_FORMATS = ("columns", "json")
TASKS = ("answer", "embed")  # llm_task: a chat answer per row, or an embedding vector
FALLBACKS = ("realtime",)


def canonical(value: Any) -> Any:
    """`value` with every dict's keys sorted, recursively (lists keep their order).

    dbt's static parser returns a config() dict in a different key order on each full parse (every
    CI checkout does one), so nothing that reaches a request, a fingerprint or the table's shape may
    follow the order a dict arrives in: where order carries no meaning, it is sorted.
    """
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


# --- validators -------------------------------------------------------------------------------------


def _number(types, minimum=None, maximum=None, to=None) -> Validator:
    def parse(name: str, value: Any, errors: list[str]) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, types):
            kind = "an integer" if types is int else "a number"
            errors.append(f"{name} must be {kind}, got {value!r}")
        elif (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            errors.append(f"{name} must be {bounds}, got {value!r}")
        elif to is not None:
            return to(value)
        return value

    return parse


def integer(minimum=None, maximum=None) -> Validator:
    return _number(int, minimum, maximum)


def number(minimum=None, maximum=None) -> Validator:
    return _number((int, float), minimum, maximum, to=float)


def boolean(name: str, value: Any, errors: list[str]) -> Any:
    if not isinstance(value, bool):
        errors.append(f"{name} must be true or false, got {value!r}")
    return value


def choice(*values: str) -> Validator:
    said = " or ".join(repr(v) for v in values) if len(values) == 2 else f"one of {list(values)}"

    def parse(name: str, value: Any, errors: list[str]) -> Any:
        if value is not None and value not in values:
            errors.append(f"{name} must be {said}, got {value!r}")
        return value

    return parse


def text(what: str, blank_ok: bool = True) -> Validator:
    """A string (or unset); `what` says what it must be when it is not."""

    def parse(name: str, value: Any, errors: list[str]) -> Any:
        if value is not None and (not isinstance(value, str) or (not blank_ok and not value.strip())):
            errors.append(f"{name} must be {what}")
        return value

    return parse


def column_name(name: str, value: Any, errors: list[str]) -> Any:
    if not isinstance(value, str) or not value:
        errors.append(f"{name} must be a column name")
    return value


def unique_key(name: str, value: Any, errors: list[str]) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(k, str) for k in value):
        return tuple(value)
    errors.append("unique_key is required: a column name or a list of column names")
    return ()


def model(name: str, value: Any, errors: list[str]) -> Any:
    if not isinstance(value, str) or not value:
        errors.append("llm_model is required (for example llm_model='gpt-4o-mini')")
    return value


def examples(name: str, value: Any, errors: list[str]) -> tuple[tuple[str, str], ...]:
    """A list of {'input': str, 'output': str or dict} pairs (a dict is sent as JSON)."""
    if not isinstance(value, list):
        errors.append("llm_examples must be a list of {'input': ..., 'output': ...} pairs")
        return ()
    pairs = []
    for i, example in enumerate(value):
        if (
            not isinstance(example, dict)
            or set(example) != {"input", "output"}
            or not isinstance(example["input"], str)
        ):
            errors.append(f"llm_examples[{i}] must be a dict with exactly 'input' (a string) and 'output'")
            continue
        output = example["output"]
        if not isinstance(output, str):  # keys sorted, like the output schema's properties (see canonical)
            output = json.dumps(output, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        pairs.append((example["input"], output))
    return tuple(pairs)


def cache_prefix(name: str, value: Any, errors: list[str]) -> str | None:
    """None, or the TTL of the cached system + examples prefix."""
    if value is True:
        return "5m"
    if value is False:
        return None
    if value not in CACHE_TTLS:
        errors.append(f"llm_cache_prefix must be true, false, '5m' or '1h', got {value!r}")
    return value


def params(name: str, value: Any, errors: list[str]) -> dict:
    if not isinstance(value, dict):
        errors.append("llm_params must be a dict of extra request parameters")
        return {}
    params = canonical(value)
    for reserved in RESERVED_PARAMS:
        if reserved in params:
            errors.append(f"llm_params may not set '{reserved}': use the llm_* key for it instead")
    return params


def concurrency(name: str, value: Any, errors: list[str]) -> Any:
    return value if value == "auto" else integer(1, 1024)(name, value, errors)


def dedup(name: str, value: Any, errors: list[str]) -> Any:
    """'model', 'ledger', None (one request per row), or unset (None, decided with llm_temperature)."""
    if value is True or value == "model":
        return "model"
    if value is False:
        return False
    if value is None or value == "ledger":
        return value
    errors.append(f"llm_dedup must be true, false or 'ledger', got {value!r}")
    return False


def realtime_when(name: str, value: Any, errors: list[str]) -> Any:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        errors.append(
            "llm_realtime_when must be a SQL boolean expression over the model's columns, e.g. \"priority = 'urgent'\""
        )
    return value


# on_schema_change (pipeline/schema_change.py): dbt's values. dbt sets 'ignore' on every model that
# does not set the key, so it cannot mean "leave the table as it is" here: it is read as the default.
SCHEMA_CHANGE_POLICIES = ("append_new_columns", "sync_all_columns", "fail")


def schema_change(name: str, value: Any, errors: list[str]) -> Any:
    if value is None or value == "ignore":
        return "append_new_columns"
    if value not in SCHEMA_CHANGE_POLICIES:
        errors.append(f"{name} must be one of {list(SCHEMA_CHANGE_POLICIES)}, got {value!r}")
    return value


def key_variable(name: str, value: Any, errors: list[str]) -> str | None:
    """The NAME of the environment variable that holds a key (llm_api_key_env), never the key. A value
    that looks like a key (long, with lower-case letters and digits, as keys are and variable names are
    not) is refused without being repeated: the message goes to the run log."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.isidentifier():
        errors.append(
            f"{name} must be the NAME of an environment variable (never the key), got a {type(value).__name__}"
        )
        return None
    if len(value) >= 20 and any(c.isdigit() for c in value) and any(c.islower() for c in value):
        errors.append(
            f"{name} looks like an API key, not the NAME of an environment variable: export the key as a "
            f"variable (export GROQ_API_KEY=...) and set {name} = 'GROQ_API_KEY'. The key is in your dbt "
            "project now, and dbt writes config into target/: rotate it"
        )
        return None
    return value
