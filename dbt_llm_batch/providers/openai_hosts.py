"""Hosts of open models that serve OpenAI's Files + Batch API (llm_provider = 'openai' with llm_base_url):
what each differs in, so the OpenAI batch provider can talk to it unchanged.

A host is found by its base URL's host name, or named with llm_batch_host. Its `name` is the price
table's `provider` column for its models (a user's llm_price_table row, with the host's batch
discount in `batch_discount`, prices them); its limits size the request files. A host not listed
is taken at OpenAI's limits and priced under its host name. docs/providers/openai-compatible.md says
what was verified for each, and from which source.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Host:
    name: str  # llm_batch_host, and the `provider` of its rows in the price table
    hostnames: tuple[str, ...]  # what its base URL's host name is
    max_requests_per_batch: int
    max_bytes_per_batch: int  # decimal bytes, as hosts state megabytes
    batch_discount: float  # the share its batch price takes off its realtime price (for the docs and the seed)
    source: str


OPENAI = Host("openai", ("api.openai.com",), 50_000, 200_000_000, 0.5, "OpenAI Batch API docs")
HOSTS = {
    host.name: host
    for host in (
        OPENAI,
        # console.groq.com/docs/batch: "50% lower cost", a 24 h to 7 d window, chat completions among the
        # endpoints. Its per-batch limits are not in the copy read: OpenAI's are assumed.
        Host("groq", ("api.groq.com",), 50_000, 200_000_000, 0.5, "console.groq.com/docs/batch"),
        # docs.together.ai batch overview: up to 50,000 requests and 100 MB per input file, 30B enqueued
        # tokens per model, a fixed 24 h best-effort window; "up to 50% off" (discounts on selected models).
        Host(
            "together",
            ("api.together.xyz",),
            50_000,
            100_000_000,
            0.5,
            "docs.together.ai/docs/inference/batch/overview",
        ),
    )
}


def host_for(base_url: str | None, named: str | None) -> Host:
    """The host a model's batches go to: the one llm_batch_host names, else the one serving base_url's
    host name, else OpenAI's limits under the host name itself (or OpenAI, without a base URL)."""
    if named is not None:
        return HOSTS[named]
    if base_url is None:
        return OPENAI
    hostname = urlsplit(base_url).hostname or ""
    for host in HOSTS.values():
        if hostname in host.hostnames:
            return host
    return Host(hostname, (hostname,), OPENAI.max_requests_per_batch, OPENAI.max_bytes_per_batch, 0.0, "not listed")
