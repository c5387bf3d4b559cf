"""A loopback stand-in for a realtime chat endpoint with a known ceiling, to measure how close a client gets.

POST /v1/chat/completions answers a valid OpenAI chat.completion body (usage included) after a fixed delay,
with at most N requests being served at a time; the rest wait in line. The ceiling is N / delay requests per
second (64 / 0.2 s = 320 req/s by default), so a client's throughput divided by it is the client's efficiency.
GET /stats returns what was served and the most requests ever served at once (to check the cap held).

Stdlib only (asyncio streams, HTTP/1.1 keep-alive), so it runs in any venv:
    python benchmarks/loopback_chat_server.py --port 8799 [--concurrency 64] [--delay 0.2]
Prints "listening on 127.0.0.1:PORT" once ready; stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import time

CATEGORIES = ("billing", "bug", "how_to", "other")


class ChatServer:
    def __init__(self, concurrency: int, delay: float):
        self.delay = delay
        self.serving = asyncio.Semaphore(concurrency)
        self.ids = itertools.count(1)
        self.in_service = 0
        self.max_in_service = 0
        self.served = 0

    def completion_body(self, request: dict) -> bytes:
        n = next(self.ids)
        content = json.dumps({"category": CATEGORIES[n % len(CATEGORIES)]})
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in request.get("messages", [])) + 8
        return json.dumps(
            {
                "id": f"chatcmpl-loopback-{n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.get("model", "loopback"),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "logprobs": None,
                        "message": {"role": "assistant", "content": content, "refusal": None},
                    }
                ],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 7, "total_tokens": prompt_tokens + 7},
                "system_fingerprint": "loopback",
            }
        ).encode()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one connection carries many requests, one after another
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                close = headers.get("connection", "").lower() == "close"
                if method == "POST" and path.split("?")[0] == "/v1/chat/completions":
                    status, payload = 200, await self.serve_completion(body)
                elif method == "GET" and path == "/stats":
                    status, payload = (
                        200,
                        json.dumps({"served": self.served, "max_in_service": self.max_in_service}).encode(),
                    )
                else:
                    status, payload = 404, b'{"error": {"message": "not found", "type": "not_found"}}'
                reason = "OK" if status == 200 else "Not Found"
                writer.write(
                    f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n"
                    f"connection: {'close' if close else 'keep-alive'}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()

    async def serve_completion(self, body: bytes) -> bytes:
        request = json.loads(body or b"{}")
        async with self.serving:  # the cap: past it, requests wait here in arrival order
            self.in_service += 1
            self.max_in_service = max(self.max_in_service, self.in_service)
            try:
                await asyncio.sleep(self.delay)
                self.served += 1
                return self.completion_body(request)
            finally:
                self.in_service -= 1


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.2)
    args = parser.parse_args()
    app = ChatServer(args.concurrency, args.delay)
    server = await asyncio.start_server(app.handle, "127.0.0.1", args.port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"listening on 127.0.0.1:{args.port}", flush=True)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
