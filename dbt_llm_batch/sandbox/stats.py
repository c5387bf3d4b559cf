"""Call and usage statistics of the sandbox (Emulator.stats() and GET /_emulator/stats)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

USAGE_KEYS = {
    "openai": ("prompt_tokens", "completion_tokens", "cached_tokens"),
    "azure_openai": ("prompt_tokens", "completion_tokens", "cached_tokens"),
    "anthropic": ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
    "bedrock": ("input_tokens", "output_tokens"),
    "gemini": ("promptTokenCount", "candidatesTokenCount"),
}


class Counters:
    """What clients did, for tests and for people watching the sandbox.

    Billed usage only (succeeded requests); `usage` keeps the OpenAI totals it
    always had, `usage_by_face` has each face's own fields.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.files_uploaded = self.batches_created = self.request_lines = 0
        self.batches_by_face: Counter[str] = Counter()
        self.usage = {face: dict.fromkeys(keys, 0) for face, keys in USAGE_KEYS.items()}
        self.creation_order: dict[str, int] = {}  # batch id -> sequence, to list both faces newest first
        self.realtime_requests: Counter[str] = Counter()  # billed realtime answers per face
        self.realtime_prompts: Counter[tuple[str, str]] = Counter()  # (face, prompt) -> billed answers
        # Every billed request, batch line or realtime call, in billing order (Emulator.billed()).
        self.billed: list[dict] = []
        # Embeddings: how often each text was billed, and the request lines (or calls) that carried them.
        self.embedded_texts: Counter[str] = Counter()
        self.embedding_requests = 0

    def new_batch(self, face: str, batch_id: str, request_lines: int) -> None:
        self.batches_created += 1
        self.batches_by_face[face] += 1
        self.request_lines += request_lines
        self.creation_order[batch_id] = len(self.creation_order)

    def add_usage(self, face: str, **tokens: int) -> None:
        for key, value in tokens.items():
            self.usage[face][key] += value

    def realtime_answered(self, face: str, prompt: str, request: dict, usage: dict[str, int]) -> None:
        self.realtime_requests[face] += 1
        self.realtime_prompts[(face, prompt)] += 1
        self.bill(face, "realtime", prompt, request, usage)

    def bill(
        self,
        face: str,
        via: str,
        prompt: str,
        request: dict,
        usage: dict[str, int],
        batch_id: str | None = None,
        custom_id: str | None = None,
    ) -> None:
        """`request` is the body (OpenAI) or params (Anthropic) asked: billed records carry its digest, so
        a test counts how often one request was paid whichever way (batch or realtime) it was sent."""
        self.billed.append(
            {
                "face": face,
                "via": via,
                "batch_id": batch_id,
                "custom_id": custom_id,
                "prompt": prompt,
                "request": request_digest(request),
                "usage": dict(usage),
            }
        )

    def embedded(self, via: str, texts: list[str], request: dict, tokens: int, batch_id=None, custom_id=None) -> None:
        """One billed /v1/embeddings request (a batch line or a realtime call) of `texts`."""
        self.embedded_texts.update(texts)
        self.embedding_requests += 1
        usage = {"prompt_tokens": tokens, "completion_tokens": 0, "cached_tokens": 0}
        self.add_usage("openai", **usage)
        if via == "realtime":
            self.realtime_requests["openai"] += 1
            self.realtime_prompts.update(("openai", t) for t in texts)
        self.bill("openai", via, "\n".join(texts), request, usage, batch_id, custom_id)

    def snapshot(self) -> dict:
        oai = self.usage["openai"]
        return {
            "calls": dict(self.calls),
            "files_uploaded": self.files_uploaded,
            "batches_created": self.batches_created,
            "request_lines": self.request_lines,
            "batches_by_face": {face: self.batches_by_face[face] for face in USAGE_KEYS},
            "realtime_requests": {face: self.realtime_requests[face] for face in USAGE_KEYS},
            "usage": {
                "prompt_tokens": oai["prompt_tokens"],
                "completion_tokens": oai["completion_tokens"],
                "total_tokens": oai["prompt_tokens"] + oai["completion_tokens"],
            },
            "usage_by_face": {face: dict(usage) for face, usage in self.usage.items()},
            "embedding_requests": self.embedding_requests,
            "embedded_texts": sum(self.embedded_texts.values()),
            "distinct_embedded_texts": len(self.embedded_texts),
        }


def request_digest(request: Any) -> str:
    """A short digest of a request body as asked, its keys in canonical order."""
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:16]
