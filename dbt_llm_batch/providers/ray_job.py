"""The Ray job a `llm_provider = 'ray'` batch runs as, and the layout of its files on shared storage.

`python -m dbt_llm_batch.providers.ray_job SPEC_JSON` is the entrypoint RayBatchProvider submits to Ray
Jobs. It reads the batch's request lines (OpenAI Batch input format) with Ray Data, sends each to one of
the OpenAI-compatible engines (round robin, `concurrency` requests in flight per task), and writes the
answers as OpenAI Batch output lines, one part file per block of `rows_per_task` lines, so the plugin's
ordinary harvest reads them.

Why not ray.data.llm's HttpRequestProcessorConfig (it imports without vLLM): it keeps only the reply's
JSON, not its HTTP status (an output line needs `response.status_code`), and a row whose retries run out
raises and fails the whole job (it has no `should_continue_on_error`). Here a row the engine answered,
even with an error, is kept as its line; only an engine that cannot be reached fails the job, after the
part with every answer the task got is written (the rows without a line are resubmitted by the plugin).

Storage layout under the job's folder (`job_folder`): `input.jsonl`, and `output/part-<first
custom_id>-<lines>.jsonl`, each written to a temporary name and moved into place, so a job stopped or
failed midway leaves only whole part files; a part written again by a retried task replaces itself.
This module imports only the standard library and pyarrow at the top: the plugin imports it for the
layout, the cluster runs it (with ray) as the job.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs

INPUT = "input.jsonl"
OUTPUT = "output"
PART_SUFFIX = ".jsonl"
RETRY_STATUSES = (408, 429, 502, 503, 504)  # the engine is busy or restarting: the same request later
ATTEMPTS = 4  # per request, within the job (1, 2, 4 s apart)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path of a storage URI: an absolute local path, `file://`, `s3://`,
    `gs://`, `abfs://`, `hdfs://` (whatever pyarrow.fs.FileSystem.from_uri reads)."""
    return pafs.FileSystem.from_uri(uri)


def job_folder(storage: str, submission_id: str) -> str:
    return storage.rstrip("/") + "/" + submission_id


def parts(storage_folder: str) -> list[tuple[str, int]]:
    """The finished part files of a job's output, each with its number of lines (from its name)."""
    fs, path = filesystem(storage_folder + "/" + OUTPUT)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    found = []
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if info.is_file and info.base_name.startswith("part-") and info.base_name.endswith(PART_SUFFIX):
            lines = int(info.base_name[: -len(PART_SUFFIX)].rsplit("-", 1)[1])
            found.append((info.path, lines))
    return sorted(found)


def write_atomically(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees all of it or nothing (a temporary name, then a move)."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with fs.open_output_stream(temporary) as out:
        out.write(data)
    fs.move(temporary, path)


class Engines:
    """Round robin over the engines' base URLs, one keep-alive connection per thread and engine."""

    def __init__(self, base_urls: list[str], api_key_env: str | None, timeout: float):
        self.urls = [urllib.parse.urlsplit(u.rstrip("/") + "/chat/completions") for u in base_urls]
        self.next = itertools.count()
        self.local = threading.local()
        self.timeout = timeout
        key = os.environ.get(api_key_env) if api_key_env else None  # read at call time, never stored
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def _connection(self, i: int) -> http.client.HTTPConnection:
        pool = self.local.__dict__.setdefault("connections", {})
        if i not in pool:
            url = self.urls[i]
            kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            pool[i] = kind(url.hostname or "127.0.0.1", url.port, timeout=self.timeout)
        return pool[i]

    def post(self, body: bytes) -> tuple[int, bytes]:
        """One request to the next engine: (status, reply body). Raises OSError if it cannot be reached."""
        i = next(self.next) % len(self.urls)
        connection = self._connection(i)
        try:
            connection.request("POST", self.urls[i].path, body=body, headers=self.headers)
            reply = connection.getresponse()
            return reply.status, reply.read()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise OSError(f"{self.urls[i].scheme}://{self.urls[i].netloc}: {type(exc).__name__}: {exc}") from exc


def answer(engines: Engines, line: str) -> str | None:
    """The OpenAI Batch output line for one request line, or None if no engine could be reached."""
    request = json.loads(line)
    body = json.dumps(request["body"]).encode()
    status, reply = 0, b""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        try:
            status, reply = engines.post(body)
        except OSError:
            status = 0
            continue
        if status not in RETRY_STATUSES:
            break
    if status == 0:
        return None
    try:
        parsed = json.loads(reply)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        parsed = {"error": {"message": f"HTTP {status}: {reply[:500].decode(errors='replace')}"}}
    return json.dumps(
        {"custom_id": request["custom_id"], "response": {"status_code": status, "body": parsed}, "error": None},
        separators=(",", ":"),
    )


def send_block(batch: dict, spec: dict) -> dict:
    """Ray Data map_batches function: send one block of request lines and write its part file."""
    import numpy as np

    engines = Engines(spec["engines"], spec.get("api_key_env"), spec.get("timeout", 600))
    lines = [str(t) for t in batch["text"] if str(t).strip()]
    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        answers = list(pool.map(lambda line: answer(engines, line), lines))
    written = [a for a in answers if a is not None]
    if written:
        first = json.loads(lines[0])["custom_id"]
        fs, folder = filesystem(spec["folder"] + "/" + OUTPUT)
        write_atomically(fs, f"{folder}/part-{first}-{len(written)}{PART_SUFFIX}", ("\n".join(written) + "\n").encode())
    if len(written) < len(lines):
        # Fail the job (the plugin resubmits the rows without a line): the engines are down.
        raise RuntimeError(
            f"{len(lines) - len(written)} of {len(lines)} request(s) could not reach an engine "
            f"({', '.join(spec['engines'])}) after {ATTEMPTS} attempts; the answered ones are kept"
        )
    return {"written": np.array([len(written)])}


def run(spec: dict) -> int:
    """Run the job: every line of the input through the engines into part files. Returns lines written."""
    import ray

    ray.init(log_to_driver=True)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    fs, path = filesystem(spec["folder"] + "/" + INPUT)
    out_fs, out_path = filesystem(spec["folder"] + "/" + OUTPUT)
    out_fs.create_dir(out_path, recursive=True)
    dataset = ray.data.read_text(path, filesystem=fs)
    sent = dataset.map_batches(
        send_block,  # type: ignore[arg-type]  # a dict of numpy arrays in and out (batch_format)
        fn_kwargs={"spec": spec},
        batch_size=spec["rows_per_task"],
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=spec["tasks"]),
        # Waiting on the network, not computing: a task takes a quarter of a CPU.
        num_cpus=0.25,
    )
    # Streamed through (no aggregate stage: Dataset.sum would add a shuffle to a job of two steps).
    total = sum(int(batch["written"].sum()) for batch in sent.iter_batches(batch_format="numpy", batch_size=None))
    print(f"dbt-llm-batch ray job: {total} result line(s) written to {spec['folder']}/{OUTPUT}")
    return total


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
