"""Progress of long work (a run waiting for its batches, realtime rows, a large submission, `poll
--wait`): done / total, rate and estimated time left, logged at most every few seconds.

The interval is DBT_LLM_BATCH_PROGRESS_SECONDS (default 5; 0 logs every update, which tests use to
be deterministic). Inside dbt the lines reach dbt's log like every other line of the package's
logger (dbt/log.py); the CLI also hands each update to a progress bar on a terminal (ops/cli.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from dbt_llm_batch.log import log

INTERVAL_ENV = "DBT_LLM_BATCH_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 5.0

# Called with (what, done, total) on every update, however often lines are logged: the CLI's bar.
Listener = Callable[[str, int, int], None]
_listeners: list[Listener] = []


def interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """One piece of long work: `update(done)` as it advances; a line is logged when the interval has
    passed since the last one (the first update after the start counts), and `finish()` logs the last."""

    def __init__(self, what: str, total: int, unit: str = "requests", clock=time.monotonic):
        self.what, self.total, self.unit, self.clock = what, total, unit, clock
        self.started = clock()
        self.done = 0
        self.last_logged = self.started
        self.interval = interval()
        self.lines = 0

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        for listener in list(_listeners):
            listener(self.what, self.done, self.total)
        now = self.clock()
        if now - self.last_logged >= self.interval and 0 < self.done < self.total:
            self.last_logged = now
            self.log()

    def finish(self) -> None:
        """The last line, if the work took longer than the interval (short work stays quiet)."""
        if self.lines or self.clock() - self.started >= self.interval:
            self.log()

    def line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        percent = 100 * self.done // self.total if self.total else 100
        text = f"{self.what}: {self.done}/{self.total} {self.unit} ({percent}%), {rate:.1f}/s"
        if self.done >= self.total:
            return f"{text}, done in {duration(elapsed)}"
        if rate > 0:
            return f"{text}, about {duration((self.total - self.done) / rate)} left"
        return f"{text}, time left unknown"

    def log(self) -> None:
        self.lines += 1
        log.info(self.line())
