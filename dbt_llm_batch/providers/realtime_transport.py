"""Sending one realtime request: the provider's own SDK, asynchronously, returning the raw reply.

The realtime executor (dbt_llm_batch/realtime.py) does concurrency, retries and the time budget;
a transport only sends one request body and says what came back. The body goes out as the provider
expects it (`client.post` with the JSON body, built in SQL), and the reply's text is kept as is: it becomes a
result line in the provider's own batch format, so settling reads realtime and batch answers alike.
The SDKs' own retries are off (max_retries=0): the executor retries, honouring `retry-after`,
inside the run's time budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from dbt_llm_batch.providers.calls import FATAL  # the words for a status that fails the run

# Statuses worth another try: rate limits, overload, server errors, request timeouts.
RETRYABLE = {408, 409, 429, 500, 502, 503, 504, 529}
REQUEST_TIMEOUT_SECONDS = 300  # one answer from a busy engine can take minutes


class TransientError(Exception):
    """No reply (timeout, refused or dropped connection): the request may be tried again."""


class LostReply(TransientError):
    """The request went out but its reply did not arrive whole (the connection dropped or timed out
    while waiting, or the body was cut off): the provider may have answered it, and billed it.
    The providers' realtime endpoints take no idempotency key, so sending it again may pay twice
    (realtime.py sends such a request at most once more)."""


# Failures of the HTTP library (httpx, or the httpx2 the installed SDKs use) that happen before the
# whole request was sent, so nothing can have been billed; matched by name, not by import. Any other
# failure (a read timeout, a dropped connection, a cut-off body, one the SDK does not explain) is
# taken as a reply lost after sending.
NOT_SENT = {
    "ConnectError",
    "ConnectTimeout",
    "PoolTimeout",
    "WriteError",
    "WriteTimeout",
    "UnsupportedProtocol",
    "ProxyError",
    "LocalProtocolError",
}


def reached_the_provider(exc: BaseException) -> bool:
    """Whether the request behind an SDK connection/timeout error may have reached the provider."""
    cause = exc.__cause__
    while cause is not None:
        if any(cls.__name__ in NOT_SENT for cls in type(cause).__mro__):
            return False
        cause = cause.__cause__
    return True


class FatalReply(Exception):
    """A reply that fails every request alike: the run stops; no row is marked failed for it."""


@dataclass
class Reply:
    status: int
    text: str
    retry_after: float | None = None  # seconds the server asked us to wait


def retry_after_seconds(headers) -> float | None:
    """`retry-after-ms` (OpenAI, Anthropic) or `retry-after` in seconds; HTTP dates are ignored."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                continue
    return None


class Transport:
    """What the executor tracks per endpoint (one per replica of a self-hosted engine)."""

    def __init__(self, name: str, key_hint: str, self_hosted: bool = False):
        self.name, self.key_hint, self.self_hosted = name, key_hint, self_hosted
        self.outstanding = 0  # requests on their way (replica selection)
        self.cooldown_until = 0.0  # after an error, other replicas are preferred until then
        self.failures = 0  # connection failures in a row
        self.never_connected = True
        self.dead = False  # never reachable: given up for this run

    def fatal_problem(self, reply: Reply) -> str | None:
        """Why `reply` fails the whole run, or None. The provider's own text is left out: a 401's
        message can quote part of the key."""
        if reply.status in FATAL:
            return f"{self.name} answered HTTP {reply.status}: {FATAL[reply.status]} (check {self.key_hint})"
        if reply.status == 404 and self.self_hosted:
            return (
                f"{self.name} answered HTTP 404: no such endpoint or model (check llm_base_url, which "
                f"usually ends in /v1, and that llm_model is the engine's served model name)"
            )
        return None


class SdkTransport(Transport):
    """POST a JSON body to `path` through an official SDK client (openai.AsyncOpenAI or
    anthropic.AsyncAnthropic), which adds the key, version headers and base URL."""

    def __init__(self, client, path: str, errors, name: str, key_hint: str):
        super().__init__(name, key_hint)
        self.client, self.path, self.errors = client, path, errors

    async def send(self, body: bytes, timeout: float) -> Reply:
        import httpx2 as httpx  # the HTTP client the SDKs are built on

        self.outstanding += 1
        try:  # the body is already JSON (built in SQL): sent as is, never parsed here
            response = await self.client.post(
                self.path,
                content=body,
                cast_to=httpx.Response,
                options={"headers": {"Content-Type": "application/json"}, "timeout": timeout},
            )
            reply = Reply(response.status_code, response.text)
        except self.errors.APIStatusError as exc:
            reply = Reply(exc.status_code, exc.response.text, retry_after_seconds(exc.response.headers))
        except (self.errors.APITimeoutError, self.errors.APIConnectionError) as exc:
            what = f"{type(exc).__name__}: {exc}" + (f" ({type(exc.__cause__).__name__})" if exc.__cause__ else "")
            if reached_the_provider(exc):
                self.never_connected, self.failures = False, 0  # it connected: the server is there
                raise LostReply(what) from None
            if not isinstance(exc, self.errors.APITimeoutError):
                self.failures += 1
            raise TransientError(what) from None
        finally:
            self.outstanding -= 1
        self.never_connected, self.failures = False, 0
        return reply

    async def aclose(self) -> None:
        await self.client.close()


def openai_transports(
    concurrency: int = 16, path: str = "/chat/completions", base_url: str | None = None, api_key_env: str | None = None
) -> list[SdkTransport]:
    """OpenAI itself, which the SDK finds through OPENAI_BASE_URL / OPENAI_API_KEY, or a host serving
    OpenAI's API at `base_url` with its key in the variable `api_key_env`."""
    import os

    import httpx2 as httpx  # the HTTP client the SDKs are built on
    import openai

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key=os.environ.get(api_key_env) if api_key_env else None,
        max_retries=0,
        timeout=REQUEST_TIMEOUT_SECONDS,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )
    name = "OpenAI" if base_url is None else base_url
    return [SdkTransport(client, path, openai, name, api_key_env or "OPENAI_API_KEY")]


def anthropic_transports(concurrency: int = 16) -> list[SdkTransport]:
    import anthropic
    import httpx2 as httpx  # the HTTP client the SDKs are built on

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = anthropic.AsyncAnthropic(
        max_retries=0, timeout=REQUEST_TIMEOUT_SECONDS, http_client=anthropic.DefaultAsyncHttpxClient(limits=limits)
    )
    return [SdkTransport(client, "/v1/messages", anthropic, "Anthropic", "ANTHROPIC_API_KEY")]


def azure_openai_transports(endpoint: str, api_version: str, deployment: str, concurrency: int = 16) -> list:
    """An Azure OpenAI deployment: the body goes to /openai/deployments/{deployment}/chat/completions
    (the SDK adds /openai, the api-version query and the api-key or Entra token header). The path names
    the deployment itself: the SDK only moves a request to it when it parses the body, which is sent raw."""
    from urllib.parse import quote

    import httpx2 as httpx  # the HTTP client the SDKs are built on
    import openai

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = openai.AsyncAzureOpenAI(
        azure_endpoint=endpoint,
        api_version=api_version,
        max_retries=0,
        timeout=REQUEST_TIMEOUT_SECONDS,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )
    path = f"/deployments/{quote(deployment, safe='')}/chat/completions"
    return [SdkTransport(client, path, openai, "Azure OpenAI", "AZURE_OPENAI_API_KEY")]
