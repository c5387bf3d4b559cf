"""A minimal HTTP/1.1 keep-alive client for self-hosted engines (llm_provider='openai_compatible').

Why not the openai SDK here: against a loopback server that answers in 200 ms with 64 slots
(benchmarks/realtime_throughput.py), the SDK spends 4-6 ms of CPU per request (processing the
request's parameters, scanning its connection pool, building response objects) and reaches about 0.5-0.6
of the server's limit on this machine; this client spends about 0.15 ms and keeps a local engine
saturated. The hosted providers' realtime endpoints keep their official SDKs.

It speaks just what an OpenAI-compatible engine needs: POST with a JSON body over http or https,
keep-alive connections reused, and Content-Length or chunked replies.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from urllib.parse import urlsplit

from dbt_llm_batch.providers.realtime_transport import Reply, TransientError, Transport, retry_after_seconds


class EngineTransport(Transport):
    """POST `path` (/chat/completions, or /embeddings) to one engine replica at `base_url`."""

    def __init__(self, base_url: str, api_key: str | None, key_hint: str, path: str = "/chat/completions"):
        super().__init__(base_url, key_hint, self_hosted=True)
        url = urlsplit(base_url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        host_header = url.netloc.rsplit("@", 1)[-1]
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.head = (
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host_header}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json\r\n{auth}"
        ).encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self, body: bytes, timeout: float) -> Reply:
        self.outstanding += 1
        try:
            return await asyncio.wait_for(self._exchange(body), timeout)
        except asyncio.TimeoutError:
            raise TransientError(f"no answer within {timeout:.0f} s") from None
        finally:
            self.outstanding -= 1

    async def _exchange(self, body: bytes) -> Reply:
        request = self.head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        while self.idle:  # a kept-alive connection the server may have closed meanwhile: try, then drop it
            reader, writer = self.idle.pop()
            try:
                return await self._roundtrip(reader, writer, request)
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                writer.close()
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        except OSError as exc:
            self.failures += 1
            raise TransientError(f"cannot connect: {exc.strerror or exc}") from None
        self.never_connected, self.failures = False, 0
        try:
            return await self._roundtrip(reader, writer, request)
        except (OSError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            writer.close()
            raise TransientError(f"connection lost: {type(exc).__name__}") from None

    async def _roundtrip(self, reader, writer, request: bytes) -> Reply:
        writer.write(request)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("closed by the server")
        status = int(status_line.split(b" ", 2)[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            payload = await reader.readexactly(int(headers["content-length"]))
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            payload = await _read_chunked(reader)
        else:  # the body runs to the end of the connection
            payload = await reader.read()
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return Reply(status, payload.decode("utf-8", "replace"), retry_after_seconds(headers))

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _read_chunked(reader) -> bytes:
    parts = []
    while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
        parts.append(await reader.readexactly(size))
        await reader.readline()
    while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
        pass
    return b"".join(parts)


def engine_transports(
    base_urls: tuple[str, ...], api_key_env: str | None, path: str = "/chat/completions"
) -> list[EngineTransport]:
    hint = f"{api_key_env}, named by llm_api_key_env" if api_key_env else "the engine's key: set llm_api_key_env"
    key = os.environ.get(api_key_env) if api_key_env else None
    return [EngineTransport(url, key, hint, path) for url in base_urls]
