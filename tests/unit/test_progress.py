"""Progress lines: at most one per interval, with done / total, rate and time left."""

from __future__ import annotations

import logging

from dbt_llm_batch.pipeline import progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_at_most_once_per_interval_with_rate_and_time_left(monkeypatch, caplog):
    monkeypatch.setenv(progress.INTERVAL_ENV, "5")
    clock = Clock()
    work = progress.Progress("m: realtime", 100, "answered", clock=clock)
    seen = []
    progress.add_listener(lambda what, done, total: seen.append((done, total)))
    try:
        with caplog.at_level(logging.INFO, logger="dbt_llm_batch"):
            for step in range(1, 10):  # one update a second: lines at 5 s and 10 s... not before
                clock.now += 1
                work.update(step * 10)
            clock.now += 1
            work.update(100)
            work.finish()
    finally:
        progress._listeners.clear()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "m: realtime: 50/100 answered (50%), 10.0/s, about 5 s left",
        "m: realtime: 100/100 answered (100%), 10.0/s, done in 10 s",
    ]
    assert seen[-1] == (100, 100) and len(seen) == 10  # a bar sees every update


def test_short_work_stays_quiet(monkeypatch, caplog):
    monkeypatch.setenv(progress.INTERVAL_ENV, "5")
    clock = Clock()
    work = progress.Progress("m: submitting", 3, clock=clock)
    with caplog.at_level(logging.INFO, logger="dbt_llm_batch"):
        clock.now += 1
        work.update(3)
        work.finish()
    assert caplog.records == []
