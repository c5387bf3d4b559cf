"""The providers' realtime endpoints in the sandbox: OpenAI `POST /v1/chat/completions` and Anthropic
`POST /v1/messages`. Same answers, usage, caching and per-request faults as a batch line gets, but
answered synchronously with the provider's HTTP status and error envelope, and billed at once.

Every answered (billed) prompt is counted in `Counters.realtime_prompts`, so tests can prove a row
was asked exactly once across crashes and reruns.
"""

from __future__ import annotations

from .answers import answer_chat_request, chat_inputs
from .anthropic_messages import STATUS_TYPES, BadParams, read_params, run_request
from .caching import openai_cached_tokens
from .embeddings import answer_embeddings_request
from .server import ApiError, Reply, Request, _json_bytes

STATUS_OF_TYPE = {type_: status for status, type_ in STATUS_TYPES.items()}


def openai_chat_completion(face, req: Request) -> Reply:
    body, emu = req.json(), face.emu
    if not isinstance(body, dict):
        raise ApiError(400, "We could not parse the JSON body of your request.")
    now = emu.now()
    status, payload, done = answer_chat_request(
        body,
        emu.fault_book,
        face._id,
        int(now),
        lambda ask: openai_cached_tokens(
            emu.prompt_cache, body.get("model"), ask, emu.min_cache_tokens, now, emu.openai_cache_ttl_seconds
        ),
        emu.null_usage_details,
    )
    if done is not None:
        tokens = {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "cached_tokens": done.cached_tokens,
        }
        emu.counters.add_usage(face.name, **tokens)
        emu.counters.realtime_answered(face.name, chat_inputs(body).prompt, body, tokens)
    # Providers send retry-after with 429 and 5xx (both SDKs honour it).
    headers = {"retry-after": "1"} if status == 429 or status >= 500 else {}
    return Reply(status, _json_bytes(payload), headers=headers)


def openai_embeddings(face, req: Request) -> Reply:
    """POST /v1/embeddings: answered at once, billed per call (its texts counted one by one)."""
    body, emu = req.json(), face.emu
    if not isinstance(body, dict):
        raise ApiError(400, "We could not parse the JSON body of your request.")
    status, payload, _ = answer_embeddings_request(
        body, emu.fault_book, lambda texts, tokens: emu.counters.embedded("realtime", texts, body, tokens)
    )
    headers = {"retry-after": "1"} if status == 429 or status >= 500 else {}
    return Reply(status, _json_bytes(payload), headers=headers)


def anthropic_create_message(face, req: Request) -> dict:
    params, emu = req.json(), face.emu
    result, usage = run_request(
        params, emu.fault_book, emu.prompt_cache, emu.min_cache_tokens, emu.now(), face._id, emu.null_usage_details
    )
    if result["type"] != "succeeded":
        error = result["error"]["error"]
        status = STATUS_OF_TYPE.get(error["type"], 400)
        raise ApiError(
            status,
            error["message"],
            error["type"],
            headers={"retry-after": "1"} if status == 429 or status >= 500 else None,
        )
    assert usage is not None  # a succeeded request has usage
    usage["service_tier"] = "standard"
    tokens = {
        k: usage[k] or 0
        for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    }
    emu.counters.add_usage(face.name, **tokens)
    try:
        emu.counters.realtime_answered(face.name, read_params(params).prompt, params, tokens)
    except BadParams:  # cannot happen for a request that succeeded; keeps the count honest if it did
        pass
    return result["message"]
