"""Amazon Bedrock batch inference, through the official `boto3` SDK (`bedrock` and `bedrock-runtime`).

One model family: Anthropic Claude on Bedrock. Each request line is `{"recordId", "modelInput"}` with
`modelInput` in Claude's InvokeModel shape (the Anthropic Messages body without `model`, with
`anthropic_version: bedrock-2023-05-31`); structured output is Claude's forced tool call, as with
Anthropic itself (Bedrock's Converse-shaped batch input takes no tools). Other families (Llama,
Nova, Mistral) have other shapes and are refused when the config is parsed.

What shapes this module (Bedrock user guide, "batch inference"; botocore's service model
bedrock/2023-04-20):
- the request file is uploaded to S3 (`llm_bedrock_s3_input`), the job writes
  `<llm_bedrock_s3_output>/<job id>/<input file>.out` and `manifest.json.out` next to it; output
  order is not guaranteed (lines are joined on recordId);
- `create_model_invocation_job` is idempotent by `clientRequestToken`, derived from the ledger's job
  id: a create repeated after a lost answer is the same job, so it is retried like a read, and an
  interrupted submission is found again by its job name and token;
- a job needs at least MIN_RECORDS records: the pipeline never creates a smaller one
  (BatchProvider.min_requests_per_batch); `llm_bedrock_under_minimum` says whether such rows wait for
  more or go realtime through the Converse API;
- credentials, and endpoints, come from the standard AWS chain only (environment, shared files,
  instance roles; AWS_ENDPOINT_URL_<SERVICE> for endpoints), never from dbt config.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.anthropic_batch import AnthropicBatchProvider
from dbt_llm_batch.providers.base import (
    CUSTOM_ID_MARK,
    PROMPT_MARK,
    REFUSED,
    REJECTED,
    BatchProvider,
    BatchState,
    Submission,
    json_object_text,
)
from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.sql import literal

ANTHROPIC_VERSION = "bedrock-2023-05-31"  # the InvokeModel body's version field for Claude on Bedrock
MIN_RECORDS = 100  # "Minimum number of records per batch inference job" (Bedrock service quotas)
ENDED = ("Completed", "PartiallyCompleted", "Failed", "Stopped", "Expired")
# recordId is an alphanumeric string (Bedrock batch data format); custom_ids are 'r_' + hex
# (plan.py), so the record id is the custom_id without its underscore, and back.
RECORD_ID_SQL = "replace(custom_id, '_', '')"
S3_URI = re.compile(r"^s3://([a-z0-9][-.a-z0-9]{1,61}[a-z0-9])(/[-!_*'().a-zA-Z0-9/]*)?$")  # botocore's S3Uri
ROLE_ARN = re.compile(r"^arn:aws(-[^:]+)?:iam::([0-9]{12})?:role/.+$")  # botocore's RoleArn
CREDENTIALS_HINT = "the standard AWS credential chain (AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a role)"


def record_id(custom_id: str) -> str:
    return custom_id.replace("_", "")


def custom_id_sql(record: str) -> str:
    """The custom_id of a recordId (the inverse of RECORD_ID_SQL for the planner's 'r_' + hex ids)."""
    return f"'r_' || substr({record}, 2)"


def job_name(token: str) -> str:
    """The job's name: the ledger's job id (job_ + hex) in the characters a job name allows."""
    return "dbt-llm-batch-" + token.removeprefix("job_")


def request_token(token: str) -> str:
    """clientRequestToken: the ledger's job id, so a repeated create is the same job."""
    return token.replace("_", "-")


def _under_minimum(value: object, errors: list[str]) -> str:
    if value not in ("wait", "realtime"):
        errors.append(f"llm_bedrock_under_minimum must be 'wait' or 'realtime', got {value!r}")
    return str(value)


def _key(name: str, type_: str, default: Any, doc: str, default_doc: str | None = None) -> Key:
    return Key(name, type_, default, doc, default_doc=default_doc)


class BedrockBatchProvider(BatchProvider):
    name = "bedrock"
    key_env_var = ""  # no key: the AWS credential chain (check_credentials)
    min_requests_per_batch = MIN_RECORDS
    # "Records per batch inference job" and "Batch inference input file size" are account quotas
    # (defaults 50,000 records and 1 GB in the quotas page); the lower readings are kept.
    max_requests_per_batch = 50_000
    max_bytes_per_batch = 1_000_000_000
    context_windows = {"anthropic.claude-": 200_000, "us.anthropic.claude-": 200_000, "eu.anthropic.claude-": 200_000}
    default_output_tokens = AnthropicBatchProvider.default_output_tokens
    # What the capability table says (docs/providers/index.md; each is shown in docs/providers/bedrock.md).
    structured_output = (
        "Claude's forced tool (`tool_choice`) in the InvokeModel body; Converse `toolConfig` in realtime"
    )
    prompt_caching = "none in batch jobs (`cache_control` is dropped)"
    unfinished_batch = (
        "expires after `timeoutDurationInHours` (24 h); an expired, stopped or failed job's processed records"
        " are kept (and billed), the rest sent again (a failed job's after a back-off)"
    )
    environment_hint = "Bedrock reads credentials, region and endpoints from the standard AWS chain"
    # Claude's stop_reason in InvokeModel bodies, and Converse's stopReason (realtime rows).
    finish_reasons = {
        **AnthropicBatchProvider.finish_reasons,
        "guardrail_intervened": "content_filter",
        "content_filtered": "content_filter",
        "model_context_window_exceeded": "length",
    }
    under_minimum_hint = (
        "set llm_bedrock_under_minimum = 'realtime' to send them now through the Converse API at list price"
    )
    config_keys = {
        "llm_bedrock_s3_input": _key(
            "llm_bedrock_s3_input",
            "string (s3://bucket/prefix)",
            None,
            "Bedrock: where request files are uploaded (the job's input location)",
            "required for llm_provider 'bedrock'",
        ),
        "llm_bedrock_s3_output": _key(
            "llm_bedrock_s3_output",
            "string (s3://bucket/prefix)",
            None,
            "Bedrock: where jobs write their results (`<prefix>/<job id>/`, with `manifest.json.out`)",
            "required for llm_provider 'bedrock'",
        ),
        "llm_bedrock_role_arn": _key(
            "llm_bedrock_role_arn",
            "string (IAM role ARN)",
            None,
            "Bedrock: the service role a batch job assumes to read the input and write the output in S3",
            "required for llm_provider 'bedrock'",
        ),
        "llm_bedrock_region": _key(
            "llm_bedrock_region",
            "string",
            None,
            "Bedrock: the AWS region of the jobs and the S3 calls",
            "the AWS chain's (AWS_DEFAULT_REGION, the profile)",
        ),
        "llm_bedrock_under_minimum": _key(
            "llm_bedrock_under_minimum",
            "'wait' or 'realtime'",
            "wait",
            "Bedrock needs at least 100 records per job: fewer requests `wait` (deferred) for more rows, or go "
            "`realtime` through the Converse API at list price",
        ),
    }

    @classmethod
    def parse_options(cls, values, errors):
        for name in ("llm_bedrock_s3_input", "llm_bedrock_s3_output"):
            uri = values[name]
            if uri is None or uri == "":
                errors.append(f"llm_provider 'bedrock' needs {name}: an S3 location such as 's3://my-bucket/llm/'")
            elif not isinstance(uri, str) or not S3_URI.match(uri.rstrip("/") or " "):
                errors.append(
                    f"{name} must be an S3 location 's3://<bucket>/<prefix>/' (a bucket name of 3 to 63 "
                    f"lowercase letters, digits, dots and hyphens), such as 's3://my-bucket/llm/', got {uri!r}"
                )
        role = values["llm_bedrock_role_arn"]
        arn = "the ARN of the IAM service role batch jobs run as ('arn:aws:iam::123456789012:role/...')"
        if role is None:
            errors.append(f"llm_provider 'bedrock' needs llm_bedrock_role_arn: {arn}")
        elif not isinstance(role, str) or not ROLE_ARN.match(role):
            errors.append(f"llm_bedrock_role_arn must be {arn}, got {role!r}")
        region = values["llm_bedrock_region"]
        if region is not None and not (isinstance(region, str) and re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", region)):
            errors.append(f"llm_bedrock_region must be an AWS region such as 'us-east-1', got {region!r}")
        return {
            "s3_input": str(values["llm_bedrock_s3_input"] or "").rstrip("/"),
            "s3_output": str(values["llm_bedrock_s3_output"] or "").rstrip("/"),
            "role_arn": role,
            "region": region,
            "under_minimum": _under_minimum(values["llm_bedrock_under_minimum"], errors),
        }

    def under_minimum(self) -> str:
        return self.config.options["under_minimum"]

    @classmethod
    def check_output_schema(cls, schema, errors):
        AnthropicBatchProvider.check_output_schema(schema, errors)

    def __init__(self, config):
        super().__init__(config)
        if not _is_claude(config.model):
            raise ConfigError(
                f"llm_provider 'bedrock' supports Anthropic Claude models (an id such as "
                f"'anthropic.claude-haiku-4-5-20251001-v1:0' or an inference profile 'us.anthropic.claude-...'), "
                f"got llm_model {config.model!r}"
            )
        # Claude's request body is Anthropic's own (without `model`): one owner of that shape.
        self._claude = AnthropicBatchProvider(config)
        self._clients: dict[str, Any] = {}

    # --- AWS clients (the standard credential chain; endpoints from AWS_ENDPOINT_URL_<SERVICE>) -----
    def _client(self, service: str):
        if service not in self._clients:
            boto3 = _boto3()
            from botocore.config import Config

            # One attempt each: self.calls retries within the run's budget (calls.py).
            config = Config(retries={"total_max_attempts": 1}, connect_timeout=30, read_timeout=120)
            session = boto3.session.Session(region_name=self.config.options["region"])
            self._clients[service] = session.client(service, config=config)
        return self._clients[service]

    def check_credentials(self) -> None:
        boto3 = _boto3()
        session = boto3.session.Session(region_name=self.config.options["region"])
        try:
            credentials, problem = session.get_credentials(), ""
        except Exception as exc:  # a source of the chain that is set up but failing (a profile, a role)
            credentials, problem = None, f" ({type(exc).__name__}: {exc})"
        if credentials is None:
            raise ConfigError(
                f"no AWS credentials found for llm_provider 'bedrock'{problem}: configure {CREDENTIALS_HINT} in "
                "the shell that runs dbt (never in dbt config; dbt writes config into target/)"
            )
        if session.region_name is None:
            raise ConfigError("no AWS region for llm_provider 'bedrock': set llm_bedrock_region or AWS_DEFAULT_REGION")

    # --- requests --------------------------------------------------------------------------------
    def model_input(self) -> dict:
        """Claude's InvokeModel body: Anthropic's params without `model` (the job names the model),
        with Bedrock's anthropic_version; no cache_control (not offered for batch jobs)."""
        params = self._claude.params()
        params.pop("model", None)
        _drop_cache_control(params)
        return {"anthropic_version": ANTHROPIC_VERSION, **params}

    def request_line_sql(self) -> str:
        text = json.dumps(
            {"recordId": CUSTOM_ID_MARK, "modelInput": self.model_input()}, ensure_ascii=False, separators=(",", ":")
        )
        head, rest = text.split(json.dumps(CUSTOM_ID_MARK))
        middle, tail = rest.split(json.dumps(PROMPT_MARK))
        return f"{literal(head)} || to_json({RECORD_ID_SQL}) || {literal(middle)} || to_json(prompt) || {literal(tail)}"

    # --- submitting --------------------------------------------------------------------------------
    def _input_uri(self, token: str) -> str:
        return f"{self.config.options['s3_input']}/{token}.jsonl"

    def upload(self, jsonl_path, token):
        bucket, key = _split(self._input_uri(token))
        # Safe to repeat: the same key is overwritten, and a file no job reads bills nothing.
        self.calls.call(
            "upload the request file to S3", lambda: self._client("s3").upload_file(jsonl_path, bucket, key)
        )
        return self._input_uri(token)

    def find_upload(self, token, since_epoch):
        bucket, key = _split(self._input_uri(token))
        try:
            self.calls.call(
                "look for an uploaded request file", lambda: self._client("s3").head_object(Bucket=bucket, Key=key)
            )
        except Exception as exc:
            if status_of(exc) == 404:
                return None
            raise
        return self._input_uri(token)

    def create(self, jsonl_path, file_id, token, model_name):
        options = self.config.options

        def create():
            return self._client("bedrock").create_model_invocation_job(
                jobName=job_name(token),
                roleArn=options["role_arn"],
                clientRequestToken=request_token(token),
                modelId=self.config.model,
                inputDataConfig={"s3InputDataConfig": {"s3Uri": file_id, "s3InputFormat": "JSONL"}},
                outputDataConfig={"s3OutputDataConfig": {"s3Uri": options["s3_output"] + "/"}},
                tags=[{"key": "dbt_model", "value": model_name[:256]}],
            )

        # Idempotent by clientRequestToken: a retry after a lost answer is the same job, never a second one.
        arn = self.calls.call("create the batch inference job", create)["jobArn"]
        return Submission(batch_id=arn, status="Submitted", input_file_id=file_id)

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        """The job created for this submission: listed by its name, confirmed by its clientRequestToken.
        None when there is none (Bedrock lists a job as soon as the create answered)."""

        def find():
            pages = self._client("bedrock").get_paginator("list_model_invocation_jobs")
            for page in pages.paginate(nameContains=job_name(token)):
                for job in page.get("invocationJobSummaries", []):
                    if job.get("clientRequestToken") == request_token(token) and job["jobArn"] not in known_batch_ids:
                        uri = job["inputDataConfig"]["s3InputDataConfig"]["s3Uri"]
                        return Submission(batch_id=job["jobArn"], status=job["status"], input_file_id=uri)
            return None

        return self.calls.call("list batch inference jobs", find)

    # --- polling and results ------------------------------------------------------------------------
    def poll(self, batch_id):
        job = self.calls.call(
            f"poll job {batch_id}", lambda: self._client("bedrock").get_model_invocation_job(jobIdentifier=batch_id)
        )
        status = job["status"]
        counts = {
            k: job[k]
            for k in ("totalRecordCount", "processedRecordCount", "successRecordCount", "errorRecordCount")
            if k in job
        }
        output = job["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"].rstrip("/")
        return BatchState(
            status=status,
            ended=status in ENDED,
            # A failed job is a batch-level failure (its unanswered records back off); stopped and
            # expired ones just end: what they finished is kept, the rest is sent again.
            error=(job.get("message") or "the batch inference job failed") if status == "Failed" else None,
            failed=status == "Failed",
            counts=counts,
            requests_done=counts.get("processedRecordCount"),
            output_file_id=f"{output}/{batch_id.rsplit('/', 1)[-1]}/",
        )

    def download_results(self, state, batch_id, directory):
        if not state.output_file_id:
            return []
        bucket, prefix = _split(state.output_file_id)
        s3 = self._client("s3")

        def keys():
            found = []
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                found += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(".jsonl.out")]
            return sorted(found)

        files = []
        found = self.calls.call(f"list the results of {batch_id}", keys)
        if not found and state.requests_done:
            state.results_gone = True  # processed records, but their output is no longer in S3
        for i, key in enumerate(found):
            path = os.path.join(directory, f"{batch_id.rsplit('/', 1)[-1]}-{i}.jsonl")
            self.calls.call(f"download {key}", lambda key=key, path=path: s3.download_file(bucket, key, path))
            files.append(("results", path))
        return files

    def cancel(self, batch_id):
        client = self._client("bedrock")
        client.stop_model_invocation_job(jobIdentifier=batch_id)
        return client.get_model_invocation_job(jobIdentifier=batch_id)["status"]

    def delete_files(self, batch_id, file_ids):
        """The uploaded request file and the job's output folder in S3."""
        s3, deleted = self._client("s3"), []
        for uri in file_ids:
            bucket, key = _split(uri)
            s3.delete_object(Bucket=bucket, Key=key)  # S3 answers 204 for a key already gone
            deleted.append(uri)
        if not batch_id:  # a submission that never made a job: only its upload is left
            return deleted
        state = self.poll(batch_id)
        if state.output_file_id:
            bucket, prefix = _split(state.output_file_id)
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=obj["Key"])
            deleted.append(state.output_file_id)
        return deleted

    # --- realtime: the Converse API -----------------------------------------------------------------
    def realtime_body(self) -> dict:
        cfg = self.config
        messages = [{"role": m["role"], "content": [{"text": m["content"]}]} for m in self.render_messages()]
        body: dict[str, Any] = {"messages": [*messages, {"role": "user", "content": [{"text": PROMPT_MARK}]}]}
        if cfg.system:
            body["system"] = [{"text": cfg.system}]
        inference: dict[str, Any] = {"maxTokens": cfg.max_tokens or AnthropicBatchProvider.default_output_tokens}
        if cfg.temperature is not None:
            inference["temperature"] = cfg.temperature
        body["inferenceConfig"] = inference
        schema = cfg.output_json_schema()
        if schema is not None:
            tool = {"name": "llm_output", "description": "Record the answer.", "inputSchema": {"json": schema}}
            body["toolConfig"] = {"tools": [{"toolSpec": tool}], "toolChoice": {"tool": {"name": "llm_output"}}}
        return body

    def realtime_transports(self) -> list:
        from dbt_llm_batch.providers.bedrock_converse import ConverseTransport

        return [ConverseTransport(self._client("bedrock-runtime"), self.config.model)]

    def realtime_result_line(self, custom_id, status, text):
        """A Converse reply as a batch output line: its message in Claude's InvokeModel shape."""
        body = json_object_text(text)
        line: dict[str, Any] = {"recordId": record_id(custom_id)}
        if status == 200 and body:
            reply = json.loads(body)
            blocks = []
            for block in reply.get("output", {}).get("message", {}).get("content", []):
                if "text" in block:
                    blocks.append({"type": "text", "text": block["text"]})
                elif "toolUse" in block:
                    use = block["toolUse"]
                    blocks.append(
                        {
                            "type": "tool_use",
                            "id": use.get("toolUseId"),
                            "name": use.get("name"),
                            "input": use.get("input"),
                        }
                    )
            usage = reply.get("usage", {})
            line["modelOutput"] = {
                "type": "message",
                "role": "assistant",
                "content": blocks,
                "stop_reason": reply.get("stopReason"),
                "usage": {"input_tokens": usage.get("inputTokens"), "output_tokens": usage.get("outputTokens")},
            }
        else:
            message = (json.loads(body).get("message") if body else None) or f"HTTP {status}: {text[:500]}"
            line["error"] = {"errorCode": status, "errorMessage": message}
        return json.dumps(line, ensure_ascii=False)

    # --- reading result lines ------------------------------------------------------------------------
    result_structure = {
        "recordId": "VARCHAR",
        "modelOutput": {
            "content": [{"type": "VARCHAR", "text": "VARCHAR", "input": "JSON"}],
            "stop_reason": "VARCHAR",
            "usage": {
                "input_tokens": "BIGINT",
                "output_tokens": "BIGINT",
                "cache_creation_input_tokens": "BIGINT",
                "cache_read_input_tokens": "BIGINT",
            },
        },
        "error": {"errorCode": "VARCHAR", "errorMessage": "VARCHAR"},
    }

    def outcomes_sql(self, r):
        message, error = f"{r}.modelOutput", f"{r}.error"
        usage, blocks = f"{message}.usage", f"{message}.content"
        if self.config.structured:  # the forced tool call's input is the answer
            answer = f"cast(list_filter({blocks}, lambda b: b.type = 'tool_use')[1].input as varchar)"
        else:
            answer = f"array_to_string(list_transform(list_filter({blocks}, lambda b: b.type = 'text'), lambda b: b.text), '')"
        refused = f"{message}.stop_reason in ('refusal', 'guardrail_intervened', 'content_filtered')"
        return f"""
            {custom_id_sql(f"{r}.recordId")} as custom_id,
            case when {error} is not null then 'error' when {refused} then 'error'
                 when {message} is not null then 'ok' else 'void' end as outcome,
            case when {error} is null and {message} is not null then {answer} end as answer,
            {message}.stop_reason as finish_reason,
            coalesce({message}.stop_reason in ('max_tokens', 'model_context_window_exceeded'), false) as truncated,
            coalesce({error}.errorMessage,
                     case when {refused} then 'model refused (stop reason ' || {message}.stop_reason || ')' end) as error,
            case when {usage} is not null then coalesce({usage}.input_tokens, 0)
                 + coalesce({usage}.cache_creation_input_tokens, 0) + coalesce({usage}.cache_read_input_tokens, 0) end
                as input_tokens,
            {usage}.output_tokens as output_tokens,
            {usage}.cache_read_input_tokens as cached_tokens,
            {usage}.cache_creation_input_tokens as cache_write_tokens,
            -- A 400 is the record itself (its modelInput), which would be rejected again; 429 and 5xx pass.
            case when {refused} then {literal(REFUSED)}
                 when {error}.errorCode in ('400', '404', '413', '422') then {literal(REJECTED)} end as not_retried,
            case when {usage} is not null then 0 end as cache_write_1h_tokens"""


def _boto3():
    """boto3, which only this provider needs (the `bedrock` extra)."""
    try:
        import boto3
    except ImportError:
        raise ConfigError(
            "llm_provider 'bedrock' needs boto3: pip install 'dbt-llm-batch[bedrock]' in dbt's environment"
        ) from None
    return boto3


def _is_claude(model: str) -> bool:
    return re.match(r"^([a-z]{2,4}\.)?anthropic\.claude-", model) is not None or (
        model.startswith("arn:aws") and "anthropic.claude-" in model
    )


def _drop_cache_control(value: Any) -> None:
    if isinstance(value, dict):
        value.pop("cache_control", None)
        for v in value.values():
            _drop_cache_control(v)
    elif isinstance(value, list):
        for v in value:
            _drop_cache_control(v)


def _split(uri: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key
