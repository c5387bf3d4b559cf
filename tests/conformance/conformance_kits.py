"""The built-in batch providers' test kits: each a face of the package's sandbox (dbt_llm_batch.sandbox),
which serves every face from one loopback server; and `all_kits`, which adds any package's kit registered in
the entry-point group `dbt_llm_batch.conformance_kits` (name: the llm_provider it tests; value: "module:Kit",
a ProviderKit of conformance_kit.py)."""

from __future__ import annotations

import atexit
import functools
import os
import uuid
from importlib.metadata import entry_points
from typing import ClassVar

import pytest
from conformance_kit import Billed, ProviderKit

from dbt_llm_batch.sandbox import Emulator


class SandboxKit(ProviderKit):
    """A kit over one face of the package's sandbox."""

    face: ClassVar[str]  # the face's name in the sandbox's stats and billing record
    calls: ClassVar[dict[str, str]]  # CALLS -> the face's route key
    overloaded_status: ClassVar[int] = 503
    # How the face's usage reads: (all input, output, cached) from a billed record's usage.
    usage_fields: ClassVar[tuple[tuple[str, ...], str, tuple[str, ...]]] = (
        ("prompt_tokens",),
        "completion_tokens",
        ("cached_tokens",),
    )

    def __init__(self) -> None:
        self.key = "sk-conformance-" + uuid.uuid4().hex
        self.emu = Emulator(api_key=self.key)

    def start(self, monkeypatch) -> None:
        self.emu.start()
        for name, value in self.environment().items():
            monkeypatch.setenv(name, value)

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def stop(self) -> None:
        self.emu.stop()
        self.emu.raise_internal_errors()

    def open_batch_ids(self) -> list[str]:
        return [b["id"] for b in self.emu.batches() if self.emu_face().owns(b["id"]) and self.is_open(b)]

    def emu_face(self):
        return next(f for f in self.emu.faces if f.name == self.face)

    def is_open(self, batch: dict) -> bool:
        return batch.get("status") in ("validating", "in_progress", "finalizing", "cancelling")

    def complete_all(self) -> None:
        for batch_id in self.open_batch_ids():
            self.emu.complete(batch_id)

    def end_unfinished(self, done_fraction: float) -> None:
        for batch_id in self.open_batch_ids():
            self.emu.advance(batch_id, "expired", done_fraction)

    def inject_fault(self, call: str, kind: str, when: str, times: int) -> None:
        args = {"status_code": self.overloaded_status} if kind == "overloaded" else {"kind": "disconnect"}
        self.emu.add_fault(endpoint=self.calls[call], when=when, times=times, **args)

    def faults_pending(self) -> int:
        return len(self.emu.faults())

    def batches_created(self) -> int:
        return self.emu.stats()["batches_by_face"][self.face]

    def billed(self) -> list[Billed]:
        inputs, output, cached = self.usage_fields
        return [
            Billed(
                prompt=b["prompt"],
                input_tokens=sum(b["usage"].get(f) or 0 for f in inputs),
                output_tokens=b["usage"][output],
                cached_tokens=sum(b["usage"].get(f) or 0 for f in cached),
            )
            for b in self.emu.billed()
            if b["face"] == self.face
        ]


class OpenAIKit(SandboxKit):
    provider = "openai"
    model = "gpt-4o-mini"
    face = "openai"
    calls = {"create": "POST /v1/batches", "poll": "GET /v1/batches/{id}"}

    def environment(self) -> dict[str, str]:
        return {"OPENAI_BASE_URL": self.emu.openai_base_url, "OPENAI_API_KEY": self.key}


class AnthropicKit(SandboxKit):
    provider = "anthropic"
    model = "claude-sonnet-4-5"
    face = "anthropic"
    calls = {"create": "POST /v1/messages/batches", "poll": "GET /v1/messages/batches/{id}"}
    overloaded_status = 529
    usage_fields = (
        ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
        "output_tokens",
        ("cache_creation_input_tokens", "cache_read_input_tokens"),
    )

    def environment(self) -> dict[str, str]:
        return {"ANTHROPIC_BASE_URL": self.emu.anthropic_base_url, "ANTHROPIC_API_KEY": self.key}

    def is_open(self, batch: dict) -> bool:
        return batch.get("processing_status") in ("in_progress", "canceling")


class AzureOpenAIKit(SandboxKit):
    provider = "azure_openai"
    model = "batch-4o-mini"  # a deployment name, as users name theirs
    config = {"llm_azure_model": "gpt-4o-mini"}
    face = "azure_openai"
    # Azure never expires a job; one ended early was cancelled (in the portal), which returns and bills
    # the finished work (learn.microsoft.com, azure ai-foundry openai how-to batch).
    ends_unfinished_by = "cancel"
    calls = {"create": "POST /openai/batches", "poll": "GET /openai/batches/{id}"}

    def environment(self) -> dict[str, str]:
        return {"AZURE_OPENAI_ENDPOINT": self.emu.base_url, "AZURE_OPENAI_API_KEY": self.key}

    def end_unfinished(self, done_fraction: float) -> None:
        for batch_id in self.open_batch_ids():
            self.emu.advance(batch_id, "cancelled", done_fraction)


class GeminiKit(SandboxKit):
    provider = "gemini"
    model = "gemini-2.5-flash"
    face = "gemini"
    calls = {
        "create": "POST /gemini/{version}/models/{model}:batchGenerateContent",
        "poll": "GET /gemini/{version}/batches/{id}",
    }
    # Gemini's promptTokenCount already counts the cached tokens (cachedContentTokenCount is a part of it).
    usage_fields = (("promptTokenCount",), "candidatesTokenCount", ("cachedContentTokenCount",))

    def environment(self) -> dict[str, str]:
        return {"GOOGLE_GEMINI_BASE_URL": self.emu.gemini_base_url, "GEMINI_API_KEY": self.key}

    def start(self, monkeypatch) -> None:
        super().start(monkeypatch)
        monkeypatch.delenv("GOOGLE_API_KEY", raising=False)  # google-genai would prefer it to GEMINI_API_KEY

    def is_open(self, batch: dict) -> bool:
        return batch.get("status") in ("BATCH_STATE_PENDING", "BATCH_STATE_RUNNING")


class BedrockKit(SandboxKit):
    """Bedrock's face reads its jobs' input from, and writes their output to, moto's S3 in server mode (one
    per test process, started on first use), through boto3 as Bedrock does; each kit has its own bucket.
    A job needs at least 100 records: the suite sizes its rows by the provider's min_requests_per_batch."""

    provider = "bedrock"
    model = "anthropic.claude-haiku-4-5-20251001-v1:0"
    face = "bedrock"
    calls = {"create": "POST /model-invocation-job", "poll": "GET /model-invocation-job/{id}"}
    usage_fields = (("input_tokens",), "output_tokens", ())  # batch inference reports no cache tokens

    def __init__(self) -> None:
        super().__init__()
        self.bucket = "llm-conformance-" + uuid.uuid4().hex[:16]
        self.config = {
            "llm_bedrock_s3_input": f"s3://{self.bucket}/requests",
            "llm_bedrock_s3_output": f"s3://{self.bucket}/results",
            "llm_bedrock_role_arn": "arn:aws:iam::123456789012:role/bedrock-batch",
        }

    def start(self, monkeypatch) -> None:
        import boto3

        self.emu.s3_endpoint_url = s3_server_url()
        super().start(monkeypatch)
        for name in (
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_BEARER_TOKEN_BEDROCK",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        ):
            monkeypatch.delenv(name, raising=False)
        boto3.session.Session().client("s3").create_bucket(Bucket=self.bucket)

    def environment(self) -> dict[str, str]:
        """boto3's standard chain, and nothing from this machine's own AWS setup: the access key id is
        the sandbox key; each service's endpoint is the face (S3: moto)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": "sandbox-secret",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_BEDROCK": self.emu.base_url,
            "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": self.emu.base_url,
            "AWS_ENDPOINT_URL_S3": s3_server_url(),
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def is_open(self, batch: dict) -> bool:
        return batch.get("status") in ("Submitted", "Validating", "Scheduled", "InProgress", "Stopping")


@functools.cache
def s3_server_url() -> str:
    """moto's S3 in server mode, one per test process (xdist worker), stopped when the process exits."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    atexit.register(server.stop)
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


BUILT_IN = (OpenAIKit, AnthropicKit, AzureOpenAIKit, GeminiKit, BedrockKit)


KIT_GROUP = "dbt_llm_batch.conformance_kits"


def all_kits() -> dict[str, type]:
    """Each tested provider's kit class, the built-in ones first; a registered kit replaces a built-in one."""
    kits = {cls.provider: cls for cls in BUILT_IN}
    for ep in entry_points(group=KIT_GROUP):
        cls = ep.load()
        if getattr(cls, "provider", None) != ep.name:
            raise pytest.UsageError(
                f"conformance kit {ep.value!r} is registered as {ep.name!r} but tests {cls.provider!r}"
            )
        kits[ep.name] = cls
    return kits
