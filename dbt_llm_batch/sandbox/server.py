"""Loopback HTTP server for the sandbox: routing, auth, faults, stats, control.

Provider behaviour lives in "face" modules listed in FACE_MODULES (OpenAI
Files+Batches at `<base>/v1`, Anthropic Message Batches at `<base>`, Amazon Bedrock's
batch inference control plane and Converse at `<base>`, Gemini Batch Mode at `<base>/gemini`). A face is
built as `Face(emulator)` and provides: `name` (its key in stats), `routes`
(list of METHOD, "/v1/path/{id}", handler), `prefixes`, `request_id_header`,
`api_key_from(headers)`, `auth_error(presented_key)`, `route_not_found(method, path)`,
`endpoint_fault_error(fault)` (these three return ApiError), `server_error_type` (the error type of a 500),
`error_payload(err, request_id)`, and the batch hooks `reset()`, `tick(now)`
(called before every request and control call, with or without auto-advance),
`owns(id)`, `advance(id, to, done_fraction)`, `expire_results(id)`, `complete_all()`, `batch_list()`.
Optional: `edge_check(req)` -> ApiError or None, run before auth (what a CDN in
front of the provider rejects, e.g. Anthropic's 413); `preauthorized(req)` -> bool, a request
authorised by its own URL (Gemini's resumable upload session), not by the key.
Handlers take a `Request` and return a dict (200 JSON), bytes (200 raw) or a
`Reply`, raising `ApiError` for provider errors. This module holds what all
faces share: auth, endpoint faults (before or after the handler ran), call statistics,
the prompt cache, one lock, and the record of the sandbox's own bugs (`internal_errors`:
the test fixtures fail a test that hit one). The CLI is in cli.py.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import random
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .answers import Faults
from .caching import PromptCache
from .engine import EngineBatch
from .stats import Counters

# Faces are imported by name when an Emulator is built: they import the shared
# helpers below, so a top-level import here would be circular.
REALTIME_PATHS = ("/v1/chat/completions", "/v1/embeddings", "/v1/messages")
PROXY_PAGES = {413: "413 Request Entity Too Large", 502: "502 Bad Gateway", 504: "504 Gateway Time-out"}
FACE_MODULES = (
    "dbt_llm_batch.sandbox.openai_batch",
    "dbt_llm_batch.sandbox.anthropic_batch",
    "dbt_llm_batch.sandbox.bedrock_batch",
    "dbt_llm_batch.sandbox.gemini_batch",
    "dbt_llm_batch.sandbox.azure_openai",
)


class ApiError(Exception):
    """A provider error reply; the owning face renders it in its own envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)
    cut: str | None = None  # transport faults: "disconnect" (no answer) or "truncate" (half the body)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names
    body: bytes
    params: dict[str, str] = field(default_factory=dict)  # from the route pattern

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError:
            raise ApiError(400, "We could not parse the JSON body of your request.") from None


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(pattern)) + "$")


class Emulator:
    """In-process sandbox of the provider batch APIs, served on loopback."""

    def __init__(
        self,
        api_key: str,
        auto_advance_seconds: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_file_bytes: int = 200_000_000,
        max_requests_per_batch: int = 50000,
        seed: int | None = None,
        max_message_batch_requests: int = 100_000,
        max_batch_bytes: int = 256_000_000,
        min_cache_tokens: int | None = None,
        openai_enqueued_token_limit: int | None = None,
        anthropic_max_queued_requests: int | None = None,
        openai_cache_ttl_seconds: float = 300,
        null_usage_details: bool = False,
        s3_endpoint_url: str | None = None,
        gemini_max_inline_bytes: int = 20_000_000,
        gemini_max_file_bytes: int = 2_000_000_000,
        gemini_max_concurrent_batches: int = 100,
        gemini_enqueued_token_limit: int | None = None,
    ):
        """One key serves both faces.

        OpenAI: `max_file_bytes` (a batch input file), `max_requests_per_batch`,
        `openai_enqueued_token_limit` (prompt tokens enqueued per model over the organisation's batches in
        progress; None: no limit), `openai_cache_ttl_seconds` (how long an unused cached prefix lives).
        Anthropic: `max_message_batch_requests`, `max_batch_bytes` (a create body),
        `anthropic_max_queued_requests` (requests of unended batches in the workspace; None: no cap).
        Sizes are decimal megabytes, as the providers' docs state them (200 MB = 200,000,000 bytes).
        Both: `min_cache_tokens` (the shortest prefix, in sandbox tokens, the prompt cache stores; None:
        each provider's per-model minimum, see caching.min_cache_tokens); `null_usage_details`: usage
        details and Anthropic `cache_*` fields are null, as a vLLM server sends them by default.
        Bedrock: `s3_endpoint_url`, the S3 emulator (moto's server mode) its jobs read and write.
        Gemini (served under `gemini_base_url`): `gemini_max_inline_bytes` (a create body with inline
        requests), `gemini_max_file_bytes` (an uploaded file), `gemini_max_concurrent_batches` (jobs not
        ended), `gemini_enqueued_token_limit` (input tokens of jobs not ended; None: no limit)."""
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self._api_key = api_key
        self.auto_advance_seconds = auto_advance_seconds
        self.host, self.port = host, port
        self.max_file_bytes, self.max_requests_per_batch = max_file_bytes, max_requests_per_batch
        self.max_message_batch_requests, self.max_batch_bytes = max_message_batch_requests, max_batch_bytes
        self.min_cache_tokens = min_cache_tokens
        self.openai_enqueued_token_limit = openai_enqueued_token_limit
        self.anthropic_max_queued_requests = anthropic_max_queued_requests
        self.openai_cache_ttl_seconds = openai_cache_ttl_seconds
        self.null_usage_details = null_usage_details
        self.s3_endpoint_url = s3_endpoint_url
        self.gemini_max_inline_bytes, self.gemini_max_file_bytes = gemini_max_inline_bytes, gemini_max_file_bytes
        self.gemini_max_concurrent_batches = gemini_max_concurrent_batches
        self.gemini_enqueued_token_limit = gemini_enqueued_token_limit
        # What the Anthropic results endpoint answers for an archived batch (`archived_at` set): the
        # provider's docs do not say; 404 by default, settable so clients are shown to rely on archived_at.
        self.archived_results_status = 404
        self.seed = seed
        self.prompt_cache = PromptCache()
        self.log_requests = False  # the CLI turns this on; never logs headers
        self.realtime_latency = 0.0  # seconds a realtime answer takes (outside the lock: requests overlap)
        self.engine: EngineBatch | None = None  # a self-hosted engine's batch and /metrics (emulate_engine)
        self._lock = threading.RLock()  # one lock: handlers are short and state is shared
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.fault_book, self.counters, self.rng = Faults(), Counters(), random.Random(seed)
        self.internal_errors: list[str] = []  # tracebacks of sandbox bugs (see raise_internal_errors)
        self.faces = [importlib.import_module(m).Face(self) for m in FACE_MODULES]
        self._routes = [
            (face, method, _compile(pattern), f"{method} {pattern}", handler)
            for face in self.faces
            for method, pattern, handler in face.routes
        ]

    # -- lifecycle of the server ------------------------------------------------
    def start(self) -> Emulator:
        if self._server is None:
            self._server = _Server((self.host, self.port), _Handler)
            self._server.daemon_threads = True
            self._server.emulator = self  # type: ignore[attr-defined]
            self.port = self._server.server_address[1]
            # A short poll interval makes stop() quick (serve_forever checks for shutdown at that pace).
            self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("Emulator not started; call .start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url  # the Anthropic SDK adds /v1 itself

    @property
    def gemini_base_url(self) -> str:
        return self.base_url + "/gemini"  # the SDK adds the API version (v1, v1beta) itself

    def now(self) -> float:
        return time.time()

    # -- Python control API (the /_emulator endpoints call these) ----------------
    def advance(self, batch_id: str, to: str | None = None, done_fraction: float = 0.0) -> dict:
        """Move a batch to `to`, or, with no `to`, one stage along its provider's path (OpenAI
        validating -> in_progress -> finalizing -> completed, cancelling -> cancelled; Anthropic
        in_progress or canceling -> ended)."""
        if not 0.0 <= float(done_fraction) <= 1.0:
            raise ValueError("done_fraction must be between 0 and 1")
        with self._lock:
            self._tick()
            for face in self.faces:
                if face.owns(batch_id):
                    step = to if to is not None else face.next_stage(batch_id)
                    return face.advance(batch_id, step, float(done_fraction))
            raise KeyError(batch_id)

    def complete(self, batch_id: str) -> dict:
        """Run every request of one batch and end it as its provider does on success (OpenAI
        `completed`, Anthropic `ended`)."""
        with self._lock:
            self._tick()
            for face in self.faces:
                if face.owns(batch_id):
                    return face.advance(batch_id, face.completed_stage, 0.0)
            raise KeyError(batch_id)

    def complete_all(self) -> list[dict]:
        with self._lock:
            self._tick()
            return [b for face in self.faces for b in face.complete_all()]

    def expire_results(self, batch_id: str) -> dict:
        """End the retention of an ended batch's results now (OpenAI: its output and error files are
        deleted; Anthropic: its results are archived); downloads then answer the provider's 404."""
        with self._lock:
            self._tick()
            for face in self.faces:
                if face.owns(batch_id):
                    return face.expire_results(batch_id)
            raise KeyError(batch_id)

    def emulate_engine(self, batch: int, kv_room: float) -> EngineBatch:
        """Answer realtime requests as a vLLM engine with `--max-num-seqs batch` whose KV cache holds
        `kv_room` requests, and serve its `GET /metrics` (sandbox/engine.py)."""
        self.engine = EngineBatch(batch, kv_room)
        return self.engine

    def add_fault(self, **kw: Any) -> dict:
        """See answers.Faults.add. An `endpoint` is a route key as in stats(), e.g. "POST /v1/batches"."""
        routes = {key for _, _, _, key, _ in self._routes}
        if kw.get("endpoint") not in (None, "*", *routes):  # a typo would otherwise never fire
            raise ValueError(f"unknown endpoint {kw['endpoint']!r}; use one of {sorted(routes)} or '*'")
        with self._lock:
            return self.fault_book.add(**kw)

    def faults(self) -> list[dict]:
        with self._lock:
            return self.fault_book.list()

    def clear_faults(self) -> None:
        with self._lock:
            self.fault_book.clear()

    def stats(self) -> dict:
        with self._lock:
            return self.counters.snapshot()

    def billed(self) -> list[dict]:
        """Every request the sandbox billed, in order: {face, via ("batch" | "realtime"), batch_id,
        custom_id (batch lines), prompt, request (a digest of the body asked: the same request sent in a
        batch or in realtime has the same digest), usage (its billed tokens)}. Billed means the provider
        charges it: a succeeded batch line (also in a batch that later expired or was cancelled) or an
        answered realtime call, also one whose answer an `after` fault kept from the client."""
        with self._lock:
            self._tick()
            return [dict(b) for b in self.counters.billed]

    def batches(self) -> list[dict]:
        """Every batch of both faces as the provider serves (or, once deleted, last served) it, newest
        first. OpenAI batches have "object": "batch", Anthropic ones "type": "message_batch"."""
        with self._lock:
            self._tick()
            merged = [b for face in self.faces for b in face.batch_list()]
            order = self.counters.creation_order
            return sorted(merged, key=lambda b: order.get(b["id"], -1), reverse=True)

    def file_bytes(self, file_id: str) -> bytes:
        """Test oracle: an OpenAI file's bytes, also after a client deleted it (the API then says 404)."""
        with self._lock:
            for face in self.faces:
                for store in (getattr(face, "contents", {}), getattr(face, "deleted_contents", {})):
                    if file_id in store:
                        return store[file_id]
        raise KeyError(file_id)

    def anthropic_results(self, batch_id: str) -> bytes:
        """Test oracle: an ended Anthropic batch's results stream, also after a client deleted the batch."""
        with self._lock:
            self._tick()
            for face in self.faces:
                job = getattr(face, "jobs", {}).get(batch_id) or getattr(face, "deleted", {}).get(batch_id)
                if job is not None:
                    return job.jsonl or b""
        raise KeyError(batch_id)

    def reset(self) -> None:
        """Forget all files, batches, cached prompts, faults and stats; re-seed the randomness."""
        with self._lock:
            self.fault_book, self.counters, self.rng = Faults(), Counters(), random.Random(self.seed)
            self.prompt_cache = PromptCache()
            for face in self.faces:
                face.reset()

    def _tick(self) -> None:
        # Time is lazy: batches only move along (auto-advance, expiry) when someone looks.
        now = self.now()
        for face in self.faces:
            face.tick(now)

    # -- HTTP dispatch ------------------------------------------------------------
    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> Reply:
        """Answer one HTTP request (socket-free, so it is easy to reason about)."""
        try:
            return self._dispatch(method, raw_path, headers, body)
        except Exception as exc:
            return self.internal_error(urlsplit(raw_path).path, exc)

    def internal_error(self, path: str, exc: BaseException) -> Reply:
        """A bug in the sandbox: recorded (tests fail on it, see raise_internal_errors) and answered as a
        500 in the envelope of the face the path belongs to."""
        self.internal_errors.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        face = self._face_for(path)
        err = ApiError(
            500, f"sandbox internal error: {exc!r}", face.server_error_type, headers={"x-should-retry": "false"}
        )
        return self._render_error(face, err)

    def raise_internal_errors(self) -> None:
        """Fail loudly if any request hit a bug in the sandbox: a client sees such a bug as a provider 500,
        which a robust client survives, so a test would otherwise pass over it."""
        if self.internal_errors:
            raise AssertionError(
                f"the sandbox failed inside {len(self.internal_errors)} time(s); first:\n" + self.internal_errors[0]
            )

    def _face_for(self, path: str):
        # The face owning the longest matching prefix (/v1/messages vs /v1) answers for a path.
        owners = [(len(p), i) for i, f in enumerate(self.faces) for p in f.prefixes if path.startswith(p)]
        return self.faces[max(owners)[1] if owners else 0]

    def _dispatch(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> Reply:
        url = urlsplit(raw_path)
        if url.path.startswith("/_emulator/"):
            return self._control(method, url.path, body)
        if self.engine is not None and (method, url.path) == ("GET", "/metrics"):
            return Reply(200, self.engine.metrics_page(), "text/plain; version=0.0.4; charset=utf-8")
        req = Request(method, url.path, dict(parse_qsl(url.query)), headers, body)
        with self._lock:
            self._tick()
            for face, route_method, regex, key, handler in self._routes:
                m = regex.match(url.path)
                if m and route_method == method:
                    self.counters.calls[key] += 1
                    req.params = m.groupdict()
                    return self._call(face, handler, req, key)
            self.counters.calls[f"{method} <unmatched>"] += 1
            face = self._face_for(url.path)
            return self._render_error(face, face.route_not_found(method, url.path))

    def _call(self, face, handler, req: Request, key: str) -> Reply:
        edge = getattr(face, "edge_check", None)
        rejected = edge(req) if edge else None
        if rejected is not None:
            return self._render_error(face, rejected)
        presented = face.api_key_from(req.headers) or ""
        # A face's session URL may carry its own authorization (Gemini's resumable upload URL).
        preauthorized = getattr(face, "preauthorized", None)
        if not (preauthorized and preauthorized(req)) and not hmac.compare_digest(
            presented.encode(), self._api_key.encode()
        ):
            return self._render_error(face, face.auth_error(presented))
        fault = self.fault_book.take_endpoint(key, req.path)
        if fault and fault["when"] == "before" and fault["kind"] != "truncate":
            return self._fault_reply(face, fault)  # nothing happened: the handler never ran
        try:
            result = handler(req)
        except ApiError as err:
            result = self._render_error(face, err)
        if fault and fault["when"] == "after" and fault["kind"] != "truncate":
            # The work is done (a batch created, an answer billed) and the client still sees a failure,
            # as after a real 5xx / gateway timeout / reset that follows the provider's own commit.
            return self._fault_reply(face, fault)
        request_id = self._request_id()
        if isinstance(result, bytes):
            result = Reply(200, result, "application/octet-stream")
        elif not isinstance(result, Reply):
            result = Reply(200, _json_bytes(result))
        result.headers.setdefault(face.request_id_header, request_id)
        if fault and fault["kind"] == "truncate":
            result.cut = "truncate"
        return result

    def _fault_reply(self, face, fault: dict) -> Reply:
        if fault["kind"] == "disconnect":
            return Reply(0, b"", cut="disconnect")
        if fault["kind"] == "proxy_error":  # a proxy in front of the API answers: a page, not JSON
            status = fault["status_code"]
            text = fault["message"] or PROXY_PAGES.get(status, f"{status} Error")
            body = (
                f"<html>\r\n<head><title>{text}</title></head>\r\n<body>\r\n<center><h1>{text}</h1></center>"
                "\r\n<hr><center>cloudflare</center>\r\n</body>\r\n</html>\r\n"
            ).encode()
            return Reply(status, body, "text/html")
        err = face.endpoint_fault_error(fault)
        if fault["retry_after"] is not None:
            err.headers["retry-after"] = f"{fault['retry_after']:g}"
        return self._render_error(face, err)

    def _render_error(self, face, err: ApiError) -> Reply:
        request_id = self._request_id()
        return Reply(
            err.status,
            _json_bytes(face.error_payload(err, request_id)),
            headers={face.request_id_header: request_id, **err.headers},
        )

    def _request_id(self) -> str:
        return "req_" + "".join(self.rng.choices("0123456789abcdef", k=32))

    def _control(self, method: str, path: str, body: bytes) -> Reply:
        try:
            data = json.loads(body) if body.strip() else {}
            if not isinstance(data, dict):
                raise ValueError("control request body must be a JSON object")
            route = f"{method} {path.rstrip('/')}"
            m = re.fullmatch(r"POST /_emulator/batches/([^/]+)/advance", route)
            complete = re.fullmatch(r"POST /_emulator/batches/([^/]+)/complete", route)
            expire = re.fullmatch(r"POST /_emulator/batches/([^/]+)/expire_results", route)

            def clear_faults() -> dict:
                self.clear_faults()
                return {"faults": []}

            def reset() -> dict:
                self.reset()
                return {"reset": True}

            simple = {
                "POST /_emulator/complete_all": lambda: {"batches": self.complete_all()},
                "POST /_emulator/faults": lambda: self.add_fault(**data),
                "GET /_emulator/faults": lambda: {"faults": self.faults()},
                "DELETE /_emulator/faults": clear_faults,
                "GET /_emulator/stats": self.stats,
                "GET /_emulator/batches": lambda: {"batches": self.batches()},
                "POST /_emulator/reset": reset,
            }
            # A batch id is percent-encoded in the path when it has a slash (a Bedrock job ARN).
            if m:
                result = self.advance(unquote(m.group(1)), data.get("to"), data.get("done_fraction") or 0.0)
            elif complete:
                result = self.complete(unquote(complete.group(1)))
            elif expire:
                result = self.expire_results(unquote(expire.group(1)))
            elif route in simple:
                result = simple[route]()
            else:
                return Reply(404, _json_bytes({"error": {"message": f"No control endpoint {route}"}}))
        except KeyError as exc:
            return Reply(404, _json_bytes({"error": {"message": f"No batch with id {exc.args[0]!r}"}}))
        except (TypeError, ValueError) as exc:  # bad arguments or an impossible transition
            return Reply(400, _json_bytes({"error": {"message": str(exc)}}))
        return Reply(200, _json_bytes(result))


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: a burst of new connections beyond a few waits in the
    # kernel for a SYN retransmit (about 1 s) before the sandbox sees it, so requests sent at once
    # reached it spread out, and an engine's count of requests in flight undercounted them (of 32 sent
    # together it saw at most 10). vLLM's server (uvicorn) and hosted APIs listen with 2048.
    request_queue_size = 2048


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's connection pool expects
    disable_nagle_algorithm = True  # headers and body go out in two writes; avoid a 40 ms stall
    server_version = "dbt-llm-batch-sandbox"

    def _handle(self) -> None:
        emulator: Emulator = self.server.emulator  # type: ignore[attr-defined]
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            reply = emulator.handle(self.command, self.path, headers, self._read_body(headers))
        except Exception as exc:  # a sandbox bug must not look like a hung provider
            reply = emulator.internal_error(urlsplit(self.path).path, exc)
        if reply.cut == "disconnect":  # like a reset connection: no status line at all
            self.close_connection = True
            return
        if urlsplit(self.path).path in REALTIME_PATHS and (emulator.realtime_latency or emulator.engine):
            # A model takes a while; other requests proceed meanwhile (an engine's batch: up to its size).
            with emulator.engine.place() if emulator.engine else contextlib.nullcontext():
                time.sleep(emulator.realtime_latency)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if reply.cut == "truncate":  # the full Content-Length is promised, half is sent
            self.wfile.write(reply.body[: len(reply.body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(reply.body)

    def _read_body(self, headers: dict[str, str]) -> bytes:
        if "chunked" not in headers.get("transfer-encoding", "").lower():
            return self.rfile.read(int(headers.get("content-length") or 0))
        chunks = []  # chunked upload (curl -T, streaming clients)
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline().strip():  # skip trailers up to the blank line
            pass
        return b"".join(chunks)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _handle

    def log_message(self, format: str, *args: Any) -> None:
        # The request line never carries the API key, so it is safe to print.
        if self.server.emulator.log_requests:  # type: ignore[attr-defined]
            sys.stderr.write("[sandbox] %s\n" % (format % args))


def main(argv: list[str] | None = None) -> int:
    """The sandbox CLI (kept importable from here; it lives in cli.py)."""
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    # Run main() from the importable module, not from __main__: the faces import
    # ApiError from dbt_llm_batch.sandbox.server and must see the same class.
    from dbt_llm_batch.sandbox.cli import main as _main

    sys.exit(_main())
