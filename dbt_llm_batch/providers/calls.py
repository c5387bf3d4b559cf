"""Provider calls that survive throttling and outages, inside one per-run time budget.

The SDK clients are built with `max_retries=0`: retries happen here instead, so that a `retry-after`
the provider sends (Anthropic's SDK honours any length, OpenAI's up to 120 s) can never hold a run
longer than `llm_retry_budget_seconds`. The budget starts with the run's first failing call and is
shared by every later one; once it is spent, calls raise ProviderUnavailable and the run leaves the
remaining work pending for the next run. Only idempotent calls go through `call` (poll, list,
download, upload); `create` is never retried (see submit.py).
"""

from __future__ import annotations

import time

# Statuses worth retrying: timeout, conflict, throttled, and any server-side failure (incl. 529).
RETRYABLE_STATUSES = (408, 409, 429)
TRANSPORT_ERRORS = ("APIConnectionError", "TransportError", "HTTPClientError", "EndpointConnectionError")


class ProviderUnavailable(Exception):
    """The provider kept failing until the run's retry budget was spent: leave the work pending."""


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an SDK error (openai and anthropic both set `status_code`; botocore's
    ClientError keeps it in its parsed `response`; google-genai's APIError, and its ClientError and
    ServerError, set `code`), else None."""
    status = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    if status is None and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status is None and any(cls.__name__ == "APIError" for cls in type(exc).__mro__):
        status = getattr(exc, "code", None)
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """A failure that says nothing about the request itself: throttling, a 5xx, a timeout, a dropped
    or cut-off connection. Both SDKs name their transport failure APIConnectionError (timeouts
    subclass it); a body cut off while it is streamed surfaces as the HTTP library's own
    TransportError (httpx, or the httpx2 the installed SDKs use); botocore's are HTTPClientError
    (timeouts, dropped connections) and EndpointConnectionError: matched by name, not by import."""
    status = status_of(exc)
    if status is not None:
        return status in RETRYABLE_STATUSES or status >= 500
    return any(cls.__name__ in TRANSPORT_ERRORS for cls in type(exc).__mro__)


def retry_after(exc: BaseException) -> float | None:
    """Seconds the provider asked us to wait (`retry-after-ms` or `retry-after`), if it said."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    try:
        if headers.get("retry-after-ms"):
            return float(headers["retry-after-ms"]) / 1000
        if headers.get("retry-after"):
            return float(headers["retry-after"])
    except ValueError:  # an HTTP date: not worth parsing, back off as usual
        return None
    return None


class CallBudget:
    """Retries transient failures with exponential back-off (or the provider's `retry-after`) until
    `seconds` have passed since the first failure of this run."""

    def __init__(self, seconds: float, sleep=time.sleep, clock=time.monotonic):
        self.seconds = seconds
        self.sleep, self.clock = sleep, clock
        self.first_failure: float | None = None
        self.spent = False  # set once a call gave up: later calls fail fast
        self.last_error: str | None = None

    def call(self, what: str, fn):
        delay = 1.0
        while True:
            if self.spent:
                raise ProviderUnavailable(f"{what}: skipped, the retry budget is spent ({self.last_error})")
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                now = self.clock()
                self.first_failure = self.first_failure if self.first_failure is not None else now
                asked = retry_after(exc)
                wait = delay if asked is None else asked
                self.last_error = f"{what}: {describe(exc)}"
                if now + wait > self.first_failure + self.seconds:
                    self.spent = True
                    raise ProviderUnavailable(self.last_error) from exc
                self.sleep(wait)
                if asked is None:
                    delay = min(delay * 2, 60.0)


def provider_message(exc: BaseException) -> str:
    """What the provider said, in its own words: the `error.message` of the response body both SDKs parse
    into `exc.body`, else the exception's first line. The SDKs' own wording around it changes between
    releases (anthropic 2.17 dropped "Error code:"), so nothing we print or test depends on it."""
    body = getattr(exc, "body", None) or getattr(exc, "details", None)
    # anthropic keeps the whole body ({"type": "error", "error": {...}}); openai keeps its "error" object;
    # google-genai keeps the whole body ({"error": {"code", "message", "status"}}) in `details`.
    error = body.get("error", body) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str) and message:
        return message.splitlines()[0][:200]
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line for a log: `HTTP <status>: <the provider's message>`, or the exception's type and text."""
    status = status_of(exc)
    if status is not None:
        return f"HTTP {status}: {provider_message(exc)}"
    text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return f"{type(exc).__name__}: {text}"
