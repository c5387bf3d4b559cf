"""The Gemini API Batch Mode face of the sandbox, served under `<base>/gemini` (the SDK's base URL:
`http_options={"base_url": ...}` or GOOGLE_GEMINI_BASE_URL), for API versions v1 and v1beta.

Follows the Gemini Batch API guide and reference (ai.google.dev/gemini-api/docs/batch-api,
ai.google.dev/api/batch-mode) and the google-genai SDK's wire shapes:
- create: `POST models/{model}:batchGenerateContent` with `{"batch": {"displayName", "inputConfig":
  {"requests": {"requests": [{"request", "metadata"}]}} or {"fileName": "files/..."}}}`; inline
  requests over `gemini_max_inline_bytes` (20 MB) are refused; a file's lines must be
  `{"key": str, "request": {...}}` with unique keys (the sandbox's strictness: results are matched by key).
  Requests are checked when they run (gemini_requests.py): a bad one is an error line, not a failed job.
  Over `gemini_max_concurrent_batches` open jobs, or `gemini_enqueued_token_limit` enqueued input tokens,
  the create is refused with 429 RESOURCE_EXHAUSTED.
- the job is an Operation: `{"name": "batches/<id>", "metadata": {..., "state": "BATCH_STATE_*",
  "batchStats", "output"}, "done"}`; the SDK maps BATCH_STATE_* to JOB_STATE_*. PENDING -> RUNNING ->
  SUCCEEDED; `:cancel` ends it CANCELLED; still open 48 h after creation it EXPIRES (unverified figure);
  a `batch_failed` fault ends it FAILED when it starts running. A job that ends early keeps the results
  of the requests that ran (the output holds only those).
- output: inline requests' responses inline (`inlinedResponses`, in input order, each with the request's
  metadata); a file's as a generated file `files/batch-<id>` of `{"key", "response"|"error"}` lines
  in no particular order.
Auth: `x-goog-api-key: <key>` (or `?key=`). Errors: `{"error": {"code", "message", "status"}}`.
"""

from __future__ import annotations

import copy
import json
import math
import re
import string
from dataclasses import dataclass, field
from typing import Any

from . import gemini_requests
from .gemini_files import GeminiFilesMixin, page, rfc3339
from .server import ApiError, Request

EXPIRES_AFTER = 48 * 3600
VERSIONS = ("v1", "v1beta")
BASE = "/gemini"
MODEL = re.compile(r"^models/(gemini-[a-z0-9.\-]+)$")
STAGES = ("BATCH_STATE_PENDING", "BATCH_STATE_RUNNING")
ENDED = ("BATCH_STATE_SUCCEEDED", "BATCH_STATE_FAILED", "BATCH_STATE_CANCELLED", "BATCH_STATE_EXPIRED")


@dataclass
class Job:
    obj: dict  # the Operation as served
    requests: list[dict]  # [{"key", "request"}] in input order
    inline: bool
    created: float
    stage_started: float
    results: list[dict] = field(default_factory=list)  # one {"key", "response"|"error"} per request run, in order


class Face(GeminiFilesMixin):
    name = "gemini"
    server_error_type = "INTERNAL"
    prefixes = (BASE,)
    request_id_header = "x-goog-request-id"
    completed_stage = "BATCH_STATE_SUCCEEDED"

    def __init__(self, emu) -> None:
        self.emu = emu
        v = BASE + "/{version}"
        self.routes = [
            ("POST", v + "/models/{model}:batchGenerateContent", self._versioned(self.create_batch)),
            ("GET", v + "/batches", self._versioned(self.list_batches)),
            ("POST", v + "/batches/{id}:cancel", self._versioned(self.cancel_batch)),
            ("GET", v + "/batches/{id}", self._versioned(self.get_batch)),
            ("DELETE", v + "/batches/{id}", self._versioned(self.delete_batch)),
            ("POST", BASE + "/upload/{version}/files", self._versioned(self.upload)),
            ("GET", v + "/files", self._versioned(self.list_files)),
            ("GET", v + "/files/{id}:download", self._versioned(self.download_file)),
            ("GET", v + "/files/{id}", self._versioned(self.get_file)),
            ("DELETE", v + "/files/{id}", self._versioned(self.delete_file)),
        ]
        self.reset()

    def reset(self) -> None:
        self.jobs: dict[str, Job] = {}  # by name `batches/<id>`, creation order
        self.deleted: dict[str, Job] = {}
        self.files: dict[str, dict] = {}
        self.contents: dict[str, bytes] = {}
        self.deleted_contents: dict[str, bytes] = {}
        self.uploads: dict[str, dict] = {}

    def _versioned(self, handler):
        def check(req: Request):
            if req.params.pop("version", None) not in VERSIONS:
                raise ApiError(404, f"The requested URL {req.path} was not found on this server.", "NOT_FOUND")
            return handler(req)

        return check

    # -- auth and error envelopes ----------------------------------------------------------
    def api_key_from(self, headers: dict[str, str]) -> str | None:
        return headers.get("x-goog-api-key")

    def preauthorized(self, req: Request) -> bool:
        """The upload URL a `start` answered authorises the bytes sent to it (as Google's upload
        sessions do): the SDK sends them without the key."""
        return req.path.startswith(BASE + "/upload/") and req.query.get("upload_id", "") in self.uploads

    def auth_error(self, presented: str | None) -> ApiError:
        if not presented:
            return ApiError(
                403,
                "Method doesn't allow unregistered callers (callers without established identity).",
                "PERMISSION_DENIED",
            )
        return ApiError(400, "API key not valid. Please pass a valid API key.", "INVALID_ARGUMENT")

    def route_not_found(self, method: str, path: str) -> ApiError:
        return ApiError(404, f"The requested URL {path} was not found on this server.", "NOT_FOUND")

    def endpoint_fault_error(self, fault: dict) -> ApiError:
        status = fault["status_code"]
        kind = fault["type"] or gemini_requests.STATUS_NAMES.get(status, "UNKNOWN")
        return ApiError(status, fault["message"] or "Sandbox fault injected.", kind)

    def error_payload(self, err: ApiError, request_id: str) -> dict:
        status = (
            err.type if err.type != "invalid_request_error" else gemini_requests.STATUS_NAMES.get(err.status, "UNKNOWN")
        )
        return {"error": {"code": err.status, "message": err.message, "status": status}}

    def edge_check(self, req: Request) -> ApiError | None:
        if req.path.endswith(":batchGenerateContent") and len(req.body) > self.emu.gemini_max_inline_bytes:
            return ApiError(
                400,
                f"Request payload size exceeds the limit: {self.emu.gemini_max_inline_bytes} bytes.",
                "INVALID_ARGUMENT",
            )
        return None

    # -- batches ---------------------------------------------------------------------------
    def create_batch(self, req: Request) -> dict:
        body = req.json()
        _require(
            isinstance(body, dict) and isinstance(body.get("batch"), dict),
            "* BatchGenerateContentRequest.batch: batch is required",
        )
        batch = body["batch"]
        model_name = f"models/{req.params['model']}"
        if not MODEL.match(model_name):
            raise ApiError(
                404,
                f"{model_name} is not found for API version v1beta, or is not supported for batchGenerateContent.",
                "NOT_FOUND",
            )
        _require(
            isinstance(batch.get("displayName"), str) and batch["displayName"],
            "* batch.display_name: display_name is required",
        )
        source = batch.get("inputConfig")
        _require(isinstance(source, dict), "* batch.input_config: input_config is required")
        has_file, has_requests = "fileName" in source, "requests" in source
        _require(has_file != has_requests, "* batch.input_config: exactly one of file_name or requests must be set")
        if has_requests:
            items = (source["requests"] or {}).get("requests") if isinstance(source["requests"], dict) else None
            _require(isinstance(items, list) and items, "* batch.input_config.requests.requests: must not be empty")
            assert isinstance(items, list)
            requests = []
            for i, item in enumerate(items):
                _require(
                    isinstance(item, dict) and isinstance(item.get("request"), dict),
                    f"* batch.input_config.requests.requests[{i}].request: request is required",
                )
                metadata = item.get("metadata") or {}
                _require(
                    isinstance(metadata, dict),
                    f"* batch.input_config.requests.requests[{i}].metadata: must be an object",
                )
                requests.append({"key": metadata.get("key"), "metadata": metadata, "request": item["request"]})
        else:
            requests = self._file_requests(source["fileName"])
        self._check_quota(requests)
        now = self.emu.now()
        name = "batches/" + self._id("", 32, string.ascii_lowercase + string.digits)
        obj: dict[str, Any] = {
            "name": name,
            "metadata": {
                "@type": "type.googleapis.com/google.ai.generativelanguage.v1beta.GenerateContentBatch",
                "name": name,
                "model": model_name,
                "displayName": batch["displayName"],
                "createTime": rfc3339(now),
                "updateTime": rfc3339(now),
                "batchStats": {"requestCount": str(len(requests)), "pendingRequestCount": str(len(requests))},
                "state": "BATCH_STATE_PENDING",
            },
            "done": False,
        }
        self.jobs[name] = Job(obj, requests, has_requests, now, now)
        self.emu.counters.new_batch(self.name, _bare(name), len(requests))
        return copy.deepcopy(obj)

    def _file_requests(self, file_name: object) -> list[dict]:
        _require(
            isinstance(file_name, str) and file_name.startswith("files/"),
            "* batch.input_config.file_name: must be files/<id>",
        )
        assert isinstance(file_name, str)
        if file_name not in self.files:
            raise ApiError(404, f"File {file_name} not found.", "NOT_FOUND")
        requests, keys = [], set()
        for n, raw in enumerate(self.contents[file_name].split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                line = None
            _require(
                isinstance(line, dict) and isinstance(line.get("key"), str) and isinstance(line.get("request"), dict),
                f"{file_name} line {n}: each line must be a JSON object with a string 'key' and a 'request' object",
            )
            assert isinstance(line, dict)
            _require(line["key"] not in keys, f"{file_name} line {n}: duplicate key {line['key']!r}")
            keys.add(line["key"])
            requests.append({"key": line["key"], "request": line["request"]})
        _require(requests, f"{file_name} holds no requests")
        return requests

    def _check_quota(self, requests: list[dict]) -> None:
        open_jobs = [j for j in self.jobs.values() if j.obj["metadata"]["state"] not in ENDED]
        if len(open_jobs) >= self.emu.gemini_max_concurrent_batches:
            raise ApiError(
                429,
                f"You can have at most {self.emu.gemini_max_concurrent_batches} batches running at once.",
                "RESOURCE_EXHAUSTED",
            )
        limit = self.emu.gemini_enqueued_token_limit
        if limit is not None:
            enqueued = sum(gemini_requests.estimate_tokens(r["request"]) for j in open_jobs for r in j.requests)
            asked = sum(gemini_requests.estimate_tokens(r["request"]) for r in requests)
            if enqueued + asked > limit:
                raise ApiError(
                    429,
                    f"Resource has been exhausted: enqueued tokens would exceed {limit:,} ({enqueued:,} enqueued, {asked:,} in this batch).",
                    "RESOURCE_EXHAUSTED",
                )

    def get_batch(self, req: Request) -> dict:
        return self._render(self._job(req.params["id"]))

    def list_batches(self, req: Request) -> dict:
        names = list(reversed(self.jobs))  # newest first
        return page(names, req, lambda n: self._render(self.jobs[n]), "operations")

    def cancel_batch(self, req: Request) -> dict:
        job = self._job(req.params["id"])
        _require(job.obj["metadata"]["state"] not in ENDED, f"Batch {job.obj['name']} has already ended.", 400)
        self._end(job, "BATCH_STATE_CANCELLED", self.emu.now())
        return {}

    def delete_batch(self, req: Request) -> dict:
        job = self._job(req.params["id"])
        self.deleted[job.obj["name"]] = self.jobs.pop(job.obj["name"])
        return {}

    def _job(self, batch_id: str) -> Job:
        name = batch_id if batch_id.startswith("batches/") else f"batches/{batch_id}"
        if name not in self.jobs:
            raise ApiError(404, f"Batch {name} not found.", "NOT_FOUND")
        return self.jobs[name]

    def _render(self, job: Job) -> dict:
        return copy.deepcopy(job.obj)

    def _control_view(self, job: Job) -> dict:
        """The job for the control API and its CLI: the operation, plus the `id` (the name without
        `batches/`, which the control paths take) and its `status`."""
        return {
            **self._render(job),
            "id": _bare(job.obj["name"]),
            "status": job.obj["metadata"]["state"],
            "object": "gemini_batch",
        }

    # -- hooks for the Emulator ----------------------------------------------------------------
    def owns(self, batch_id: str) -> bool:
        return (batch_id if batch_id.startswith("batches/") else f"batches/{batch_id}") in self.jobs

    def batch_list(self) -> list[dict]:
        jobs = sorted([*self.jobs.values(), *self.deleted.values()], key=lambda j: j.created, reverse=True)
        return [self._control_view(j) for j in jobs]

    def complete_all(self) -> list[dict]:
        open_names = [n for n, j in self.jobs.items() if j.obj["metadata"]["state"] not in ENDED]
        return [self.advance(n, "BATCH_STATE_SUCCEEDED", 0.0) for n in open_names]

    def next_stage(self, batch_id: str) -> str:
        state = self._job(batch_id).obj["metadata"]["state"]
        if state in ENDED:
            raise ValueError(f"batch {batch_id} has ended: there is no next stage")
        return "BATCH_STATE_RUNNING" if state == "BATCH_STATE_PENDING" else "BATCH_STATE_SUCCEEDED"

    def advance(self, batch_id: str, to: str, done_fraction: float) -> dict:
        """Move a job along the provider's path (tests drive this). `to` is a BATCH_STATE_* or JOB_STATE_*
        word or its tail ("running", "succeeded", "failed", "cancelled", "expired"): RUNNING runs
        `done_fraction` of the requests; SUCCEEDED runs every one; FAILED, CANCELLED and EXPIRED end the job
        with only the requests up to `done_fraction` run (their results kept, the rest never answered)."""
        job, now = self._job(batch_id), self.emu.now()
        target = "BATCH_STATE_" + to.upper().removeprefix("BATCH_STATE_").removeprefix("JOB_STATE_")
        state = job.obj["metadata"]["state"]
        if state == target and target == "BATCH_STATE_SUCCEEDED":
            return self._control_view(job)
        if state in ENDED or target not in (*STAGES[1:], *ENDED):
            raise ValueError(f"cannot advance batch {batch_id} from {state!r} to {to!r}")
        if target == "BATCH_STATE_RUNNING":
            self._start(job, now)
            self._run_until(job, done_fraction)
        elif target == "BATCH_STATE_SUCCEEDED":
            self._run_until(job, 1.0)
            self._end(job, target, now)
        else:
            self._run_until(job, done_fraction)
            self._end(job, target, now)
        return self._control_view(job)

    def expire_results(self, batch_id: str) -> dict:
        """Retention ended: the responses file is deleted (downloads answer 403); inline results go with the job."""
        job = self._job(batch_id)
        if job.obj["metadata"]["state"] not in ENDED:
            raise ValueError(f"batch {batch_id} has not ended; only an ended batch's results expire")
        file_name = job.obj["metadata"].get("output", {}).get("responsesFile")
        if file_name and file_name in self.files:
            self.deleted_contents[file_name] = self.contents.pop(file_name)
            del self.files[file_name]
        elif job.inline:
            self.deleted[job.obj["name"]] = self.jobs.pop(job.obj["name"])
        return self._control_view(job)

    def tick(self, now: float) -> None:
        """Auto-advance (each stage lasts `auto_advance_seconds`), 48 h expiry, 48 h file retention."""
        stage = self.emu.auto_advance_seconds
        for job in self.jobs.values():
            state = job.obj["metadata"]["state"]
            if state not in ENDED and stage is not None and now >= job.stage_started + stage:
                if state == "BATCH_STATE_PENDING":
                    self._start(job, job.stage_started + stage)
                    state = job.obj["metadata"]["state"]
                if state == "BATCH_STATE_RUNNING" and now >= job.stage_started + stage:
                    self._run_until(job, 1.0)
                    self._end(job, "BATCH_STATE_SUCCEEDED", job.stage_started + stage)
            if job.obj["metadata"]["state"] not in ENDED and now >= job.created + EXPIRES_AFTER:
                self._end(job, "BATCH_STATE_EXPIRED", job.created + EXPIRES_AFTER)
        self.expire_files(now)

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self, job: Job, at: float) -> None:
        meta = job.obj["metadata"]
        if meta["state"] != "BATCH_STATE_PENDING":
            return
        meta["state"], meta["updateTime"] = "BATCH_STATE_RUNNING", rfc3339(at)
        job.stage_started = at
        fault = self.emu.fault_book.take_batch_failure()
        if fault:  # the job fails as a whole, naming no request
            job.obj["error"] = {"code": 13, "message": fault["message"] or "The batch failed: internal error."}
            self._end(job, "BATCH_STATE_FAILED", at)

    def _run_until(self, job: Job, fraction: float) -> None:
        """Run requests in input order until `fraction` of the job is done (never undoes work)."""
        if job.obj["metadata"]["state"] in ENDED:
            return
        self._start(job, self.emu.now())
        if job.obj["metadata"]["state"] in ENDED:
            return
        target = min(len(job.requests), math.floor(len(job.requests) * fraction + 1e-9))
        model = job.obj["metadata"]["model"].removeprefix("models/")
        while len(job.results) < target:
            item = job.requests[len(job.results)]
            outcome, usage, prompt = gemini_requests.answer(
                item["request"], self.emu.fault_book, model, self._id("", 22)
            )
            job.results.append({"key": item["key"], **outcome})
            if usage is not None:  # only answered requests are billed
                self.emu.counters.add_usage(self.name, **usage)
                self.emu.counters.bill(self.name, "batch", prompt, item["request"], usage, job.obj["name"], item["key"])
        stats = job.obj["metadata"]["batchStats"]
        stats["pendingRequestCount"] = str(len(job.requests) - len(job.results))
        stats["successfulRequestCount"] = str(sum("response" in r for r in job.results))
        stats["failedRequestCount"] = str(sum("error" in r for r in job.results))

    def _end(self, job: Job, state: str, at: float) -> None:
        """End the job; its output holds the results of the requests that ran (all, when it succeeded)."""
        meta = job.obj["metadata"]
        if meta["state"] in ENDED:  # a job that failed as it started has ended already
            return
        meta.update(state=state, updateTime=rfc3339(at), endTime=rfc3339(at))
        job.obj["done"] = True
        job.stage_started = at
        if job.inline:
            responses = [
                {"metadata": item.get("metadata") or {}, **{k: v for k, v in r.items() if k != "key"}}
                for item, r in zip(job.requests, job.results, strict=False)
            ]
            meta["output"] = {"inlinedResponses": {"inlinedResponses": responses}}
        else:
            lines = list(job.results)
            self.emu.rng.shuffle(lines)  # result order is not input order; clients join on key
            data = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
            file_name = "files/batch-" + job.obj["name"].removeprefix("batches/")
            self.store_file(file_name, data, "application/jsonl", "GENERATED")
            meta["output"] = {"responsesFile": file_name}
        job.obj["response"] = {
            "@type": "type.googleapis.com/google.ai.generativelanguage.v1beta.GenerateContentBatchOutput",
            **meta["output"],
        }

    def _id(self, prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return prefix + "".join(self.emu.rng.choices(alphabet, k=length))


def _require(ok: object, message: str, status: int = 400) -> None:
    if not ok:
        raise ApiError(
            status,
            message,
            "INVALID_ARGUMENT" if status == 400 else gemini_requests.STATUS_NAMES.get(status, "UNKNOWN"),
        )


def _bare(name: str) -> str:
    return name.removeprefix("batches/")
