"""The adaptive concurrency controller (`llm_concurrency = 'auto'`), driven by a simulated engine:
a fixed number of batch slots whose per-request time grows with the batch, a queue behind them, and
optionally 429s above a queue depth. Deterministic: simulated time, no sleeping, no randomness."""

from __future__ import annotations

import heapq

import pytest

from dbt_llm_batch.pipeline.concurrency import AdaptiveConcurrency


class Engine:
    def __init__(self, slots: int, seconds: float = 1.0, reject_above: int | None = None):
        self.slots, self.seconds, self.reject_above = slots, seconds, reject_above

    def service_time(self, running: int) -> float:
        # A batch of n sequences decodes each a little slower than one alone (shared compute), so
        # throughput n / time rises with n up to the slots, with diminishing returns.
        return self.seconds * (1 + 0.5 * running / self.slots)


def simulate(engine: Engine, requests: int, limit_of, on_finish=None) -> tuple[float, list[tuple[int, int]]]:
    """Send `requests` through `engine`, keeping at most limit_of() in flight; returns (throughput,
    [(in flight, limit) at every send])."""
    now, sent, done = 0.0, 0, 0
    finishing: list[tuple[float, int, bool]] = []  # (time, id, overloaded)
    waiting_in_engine: list[int] = []
    running = 0
    in_flight = 0
    seen = []

    def start(rid: int) -> None:
        nonlocal running
        running += 1
        heapq.heappush(finishing, (now + engine.service_time(running), rid, False))

    while done < requests:
        while sent < requests and in_flight < limit_of():
            in_flight += 1
            seen.append((in_flight, limit_of()))
            if engine.reject_above is not None and in_flight > engine.reject_above:
                heapq.heappush(finishing, (now + 0.01, -sent - 1, True))  # a quick 429
            elif running < engine.slots:
                start(sent)
            else:
                waiting_in_engine.append(sent)
            sent += 1
        now, rid, overloaded = heapq.heappop(finishing)
        in_flight -= 1
        if overloaded:
            sent -= 1  # the executor sends it again
        else:
            running -= 1
            done += 1
            if waiting_in_engine:
                start(waiting_in_engine.pop(0))
        if on_finish:
            on_finish(now, overloaded)
    return done / now, seen


def best_fixed(engine: Engine, requests: int, upper: int) -> tuple[int, float]:
    rates = {n: simulate(engine, requests, lambda n=n: n)[0] for n in range(1, upper + 1)}
    best = max(rates, key=rates.get)
    return best, rates[best]


@pytest.mark.parametrize("slots, upper", [(8, 64), (24, 64), (32, 32), (3, 16)])
def test_auto_reaches_the_engines_knee_within_its_bound(slots, upper):
    engine = Engine(slots)
    ctl = AdaptiveConcurrency(upper=upper)
    rate, seen = simulate(engine, 3000, lambda: ctl.limit, ctl.finished)
    _, best = best_fixed(engine, 3000, upper)
    assert all(n <= limit <= upper for n, limit in seen)  # never above its bound, never above its own limit
    assert rate >= 0.9 * best, (rate, best, ctl.limit)
    assert slots <= ctl.limit <= max(upper, slots)  # it settled at or past the knee, within the bound


def test_auto_backs_off_on_429_and_stays_under_the_servers_limit():
    engine = Engine(slots=32, reject_above=10)  # a server that refuses more than 10 at once
    ctl = AdaptiveConcurrency(upper=64)
    backoffs, overloads = [], []

    def finished(now, overloaded):
        before, count = ctl.limit, ctl.backoffs
        ctl.finished(now, overloaded)
        overloads.append(overloaded)
        if ctl.backoffs > count:
            backoffs.append((before, ctl.limit))

    rate, seen = simulate(engine, 2000, lambda: ctl.limit, finished)
    assert backoffs, "the simulation never produced a 429"
    assert all(after == max(1, before // 2) for before, after in backoffs)  # halved, once per overload
    # Overloads are rare once it has learned: few 429s among 2,000 requests, and it ends at or under 10.
    assert sum(overloads) < 60 and ctl.limit <= 10
    _, best = best_fixed(Engine(slots=32), 2000, 10)
    assert rate >= 0.8 * best


def test_halving_floors_at_one_and_the_bound_caps_the_climb():
    ctl = AdaptiveConcurrency(upper=5, start=4)
    for _ in range(10):
        ctl.finished(0.0, overloaded=True)
    assert ctl.limit == 1
    fast = AdaptiveConcurrency(upper=5, start=4)
    t = 0.0
    for _ in range(200):  # throughput that keeps rising: it climbs, but only to the bound
        t += 1.0 / (fast.limit * 10)
        fast.finished(t)
        assert fast.limit <= 5
    assert fast.limit == 5
