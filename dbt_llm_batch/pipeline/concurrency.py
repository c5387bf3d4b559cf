"""How many realtime requests to keep in flight when `llm_concurrency = 'auto'`.

A self-hosted engine's throughput rises with the requests it runs at once until its batch is full
(vLLM's `--max-num-seqs`, its KV cache, the CPU); beyond that knee more requests only queue and wait
longer. The knee depends on the engine, the model, the prompt lengths and the machine, so a fixed
default is wrong somewhere. This controller finds it while sending:

- **start where the engine says** (`for_run`): a vLLM engine's `/metrics` tells how many requests its KV
  cache holds at once (providers/engine_load.py); the run starts there, so a run of a few hundred rows
  does not spend itself climbing (from 16, the climb to 64 took longer than a 300-row run on the local
  engine, which then ran at 0.85x the best fixed number). A server that says nothing: start at 16;
- **come down to the engine's batch** (`engine_said`): requests waiting in the engine for a place in its
  batch mean the batch is full at the requests it runs; the limit comes down to that batch plus half of it (the queue that
  refills the batch the moment a sequence ends, without a round trip to this client), and never goes
  above it again in the run;
- **climb**: double the limit while each step raises throughput (completions per second, measured over
  a window of completions) by at least `gain`;
- **settle**: when a step no longer pays, go back to the best limit seen, and now and then probe a
  quarter higher (the engine may have warmed up, or other load gone away);
- **back off**: an overload reply (HTTP 429, 503, 529) or a failed connection halves the limit at once
  (multiplicative decrease, as TCP does), once per overload: a request that took its place before that
  back-off (`generation`) was sent under the old limit, so its overload replies, its retries' included,
  are not counted again: until those requests end, more are in flight than the new limit, and their
  overloads say nothing of it. The limit that was overloaded is not probed again for a while;
- never above `upper` (the user's bound), never below 1.

It is plain arithmetic on the times and readings the caller reports (no clock, no I/O), so it can be
tested by simulation; pipeline/realtime.py feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dbt_llm_batch.config_keys import AUTO_MAX_CONCURRENCY, AUTO_START

CLIMB, SETTLE = "climb", "settle"


@dataclass
class AdaptiveConcurrency:
    upper: int  # the user's bound (the engine's batch size, a provider's rate limit)
    start: int = 4
    gain: float = 1.08  # a step must raise throughput by 8 % to be worth its extra waiting
    probe_every: int = 4  # windows at the settled limit between two probes upward
    limit: int = field(init=False)
    phase: str = field(init=False, default=CLIMB)
    best_rate: float = field(init=False, default=0.0)
    best_limit: int = field(init=False)
    overloaded_at: int | None = field(init=False, default=None)  # not probed again until it decays
    _window_start: float | None = field(init=False, default=None)
    _done: int = field(init=False, default=0)
    _settled_windows: int = field(init=False, default=0)
    _probing_from: int | None = field(init=False, default=None)
    backoffs: int = field(init=False, default=0)  # also the generation of a request taking its place now
    engine_room: int | None = None  # what the engine said its KV cache holds when the run began
    engine_batch: int | None = field(init=False, default=None)  # the largest batch it ran with requests waiting
    ceiling: int = field(init=False)  # upper, or the engine's batch plus its refill queue once seen full
    _answered: int = field(init=False, default=0)
    first_limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.upper = self.ceiling = max(1, self.upper)
        self.limit = self.best_limit = self.first_limit = max(1, min(self.start, self.upper))

    @classmethod
    def for_run(cls, max_concurrency: int | None, engine_room: int | None) -> AdaptiveConcurrency:
        """The controller of one run: `max_concurrency` is llm_max_concurrency as set (None: unset),
        `engine_room` what the engine's /metrics says its KV cache holds (None: it says nothing). An
        engine that holds more than the default bound may get that many, unless the user bounds it."""
        upper = max_concurrency or max(AUTO_MAX_CONCURRENCY, engine_room or 0)
        return cls(upper=upper, start=engine_room or AUTO_START, engine_room=engine_room)

    def engine_said(self, running: int, waiting: int) -> None:
        """A reading of the engine's own gauges (summed over replicas) while sending."""
        if waiting <= 0 or running <= 0 or not self._answered:
            # Nothing queues; or nothing has been answered yet, and a burst sent at the start may wait a
            # scheduler step or two for its prefill while the batch is not full.
            return
        # Requests queue in the engine: its batch is full at `running` (its --max-num-seqs, or its KV
        # cache). More in flight than that batch plus a queue to refill it only waits longer.
        self.engine_batch = max(self.engine_batch or 0, running)
        before, self.ceiling = self.ceiling, min(self.upper, self.engine_batch + max(2, self.engine_batch // 2))
        # Down to the new ceiling; or up to it when the last reading set the limit and this one saw a
        # larger batch (a reading can catch the batch while a finished sequence's slot is being refilled).
        if self.limit > self.ceiling or self.limit == before < self.ceiling:
            self.phase, self._probing_from, self._settled_windows = SETTLE, None, 0
            self.best_limit, self.best_rate = self.ceiling, 0.0  # measured again at the new limit
            self._set(self.ceiling)

    def window_size(self) -> int:
        # Enough completions that a window measures the steady state at this limit, not the ramp: two
        # rounds of the limit. (Three made the climb from 16 to 64 take 336 completions, longer than a
        # 300-row run on the local engine, measured with benchmarks/engine_batch.py.)
        return max(8, 2 * self.limit)

    @property
    def generation(self) -> int:
        """What a request taking its place in flight now passes to `finished` with each of its replies
        (retries included): how many back-offs came before it."""
        return self.backoffs

    def finished(self, now: float, overloaded: bool = False, generation: int | None = None) -> None:
        """A reply to a request came at `now` (seconds, any monotonic origin); `overloaded` when it
        said the server is over capacity (429, 503, 529) or the connection failed. `generation`: the
        request's (`generation` when it took its place); None counts every overload."""
        if overloaded:
            if generation is None or generation >= self.backoffs:
                self._back_off()
            return
        self._answered += 1
        if self._window_start is None:
            self._window_start = now
            return
        self._done += 1
        if self._done >= self.window_size() and now > self._window_start:
            self._end_window(self._done / (now - self._window_start))

    def _new_window(self) -> None:
        self._window_start, self._done = None, 0

    def _set(self, limit: int) -> None:
        self.limit = max(1, min(self.ceiling, limit))
        self._new_window()

    def _back_off(self) -> None:
        self.backoffs += 1
        self.overloaded_at = self.limit
        self.phase, self._probing_from, self._settled_windows = SETTLE, None, 0
        self.best_limit = max(1, self.limit // 2)
        self.best_rate = 0.0  # measured again at the lower limit
        self._set(self.best_limit)

    def _end_window(self, rate: float) -> None:
        if self.phase == CLIMB:
            if rate >= self.best_rate * self.gain:
                self.best_rate, self.best_limit = rate, self.limit
                if self.limit >= self.ceiling:
                    self.phase = SETTLE
                    self._new_window()
                else:
                    self._set(self.limit * 2)
            else:
                self.phase = SETTLE
                self._set(self.best_limit)
            return
        if self._probing_from is not None:  # the window after a probe upward
            if rate >= self.best_rate * self.gain:
                self.best_rate, self.best_limit = rate, self.limit
            else:
                self._set(self._probing_from)
            self._probing_from, self._settled_windows = None, 0
            self._new_window()
            return
        # Settled: the latest window is the level a probe must beat (the engine may have got slower or
        # faster since the climb), and probe upward now and then.
        self.best_rate = rate
        self._settled_windows += 1
        step = max(1, self.limit // 4)
        if self.overloaded_at is not None and self._settled_windows >= 4 * self.probe_every:
            self.overloaded_at = None  # long enough: the overload may have been someone else's
        room = self.limit + step < (self.overloaded_at or self.ceiling + 1) and self.limit < self.ceiling
        if self._settled_windows >= self.probe_every and room:
            self._probing_from = self.limit
            self._set(self.limit + step)
        else:
            self._new_window()


def describe(ctl: AdaptiveConcurrency) -> str:
    """Where a run's controller ended and why, for the run's log."""
    said = (
        f"; the engine's /metrics: KV room for {ctl.engine_room}"
        + (f", a full batch of {ctl.engine_batch} with requests waiting" if ctl.engine_batch else "")
        if ctl.engine_room is not None
        else "; the engine said nothing of its load"
    )
    return (
        f"{ctl.limit} request(s) in flight (started at {ctl.first_limit}, bound {ctl.upper}{said}; "
        f"{ctl.backoffs} back-off(s) on overload)"
    )
