"""The sandbox's `/v1/embeddings` (realtime, and as a batch endpoint): what one request gets back.

Vectors are a pure function of (model, text): the same text always gets the same vector (near texts
are not made near). The models' rules are the real ones (OpenAI embeddings guide and API reference):
text-embedding-3-* take `dimensions` up to their native size, ada-002 refuses it; `input` is a string
or an array of at most 2,048 non-empty strings; usage counts the inputs' tokens (4 characters a token,
as the chat face bills), and there are no output tokens.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable

from .answers import Faults, estimate_input_tokens

MODELS = {  # native size, takes `dimensions`
    "text-embedding-3-small": (1536, True),
    "text-embedding-3-large": (3072, True),
    "text-embedding-ada-002": (1536, False),
}
MAX_INPUTS = 2048


def vector(model: str, text: str, size: int) -> list[float]:
    """The deterministic unit vector of `text` (the sandbox's contract: tests recompute it)."""
    seed = int.from_bytes(hashlib.sha256(f"{model}\x00{text}".encode()).digest()[:8], "big")
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) for _ in range(size)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]


def inputs_of(body: dict) -> list[str]:
    """The texts a request embeds (raises ValueError with the API's message when it would refuse them)."""
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("'input' must be a non-empty string or an array of non-empty strings.")
    if len(texts) > MAX_INPUTS:
        raise ValueError(f"'input' may contain at most {MAX_INPUTS} items, got {len(texts)}.")
    if any(not t for t in texts):
        raise ValueError("'input' cannot contain an empty string.")
    return texts


def answer_embeddings_request(
    body: dict, faults: Faults, bill: Callable[[list[str], int], None]
) -> tuple[int, dict, int | None]:
    """Run one /v1/embeddings request: (status, response body, billed prompt tokens or None on error).
    `bill(texts, tokens)` is called once for a request that is answered (and so billed)."""

    def refuse(status: int, message: str, param: str | None, code: str | None = None):
        type_ = "invalid_request_error"
        return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}, None

    model = body.get("model")
    if model not in MODELS:
        return refuse(
            404, f"The model `{model}` does not exist or you do not have access to it.", None, "model_not_found"
        )
    native, shortenable = MODELS[model]
    try:
        texts = inputs_of(body)
    except ValueError as exc:
        return refuse(400, str(exc), "input")
    size = native
    if "dimensions" in body:
        dims = body["dimensions"]
        if not shortenable:
            return refuse(400, "This model does not support specifying dimensions.", "dimensions")
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= native:
            return refuse(400, f"Invalid 'dimensions': must be an integer from 1 to {native}.", "dimensions")
        size = dims
    if body.get("encoding_format", "float") not in ("float", "base64"):
        return refuse(400, "Invalid 'encoding_format': expected 'float' or 'base64'.", "encoding_format")
    for text in texts:  # a fault set on one text fails the request that carries it
        fault = faults.take_request(text)
        if fault and fault["kind"] == "http_error":
            status = fault["status_code"]
            type_ = fault["type"] or ("server_error" if status >= 500 else "invalid_request_error")
            message = fault["message"] or "Sandbox fault injected for this request."
            return (
                status,
                {"error": {"message": message, "type": type_, "param": fault["param"], "code": fault["code"]}},
                None,
            )
    tokens = sum(estimate_input_tokens(len(t)) for t in texts)
    bill(texts, tokens)
    data = [{"object": "embedding", "index": i, "embedding": vector(model, t, size)} for i, t in enumerate(texts)]
    return (
        200,
        {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
        tokens,
    )
