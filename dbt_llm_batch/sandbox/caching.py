"""The sandbox's prompt cache, shared by the faces (each words its own keys and rules).

- OpenAI caches automatically: the messages before the last user message form
  the prefix; a repeat of (model, prefix) reads `(prefix_tokens // 128) * 128`
  cached tokens once the prefix reaches the minimum (1,024 tokens, OpenAI prompt
  caching guide). An entry lives `Emulator.openai_cache_ttl_seconds` (default 5
  minutes: the guide says cached prefixes stay active for 5 to 10 minutes of
  inactivity) of the emulator's clock and each read refreshes it.
- Anthropic caches what the client marks with `cache_control` (see
  anthropic_messages.py): an entry lives `ttl` seconds of the emulator's clock
  ("5m" by default, "1h" on request) and each read refreshes it, as the
  provider does. The minimum cacheable prefix is per model (min_cache_tokens).

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


def min_cache_tokens(face: str, model: object, override: int | None) -> int:
    """The shortest prefix, in tokens, a provider caches for `model` (`override`: the Emulator's setting).

    Anthropic prompt caching docs: 1,024 tokens for Opus and Sonnet models, 2,048 for Haiku models.
    OpenAI prompt caching guide: 1,024 tokens for every model."""
    if override is not None:
        return override
    if face == "anthropic" and "haiku" in str(model).lower():
        return 2048
    return 1024


def openai_cached_tokens(
    cache: PromptCache, model: object, ask: ChatInputs, min_tokens: int | None, now: float, ttl: float
) -> int:
    """cached_tokens of one OpenAI chat request (0 on the first sight of its prefix, or once it expired)."""
    prefix_tokens = count_tokens(sum(len(text) for _, text in ask.prefix))
    if not ask.prefix or prefix_tokens < min_cache_tokens("openai", model, min_tokens):
        return 0
    key = json.dumps(["openai", model, ask.prefix], ensure_ascii=False)
    if not cache.use(key, now, ttl):
        return 0
    return (prefix_tokens // OPENAI_CACHE_INCREMENT) * OPENAI_CACHE_INCREMENT
