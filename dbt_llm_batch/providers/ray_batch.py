"""Self-hosted batch jobs on a Ray cluster (`llm_provider = 'ray'`): submit and return, harvest later.

A batch is a Ray job. Submitting copies the request file (OpenAI Batch input lines, the same writer as
OpenAI's) to storage the cluster reads (`llm_ray_storage`: a local or shared path, or any pyarrow
filesystem URI such as `s3://bucket/prefix`), then `JobSubmissionClient(address).submit_job(...)`
with `submission_id` = the ledger's job id and the package's job module as the entrypoint
(providers/ray_job.py); `dbt run` returns while the job runs. Poll is the job's status; harvest reads
the part files the job wrote (OpenAI Batch output lines: OpenAIChatProvider's result format), also of
a job that was stopped or failed midway; the requests without a line go back to the queue.

Crash safety: the submission id is the ledger's job id, so a run killed after `submit_job` and before
recording it finds the job by that id (find_submission), and Ray refuses a second job with the same
id ("already exists"), which `create` adopts: one job per intent, never two.

A Ray job is self-hosted inference: nothing is billed by a provider, so cost comes from the price
table alone (zero unless the model's llm_price_table prices the engine). Urgent rows
(llm_realtime_when) go straight to the engines in `llm_base_url`, as with `openai_compatible`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any

from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers import ray_job
from dbt_llm_batch.providers.base import CUSTOM_ID_MARK, BatchProvider, BatchState, Submission, spliced_line_sql
from dbt_llm_batch.providers.openai_compatible import OpenAICompatibleProvider

ENDPOINT = "/v1/chat/completions"
ADDRESS_ENV_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # where Ray's own job CLI looks
ENDED = ("STOPPED", "SUCCEEDED", "FAILED")  # ray.job_submission.JobStatus.is_terminal()
ENTRYPOINT = "python -m dbt_llm_batch.providers.ray_job"


NO_ADDRESS = (
    "llm_provider 'ray' needs the cluster's address: set llm_ray_address = 'http://HEAD:8265' in the model's "
    f"config, or export {ADDRESS_ENV_VARS[0]}"
)
NO_STORAGE = (
    "llm_provider 'ray' needs llm_ray_storage: a path or URI (e.g. 's3://bucket/prefix') that this machine "
    "writes and every node of the cluster reads; the request and result files go there"
)


def environment_address() -> str | None:
    return next((os.environ[v] for v in ADDRESS_ENV_VARS if os.environ.get(v)), None)


def job_client_class():
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:
        raise ConfigError("llm_provider 'ray' needs Ray's job client: pip install 'dbt-llm-batch[ray]'") from exc
    return JobSubmissionClient


class RayJobsError(Exception):
    """An answer of the Ray Jobs REST API other than success, with its HTTP status (the Ray client raises
    a RuntimeError that names it in its text: 'Request failed with status code 404: ...')."""

    def __init__(self, message: str, status_code: int | None):
        super().__init__(message)
        self.status_code = status_code


class APIConnectionError(ConnectionError):
    """The Ray dashboard could not be reached. Named like the SDKs' transport error, which
    calls.is_transient matches by name: a poll retries it within the run's retry budget."""


def ray_call(what: str, fn):
    """Call the Ray job client, turning its errors into RayJobsError (with the status) or APIConnectionError."""
    try:
        return fn()
    except (RayJobsError, APIConnectionError):
        raise
    except OSError as exc:  # the client's ConnectionError, and requests' (an IOError)
        raise APIConnectionError(f"{what}: the Ray dashboard could not be reached ({exc})") from exc
    except RuntimeError as exc:
        found = re.search(r"status code (\d{3})", str(exc))
        if found is None:
            raise
        said = [line.strip() for line in str(exc).splitlines() if len(line.strip()) > 3]
        raise RayJobsError(f"{what}: {said[-1][:300]}", int(found.group(1))) from exc


def failure(message: str | None) -> str:
    """Why a Ray job failed, in a line: Ray's message ends with the job's last log lines, in which the last
    line naming an error says it (the job module's own, when the engines could not be reached)."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "could not reach" in line]
    return (named or lines or ["the Ray job failed, giving no message"])[-1][:1000]


class RayBatchProvider(OpenAICompatibleProvider, BatchProvider):
    name = "ray"
    key_env_var = ""
    self_hosted = True
    # The job sends chat completions only (providers/ray_job.py): llm_task = 'embed' is refused at parse time.
    has_embeddings = False
    # One job holds many rows: its start-up (seconds) is paid once, and partial results are harvested.
    max_requests_per_batch = 200_000
    max_bytes_per_batch = 2_000_000_000
    config_keys = {
        **OpenAICompatibleProvider.config_keys,
        **{
            key.name: key
            for key in (
                Key(
                    "llm_ray_address",
                    "URL",
                    None,
                    "the Ray cluster's dashboard (Jobs API) address, `http://head:8265`; unset: "
                    "RAY_API_SERVER_ADDRESS or RAY_ADDRESS from the environment",
                ),
                Key(
                    "llm_ray_storage",
                    "path or URI",
                    None,
                    "where request and result files go, readable by the plugin and every node: a shared "
                    "path, or a pyarrow filesystem URI (`s3://bucket/prefix`)",
                    default_doc="required",
                ),
                Key(
                    "llm_ray_runtime_env",
                    "dict",
                    None,
                    "the job's Ray runtime environment (e.g. `{'pip': ['dbt-llm-batch[ray]']}`); unset: the "
                    "cluster's Python must have dbt-llm-batch installed",
                ),
                Key(
                    "llm_ray_tasks",
                    "integer 1-1024",
                    2,
                    "request blocks sent at once (each with `llm_concurrency` requests in flight)",
                ),
                Key(
                    "llm_ray_rows_per_task",
                    "integer 1-100000",
                    256,
                    "request lines per block: a block's answers are written (and harvestable) when it ends",
                ),
                Key(
                    "llm_gpu_hour_usd",
                    "number >= 0",
                    None,
                    "the price of one GPU-hour of the engines: a job costs its run time (Ray's start to end) x "
                    "`llm_gpus` x this, spread evenly over the requests it answered (added to any per-token price)",
                ),
                Key(
                    "llm_gpus",
                    "integer 1-100000",
                    1,
                    "the GPUs the engines in `llm_base_url` hold while a job runs (with `llm_gpu_hour_usd`)",
                ),
            )
        },
    }
    environment_hint = "a Ray job reads llm_ray_address, llm_ray_storage and the engines' llm_base_url"

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        """The engines' keys (OpenAICompatibleProvider), then the Ray keys: address (http(s) URL, or None:
        the environment's at call time), storage (required), runtime_env, tasks and rows per task. Every
        problem goes into `errors`, so a model with several is told them all in one error, before anything
        is submitted (an address missing from the environment too: check_credentials says it again
        with the engines' key at call time, when a run, the poller or another model's run needs it)."""
        options = super().parse_options(values, errors)
        address = values["llm_ray_address"]
        if address is not None and not (isinstance(address, str) and address.startswith(("http://", "https://"))):
            errors.append(
                f"llm_ray_address must be the dashboard's http(s) URL, e.g. 'http://head:8265', got {address!r}"
            )
        elif address is None and not environment_address():
            errors.append(NO_ADDRESS)
        storage = values["llm_ray_storage"]
        if storage is None:
            errors.append(NO_STORAGE)
        elif not (isinstance(storage, str) and ("://" in storage or storage.startswith("/"))):
            errors.append(
                f"llm_ray_storage must be an absolute path or a URI (e.g. 's3://bucket/prefix'), got {storage!r}"
            )
        runtime_env = values["llm_ray_runtime_env"]
        if runtime_env is not None and not isinstance(runtime_env, dict):
            errors.append(f"llm_ray_runtime_env must be a dict (a Ray runtime environment), got {runtime_env!r}")
        gpu_hour = values["llm_gpu_hour_usd"]
        if gpu_hour is not None and (
            isinstance(gpu_hour, bool) or not isinstance(gpu_hour, int | float) or gpu_hour < 0
        ):
            errors.append(f"llm_gpu_hour_usd must be a number >= 0 (US dollars per GPU-hour), got {gpu_hour!r}")
        for key, most in (("llm_ray_tasks", 1024), ("llm_ray_rows_per_task", 100_000), ("llm_gpus", 100_000)):
            n = values[key]
            if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= most):
                errors.append(f"{key} must be an integer from 1 to {most}, got {n!r}")
        return {
            **options,
            "ray_address": address,
            "ray_storage": storage,
            "ray_runtime_env": runtime_env,
            "ray_tasks": values["llm_ray_tasks"],
            "ray_rows_per_task": values["llm_ray_rows_per_task"],
            "gpu_hour_usd": gpu_hour,
            "gpus": values["llm_gpus"],
        }

    def __init__(self, config):
        super().__init__(config)
        self._client = None

    @property
    def address(self) -> str:
        found = self.config.options.get("ray_address") or environment_address()
        if not found:
            raise ConfigError(NO_ADDRESS)
        return found

    @property
    def storage(self) -> str:
        storage = self.config.options.get("ray_storage")
        if not storage:
            raise ConfigError(NO_STORAGE)
        return storage

    @property
    def client(self):
        if self._client is None:
            client_class, address = job_client_class(), self.address
            self._client = ray_call(f"connect to Ray at {address}", lambda: client_class(address))
        return self._client

    def check_credentials(self) -> None:
        """What a Ray job needs from this machine's environment, every missing piece in one error: the
        engines' key variable (if llm_api_key_env names one), the cluster's address, Ray's job client."""
        problems = []
        for check in (super().check_credentials, lambda: self.address, job_client_class):
            try:
                check()
            except ConfigError as exc:
                problems.append(str(exc))
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError("llm_provider 'ray' cannot submit:\n  - " + "\n  - ".join(problems))

    def request_line_sql(self) -> str:
        return spliced_line_sql(
            {"custom_id": CUSTOM_ID_MARK, "method": "POST", "url": ENDPOINT, "body": self.request_body()}
        )

    @staticmethod
    def submission_id(token: str) -> str:
        return f"dbt_llm_batch-{token}"

    def folder(self, batch_id: str) -> str:
        return ray_job.job_folder(self.storage, batch_id)

    def upload(self, jsonl_path, token):
        """Copy the request file to the job's folder on the storage; its URI is the file id."""
        uri = self.folder(self.submission_id(token)) + "/" + ray_job.INPUT

        def copy():  # safe to repeat: the same file to the same place
            fs, path = ray_job.filesystem(uri)
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with open(jsonl_path, "rb") as f:
                ray_job.write_atomically(fs, path, f.read())
            return uri

        return self.calls.call("copy the request file to llm_ray_storage", copy)

    def job_spec(self, batch_id: str) -> dict:
        cfg = self.config
        return {
            "folder": self.folder(batch_id),
            "engines": list(self.base_urls),
            "api_key_env": self.api_key_env,
            "concurrency": cfg.concurrency,
            "tasks": cfg.options["ray_tasks"],
            "rows_per_task": cfg.options["ray_rows_per_task"],
        }

    def create(self, jsonl_path, file_id, token, model_name):
        """Submit the Ray job. Not retried (submit.py); a second submit of the same id (a run that died
        after the first) is refused by Ray as 'already exists', and the job that exists is adopted."""
        batch_id = self.submission_id(token)
        entrypoint = f"{ENTRYPOINT} {shlex.quote(json.dumps(self.job_spec(batch_id), separators=(',', ':')))}"
        try:
            ray_call(
                "submit the Ray job",
                lambda: self.client.submit_job(
                    entrypoint=entrypoint,
                    submission_id=batch_id,
                    runtime_env=self.config.options["ray_runtime_env"],
                    metadata={"dbt_llm_batch_token": token, "dbt_model": model_name[:512]},
                ),
            )
        except RayJobsError as exc:
            if "already exists" not in str(exc.__cause__ or exc):
                raise
        return Submission(batch_id=batch_id, status=self._status(batch_id), input_file_id=file_id)

    def _status(self, batch_id: str) -> str:
        return str(ray_call(f"status of Ray job {batch_id}", lambda: self.client.get_job_status(batch_id)).value)

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        """The job is named by the ledger's job id: Ray has it (adopt it) or does not (it never reached Ray)."""
        batch_id = self.submission_id(token)
        try:
            status = self.calls.call(f"find Ray job {batch_id}", lambda: self._status(batch_id))
        except RayJobsError as exc:
            if exc.status_code == 404:
                return None
            raise
        return Submission(batch_id=batch_id, status=status, input_file_id=self.folder(batch_id) + "/" + ray_job.INPUT)

    def poll(self, batch_id):
        info = self.calls.call(
            f"poll Ray job {batch_id}", lambda: ray_call("poll", lambda: self.client.get_job_info(batch_id))
        )
        status = str(info.status.value)
        done = sum(n for _, n in ray_job.parts(self.folder(batch_id)))
        return BatchState(
            status=status,
            ended=status in ENDED,
            failed=status == "FAILED",
            error=failure(info.message) if status == "FAILED" else None,
            requests_done=done,
            output_file_id=self.folder(batch_id) + "/" + ray_job.OUTPUT,
            run_cost_usd=self.run_cost(info.start_time, info.end_time) if status in ENDED else None,
        )

    def run_cost(self, start_ms: int | None, end_ms: int | None) -> float | None:
        """The job's GPU time at the user's price: (end - start) x llm_gpus x llm_gpu_hour_usd (Ray's
        JobInfo times are Unix milliseconds). None without a price, or when Ray did not record both."""
        price = self.config.options.get("gpu_hour_usd")
        if price is None or not start_ms or not end_ms:
            return None
        return max(0, end_ms - start_ms) / 3_600_000 * self.config.options["gpus"] * price

    def download_results(self, state, batch_id, directory):
        """Every finished part file, joined into one local output file (none: the job wrote nothing)."""
        found = ray_job.parts(self.folder(batch_id))
        if not found:
            return []
        fs, _ = ray_job.filesystem(self.folder(batch_id))
        path = os.path.join(directory, f"{batch_id}-output.jsonl")

        def download():
            with open(path, "wb") as out:
                for part, _lines in found:
                    with fs.open_input_stream(part) as f:
                        out.write(f.read())
            return path

        return [("output", self.calls.call(f"read the results of {batch_id}", download))]

    def cancel(self, batch_id):
        """stop_job: the job ends as STOPPED; what it finished is harvested, the rest held by the ledger."""
        ray_call(f"stop Ray job {batch_id}", lambda: self.client.stop_job(batch_id))
        return self._status(batch_id)

    def delete_files(self, batch_id, file_ids):
        """The job's folder on the storage (its input and result files)."""
        import pyarrow.fs as pafs

        fs, path = ray_job.filesystem(self.folder(batch_id))
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            fs.delete_dir(path)
        return list(file_ids)
