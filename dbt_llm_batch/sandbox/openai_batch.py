"""OpenAI Files + Batches face of the sandbox: state, validation, results.

Follows the OpenAI Batch API docs and SDK:
create answers `validating`, validation happens later and can end `failed`
with `errors.data`; results go to an output file (successes) and an error file
(failures), each in shuffled order; expiry and cancellation keep partial output.
Per-request results are computed only when a batch is processed, from the
deterministic answer function unless a fault applies. Prompt caching is
automatic, as at OpenAI (caching.openai_cached_tokens). The Files API is in
openai_files.py.
"""

from __future__ import annotations

import copy
import json
import math
import string
from dataclasses import dataclass, field

from .answers import (
    InvalidBody,
    answer_chat_request,
    batch_error,
    chat_inputs,
    check_lines,
    estimate_input_tokens,
    faulted_lines,
)
from .caching import openai_cached_tokens
from .embeddings import answer_embeddings_request, inputs_of
from .openai_files import DAY, FilesMixin, list_page, require, ttl_seconds
from .realtime import openai_chat_completion, openai_embeddings
from .server import ApiError, Request

HEX = "0123456789abcdef"
ENDPOINTS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)
EMULATED_ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
TOKEN_LIMIT = (
    "Enqueued token limit reached for {model} in organization org-sandbox. Limit: {limit:,} enqueued "
    "tokens. Please try again once some in_progress batches have been completed."
)
ENDPOINT_FAULTS = {  # status -> (message, type, code) as the real API words them
    429: ("Rate limit reached for requests", "requests", "rate_limit_exceeded"),
    500: ("The server had an error while processing your request. Sorry about that!", "server_error", None),
    503: ("The engine is currently overloaded, please try again later.", "server_error", None),
}


@dataclass
class Run:
    """One batch: the served Batch object plus what the provider keeps behind it."""

    obj: dict
    data: bytes  # input snapshot taken at create, so deleting the file later changes nothing
    output_ttl: int
    stage_started: float  # when the current status began (drives auto-advance)
    requests: list[dict] | None = None  # set once validation passed
    todo: list[int] = field(default_factory=list)  # requests not yet run, in (random) processing order
    out_lines: list[dict] = field(default_factory=list)
    err_lines: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # prompt, completion, cached over successes
    enqueued_tokens: int = 0  # prompt tokens of all its requests (the enqueued-token limit counts them)


class Face(FilesMixin):
    """The OpenAI face: routes, envelopes and batch lifecycle (protocol in server.py)."""

    name = "openai"
    server_error_type = "server_error"
    prefixes = ("/v1",)
    request_id_header = "x-request-id"
    batch_endpoints: tuple[str, ...] = ENDPOINTS  # what `endpoint` of a create (and `url` of each line) may name
    emulated_endpoints: tuple[str, ...] = EMULATED_ENDPOINTS
    # OpenAI expires a batch not done within its 24 h window (finished work kept); Azure does not.
    window_expires = True
    token_limit_message = TOKEN_LIMIT

    def __init__(self, emu) -> None:
        self.emu = emu  # shared machinery: rng, fault_book, counters, now(), limits
        self.routes = [
            ("POST", "/v1/files", self.upload_file),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{id}", self.get_file),
            ("DELETE", "/v1/files/{id}", self.delete_file),
            ("GET", "/v1/files/{id}/content", self.file_content),
            ("POST", "/v1/batches", self.create_batch),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{id}", self.get_batch),
            ("POST", "/v1/batches/{id}/cancel", self.cancel_batch),
            ("POST", "/v1/chat/completions", lambda req: openai_chat_completion(self, req)),  # realtime
            ("POST", "/v1/embeddings", lambda req: openai_embeddings(self, req)),  # realtime
        ]
        self.reset()

    def reset(self) -> None:
        self.files: dict[str, dict] = {}  # FileObjects as served
        self.contents: dict[str, bytes] = {}
        self.deleted_contents: dict[str, bytes] = {}
        self.runs: dict[str, Run] = {}  # insertion order = creation order

    # -- auth and error envelopes ----------------------------------------------------
    def api_key_from(self, headers: dict[str, str]) -> str | None:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None

    def auth_error(self, presented: str | None) -> ApiError:
        if not presented:
            return ApiError(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        shown = f"{presented[:3]}***{presented[-4:]}" if len(presented) >= 12 else "***"
        return ApiError(
            401,
            f"Incorrect API key provided: {shown}. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            code="invalid_api_key",
        )

    def route_not_found(self, method: str, path: str) -> ApiError:
        return ApiError(404, f"Invalid URL ({method} {path})")

    def endpoint_fault_error(self, fault: dict) -> ApiError:
        status = fault["status_code"]
        message, type_, code = ENDPOINT_FAULTS.get(
            status, ("Sandbox fault injected.", "server_error" if status >= 500 else "invalid_request_error", None)
        )
        return ApiError(
            status, fault["message"] or message, fault["type"] or type_, fault["code"] or code, fault["param"]
        )

    def error_payload(self, err: ApiError, request_id: str) -> dict:
        return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}

    # -- Batches: HTTP -------------------------------------------------------------------
    def create_batch(self, req: Request) -> dict:
        p = req.json()
        require(isinstance(p, dict), "The request body must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            require(
                p.get(name) is not None, f"Missing required parameter: '{name}'.", name, "missing_required_parameter"
            )
        require(
            p["endpoint"] in self.batch_endpoints,
            f"Invalid value: '{p['endpoint']}'. Supported values are: {', '.join(self.batch_endpoints)}.",
            "endpoint",
            "invalid_value",
        )
        # A sandbox limit, said plainly rather than faked with wrong-shaped results.
        require(
            p["endpoint"] in self.emulated_endpoints,
            f"The sandbox emulator only emulates {', '.join(self.emulated_endpoints)} batches.",
            "endpoint",
        )
        require(
            p["completion_window"] == "24h",
            f"Invalid value: '{p['completion_window']}'. Supported values are: '24h'.",
            "completion_window",
            "invalid_value",
        )
        metadata = _metadata(p.get("metadata"))
        expiry = p.get("output_expires_after") or {"anchor": "created_at", "seconds": 30 * DAY}
        require(
            isinstance(expiry, dict) and expiry.get("anchor") == "created_at",
            "Invalid 'output_expires_after.anchor': expected 'created_at'.",
            "output_expires_after.anchor",
        )
        output_ttl = ttl_seconds(expiry.get("seconds"), "output_expires_after.seconds")
        source = self._file(p["input_file_id"], "input_file_id")
        require(
            source["purpose"] == "batch",
            f"Invalid 'input_file_id': file {source['id']} has purpose "
            f"'{source['purpose']}', but batches need purpose 'batch'.",
            "input_file_id",
        )
        data = self.contents[source["id"]]
        now = self.emu.now()
        obj = {
            "id": self._id("batch_", 32, HEX),
            "object": "batch",
            "endpoint": p["endpoint"],
            "model": None,
            "errors": None,
            "input_file_id": source["id"],
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": int(now),
            "in_progress_at": None,
            "expires_at": int(now) + DAY if self.window_expires else None,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": None,
            "metadata": metadata,
        }
        self.runs[obj["id"]] = Run(obj, data, output_ttl, now)
        self.emu.counters.new_batch(self.name, obj["id"], sum(1 for raw in data.split(b"\n") if raw.strip()))
        return copy.deepcopy(obj)

    def get_batch(self, req: Request) -> dict:
        return copy.deepcopy(self._run(req.params["id"]).obj)

    def cancel_batch(self, req: Request) -> dict:
        run = self._run(req.params["id"])
        status = run.obj["status"]
        require(status in OPEN, f"Cannot cancel a batch with status '{status}'.", status=409)
        if status != "cancelling":  # cancelling twice is harmless
            self._set_status(run, "cancelling", self.emu.now())
        return copy.deepcopy(run.obj)

    def list_batches(self, req: Request) -> dict:
        return list_page(self.batch_list(), req.query, default=20, maximum=100)

    def _run(self, batch_id: str) -> Run:
        require(batch_id in self.runs, f"No batch found with id '{batch_id}'.", "batch_id", status=404)
        return self.runs[batch_id]

    # -- hooks for the Emulator ----------------------------------------------------------
    def owns(self, batch_id: str) -> bool:
        return batch_id in self.runs

    def batch_list(self) -> list[dict]:
        return [copy.deepcopy(run.obj) for run in reversed(self.runs.values())]  # newest first

    def complete_all(self) -> list[dict]:
        open_ids = [bid for bid, run in self.runs.items() if run.obj["status"] in OPEN]
        return [
            self.advance(bid, "cancelled" if self.runs[bid].obj["status"] == "cancelling" else "completed", 0.0)
            for bid in open_ids
        ]

    completed_stage = "completed"  # where Emulator.complete takes a batch

    def next_stage(self, batch_id: str) -> str:
        """The stage after the batch's current one (an advance with no `to`)."""
        status = self.runs[batch_id].obj["status"]
        following = {
            "validating": "in_progress",
            "in_progress": "finalizing",
            "finalizing": "completed",
            "cancelling": "cancelled",
        }
        if status not in following:
            raise ValueError(f"batch {batch_id} has ended ({status!r}): there is no next stage")
        return following[status]

    def advance(self, batch_id: str, to: str, done_fraction: float) -> dict:
        """Move a batch to `to` through the provider's own path (tests drive this)."""
        run, now = self.runs[batch_id], self.emu.now()
        status = run.obj["status"]
        path = ("validating", "in_progress", "finalizing", "completed")
        if to == status and to != "in_progress":
            pass
        elif to in path[1:] and status in path[: path.index(to) + 1]:
            if status == "validating" and not self._leave_validating(run, now):
                return copy.deepcopy(run.obj)  # a bad file ends `failed`, whatever was asked
            self._run_until(run, 1.0 if to != "in_progress" else done_fraction, now)
            if to != "in_progress" and run.obj["status"] == "in_progress":
                self._set_status(run, "finalizing", now)
            if to == "completed":
                self._finish(run, "completed", now)
        elif to == "failed" and status == "validating":
            self._leave_validating(run, now, force_fail=True)
        elif to == "expired" and status in ("validating", "in_progress") and self.window_expires:
            if status == "in_progress" or self._leave_validating(run, now):
                self._run_until(run, done_fraction, now)
                self._finish(run, "expired", now)
        elif to in ("cancelling", "cancelled") and status in OPEN:
            # Only a validated batch can have run anything before the cancel lands.
            if status == "validating" and to == "cancelled" and done_fraction > 0:
                if not self._leave_validating(run, now):
                    return copy.deepcopy(run.obj)
            if run.obj["status"] != "cancelling":
                self._set_status(run, "cancelling", now)
            if to == "cancelled":
                self._run_until(run, done_fraction, now)
                self._finish(run, "cancelled", now)
        else:
            raise ValueError(f"cannot advance batch {batch_id} from '{status}' to {to!r}")
        return copy.deepcopy(run.obj)

    def expire_results(self, batch_id: str) -> dict:
        """Retention ended: the batch's output and error files are deleted, as OpenAI does 30 days
        after completion; their content then answers 404 like any missing file."""
        run = self.runs[batch_id]
        if run.obj["status"] in OPEN:
            raise ValueError(f"batch {batch_id} has not ended; only an ended batch's results expire")
        for key in ("output_file_id", "error_file_id"):
            if run.obj[key] in self.files:
                self._forget_file(run.obj[key])
        return copy.deepcopy(run.obj)

    def tick(self, now: float) -> None:
        """Auto-advance (each stage lasts `auto_advance_seconds`; catch up on any lag), the 24 h
        completion window (`expires_at`), and file retention (`expires_at` of each file)."""
        stage = self.emu.auto_advance_seconds
        for run in self.runs.values():
            deadline = run.obj["expires_at"]
            if stage is not None:  # otherwise batches move only when told to
                self._auto_advance(run, stage, now if deadline is None else min(now, deadline))
            if deadline is not None and now >= deadline and run.obj["status"] in ("validating", "in_progress"):
                # OpenAI Batch guide: unfinished requests of a batch not done within 24 h are cancelled
                # and reported as batch_expired; completed ones stay in the output file (and are billed).
                if run.obj["status"] == "in_progress" or self._leave_validating(run, deadline):
                    self._finish(run, "expired", deadline)
            if stage is not None and deadline is not None and now > deadline:
                self._auto_advance(run, stage, now)  # finalizing / cancelling may end after the window
        for file_id in [i for i, f in self.files.items() if f["expires_at"] is not None and now >= f["expires_at"]]:
            self._forget_file(file_id)  # retention ended: the provider deleted it

    def _auto_advance(self, run: Run, stage: float, now: float) -> None:
        while run.obj["status"] in OPEN:
            status, due = run.obj["status"], run.stage_started + stage
            if status == "in_progress":  # requests complete steadily through the stage
                self._run_until(run, 1.0 if stage <= 0 else min(1.0, (now - run.stage_started) / stage), due)
            if now < due:
                break
            if status == "validating":
                self._leave_validating(run, due)
            elif status == "in_progress":
                self._set_status(run, "finalizing", due)
            else:  # finalizing or cancelling
                self._finish(run, "completed" if status == "finalizing" else "cancelled", due)

    # -- Batches: lifecycle ------------------------------------------------------------
    def _set_status(self, run: Run, status: str, at: float) -> None:
        run.obj["status"] = status
        run.obj[f"{status}_at"] = int(at)
        run.stage_started = at

    def _leave_validating(self, run: Run, at: float, force_fail: bool = False) -> bool:
        errors, requests, model = check_lines(run.data, run.obj["endpoint"], self.emu.max_requests_per_batch)
        errors = errors or faulted_lines(run.data, self.emu.fault_book)
        tokens = sum(_prompt_tokens(r["body"]) for r in requests) if not errors else 0
        if not errors and force_fail:
            errors = [batch_error("sandbox_forced_failure", None, "Batch failed on request of the sandbox controller.")]
        elif not errors and (self.emu.fault_book.take_token_limit() or self._over_token_limit(model, tokens)):
            errors = [
                batch_error(
                    "token_limit_exceeded",
                    None,
                    self.token_limit_message.format(
                        model=model, limit=self.emu.openai_enqueued_token_limit or 2_000_000
                    ),
                )
            ]
        elif not errors and (failure := self.emu.fault_book.take_batch_failure()):
            errors = [
                batch_error(
                    failure["code"] or "invalid_request",
                    None,
                    failure["message"] or "The batch could not be processed.",
                    failure["param"],
                )
            ]
        if errors:
            run.obj["errors"] = {"object": "list", "data": errors}
            self._set_status(run, "failed", at)
            return False
        run.requests, run.obj["model"], run.enqueued_tokens = requests, model, tokens
        run.obj["request_counts"]["total"] = len(requests)
        run.todo = list(range(len(requests)))
        self.emu.rng.shuffle(run.todo)  # the provider does not run requests in file order
        self._set_status(run, "in_progress", at)
        return True

    def _over_token_limit(self, model: str | None, tokens: int) -> bool:
        """OpenAI Batch guide: an organisation may have at most so many prompt tokens enqueued per model
        (over all its batches in progress); a batch over it fails validation with token_limit_exceeded
        (create itself does not raise)."""
        limit = self.emu.openai_enqueued_token_limit
        if limit is None:
            return False
        enqueued = sum(
            r.enqueued_tokens
            for r in self.runs.values()
            if r.obj["model"] == model and r.obj["status"] in ("in_progress", "finalizing", "cancelling")
        )
        return enqueued + tokens > limit

    def _run_until(self, run: Run, fraction: float, at: float) -> None:
        """Run requests until `fraction` of the batch is done (never undoes work)."""
        if run.requests is None:
            return
        target = math.floor(len(run.requests) * fraction + 1e-9)
        while run.todo and len(run.requests) - len(run.todo) < target:
            self._execute(run, run.requests[run.todo.pop()], at)  # todo is shuffled; pop() is O(1)

    def _execute(self, run: Run, line: dict, at: float) -> None:
        if run.obj["endpoint"] == "/v1/embeddings":
            self._execute_embeddings(run, line)
            return
        model, emu = line["body"].get("model"), self.emu
        status, body, done = answer_chat_request(
            line["body"],
            emu.fault_book,
            self._id,
            int(at),
            lambda ask: openai_cached_tokens(
                emu.prompt_cache, model, ask, emu.min_cache_tokens, at, emu.openai_cache_ttl_seconds
            ),
            emu.null_usage_details,
        )
        result = self._line(line, {"status_code": status, "request_id": self._id("req_", 32, HEX), "body": body})
        counts = run.obj["request_counts"]
        if done is None:
            counts["failed"] += 1
            run.err_lines.append(result)
            return
        counts["completed"] += 1
        run.out_lines.append(result)
        run.tokens[0] += done.prompt_tokens
        run.tokens[1] += done.completion_tokens
        run.tokens[2] += done.cached_tokens
        tokens = {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "cached_tokens": done.cached_tokens,
        }
        self.emu.counters.add_usage(self.name, **tokens)
        prompt = chat_inputs(line["body"]).prompt
        self.emu.counters.bill(self.name, "batch", prompt, line["body"], tokens, run.obj["id"], line["custom_id"])

    def _execute_embeddings(self, run: Run, line: dict) -> None:
        """One /v1/embeddings line (its `input` may be an array: every text embedded, billed once)."""

        def bill(texts: list[str], tokens: int) -> None:
            self.emu.counters.embedded("batch", texts, line["body"], tokens, run.obj["id"], line["custom_id"])

        status, body, tokens = answer_embeddings_request(line["body"], self.emu.fault_book, bill)
        result = self._line(line, {"status_code": status, "request_id": self._id("req_", 32, HEX), "body": body})
        counts = run.obj["request_counts"]
        if tokens is None:
            counts["failed"] += 1
            run.err_lines.append(result)
            return
        counts["completed"] += 1
        run.out_lines.append(result)
        run.tokens[0] += tokens

    def _line(self, line: dict, response: dict | None, error: dict | None = None) -> dict:
        return {
            "id": self._id("batch_req_", 32, HEX),
            "custom_id": line["custom_id"],
            "response": response,
            "error": error,
        }

    def _finish(self, run: Run, status: str, at: float) -> None:
        """Enter a terminal status: write result files and the batch's usage."""
        if status == "expired":  # unfinished requests are reported, not silently dropped
            for index in run.todo:
                assert run.requests is not None  # only a validated batch has requests to run
                run.err_lines.append(self._line(run.requests[index], None, dict(EXPIRED)))
            run.obj["request_counts"]["failed"] += len(run.todo)
        run.todo = []  # a cancelled batch simply never runs the rest
        for kind, lines in (("output", run.out_lines), ("error", run.err_lines)):
            if lines:
                shuffled = lines[:]
                self.emu.rng.shuffle(shuffled)  # result order is not input order; clients join on custom_id
                data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in shuffled).encode()
                f = self._store(f"{run.obj['id']}_{kind}.jsonl", "batch_output", data, at, run.output_ttl)
                run.obj[f"{kind}_file_id"] = f["id"]
        if run.requests is not None:
            p, c, cached = run.tokens
            run.obj["usage"] = {
                "input_tokens": p,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": c,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": p + c,
            }
        self._set_status(run, status, at)

    def _id(self, prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return prefix + "".join(self.emu.rng.choices(alphabet, k=length))


def _prompt_tokens(body: dict) -> int:
    """Prompt tokens a line enqueues (0 for a body that will fail when it runs)."""
    if "input" in body and "messages" not in body:  # an embeddings line
        try:
            return sum(estimate_input_tokens(len(t)) for t in inputs_of(body))
        except ValueError:
            return 0
    try:
        return estimate_input_tokens(chat_inputs(body).prompt_chars)
    except InvalidBody:
        return 0


def _metadata(metadata: object) -> dict | None:
    if metadata is None:
        return None
    require(
        isinstance(metadata, dict) and len(metadata) <= 16,
        "Invalid 'metadata': expected an object with at most 16 pairs.",
        "metadata",
    )
    assert isinstance(metadata, dict)  # require() raised otherwise
    for key, value in metadata.items():
        require(
            len(key) <= 64 and isinstance(value, str) and len(value) <= 512,
            "Invalid 'metadata': keys must be "
            f"at most 64 characters and values strings of at most 512 characters (key '{key[:64]}').",
            "metadata",
        )
    return dict(metadata)
