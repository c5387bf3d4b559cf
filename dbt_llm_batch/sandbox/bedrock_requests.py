"""Amazon Bedrock's requests as the sandbox reads them: a job's input records (validated as a job's
validation step would) and a Converse request, each turned into the Anthropic params that
anthropic_messages.run_request answers (Claude behind Bedrock). Errors are Bedrock's envelopes
(`x-amzn-errortype` and `{"message"}`), raised as server.ApiError.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

from .server import ApiError

MIN_RECORDS = 100
RECORD_ID = re.compile(r"^[A-Za-z0-9]+$")
EXCEPTIONS = {400: "ValidationException", 403: "AccessDeniedException", 404: "ResourceNotFoundException"}
EXCEPTIONS.update({429: "ThrottlingException", 500: "InternalServerException", 503: "ServiceUnavailableException"})


def iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def error(status: int, message: str, type_: str | None = None) -> ApiError:
    type_ = type_ or EXCEPTIONS.get(status, "ValidationException")
    return ApiError(status, message, type_, headers={"x-amzn-errortype": type_})


def records_of(data: bytes) -> tuple[list[dict], str | None]:
    """The input's records, and why validation would fail the job (None: it runs)."""
    records: list[dict] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            return records, f"Invalid JSON in input record at line {n}."
        if not isinstance(record, dict) or not isinstance(record.get("modelInput"), dict):
            return records, f"Input record at line {n} has no modelInput object."
        rid = record.get("recordId")
        if rid is not None and (not isinstance(rid, str) or not RECORD_ID.match(rid)):
            return records, f"Input record at line {n}: recordId must be an alphanumeric string."
        if rid in seen:
            return records, f"Input record at line {n}: duplicate recordId {rid}."
        seen.add(rid or "")
        records.append({"recordId": rid or f"{n:011d}", "modelInput": record["modelInput"]})
    if len(records) < MIN_RECORDS:
        return records, (
            f"The number of records in the input ({len(records)}) is less than the minimum number of records "
            f"per batch inference job ({MIN_RECORDS})."
        )
    return records, None


def converse_params(model: str, body: dict) -> dict:
    """A Converse request as the Anthropic params run_request answers (Claude behind Converse)."""

    def text_blocks(blocks: object, where: str) -> list[dict]:
        if not isinstance(blocks, list):
            raise error(400, f"{where} must be a list")
        out = []
        for b in blocks:
            require(isinstance(b, dict) and isinstance(b.get("text"), str), f"{where}: only text blocks are supported")
            out.append({"type": "text", "text": b["text"]})
        return out

    params: dict[str, Any] = {
        "model": model,
        "max_tokens": (body.get("inferenceConfig") or {}).get("maxTokens", 4096),
        "messages": [
            {"role": m.get("role"), "content": text_blocks(m.get("content"), f"messages.{i}.content")}
            for i, m in enumerate(body["messages"])
        ],
    }
    if body.get("system"):
        params["system"] = text_blocks(body["system"], "system")
    if "temperature" in (body.get("inferenceConfig") or {}):
        params["temperature"] = body["inferenceConfig"]["temperature"]
    tools = body.get("toolConfig")
    if tools:
        specs = [t["toolSpec"] for t in tools.get("tools", []) if "toolSpec" in t]
        params["tools"] = [{"name": s["name"], "input_schema": s["inputSchema"]["json"]} for s in specs]
        choice = tools.get("toolChoice", {}).get("tool")
        if choice:
            params["tool_choice"] = {"type": "tool", "name": choice["name"]}
    return params


def check(value: object, pattern: re.Pattern, name: str) -> None:
    if not isinstance(value, str) or not pattern.match(value):
        raise error(
            400,
            f"1 validation error detected: Value '{value}' at '{name}' failed to satisfy constraint: "
            f"Member must satisfy regular expression pattern: {pattern.pattern.strip('^$')}",
        )


def require(ok: object, message: str) -> None:
    if not ok:
        raise error(400, message)
