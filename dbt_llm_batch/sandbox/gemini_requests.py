"""What one Gemini GenerateContentRequest gets back in the sandbox: its shape checked as the Gemini API
checks it, then the deterministic answer (answers.expected_answer) with usageMetadata.

The checks follow the Gemini API reference (GenerateContentRequest, Content, Part, GenerationConfig)
and the structured-output guide (`responseJsonSchema` takes a JSON Schema subset and needs
`responseMimeType: application/json`). A request that fails one is answered with the status object
the Batch API puts in a result line (`{"code": 400, "message", "status": "INVALID_ARGUMENT"}`).
"""

from __future__ import annotations

import jsonschema

from .answers import answer_for, estimate_input_tokens, simulate

REQUEST_FIELDS = {
    "model",
    "contents",
    "systemInstruction",
    "generationConfig",
    "safetySettings",
    "tools",
    "toolConfig",
    "cachedContent",
}
GENERATION_FIELDS = {
    "maxOutputTokens",
    "temperature",
    "topP",
    "topK",
    "candidateCount",
    "stopSequences",
    "responseMimeType",
    "responseJsonSchema",
    "responseSchema",
    "thinkingConfig",
    "seed",
    "presencePenalty",
    "frequencyPenalty",
    "responseLogprobs",
    "logprobs",
}
MIME_TYPES = ("text/plain", "application/json", "text/x.enum")
# The JSON Schema keywords responseJsonSchema takes (structured-output guide).
SCHEMA_KEYWORDS = {
    "$id",
    "$defs",
    "$ref",
    "$anchor",
    "type",
    "format",
    "title",
    "description",
    "enum",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "anyOf",
    "oneOf",
    "properties",
    "additionalProperties",
    "required",
}
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class BadRequest(ValueError):
    """A request the Gemini API refuses with 400 INVALID_ARGUMENT; the message names the field."""


def status_object(code: int, message: str) -> dict:
    return {"code": code, "message": message, "status": STATUS_NAMES.get(code, "UNKNOWN")}


def _texts(content: object, where: str) -> list[str]:
    if not isinstance(content, dict):
        raise BadRequest(f"Invalid value at '{where}': expected a Content object.")
    parts = content.get("parts")
    if not isinstance(parts, list) or not parts:
        raise BadRequest(f"* GenerateContentRequest.{where}.parts: contents.parts must not be empty.")
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise BadRequest(f"Invalid value at '{where}.parts[{i}]': the sandbox takes text parts only.")
        texts.append(part["text"])
    return texts


def check_schema(schema: object, where: str) -> None:
    if not isinstance(schema, dict):
        raise BadRequest(f"Invalid value at '{where}': expected a JSON Schema object.")

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key not in SCHEMA_KEYWORDS and not path.endswith(("properties", "$defs")):
                    raise BadRequest(f"Invalid JSON schema at '{path}': keyword '{key}' is not supported.")
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")

    walk(schema, where)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise BadRequest(f"Invalid JSON schema at '{where}': {exc.message}") from None


def read_request(request: object) -> tuple[str | None, str, dict | None, int, int | None]:
    """(system, prompt, schema, characters of all text, maxOutputTokens) of a valid request, else BadRequest."""
    if not isinstance(request, dict):
        raise BadRequest("Invalid value at 'request': expected a GenerateContentRequest object.")
    for name in request:
        if name not in REQUEST_FIELDS:
            raise BadRequest(f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.')
    contents = request.get("contents")
    if not isinstance(contents, list) or not contents:
        raise BadRequest("* GenerateContentRequest.contents: contents is not specified")
    chars, prompt = 0, ""
    for i, content in enumerate(contents):
        texts = _texts(content, f"contents[{i}]")
        role = content.get("role", "user")
        if role not in ("user", "model"):
            raise BadRequest(f"Please use a valid role: user, model. (contents[{i}].role is {role!r})")
        chars += sum(map(len, texts))
        if role == "user":
            prompt = "\n".join(texts)
    if contents[-1].get("role", "user") != "user":
        raise BadRequest("Please ensure that the last turn of contents is a user turn.")
    system = None
    if "systemInstruction" in request:
        texts = _texts(request["systemInstruction"], "system_instruction")
        system = "\n".join(texts)
        chars += sum(map(len, texts))
    config = request.get("generationConfig", {})
    if not isinstance(config, dict):
        raise BadRequest("Invalid value at 'generation_config': expected a GenerationConfig object.")
    for name in config:
        if name not in GENERATION_FIELDS:
            raise BadRequest(
                f"Invalid JSON payload received. Unknown name \"{name}\" at 'generation_config': Cannot find field."
            )
    limit = config.get("maxOutputTokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadRequest("* GenerateContentRequest.generation_config.max_output_tokens: must be a positive integer")
    temperature = config.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2):
        raise BadRequest("* GenerateContentRequest.generation_config.temperature: must be between 0 and 2")
    mime = config.get("responseMimeType", "text/plain")
    if mime not in MIME_TYPES:
        raise BadRequest(f"* GenerateContentRequest.generation_config.response_mime_type: {mime!r} is not supported")
    schema = config.get("responseJsonSchema")
    if schema is not None:
        if mime != "application/json":
            raise BadRequest(
                "* GenerateContentRequest.generation_config.response_mime_type: responseJsonSchema needs "
                "response_mime_type application/json"
            )
        check_schema(schema, "generation_config.response_json_schema")
    return system, prompt, schema, chars, limit


def answer(request: object, faults, model: str, response_id: str) -> tuple[dict, dict | None, str]:
    """One request's outcome: ({"response": ...} or {"error": status}, its billed usage or None, prompt)."""
    try:
        system, prompt, schema, chars, limit = read_request(request)
    except BadRequest as exc:
        return {"error": status_object(400, str(exc))}, None, ""
    fault = faults.take_request(prompt)
    if fault and fault["kind"] == "http_error":
        status = fault["status_code"]
        return (
            {"error": status_object(status, fault["message"] or "Sandbox fault injected for this request.")},
            None,
            prompt,
        )
    done = simulate(answer_for(fault, system, prompt, schema), chars, limit)
    usage = {"promptTokenCount": done.prompt_tokens, "candidatesTokenCount": done.completion_tokens}
    body = {
        "candidates": [
            {
                "content": {"parts": [{"text": done.content}], "role": "model"},
                "finishReason": "MAX_TOKENS" if done.truncated else "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            **usage,
            "totalTokenCount": done.prompt_tokens + done.completion_tokens,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": done.prompt_tokens}],
        },
        "modelVersion": model,
        "responseId": response_id,
    }
    return {"response": body}, usage, prompt


def estimate_tokens(request: object) -> int:
    """Input tokens a request would enqueue (for the enqueued-token limit), 0 if it is malformed."""
    try:
        return estimate_input_tokens(read_request(request)[3])
    except BadRequest:
        return 0
