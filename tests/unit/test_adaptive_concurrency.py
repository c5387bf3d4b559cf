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


def simulate(
    engine: Engine, requests: int, limit_of, on_finish=None, generation_of=lambda: None
) -> tuple[float, list[tuple[int, int]]]:
    """Send `requests` through `engine`, keeping at most limit_of() in flight; returns (throughput,
    [(in flight, limit) at every send]). `on_finish(now, overloaded, generation)`, with the
    generation_of() a request was sent at. A refused request leaves its place and is sent again."""
    now, sent, done = 0.0, 0, 0
    finishing: list[tuple[float, int, bool]] = []  # (time, id, overloaded)
    waiting_in_engine: list[int] = []
    generations: dict[int, int | None] = {}
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
            rid = sent if engine.reject_above is None or in_flight <= engine.reject_above else -sent - 1
            generations[rid] = generation_of()
            if rid < 0:
                heapq.heappush(finishing, (now + 0.01, rid, True))  # a quick 429
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
            on_finish(now, overloaded, generations.pop(rid))
    return done / now, seen


def best_fixed(engine: Engine, requests: int, upper: int) -> tuple[int, float]:
    rates = {n: simulate(engine, requests, lambda n=n: n)[0] for n in range(1, upper + 1)}
    best = max(rates, key=rates.get)
    return best, rates[best]


@pytest.mark.parametrize("slots, upper", [(8, 64), (24, 64), (32, 32), (3, 16)])
def test_auto_reaches_the_engines_knee_within_its_bound(slots, upper):
    engine = Engine(slots)
    ctl = AdaptiveConcurrency(upper=upper)
    rate, seen = simulate(engine, 3000, lambda: ctl.limit, ctl.finished, lambda: ctl.generation)
    _, best = best_fixed(engine, 3000, upper)
    assert all(n <= limit <= upper for n, limit in seen)  # never above its bound, never above its own limit
    assert rate >= 0.9 * best, (rate, best, ctl.limit)
    assert slots <= ctl.limit <= max(upper, slots)  # it settled at or past the knee, within the bound


def test_auto_backs_off_on_429_and_stays_under_the_servers_limit():
    engine = Engine(slots=32, reject_above=10)  # a server that refuses more than 10 at once
    ctl = AdaptiveConcurrency(upper=64)
    backoffs, overloads = [], []

    def finished(now, overloaded, generation):
        before, count = ctl.limit, ctl.backoffs
        ctl.finished(now, overloaded, generation)
        overloads.append(overloaded)
        if ctl.backoffs > count:
            backoffs.append((before, ctl.limit))

    rate, seen = simulate(engine, 2000, lambda: ctl.limit, finished, lambda: ctl.generation)
    assert backoffs, "the simulation never produced a 429"
    assert all(after == max(1, before // 2) for before, after in backoffs)  # halved, once per overload
    # Overloads are rare once it has learned: few 429s among 2,000 requests, and it ends at or under 10.
    assert sum(overloads) < 60 and ctl.limit <= 10
    _, best = best_fixed(Engine(slots=32), 2000, 10)
    assert rate >= 0.8 * best


def gateway_with_retries(ctl: AdaptiveConcurrency, capacity: int, requests: int, seconds: float) -> float:
    """A server behind a gateway that answers 503 at once to a request arriving while `capacity` are
    being served (two models sending to one engine: the other model's share is gone), as
    pipeline/realtime.py sends to it: a request keeps its place in flight while `_ask` retries it
    (after 0.5 s), so until a refused request is answered more are in flight than a lowered limit.
    A request is served in `seconds`. Each request passes the generation it took its place at.
    Returns completions per second."""
    now, started, done, serving = 0.0, 0, 0, 0
    events: list[tuple[float, int, str, int]] = []  # (time, order, 'arrive' | 'done', request)
    generation: dict[int, int] = {}
    order = 0

    def push(at: float, kind: str, rid: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, rid))

    while done < requests:
        while started < requests and len(generation) < ctl.limit:
            generation[started] = ctl.generation
            push(now, "arrive", started)
            started += 1
        now, _, kind, rid = heapq.heappop(events)
        if kind == "arrive" and serving >= capacity:
            ctl.finished(now, True, generation[rid])  # 503: retried by the same place in flight
            push(now + 0.5, "arrive", rid)
        elif kind == "arrive":
            serving += 1
            push(now + seconds, "done", rid)
        else:
            serving -= 1
            done += 1
            del generation[rid]
            ctl.finished(now, False, None)
    return done / now


def test_retries_of_requests_sent_before_a_back_off_do_not_halve_the_limit_again():
    """One overload, one halving: a request refused before the limit came down is retried in its place,
    and its next 503s are the old limit's, not the new one's (the ignore allowance it replaced, a count
    of replies, was used up by the retries' replies, and the limit fell to 1). A request takes 4 s:
    its place is retried eight times before one is free."""
    ctl = AdaptiveConcurrency(upper=64, start=16)
    rate = gateway_with_retries(ctl, capacity=10, requests=600, seconds=4.0)
    assert ctl.backoffs <= 2, (ctl.backoffs, ctl.limit)
    assert ctl.limit >= 5, (ctl.backoffs, ctl.limit)
    assert rate >= 0.8 * 10 / 4.0, rate  # 10 served at once, 4 s each


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


# --- started and steered by what the engine says (its /metrics, providers/engine_load.py) ----------------


def simulate_engine(slots: int, requests: int, ctl: AdaptiveConcurrency | None, fixed: int = 0) -> float:
    """An engine like vLLM as the controller sees it: `slots` sequences in its batch (--max-num-seqs),
    a queue behind it, and a request that needs `ARRIVE` seconds (HTTP, tokenizing, its grammar) from
    the client's send before it can take a slot, while a queued one takes a freed slot at once. Every
    second the controller (if any) reads the engine's gauges, as pipeline/realtime.py does. Returns
    completions per second; deterministic (simulated time)."""
    now, sent, done, in_flight, running = 0.0, 0, 0, 0, 0
    events: list[tuple[float, int, str]] = []  # (time, sequence, 'arrive' | 'finish')
    queued: list[int] = []
    next_reading = 1.0
    limit = (lambda: ctl.limit) if ctl else (lambda: fixed)

    def take_slot(rid: int) -> None:
        nonlocal running
        running += 1
        heapq.heappush(events, (now + 1.0 * (1 + 0.5 * running / slots), rid, "finish"))

    while done < requests:
        while sent < requests and in_flight < limit():
            in_flight += 1
            heapq.heappush(events, (now + ARRIVE, sent, "arrive"))
            sent += 1
        now, rid, kind = heapq.heappop(events)
        if ctl is not None and now >= next_reading:
            ctl.engine_said(running, len(queued))
            next_reading = now + 1.0
        if kind == "arrive":
            if running < slots:
                take_slot(rid)
            else:
                queued.append(rid)
            continue
        running, in_flight, done = running - 1, in_flight - 1, done + 1
        if queued:
            take_slot(queued.pop(0))
        if ctl is not None:
            ctl.finished(now)
    return done / now


ARRIVE = 0.15  # a slot left empty for this long after a sequence ends, unless a request waits for it


def test_auto_starts_where_the_engine_has_room_and_reaches_0_9_of_the_best_fixed_in_300_rows():
    """The local engine's case (benchmarks/engine_batch.py): 64 slots, a KV cache with room for 142,
    a run of 300 rows. Climbing from 16 (what 'auto' did, and still does against a server that says
    nothing) reaches 0.85x of the best fixed number here; starting at the engine's room, then coming
    down to its batch plus a refill queue, reaches 0.9x."""
    best = max(simulate_engine(64, 300, None, fixed=c) for c in (16, 32, 48, 64, 80, 96, 128, 300))
    blind = simulate_engine(64, 300, AdaptiveConcurrency.for_run(None, None))
    told = AdaptiveConcurrency.for_run(None, engine_room=142)
    rate = simulate_engine(64, 300, told)
    assert blind < 0.9 * best, (blind, best)  # the case this fixes
    assert rate >= 0.9 * best, (rate, best)
    assert told.first_limit == 142 and told.engine_batch == 64 and told.limit == 96  # 64 + 32 to refill it


def test_requests_waiting_in_the_engine_bring_the_limit_down_to_its_batch_plus_half():
    ctl = AdaptiveConcurrency.for_run(None, engine_room=200)
    assert (ctl.limit, ctl.upper) == (200, 200)  # more room than the default bound of 64: the bound follows
    ctl.engine_said(running=64, waiting=136)
    assert ctl.limit == 200  # nothing answered yet: the first burst may still be waiting for its prefill
    ctl.finished(0.0)
    ctl.engine_said(running=64, waiting=0)
    assert ctl.limit == 200  # nothing waits for a place: the batch is not full
    ctl.engine_said(running=60, waiting=130)
    assert (ctl.limit, ctl.engine_batch) == (90, 60)
    ctl.engine_said(running=64, waiting=30)  # a reading caught the batch larger: the limit follows it up
    assert (ctl.limit, ctl.engine_batch) == (96, 64)
    ctl.engine_said(running=50, waiting=2)  # a smaller batch later (sequences ending): the ceiling stays
    assert ctl.limit == 96
    t = 0.0
    for _ in range(2000):  # throughput that keeps rising: probes climb, but never past the engine's ceiling
        t += 1.0 / (ctl.limit * 10)
        ctl.finished(t)
        assert ctl.limit <= 96


def test_where_auto_starts_and_its_bound():
    assert (lambda c: (c.limit, c.upper))(AdaptiveConcurrency.for_run(None, None)) == (16, 64)  # says nothing
    assert (lambda c: (c.limit, c.upper))(AdaptiveConcurrency.for_run(None, 20)) == (20, 64)
    assert (lambda c: (c.limit, c.upper))(AdaptiveConcurrency.for_run(32, 142)) == (32, 32)  # the user's bound
    assert (lambda c: (c.limit, c.upper))(AdaptiveConcurrency.for_run(3, None)) == (3, 3)


def test_an_overload_still_halves_a_limit_the_engine_set():
    ctl = AdaptiveConcurrency.for_run(None, engine_room=142)
    ctl.finished(0.0)
    ctl.engine_said(running=64, waiting=10)
    ctl.finished(0.1, overloaded=True)
    assert (ctl.limit, ctl.backoffs) == (48, 1)
