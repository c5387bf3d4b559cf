"""Anthropic Message Batches face of the sandbox: routes, envelopes, lifecycle.

Follows the Anthropic Message Batches docs and SDK:
- create answers `in_progress`; only the envelope (request count, custom_id
  pattern and uniqueness, body size) is checked synchronously; bad `params`
  become `errored` result lines (anthropic_messages.py).
- in_progress -> ended, or in_progress -> canceling -> ended; every request
  counts as `processing` until the batch ends, then as succeeded / errored /
  canceled / expired. A batch still open 24 h after creation expires; results
  are archived (`archived_at`, no more results) 29 days after creation.
- Requests run in input order (so the first of N identical cached prefixes
  writes the cache and the others read it); the results stream is shuffled.
- `results_url` is absolute and points back at this server.
Auth: `x-api-key: <key>` or `Authorization: Bearer <key>`, any `anthropic-version`.
"""

from __future__ import annotations

import copy
import json
import math
import string
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .anthropic_messages import CUSTOM_ID, error_type_for, read_params, run_request
from .realtime import anthropic_create_message
from .server import ApiError, Reply, Request

DAY = 86400
EXPIRES_AFTER = DAY
RESULTS_KEPT = 29 * DAY
ENDPOINT_FAULTS = {  # status -> message, as the real API words them
    429: "Number of request tokens has exceeded your per-minute rate limit "
    "(https://docs.claude.com/en/api/rate-limits); see the response headers for current usage. "
    "Please reduce the prompt length or the maximum tokens requested, or try again later.",
    500: "Internal server error",
    529: "Overloaded",
}


def rfc3339(at: float | None) -> str | None:
    if at is None:
        return None
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Job:
    """One message batch: the served object plus what the provider keeps behind it."""

    obj: dict  # MessageBatch as served, except results_url (rendered per request)
    requests: list[dict]  # [{"custom_id", "params"}] in input order
    created: float
    stage_started: float  # when the current processing_status began (drives auto-advance)
    results: list[dict] = field(default_factory=list)  # `result` objects, input order, for the requests done
    jsonl: bytes | None = None  # the results stream, once ended and until archived


class Face:
    """The Anthropic face: routes, envelopes and batch lifecycle (protocol in server.py)."""

    name = "anthropic"
    server_error_type = "api_error"
    prefixes = ("/v1/messages",)
    request_id_header = "request-id"

    def __init__(self, emu) -> None:
        self.emu = emu
        base = "/v1/messages/batches"
        self.routes = [
            ("POST", base, self.create_batch),
            ("GET", base, self.list_batches),
            ("GET", base + "/{id}", self.get_batch),
            ("DELETE", base + "/{id}", self.delete_batch),
            ("POST", base + "/{id}/cancel", self.cancel_batch),
            ("GET", base + "/{id}/results", self.batch_results),
            ("POST", "/v1/messages", lambda req: anthropic_create_message(self, req)),  # realtime
        ]
        self.reset()

    def reset(self) -> None:
        self.jobs: dict[str, Job] = {}  # insertion order = creation order
        self.deleted: dict[str, Job] = {}  # gone from the API; still in batch_list() for test oracles

    # -- auth and error envelopes ----------------------------------------------------
    def api_key_from(self, headers: dict[str, str]) -> str | None:
        if headers.get("x-api-key"):
            return headers["x-api-key"].strip()
        scheme, _, key = headers.get("authorization", "").partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None

    def auth_error(self, presented: str | None) -> ApiError:
        return ApiError(
            401, "invalid x-api-key" if presented else "x-api-key header is required", "authentication_error"
        )

    def route_not_found(self, method: str, path: str) -> ApiError:
        return ApiError(404, "Not Found", "not_found_error")

    def endpoint_fault_error(self, fault: dict) -> ApiError:
        status = fault["status_code"]
        return ApiError(
            status,
            fault["message"] or ENDPOINT_FAULTS.get(status, "Sandbox fault injected."),
            fault["type"] or error_type_for(status),
        )

    def error_payload(self, err: ApiError, request_id: str) -> dict:
        return {"type": "error", "error": {"type": err.type, "message": err.message}, "request_id": request_id}

    def edge_check(self, req: Request) -> ApiError | None:
        # The provider's CDN refuses oversized bodies before the API (and auth) sees them.
        if len(req.body) > self.emu.max_batch_bytes:
            return ApiError(413, "Request exceeds the maximum allowed number of bytes.", "request_too_large")
        return None

    # -- HTTP ----------------------------------------------------------------------------
    def create_batch(self, req: Request) -> dict:
        p = req.json()
        _require(isinstance(p, dict), "Input should be a valid dictionary")
        requests = p.get("requests")
        _require(requests is not None, "requests: Field required")
        _require(isinstance(requests, list), "requests: Input should be a valid list")
        limit = self.emu.max_message_batch_requests
        _require(len(requests) >= 1, "requests: List should have at least 1 item after validation, not 0")
        _require(
            len(requests) <= limit,
            f"requests: List should have at most {limit} items after validation, not {len(requests)}",
        )
        seen: dict[str, int] = {}
        for i, item in enumerate(requests):
            _require(isinstance(item, dict), f"requests.{i}: Input should be a valid dictionary")
            custom_id = item.get("custom_id")
            _require(custom_id is not None, f"requests.{i}.custom_id: Field required")
            _require(isinstance(custom_id, str), f"requests.{i}.custom_id: Input should be a valid string")
            _require(len(custom_id) >= 1, f"requests.{i}.custom_id: String should have at least 1 character")
            _require(len(custom_id) <= 64, f"requests.{i}.custom_id: String should have at most 64 characters")
            _require(
                CUSTOM_ID.match(custom_id), f"requests.{i}.custom_id: String should match pattern '{CUSTOM_ID.pattern}'"
            )
            _require(
                custom_id not in seen,
                f"requests.{i}.custom_id: Duplicate custom_id '{custom_id}' "
                f"(also used by requests.{seen.get(custom_id)}); custom_id must be unique within a batch",
            )
            seen[custom_id] = i
            _require("params" in item, f"requests.{i}.params: Field required")
            _require(isinstance(item["params"], dict), f"requests.{i}.params: Input should be a valid dictionary")
        cap = self.emu.anthropic_max_queued_requests
        if cap is not None:
            # Anthropic rate limits: one cap on "batch requests in processing queue" per workspace, over
            # every model; a create that would go over it is refused with a 429.
            queued = sum(len(j.requests) for j in self.jobs.values() if j.obj["processing_status"] != "ended")
            if queued + len(requests) > cap:
                raise ApiError(
                    429,
                    f"Number of batch requests in the processing queue would exceed your "
                    f"organization's rate limit of {cap:,} queued requests ({queued:,} queued, "
                    f"{len(requests):,} in this batch). Please try again once some batches "
                    "have ended.",
                    "rate_limit_error",
                    headers={"retry-after": "60"},
                )
        now = self.emu.now()
        obj: dict[str, Any] = {
            "id": self._id("msgbatch_01", 22),
            "type": "message_batch",
            "processing_status": "in_progress",
            "request_counts": {"processing": len(requests), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
            "ended_at": None,
            "created_at": rfc3339(now),
            "expires_at": rfc3339(now + EXPIRES_AFTER),
            "archived_at": None,
            "cancel_initiated_at": None,
            "results_url": None,
        }
        job = Job(obj, [{"custom_id": r["custom_id"], "params": r["params"]} for r in requests], now, now)
        self.jobs[obj["id"]] = job
        self.emu.counters.new_batch(self.name, obj["id"], len(requests))
        return self._render(job, req)

    def get_batch(self, req: Request) -> dict:
        return self._render(self._job(req.params["id"]), req)

    def list_batches(self, req: Request) -> dict:
        try:
            limit = int(req.query.get("limit", 20))
        except ValueError:
            raise ApiError(400, "limit: Input should be a valid integer") from None
        _require(limit >= 1, "limit: Input should be greater than or equal to 1")
        _require(limit <= 1000, "limit: Input should be less than or equal to 1000")
        ids = list(reversed(self.jobs))  # newest first
        for name in ("after_id", "before_id"):
            _require(
                not req.query.get(name) or req.query[name] in self.jobs,
                f"{name}: no Message Batch with id '{req.query.get(name)}'",
            )
        if req.query.get("after_id"):
            ids = ids[ids.index(req.query["after_id"]) + 1 :]
        if req.query.get("before_id"):  # the page just before (newer than) that batch
            ids = ids[: ids.index(req.query["before_id"])]
            page, has_more = ids[-limit:], len(ids) > limit
        else:
            page, has_more = ids[:limit], len(ids) > limit
        return {
            "data": [self._render(self.jobs[i], req) for i in page],
            "has_more": has_more,
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
        }

    def cancel_batch(self, req: Request) -> dict:
        job = self._job(req.params["id"])
        status = job.obj["processing_status"]
        _require(status != "ended", f"Message Batch {job.obj['id']} has already ended and cannot be canceled.")
        if status == "in_progress":  # canceling twice is harmless
            self._set_canceling(job, self.emu.now())
        return self._render(job, req)

    def delete_batch(self, req: Request) -> dict:
        job = self._job(req.params["id"])
        _require(
            job.obj["processing_status"] == "ended",
            f"Message Batch {job.obj['id']} cannot be deleted while processing is "
            f"'{job.obj['processing_status']}'. You must first cancel it and wait for it to end.",
        )
        self.deleted[job.obj["id"]] = self.jobs.pop(job.obj["id"])
        return {"id": job.obj["id"], "type": "message_batch_deleted"}

    def batch_results(self, req: Request) -> Reply:
        job = self._job(req.params["id"])
        _require(
            job.obj["processing_status"] == "ended",
            f"Message Batch {job.obj['id']} has not yet ended; "
            "its results are available once processing_status is 'ended'.",
        )
        if job.jsonl is None:  # archived; which status the provider answers then is not documented
            status = self.emu.archived_results_status
            raise ApiError(
                status,
                f"The results of Message Batch {job.obj['id']} are no longer available: batch "
                "results are kept for 29 days after creation.",
                error_type_for(status),
            )
        return Reply(200, job.jsonl, "application/binary")

    def _job(self, batch_id: str) -> Job:
        if batch_id not in self.jobs:
            raise ApiError(404, f"Message Batch {batch_id} not found.", "not_found_error")
        return self.jobs[batch_id]

    def _render(self, job: Job, req: Request | None = None) -> dict:
        obj = copy.deepcopy(job.obj)
        if obj["processing_status"] == "ended":
            host = (req.headers.get("host") if req else None) or f"{self.emu.host}:{self.emu.port}"
            obj["results_url"] = f"http://{host}/v1/messages/batches/{obj['id']}/results"
        return obj

    # -- hooks for the Emulator ----------------------------------------------------------
    def owns(self, batch_id: str) -> bool:
        return batch_id in self.jobs

    def batch_list(self) -> list[dict]:
        jobs = sorted([*self.jobs.values(), *self.deleted.values()], key=lambda j: j.created)
        return [self._render(job) for job in reversed(jobs)]  # newest first

    def complete_all(self) -> list[dict]:
        open_ids = [bid for bid, job in self.jobs.items() if job.obj["processing_status"] != "ended"]
        return [self.advance(bid, "ended", 0.0) for bid in open_ids]

    completed_stage = "ended"  # where Emulator.complete takes a batch

    def next_stage(self, batch_id: str) -> str:
        """The stage after the batch's current one (an advance with no `to`): in_progress and
        canceling both end (a canceling batch ends with its unanswered requests canceled)."""
        status = self.jobs[batch_id].obj["processing_status"]
        if status == "ended":
            raise ValueError(f"message batch {batch_id} has ended: there is no next stage")
        return "ended"

    def advance(self, batch_id: str, to: str, done_fraction: float) -> dict:
        """Move a batch along the provider's own path (tests drive this).

        to: "in_progress" (run `done_fraction` of the requests, still counted as processing),
        "canceling", "ended" (from in_progress: every request runs; from canceling: the rest are
        canceled), "canceled"/"cancelled" or "expired" (end with the requests not yet run - beyond
        `done_fraction` - canceled or expired).
        """
        job, now = self.jobs[batch_id], self.emu.now()
        status = job.obj["processing_status"]
        if status == "ended" and to == "ended":
            return self._render(job)
        if (
            status == "ended"
            or to not in ("in_progress", "canceling", "ended", "canceled", "cancelled", "expired")
            or (to == "in_progress" and status != "in_progress")
        ):
            raise ValueError(f"cannot advance message batch {batch_id} from '{status}' to {to!r}")
        if to in ("canceling", "canceled", "cancelled") and status == "in_progress":
            self._set_canceling(job, now)
        self._run_until(job, 1.0 if to == "ended" and status == "in_progress" else done_fraction, now)
        if to == "ended":
            self._end(job, "canceled" if status == "canceling" else None, now)
        elif to in ("canceled", "cancelled", "expired"):
            self._end(job, "expired" if to == "expired" else "canceled", now)
        return self._render(job)

    def expire_results(self, batch_id: str) -> dict:
        """Retention ended early (the 29 days, without waiting): results are archived and the
        results endpoint answers 404."""
        job = self.jobs[batch_id]
        if job.obj["processing_status"] != "ended":
            raise ValueError(f"message batch {batch_id} has not ended; only an ended batch's results expire")
        job.obj["archived_at"], job.jsonl = rfc3339(self.emu.now()), None
        return self._render(job)

    def tick(self, now: float) -> None:
        """Auto-advance (each stage lasts `auto_advance_seconds`), 24 h expiry, 29-day archiving."""
        stage = self.emu.auto_advance_seconds
        for job in self.jobs.values():
            status = job.obj["processing_status"]
            if status != "ended" and stage is not None:
                due = job.stage_started + stage
                if status == "in_progress":  # requests complete steadily through the stage
                    self._run_until(
                        job, 1.0 if stage <= 0 else min(1.0, (now - job.stage_started) / stage), min(now, due)
                    )
                if now >= due:
                    self._end(job, "canceled" if status == "canceling" else None, due)
            if job.obj["processing_status"] != "ended" and now >= job.created + EXPIRES_AFTER:
                self._end(job, "expired", job.created + EXPIRES_AFTER)
            if job.jsonl is not None and now >= job.created + RESULTS_KEPT:
                job.obj["archived_at"], job.jsonl = rfc3339(job.created + RESULTS_KEPT), None

    # -- lifecycle ---------------------------------------------------------------------
    def _set_canceling(self, job: Job, at: float) -> None:
        job.obj["processing_status"], job.obj["cancel_initiated_at"] = "canceling", rfc3339(at)
        job.stage_started = at

    def _run_until(self, job: Job, fraction: float, at: float) -> None:
        """Run requests in input order until `fraction` of the batch is done (never undoes work)."""
        target = min(len(job.requests), math.floor(len(job.requests) * fraction + 1e-9))
        while len(job.results) < target:
            item = job.requests[len(job.results)]
            result, usage = run_request(
                item["params"],
                self.emu.fault_book,
                self.emu.prompt_cache,
                self.emu.min_cache_tokens,
                at,
                self._id,
                self.emu.null_usage_details,
            )
            job.results.append(result)
            if usage is not None:  # only succeeded requests are billed
                tokens = {
                    k: usage[k] or 0
                    for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
                }
                self.emu.counters.add_usage(self.name, **tokens)
                self.emu.counters.bill(
                    self.name,
                    "batch",
                    read_params(item["params"]).prompt,
                    item["params"],
                    tokens,
                    job.obj["id"],
                    item["custom_id"],
                )

    def _end(self, job: Job, leftover: str | None, at: float) -> None:
        """End processing; requests not run are `leftover` (canceled/expired) or run now (None)."""
        if leftover is None:
            self._run_until(job, 1.0, at)
        results = job.results + [{"type": leftover}] * (len(job.requests) - len(job.results))
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for result in results:
            counts[result["type"]] += 1
        lines = [
            {"custom_id": item["custom_id"], "result": result}
            for item, result in zip(job.requests, results, strict=True)
        ]
        self.emu.rng.shuffle(lines)  # result order is not input order; clients join on custom_id
        job.jsonl = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
        job.obj.update(processing_status="ended", request_counts=counts, ended_at=rfc3339(at))
        job.stage_started = at

    def _id(self, prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return prefix + "".join(self.emu.rng.choices(alphabet, k=length))


def _require(ok: object, message: str, status: int = 400, type_: str = "invalid_request_error") -> None:
    if not ok:
        raise ApiError(status, message, type_)
