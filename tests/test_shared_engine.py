"""Two models sending to one self-hosted engine at the same time under dbt's threads (the integration
project's profile runs 4), with llm_concurrency = 'auto' (pipeline/concurrency.py, pipeline/realtime.py).

Each model's run has a controller of its own and neither knows of the other: what they share is the
engine, and its /metrics, which reports the engine's whole load (both models' requests). The engine is
the sandbox's vLLM face (sandbox/engine.py): at most BATCH answers computed at once (its --max-num-seqs),
the others queue in it, unbounded; it never answers 429/503 for load. What was answered and billed, and
how many requests were in the engine at once, is read from the sandbox, not from the package's ledger.

dbt starts both models together, but whether their requests overlap is up to the scheduler: a barrier
after each run's controller is made (AdaptiveConcurrency.for_run, just before the first request goes
out) holds each model there until both have one, and the test checks from the engine's side that their
requests were in it together.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading

import pytest
from helpers import PROVIDER_MODELS

from dbt_llm_batch.pipeline import realtime
from dbt_llm_batch.pipeline.concurrency import AdaptiveConcurrency
from dbt_llm_batch.sandbox import Emulator, expected_answer
from dbt_llm_batch.sandbox.engine import EngineBatch

MODELS = ("ask_a", "ask_b")
ROWS = 80  # per model, every prompt distinct (no request shared between the models)
SYSTEM = "Answer in one line."
BATCH, KV_ROOM = 4, 16  # the engine's --max-num-seqs, and the requests its /metrics says its KV cache holds
# Where one controller settles once the engine's /metrics shows its batch full with requests waiting
# (AdaptiveConcurrency.engine_said): the batch plus half of it, at least 2, as a queue that refills it. The
# gauge `running` it reads is the engine's (both models' requests), so never above BATCH.
SETTLED = BATCH + max(2, BATCH // 2)


class WatchedEngine(EngineBatch):
    """The sandbox's engine batch, noting at each request's arrival how many requests of each model
    were in the engine (computing or waiting for a place), the arriving one included."""

    def __init__(self, batch: int, kv_room: float):
        super().__init__(batch, kv_room)
        self.asking = threading.local()  # the model of the request its handler thread is answering
        self.in_engine: collections.Counter[str] = collections.Counter()
        self.arrivals: list[dict[str, int]] = []

    @contextlib.contextmanager
    def place(self):
        model = self.asking.model
        with self._place:
            self.in_engine[model] += 1
            self.arrivals.append(dict(self.in_engine))
        try:
            with super().place():
                yield
        finally:
            with self._place:
                self.in_engine[model] -= 1


@pytest.fixture
def one_engine(monkeypatch, api_key):
    """One engine for both models: the sandbox with vLLM's batch and /metrics, answering in 50 ms."""
    monkeypatch.setenv("ENGINE_KEY", api_key)
    with Emulator(api_key=api_key) as emu:
        emu.engine = WatchedEngine(BATCH, KV_ROOM)  # as emu.emulate_engine(BATCH, KV_ROOM) does
        emu.realtime_latency = 0.05
        answer = emu.handle

        def noting_the_model(method, path, headers, body):
            if path.endswith("/chat/completions"):
                emu.engine.asking.model = json.loads(body)["messages"][-1]["content"].split(":", 1)[0]
            return answer(method, path, headers, body)

        emu.handle = noting_the_model
        yield emu
    emu.raise_internal_errors()


def engine_model(name: str, base_url: str) -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='id', llm_provider='openai_compatible',
            llm_model='{PROVIDER_MODELS["openai"]}', llm_base_url='{base_url}', llm_api_key_env='ENGINE_KEY',
            llm_concurrency='auto', llm_system={SYSTEM!r}, llm_max_tokens=20) }}}}
select i as id, '{name}: question ' || i as prompt from range({ROWS}) t(i)
"""


def both_send_together(monkeypatch) -> None:
    """Each run, once its controller is made (after it read the engine's /metrics, before it sends
    anything), waits until the other's is made too."""
    barrier, for_run = threading.Barrier(len(MODELS)), AdaptiveConcurrency.for_run

    def together(max_concurrency, engine_room):
        try:
            return for_run(max_concurrency, engine_room)
        finally:
            barrier.wait(timeout=120)  # a model that never gets here fails the test, it never hangs it

    monkeypatch.setattr(AdaptiveConcurrency, "for_run", staticmethod(together))


def test_two_models_on_one_engine_are_answered_and_come_down_to_its_batch_together(project, one_engine, monkeypatch):
    """Both models' rows are answered in the one run, each prompt billed once, and once the engine's
    /metrics shows requests waiting for its batch, the two controllers together keep no more than
    2 * SETTLED requests in it (without the come-down they keep 2 * KV_ROOM there, and climb)."""
    monkeypatch.setattr(realtime, "ENGINE_READ_SECONDS", 0.05)  # the gauges read every 50 ms, not 1 s
    both_send_together(monkeypatch)
    for name in MODELS:
        project.write(f"models/{name}.sql", engine_model(name, one_engine.openai_base_url))

    project.dbt("run", "-s", *MODELS)

    for name in MODELS:
        rows = project.query(f"select prompt, llm_status, llm_output from main.{name}")
        assert len(rows) == ROWS, name
        wrong = [(p, s, o) for p, s, o in rows if s != "succeeded" or o != expected_answer(SYSTEM, p, None)]
        assert wrong == [], f"{name}: rows not answered with their own prompt's answer in the run"
    billed = collections.Counter((b["prompt"], b["via"]) for b in one_engine.billed())
    asked = {(f"{name}: question {i}", "realtime") for name in MODELS for i in range(ROWS)}
    assert billed == dict.fromkeys(asked, 1), "each distinct prompt billed once, in realtime"

    arrivals = one_engine.engine.arrivals
    assert len(arrivals) == 2 * ROWS, "one request per row reached the engine (none retried)"
    assert any(all(seen.get(name) for name in MODELS) for seen in arrivals), "the models' requests overlapped"
    in_engine = [sum(seen.values()) for seen in arrivals]
    # Each controller starts where the engine's /metrics says its KV cache has room (for_run: both read
    # KV_ROOM from an idle engine) and cannot climb before its first window of 2 * KV_ROOM answers, long
    # after the gauges (read every 50 ms) showed the queue and brought it down.
    assert max(in_engine) <= 2 * KV_ROOM
    # From then on each keeps at most SETTLED in flight: neither knows of the other, so together they
    # keep twice one model's queue in the engine, and no more. By the second half of the requests both
    # have come down (the first 2 * KV_ROOM drain in 2 * KV_ROOM / BATCH * 50 ms = 0.4 s; seen: by the
    # 45th), so none of those found more than both controllers' SETTLED in the engine.
    late = in_engine[ROWS:]
    assert max(late) <= 2 * SETTLED, f"requests in the engine at each arrival of the second half: {late}"
