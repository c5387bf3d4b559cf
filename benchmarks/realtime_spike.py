"""Spike (not a test): how close can a pure-Python client get to a realtime endpoint's ceiling?

Starts benchmarks/loopback_chat_server.py in its own process (64 served at a time, 200 ms each: a ceiling of
320 req/s), then sends N chat completions (default 2,000) with each client approach below, 64 in flight, and
prints throughput as a fraction of the ceiling plus the client's own CPU time per request.

    .venv/bin/python benchmarks/realtime_spike.py [--requests 2000] [--repeat 2] [--only NAME ...]

Approaches:
  openai          openai.AsyncOpenAI, asyncio.Semaphore(64), parsed into the SDK's pydantic models
  openai_raw      the same through .with_raw_response, body parsed with json.loads (no pydantic models)
  openai_post     AsyncOpenAI's own client.post("/chat/completions", body=dict, cast_to=ChatCompletion): the
                  SDK's auth, errors and retries and a typed result, without its per-request parameter
                  transform (the largest CPU cost in a profile, recursing through response_format's schema)
  httpx           the SDK's HTTP client (httpx2, or httpx) AsyncClient(max_connections=64), json.loads
  raw_streams     64 asyncio stream connections speaking minimal HTTP/1.1 keep-alive, json.loads
  openai_threads  2 threads, each its own event loop and AsyncOpenAI with 32 in flight
  openai_procs    2 processes, each its own event loop and AsyncOpenAI with 32 in flight (CPU: the children's)
  openai_aiohttp  AsyncOpenAI over aiohttp (DefaultAioHttpClient), if aiohttp is installed (openai[aiohttp])
  aiohttp         a plain aiohttp.ClientSession (TCPConnector limit 64) posting JSON, json.loads, if installed
--uvloop runs every approach on uvloop's event loop instead of asyncio's (if uvloop is installed).
Every answer is checked: HTTP 200, a chat.completion whose content is JSON with an allowed category.

Measured 2026-12-01 (2 cores shared with other busy processes, load average 2-5, so +-30% between runs;
2,000 requests, 2 runs each; fraction of the 320 req/s ceiling, client CPU ms per request). A lock-step
client can reach at most 0.977 here (2,000 / 64 = 31.25 rounds of 200 ms).
  openai          0.51-0.62 (0.24-0.28 when the machine was busiest)   4.2-6.2 ms
  openai_raw      0.40-0.63                                            4.4-4.7 ms
  openai_post     0.31-0.34 (busiest period; same run: openai 0.24-0.28) 4.3-4.7 ms
  openai_threads  0.39-0.53                                            4.4-5.6 ms
  openai_procs    0.38-0.50                                            4.7-5.4 ms (startup included)
  openai_aiohttp  0.50-0.56                                            3.4 ms
  httpx (httpx2)  0.45-0.78                                            2.1-2.8 ms
  aiohttp         0.82-0.89                                            0.5-0.6 ms
  raw_streams     0.93-0.955, steady in every run                      0.12-0.18 ms
uvloop changed nothing measurable. The SDK's cost is CPU in the client process: a cProfile of 1,000 requests
puts most of it in openai._utils._transform (recursing through the request's params, response_format's
schema included), httpcore2's pool scanning every connection for expiry on each request, and building the
pydantic response models. So on this machine only a minimal HTTP/1.1 client (or plain aiohttp) gets near
the ceiling; the openai SDK tops out near 200 req/s of client CPU on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai

try:  # openai 3.x ships its HTTP client as httpx2; older releases use httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "loopback"
CATEGORIES = {"billing", "bug", "how_to", "other"}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "llm_output",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"category": {"type": "string", "enum": sorted(CATEGORIES)}},
            "required": ["category"],
            "additionalProperties": False,
        },
    },
}


def request_body(i: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 24,
        "temperature": 0,
        "response_format": RESPONSE_FORMAT,
        "messages": [
            {"role": "system", "content": "Classify the support ticket."},
            {"role": "user", "content": f"Ticket {i}: I was charged twice for my subscription."},
        ],
    }


def check_body(body: dict) -> None:
    assert body["object"] == "chat.completion", body
    assert json.loads(body["choices"][0]["message"]["content"])["category"] in CATEGORIES, body
    assert body["usage"]["total_tokens"] > 0, body


# --- client approaches: each sends requests [0, n) with `inflight` at a time and checks every answer ---


async def run_openai(base_url: str, n: int, inflight: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    gate = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with gate:
            r = await client.chat.completions.create(**request_body(i))
        assert r.choices[0].finish_reason == "stop" and r.usage.total_tokens > 0
        assert json.loads(r.choices[0].message.content)["category"] in CATEGORIES

    async with client:
        await asyncio.gather(*(one(i) for i in range(n)))


async def run_openai_raw(base_url: str, n: int, inflight: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    gate = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with gate:
            raw = await client.chat.completions.with_raw_response.create(**request_body(i))
        check_body(json.loads(raw.http_response.content))

    async with client:
        await asyncio.gather(*(one(i) for i in range(n)))


async def run_openai_post(base_url: str, n: int, inflight: int) -> None:
    from openai.types.chat import ChatCompletion

    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    gate = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with gate:
            r = await client.post("/chat/completions", body=request_body(i), cast_to=ChatCompletion)
        assert r.choices[0].finish_reason == "stop" and r.usage.total_tokens > 0
        assert json.loads(r.choices[0].message.content)["category"] in CATEGORIES

    async with client:
        await asyncio.gather(*(one(i) for i in range(n)))


async def run_httpx(base_url: str, n: int, inflight: int) -> None:
    limits = httpx.Limits(max_connections=inflight, max_keepalive_connections=inflight)
    headers = {"authorization": "Bearer EMPTY", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:

        async def one(i: int) -> None:
            r = await client.post("/chat/completions", content=json.dumps(request_body(i)), headers=headers)
            assert r.status_code == 200, r.text
            check_body(json.loads(r.content))

        await asyncio.gather(*(one(i) for i in range(n)))


async def run_raw_streams(base_url: str, n: int, inflight: int) -> None:
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    queue = iter(range(n))  # shared by the workers; only one runs at a time, so a plain iterator is safe

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for i in queue:
                body = json.dumps(request_body(i)).encode()
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer EMPTY\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
                )
                head = await reader.readuntil(b"\r\n\r\n")
                status_line, *header_lines = head.decode("latin-1").split("\r\n")
                assert status_line.split(" ")[1] == "200", status_line
                length = next(int(h.split(":", 1)[1]) for h in header_lines if h.lower().startswith("content-length:"))
                check_body(json.loads(await reader.readexactly(length)))
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(inflight)))


async def run_openai_aiohttp(base_url: str, n: int, inflight: int) -> None:
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="EMPTY", max_retries=0, http_client=openai.DefaultAioHttpClient()
    )
    gate = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with gate:
            r = await client.chat.completions.create(**request_body(i))
        assert json.loads(r.choices[0].message.content)["category"] in CATEGORIES

    async with client:
        await asyncio.gather(*(one(i) for i in range(n)))


def run_openai_threads(base_url: str, n: int, inflight: int, threads: int = 2) -> None:
    errors: list[BaseException] = []

    def thread_main(k: int) -> None:
        try:
            share = range(k, n, threads)
            run_on_loop(run_openai_share(base_url, share, inflight // threads))
        except BaseException as e:  # re-raised below in the main thread
            errors.append(e)

    workers = [threading.Thread(target=thread_main, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def openai_share_in_process(base_url: str, share: range, inflight: int, uvloop: bool) -> None:
    global USE_UVLOOP
    USE_UVLOOP = uvloop
    run_on_loop(run_openai_share(base_url, share, inflight))


def run_openai_procs(base_url: str, n: int, inflight: int, procs: int = 2) -> None:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(procs) as pool:  # joined on exit, so their CPU shows in RUSAGE_CHILDREN
        for f in [
            pool.submit(openai_share_in_process, base_url, range(k, n, procs), inflight // procs, USE_UVLOOP)
            for k in range(procs)
        ]:
            f.result()


async def run_openai_share(base_url: str, share: range, inflight: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    gate = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with gate:
            r = await client.chat.completions.create(**request_body(i))
        assert json.loads(r.choices[0].message.content)["category"] in CATEGORIES

    async with client:
        await asyncio.gather(*(one(i) for i in share))


async def run_aiohttp(base_url: str, n: int, inflight: int) -> None:
    import aiohttp

    headers = {"authorization": "Bearer EMPTY", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=inflight)
    async with aiohttp.ClientSession(base_url=base_url.rstrip("/") + "/", connector=connector) as session:

        async def one(i: int) -> None:
            async with session.post("chat/completions", data=json.dumps(request_body(i)), headers=headers) as r:
                assert r.status == 200, await r.text()
                check_body(json.loads(await r.read()))

        await asyncio.gather(*(one(i) for i in range(n)))


def run_on_loop(coro) -> None:
    """asyncio.run, or uvloop's loop when --uvloop was given."""
    if USE_UVLOOP:
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


USE_UVLOOP = False


def aiohttp_available() -> bool:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    return hasattr(openai, "DefaultAioHttpClient")


APPROACHES = {
    "openai": lambda u, n, k: run_on_loop(run_openai(u, n, k)),
    "openai_raw": lambda u, n, k: run_on_loop(run_openai_raw(u, n, k)),
    "openai_post": lambda u, n, k: run_on_loop(run_openai_post(u, n, k)),
    "httpx": lambda u, n, k: run_on_loop(run_httpx(u, n, k)),
    "raw_streams": lambda u, n, k: run_on_loop(run_raw_streams(u, n, k)),
    "openai_threads": run_openai_threads,
    "openai_procs": run_openai_procs,
    "openai_aiohttp": lambda u, n, k: run_on_loop(run_openai_aiohttp(u, n, k)),
    "aiohttp": lambda u, n, k: run_on_loop(run_aiohttp(u, n, k)),
}
NEEDS_AIOHTTP = {"openai_aiohttp", "aiohttp"}


# --- harness ---


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cpu() -> float:
    """CPU seconds of finished child processes (the openai_procs workers; the server is still running)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
        return json.loads(r.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="the server's cap and the clients' in-flight")
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--only", nargs="*", choices=sorted(APPROACHES))
    parser.add_argument("--uvloop", action="store_true", help="use uvloop's event loop")
    args = parser.parse_args()
    global USE_UVLOOP
    USE_UVLOOP = args.uvloop

    names = args.only or [a for a in APPROACHES if a not in NEEDS_AIOHTTP or aiohttp_available()]
    ceiling = args.concurrency / args.delay
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "loopback_chat_server.py"),
            "--port",
            str(port),
            "--concurrency",
            str(args.concurrency),
            "--delay",
            str(args.delay),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().startswith("listening"), "the loopback server did not start"
        base_url = f"http://127.0.0.1:{port}/v1"
        print(
            f"ceiling {ceiling:.0f} req/s ({args.concurrency} at a time x {args.delay * 1000:.0f} ms); "
            f"{args.requests} requests per run; openai {openai.__version__}, {httpx.__name__} {httpx.__version__}, "
            f"event loop {'uvloop' if args.uvloop else 'asyncio'}"
        )
        print(f"{'approach':<16}{'run':>4}{'seconds':>9}{'req/s':>8}{'of ceiling':>12}{'client CPU ms/req':>19}")
        for name in names:
            for run in range(1, args.repeat + 1):
                served_before = server_stats(port)["served"]
                wall0, cpu0 = time.perf_counter(), time.process_time() + children_cpu()
                APPROACHES[name](base_url, args.requests, args.concurrency)
                wall, cpu = time.perf_counter() - wall0, time.process_time() + children_cpu() - cpu0
                stats = server_stats(port)
                assert stats["served"] - served_before == args.requests, stats
                assert stats["max_in_service"] <= args.concurrency, stats
                rate = args.requests / wall
                print(
                    f"{name:<16}{run:>4}{wall:>9.2f}{rate:>8.1f}{rate / ceiling:>12.3f}"
                    f"{cpu / args.requests * 1000:>19.2f}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
