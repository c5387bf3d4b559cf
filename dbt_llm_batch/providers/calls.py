"""Provider calls that survive throttling and outages, inside one per-run time budget.

The SDK clients are built with `max_retries=0`: retries happen here instead, so that a `retry-after`
the provider sends (Anthropic's SDK honours any length, OpenAI's up to 120 s) can never hold a run
longer than `llm_retry_budget_seconds`. The budget starts with the run's first failing call and is
shared by every later one; once it is spent, calls raise ProviderUnavailable and the run leaves the
remaining work pending for the next run. Only idempotent calls go through `call` (poll, list,
download, upload); `create` is never retried (see submit.py).
"""

from __future__ import annotations

import os
import re
import time

# Statuses worth retrying: timeout, conflict, throttled, and any server-side failure (incl. 529).
RETRYABLE_STATUSES = (408, 409, 429)
TRANSPORT_ERRORS = ("APIConnectionError", "TransportError", "HTTPClientError", "EndpointConnectionError")

# Statuses that say the run itself is wrong (key, account, model name or URL), not the row: the
# realtime path (realtime_transport.py) and the batch path (refusal, below) say them in these words.
FATAL = {
    401: "the API key was rejected",
    402: "the account cannot pay for requests",
    403: "the API key may not use this model",
}
# How providers that do not answer 401 say the key was rejected: Gemini answers 400 "API key not
# valid"; Bedrock (AWS) answers 403 with one of these error codes.
REJECTED_KEY_TEXT = ("API key not valid", "UnrecognizedClientException", "InvalidSignatureException")


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


# Set on an error a provider call raised: the client that made the call. A run asks old jobs through
# the provider, model and host each was sent with (pipeline/pool.py): a refused key is that client's.
RAISED_BY = "dbt_llm_batch_client"


def raised_by(exc: BaseException):
    """The provider client whose call raised `exc` (CallBudget), or None."""
    return getattr(exc, RAISED_BY, None)


class CallBudget:
    """Retries transient failures with exponential back-off (or the provider's `retry-after`) until
    `seconds` have passed since the first failure of this run."""

    def __init__(self, seconds: float, sleep=time.sleep, clock=time.monotonic, owner=None):
        self.seconds = seconds
        self.owner = owner  # the provider client whose calls these are (raised_by)
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
                    if self.owner is not None and raised_by(exc) is None:
                        setattr(exc, RAISED_BY, self.owner)
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


def key_rejected(exc: BaseException) -> bool:
    """Whether the provider said the key (or the credentials) itself is wrong."""
    status = status_of(exc)
    if status == 401:
        return True
    text = f"{provider_message(exc)} {exc}"
    return status in (400, 403) and any(marker in text for marker in REJECTED_KEY_TEXT)


def key_variable(provider) -> str | None:
    """The environment variable that holds `provider`'s key as its SDK reads it (or the one
    llm_api_key_env names); None for a provider without one (Bedrock: the AWS credential chain)."""
    var = getattr(provider, "key_variable", None) or provider.key_env_var
    if var == "GEMINI_API_KEY" and os.environ.get("GOOGLE_API_KEY"):  # the SDK prefers it
        return "GOOGLE_API_KEY"
    if var == "AZURE_OPENAI_API_KEY" and not os.environ.get(var) and os.environ.get("AZURE_OPENAI_AD_TOKEN"):
        return "AZURE_OPENAI_AD_TOKEN"  # an Entra ID token instead of a key
    return var or None


def key_hint(provider) -> str:
    """Where `provider`'s key comes from, for "check ...": its variable, or its credential chain."""
    var = key_variable(provider)
    if var is None:
        chain = provider.environment_hint or "the provider reads its credentials from its standard chain"
        return f"the credentials ({chain}: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    named = " (named by llm_api_key_env)" if provider.config.options.get("api_key_env") else ""
    return f"{var}{named}"


# The variable each SDK reads its key from, by the SDK's package: for an error whose model is not known.
SDK_KEY_HINTS = {
    "openai": "OPENAI_API_KEY (AZURE_OPENAI_API_KEY for llm_provider 'azure_openai'; or the variable llm_api_key_env names)",
    "anthropic": "ANTHROPIC_API_KEY",
    "google": "GOOGLE_API_KEY or GEMINI_API_KEY",
    "botocore": "the AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
}


def sdk_key_hint(exc: BaseException) -> str:
    """Where the key of the SDK that raised `exc` comes from, when the model it served is not known."""
    package = type(exc).__module__.split(".")[0]
    return SDK_KEY_HINTS.get(package, "the provider's API key variable")


def redact(text: str, secret: str | None = None) -> str:
    """`text` without the key: the value itself, its last characters, or a key the provider masked
    ("sk-***0000"), which a 401's message can quote."""
    text = re.sub(r"\S*\*{3}[^\s.,;:]*", "[key]", text)
    if secret:
        text = text.replace(secret, "[key]")
        if len(secret) >= 8:
            text = text.replace(secret[-4:], "[key]")
    return text


def refusal(exc: BaseException, who: str, key_hint: str, secret: str | None = None, again: str = "run") -> str | None:
    """The message a user sees for a provider error about the account, not the request (a rejected
    key, a missing permission, an unpaid account), or None for any other exception: another 4xx (a
    batch the provider deleted, a body it refused) may be a bug of this package, and keeps its
    traceback, as before. `who` names the
    model and provider; `key_hint` where its key comes from (key_hint); `secret`, the key, is never shown;
    `again`: what the user does next ("run" the model, or "poll")."""
    status = status_of(exc)
    if status is None or not 400 <= status < 500 or is_transient(exc):
        return None
    if key_rejected(exc):
        fix = f"{FATAL[401]}: check {key_hint}, then {'run the model' if again == 'run' else again} again"
    elif status == 403:
        fix = f"{FATAL[403]}: check that the key in {key_hint} has permission for llm_model (and for batches)"
    elif status == 402:
        fix = f"{FATAL[402]}: check the account's billing"
    else:
        return None
    said = redact(provider_message(exc), secret)
    return (
        f"{who} answered HTTP {status}: {fix}. The provider said: {said!r}. With it fixed, the next {again} "
        f"goes on where this one stopped (nothing is sent twice)."
    )
