"""Amazon Bedrock face of the sandbox: the batch inference control plane and Converse, over S3.

boto3 drives it with `endpoint_url` (AWS_ENDPOINT_URL_BEDROCK, AWS_ENDPOINT_URL_BEDROCK_RUNTIME);
S3 is not emulated here: jobs read their input from, and write their output to, a real S3 emulator
(moto's server mode) at `Emulator.s3_endpoint_url`, through boto3 as Bedrock would.

Follows botocore's service model (bedrock 2023-04-20, bedrock-runtime 2023-09-30) and the Bedrock
user guide:
- CreateModelInvocationJob (POST /model-invocation-job): required fields, the name, token, role,
  model and S3 URI patterns, timeoutDurationInHours 24..168 are checked synchronously
  (ValidationException); the same clientRequestToken again returns the same job, a different token
  with a job's name is a ConflictException. The input (a .jsonl object, or every .jsonl under a
  prefix) is read at create; a missing object is a ValidationException.
- A job goes Submitted -> Validating -> Scheduled -> InProgress -> Completed (PartiallyCompleted when
  a record errored); Stopping -> Stopped; Failed; Expired once timeoutDurationInHours passed. The
  record minimum (100) and malformed lines fail the job at validation (Failed, with a message).
- Each record's modelInput is Claude's InvokeModel body (`anthropic_version: bedrock-2023-05-31`, no
  `model`), answered as Anthropic's Messages API would (anthropic_messages.py); a bad body is an error
  line `{"errorCode": 400, "errorMessage"}`. A job that ends (also stopped, expired or failed after
  it started) writes what it processed, shuffled, to `<output>/<job id>/<input file>.out`, and
  `manifest.json.out` beside it; records never processed have no line.
- Converse (POST /model/{modelId}/converse) answers one request synchronously, billed at once.
Auth: SigV4's access key id (`Credential=<key>/...`) or a bearer token must be the sandbox key; the
signature itself is not checked.
"""

from __future__ import annotations

import json
import math
import re
import string
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from .anthropic_messages import read_params, run_request
from .bedrock_requests import check, converse_params, error, iso, records_of, require
from .server import ApiError, Request

HOUR = 3600
ANTHROPIC_VERSION = "bedrock-2023-05-31"
ENDED = ("Completed", "PartiallyCompleted", "Failed", "Stopped", "Expired")
# The other faces' words for an end, as the sandbox CLI sends them (`expire` asks for "expired").
ALIASES = {"expired": "Expired", "cancelled": "Stopped", "canceled": "Stopped", "failed": "Failed"}
ALIASES.update({"completed": "Completed", "in_progress": "InProgress"})
STAGES = ("Submitted", "Validating", "Scheduled", "InProgress")
# botocore's patterns (bedrock service-2.json)
JOB_NAME = re.compile(r"^[a-zA-Z0-9]{1,63}(-*[a-zA-Z0-9\+\-\.]){0,63}$")
TOKEN = re.compile(r"^[a-zA-Z0-9]{1,256}(-*[a-zA-Z0-9]){0,256}$")
ROLE_ARN = re.compile(r"^arn:aws(-[^:]+)?:iam::([0-9]{12})?:role/.+$")
S3_URI = re.compile(r"^s3://[a-z0-9][-.a-z0-9]{1,61}[a-z0-9](?:/[-!_*'().a-z0-9A-Z]+(?:/[-!_*'().a-z0-9A-Z]+)*)?/?$")
MODEL_ID = re.compile(
    r"^([a-z]{2,4}\.)?[a-z0-9-]{1,63}\.[a-z0-9-]{1,63}([.]?[a-z0-9-]{1,63})([:][a-z0-9-]{1,63}){0,2}$"
)
ACCOUNT = "123456789012"


@dataclass
class Job:
    obj: dict  # the job as GetModelInvocationJob serves it
    records: list[dict]  # the input lines, in input order
    input_name: str  # the input file's name (the output file is <name>.out)
    problem: str | None  # why validation fails the job (None: it runs)
    created: float
    stage_started: float
    lines: list[dict] = field(default_factory=list)  # output lines of the records processed, input order


class Face:
    name = "bedrock"
    server_error_type = "InternalServerException"
    prefixes = ("/model-invocation-job", "/model/")
    request_id_header = "x-amzn-requestid"
    completed_stage = "Completed"

    def __init__(self, emu) -> None:
        self.emu = emu
        self._s3_clients: dict[str, Any] = {}
        self.routes = [
            ("POST", "/model-invocation-job", self.create_job),
            ("GET", "/model-invocation-jobs", self.list_jobs),
            ("GET", "/model-invocation-job/{id}", self.get_job),
            ("POST", "/model-invocation-job/{id}/stop", self.stop_job),
            ("POST", "/model/{model}/converse", self.converse),
        ]
        self.reset()

    def reset(self) -> None:
        self.jobs: dict[str, Job] = {}  # job id -> job, creation order

    # -- auth and envelopes --------------------------------------------------------------------
    def api_key_from(self, headers: dict[str, str]) -> str | None:
        auth = headers.get("authorization", "")
        if m := re.search(r"Credential=([^/,\s]+)/", auth):
            return m.group(1)
        scheme, _, key = auth.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None

    def auth_error(self, presented: str | None) -> ApiError:
        if not presented:
            return error(403, "Missing Authentication Token", "MissingAuthenticationTokenException")
        return error(403, "The security token included in the request is invalid.", "UnrecognizedClientException")

    def route_not_found(self, method: str, path: str) -> ApiError:
        return error(404, f"No route for {method} {path}", "UnknownOperationException")

    def endpoint_fault_error(self, fault: dict) -> ApiError:
        status = fault["status_code"]
        return error(status, fault["message"] or "Sandbox fault injected.", fault["type"])

    def error_payload(self, err: ApiError, request_id: str) -> dict:
        return {"message": err.message, "__type": err.type}

    # -- the control plane ----------------------------------------------------------------------
    def create_job(self, req: Request) -> dict:
        p = req.json()
        require(isinstance(p, dict), "Request body must be a JSON object")
        for name in ("jobName", "roleArn", "modelId", "inputDataConfig", "outputDataConfig"):
            require(
                name in p,
                f"1 validation error detected: Value null at '{name}' failed to satisfy constraint: Member must not be null",
            )
        check(p["jobName"], JOB_NAME, "jobName")
        check(p["roleArn"], ROLE_ARN, "roleArn")
        check(p["modelId"], MODEL_ID, "modelId")
        token = p.get("clientRequestToken")
        if token is not None:
            check(token, TOKEN, "clientRequestToken")
        hours = p.get("timeoutDurationInHours", 24)
        require(isinstance(hours, int) and 24 <= hours <= 168, "timeoutDurationInHours must be between 24 and 168")
        source = (p["inputDataConfig"] or {}).get("s3InputDataConfig") or {}
        target = (p["outputDataConfig"] or {}).get("s3OutputDataConfig") or {}
        check(source.get("s3Uri"), S3_URI, "inputDataConfig.s3InputDataConfig.s3Uri")
        check(target.get("s3Uri"), S3_URI, "outputDataConfig.s3OutputDataConfig.s3Uri")
        require(source.get("s3InputFormat", "JSONL") == "JSONL", "s3InputFormat must be JSONL")
        require(p.get("modelInvocationType", "InvokeModel") == "InvokeModel", "the sandbox runs InvokeModel jobs only")
        for job in self.jobs.values():
            if token is not None and job.obj.get("clientRequestToken") == token:
                return {"jobArn": job.obj["jobArn"]}  # idempotent: the same job, nothing created
            if job.obj["jobName"] == p["jobName"]:
                raise error(400, f"A job with name {p['jobName']} already exists.", "ConflictException")
        name, data = self._read_input(source["s3Uri"])
        records, problem = records_of(data)
        now, job_id = self.emu.now(), self._id()
        arn = f"arn:aws:bedrock:{self._region(req)}:{ACCOUNT}:model-invocation-job/{job_id}"
        obj = {
            "jobArn": arn,
            "jobName": p["jobName"],
            "modelId": p["modelId"],
            "clientRequestToken": token,
            "roleArn": p["roleArn"],
            "status": "Submitted",
            "submitTime": iso(now),
            "lastModifiedTime": iso(now),
            "inputDataConfig": p["inputDataConfig"],
            "outputDataConfig": p["outputDataConfig"],
            "timeoutDurationInHours": hours,
            "jobExpirationTime": iso(now + hours * HOUR),
            "modelInvocationType": "InvokeModel",
        }
        self.jobs[job_id] = Job(obj, records, name, problem, now, now)
        self.emu.counters.new_batch(self.name, arn, len(records))
        return {"jobArn": arn}

    def get_job(self, req: Request) -> dict:
        return self._render(self._job(req.params["id"]))

    def list_jobs(self, req: Request) -> dict:
        q = req.query
        try:
            limit = int(q.get("maxResults", 1000))
        except ValueError:
            raise error(400, "maxResults must be an integer") from None
        require(1 <= limit <= 1000, "maxResults must be between 1 and 1000")
        jobs = [j for j in self.jobs.values() if q.get("nameContains", "") in j.obj["jobName"]]
        if q.get("statusEquals"):
            jobs = [j for j in jobs if j.obj["status"] == q["statusEquals"]]
        jobs.sort(key=lambda j: j.created, reverse=q.get("sortOrder", "Descending") == "Descending")
        start = int(q.get("nextToken") or 0)
        page = jobs[start : start + limit]
        out: dict[str, Any] = {"invocationJobSummaries": [self._render(j) for j in page]}
        if start + limit < len(jobs):
            out["nextToken"] = str(start + limit)
        return out

    def stop_job(self, req: Request) -> dict:
        job = self._job(req.params["id"])
        status = job.obj["status"]
        if status in ENDED or status == "Stopping":
            raise error(400, f"Job {job.obj['jobArn']} cannot be stopped in status {status}.", "ConflictException")
        self._set(job, "Stopping", self.emu.now())
        return {}

    # -- realtime: Converse --------------------------------------------------------------------
    def converse(self, req: Request) -> dict:
        body, model = req.json(), unquote(req.params["model"])
        require(isinstance(body, dict), "Request body must be a JSON object")
        require(isinstance(body.get("messages"), list) and body["messages"], "messages must not be empty")
        params = converse_params(model, body)
        result, usage = run_request(
            params, self.emu.fault_book, self.emu.prompt_cache, None, self.emu.now(), self._id_prefixed
        )
        if result["type"] != "succeeded":
            e = result["error"]["error"]
            raise error(
                400 if e["type"] == "invalid_request_error" else 500 if e["type"] == "api_error" else 429, e["message"]
            )
        message = result["message"]
        content = []
        for block in message["content"]:
            if block["type"] == "tool_use":
                content.append({"toolUse": {"toolUseId": block["id"], "name": block["name"], "input": block["input"]}})
            else:
                content.append({"text": block["text"]})
        assert usage is not None  # a succeeded request is billed
        tokens = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}
        self.emu.counters.add_usage(self.name, **tokens)
        self.emu.counters.realtime_answered(self.name, read_params(params).prompt, body, tokens)
        return {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": message["stop_reason"],
            "usage": {
                "inputTokens": tokens["input_tokens"],
                "outputTokens": tokens["output_tokens"],
                "totalTokens": tokens["input_tokens"] + tokens["output_tokens"],
            },
            "metrics": {"latencyMs": 1},
        }

    # -- hooks for the Emulator ----------------------------------------------------------------
    def owns(self, batch_id: str) -> bool:
        return batch_id.rsplit("/", 1)[-1] in self.jobs

    def batch_list(self) -> list[dict]:
        return [self._control_view(j) for j in reversed(self.jobs.values())]

    def complete_all(self) -> list[dict]:
        open_jobs = [j for j in self.jobs.values() if j.obj["status"] not in ENDED]
        return [
            self.advance(j.obj["jobArn"], "Stopped" if j.obj["status"] == "Stopping" else "Completed", 0.0)
            for j in open_jobs
        ]

    def next_stage(self, batch_id: str) -> str:
        status = self._job(batch_id).obj["status"]
        if status in ENDED:
            raise ValueError(f"job {batch_id} has ended: there is no next stage")
        if status == "Stopping":
            return "Stopped"
        return STAGES[STAGES.index(status) + 1] if status != "InProgress" else "Completed"

    def advance(self, batch_id: str, to: str, done_fraction: float) -> dict:
        """Move a job along Bedrock's path (tests drive this): a stage of STAGES (InProgress runs
        `done_fraction` of the records), "Completed" (every record runs; PartiallyCompleted when one
        errored), or an end keeping what ran ("Stopped", "Expired", "Failed")."""
        to = ALIASES.get(to, to)
        job, now = self._job(batch_id), self.emu.now()
        status = job.obj["status"]
        if status in ENDED or to not in (*STAGES, "Stopping", "Completed", "Stopped", "Expired", "Failed"):
            raise ValueError(f"cannot move job {batch_id} from {status} to {to!r}")
        if to in STAGES and STAGES.index(to) < STAGES.index(status if status in STAGES else "InProgress"):
            raise ValueError(f"cannot move job {batch_id} back from {status} to {to}")
        if job.problem and to not in ("Submitted", "Validating"):
            self._end(job, "Failed", now, job.problem)  # validation fails it before any record runs
            return self._control_view(job)
        if to == "InProgress":
            self._set(job, "InProgress", now)
            self._run_until(job, done_fraction, now)
        elif to == "Completed":
            self._run_until(job, 1.0, now)
            errored = any("error" in line for line in job.lines)
            self._end(job, "PartiallyCompleted" if errored else "Completed", now)
        elif to in ("Stopped", "Expired", "Failed"):
            if status == "InProgress" or done_fraction:
                self._run_until(job, done_fraction, now)
            self._end(job, to, now, "sandbox: the job failed" if to == "Failed" else None)
        else:
            self._set(job, to, now)
        return self._control_view(job)

    def expire_results(self, batch_id: str) -> dict:
        """The job's output objects are deleted from S3 (a lifecycle rule, say)."""
        job = self._job(batch_id)
        bucket, prefix = self._output_prefix(job)
        s3 = self._s3()
        for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
        return self._control_view(job)

    def tick(self, now: float) -> None:
        stage = self.emu.auto_advance_seconds
        for job in self.jobs.values():
            status = job.obj["status"]
            if status in ENDED:
                continue
            expires = job.created + job.obj["timeoutDurationInHours"] * HOUR
            if now >= expires:
                self._end(job, "Expired", expires)
            elif stage is not None and now >= job.stage_started + stage:
                self.advance(
                    job.obj["jobArn"], self.next_stage(job.obj["jobArn"]), 1.0 if status == "InProgress" else 0.0
                )

    # -- lifecycle ------------------------------------------------------------------------------
    def _set(self, job: Job, status: str, at: float) -> None:
        job.obj.update(status=status, lastModifiedTime=iso(at))
        job.stage_started = at

    def _run_until(self, job: Job, fraction: float, at: float) -> None:
        target = min(len(job.records), math.floor(len(job.records) * fraction + 1e-9))
        while len(job.lines) < target:
            record = job.records[len(job.lines)]
            job.lines.append(self._answer(job, record, at))

    def _answer(self, job: Job, record: dict, at: float) -> dict:
        line: dict[str, Any] = {"recordId": record["recordId"], "modelInput": record["modelInput"]}
        model_input = record["modelInput"]
        if not isinstance(model_input, dict) or model_input.get("anthropic_version") != ANTHROPIC_VERSION:
            line["error"] = {"errorCode": 400, "errorMessage": f"anthropic_version: must be {ANTHROPIC_VERSION}"}
            return line
        if "model" in model_input:
            line["error"] = {"errorCode": 400, "errorMessage": "extraneous key [model] is not permitted"}
            return line
        params = {k: v for k, v in model_input.items() if k != "anthropic_version"} | {"model": job.obj["modelId"]}
        result, usage = run_request(params, self.emu.fault_book, self.emu.prompt_cache, None, at, self._id_prefixed)
        if result["type"] != "succeeded":
            e = result["error"]["error"]
            code = 400 if e["type"] == "invalid_request_error" else 500
            line["error"] = {"errorCode": code, "errorMessage": e["message"]}
            return line
        assert usage is not None  # a succeeded request is billed
        message = {k: v for k, v in result["message"].items() if k != "id"}
        message["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}
        line["modelOutput"] = message
        tokens = dict(message["usage"])
        self.emu.counters.add_usage(self.name, **tokens)
        self.emu.counters.bill(
            self.name, "batch", read_params(params).prompt, model_input, tokens, job.obj["jobArn"], record["recordId"]
        )
        return line

    def _end(self, job: Job, status: str, at: float, message: str | None = None) -> None:
        self._set(job, status, at)
        job.obj["endTime"] = iso(at)
        if message:
            job.obj["message"] = message
        errors = sum(1 for line in job.lines if "error" in line)
        job.obj.update(
            totalRecordCount=len(job.records),
            processedRecordCount=len(job.lines),
            successRecordCount=len(job.lines) - errors,
            errorRecordCount=errors,
        )
        if job.problem and not job.lines:
            return  # failed at validation: nothing written
        lines = list(job.lines)
        self.emu.rng.shuffle(lines)  # output order is not input order
        manifest = {
            "totalRecordCount": len(job.records),
            "processedRecordCount": len(job.lines),
            "successRecordCount": len(job.lines) - errors,
            "errorRecordCount": errors,
            "inputTokenCount": sum(x.get("modelOutput", {}).get("usage", {}).get("input_tokens", 0) for x in lines),
            "outputTokenCount": sum(x.get("modelOutput", {}).get("usage", {}).get("output_tokens", 0) for x in lines),
        }
        bucket, prefix = self._output_prefix(job)
        s3 = self._s3()
        body = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
        s3.put_object(Bucket=bucket, Key=f"{prefix}{job.input_name}.out", Body=body)
        s3.put_object(Bucket=bucket, Key=f"{prefix}manifest.json.out", Body=json.dumps(manifest).encode())

    # -- S3, through boto3 as Bedrock itself would -----------------------------------------------
    def _s3(self):
        import boto3

        url = self.emu.s3_endpoint_url
        if not url:
            raise error(400, "the sandbox has no S3 (set Emulator.s3_endpoint_url to an S3 emulator)")
        if url not in self._s3_clients:  # a client loads its service model once: kept per endpoint
            self._s3_clients[url] = boto3.session.Session().client(
                "s3",
                endpoint_url=url,
                region_name="us-east-1",
                aws_access_key_id="sandbox",
                aws_secret_access_key="sandbox",
            )
        return self._s3_clients[url]

    def _read_input(self, uri: str) -> tuple[str, bytes]:
        bucket, key = uri.removeprefix("s3://").partition("/")[::2]
        s3 = self._s3()
        try:
            if key.endswith(".jsonl"):
                return key.rsplit("/", 1)[-1], s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            objects = s3.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", [])
            keys = sorted(o["Key"] for o in objects if o["Key"].endswith(".jsonl"))
            if keys:
                return keys[0].rsplit("/", 1)[-1], b"".join(
                    s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys
                )
        except Exception as exc:  # NoSuchKey, NoSuchBucket: as Bedrock says it
            if getattr(exc, "response", None) is None:
                raise
        raise error(400, f"Unable to access the input data at {uri}: no .jsonl object found.")

    def _output_prefix(self, job: Job) -> tuple[str, str]:
        uri = job.obj["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/")
        job_id = job.obj["jobArn"].rsplit("/", 1)[-1]
        return bucket, f"{prefix}/{job_id}/" if prefix else f"{job_id}/"

    def _job(self, identifier: str) -> Job:
        job_id = unquote(identifier).rsplit("/", 1)[-1]
        if job_id not in self.jobs:
            raise error(404, f"Job {unquote(identifier)} not found.")
        return self.jobs[job_id]

    def _render(self, job: Job) -> dict:
        return {k: v for k, v in json.loads(json.dumps(job.obj)).items() if v is not None}

    def _control_view(self, job: Job) -> dict:
        """The job as the control API shows it: as served, with the `id` every face's batches have."""
        return self._render(job) | {"id": job.obj["jobArn"]}

    def _region(self, req: Request) -> str:
        m = re.search(r"Credential=[^/]+/\d{8}/([a-z0-9-]+)/", req.headers.get("authorization", ""))
        return m.group(1) if m else "us-east-1"

    def _id(self) -> str:
        return "".join(self.emu.rng.choices(string.ascii_lowercase + string.digits, k=12))

    def _id_prefixed(self, prefix: str, length: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return prefix + "".join(self.emu.rng.choices(alphabet, k=length))
