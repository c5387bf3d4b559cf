"""The sandbox's prompt cache, shared by the faces (each words its own keys and rules).

- OpenAI caches automatically: the messages before the last user message form
  the prefix; a repeat of (model, prefix) reads `(prefix_tokens // 128) * 128`
  cached tokens once the prefix reaches `min_cache_tokens`. Entries never expire
  here (the provider keeps them minutes to hours; the sandbox keeps them all).
- Anthropic caches what the client marks with `cache_control` (see
  anthropic_messages.py): an entry lives `ttl` seconds of the emulator's clock
  and each read refreshes it, as the provider does.

Token counts come from answers.count_tokens, like every other count of the sandbox.
"""
from __future__ import annotations

import json

from .answers import ChatInputs, count_tokens

OPENAI_CACHE_INCREMENT = 128  # OpenAI reports cached tokens in 128-token steps


class PromptCache:
    """Prefix keys the sandbox has seen, with when they expire (None: never)."""

    def __init__(self) -> None:
        self._expires: dict[str, float | None] = {}

    def use(self, key: str, now: float, ttl: float | None = None) -> bool:
        """True on a hit (the entry is refreshed); on a miss, record the prefix and return False."""
        expires = self._expires.get(key, 0.0)
        hit = key in self._expires and (expires is None or now < expires)
        if hit and expires is not None and ttl is not None:
            self._expires[key] = max(expires, now + ttl)
        elif not hit:
            self._expires[key] = None if ttl is None else now + ttl
        return hit

    def __len__(self) -> int:
        return len(self._expires)


def openai_cached_tokens(cache: PromptCache, model: object, ask: ChatInputs, min_tokens: int, now: float) -> int:
    """cached_tokens of one OpenAI chat request (0 on the first sight of its prefix)."""
    prefix_tokens = count_tokens(sum(len(text) for _, text in ask.prefix))
    if not ask.prefix or prefix_tokens < min_tokens:
        return 0
    key = json.dumps(["openai", model, ask.prefix], ensure_ascii=False)
    if not cache.use(key, now):
        return 0
    return (prefix_tokens // OPENAI_CACHE_INCREMENT) * OPENAI_CACHE_INCREMENT
