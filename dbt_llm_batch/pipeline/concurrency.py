"""How many realtime requests to keep in flight when `llm_concurrency = 'auto'`.

A self-hosted engine's throughput rises with the requests it runs at once until its batch is full
(vLLM's `--max-num-seqs`, its KV cache, the CPU); beyond that knee more requests only queue and wait
longer. The knee depends on the engine, the model, the prompt lengths and the machine, so a fixed
default is wrong somewhere. This controller finds it while sending:

- **climb**: start low and double the limit while each step raises throughput (completions per second,
  measured over a window of completions) by at least `gain`;
- **settle**: when a step no longer pays, go back to the best limit seen, and now and then probe a
  quarter higher (the engine may have warmed up, or other load gone away);
- **back off**: an overload reply (HTTP 429, 503, 529) or a failed connection halves the limit at once
  (multiplicative decrease, as TCP does), once per overload: the other requests already in flight at
  that moment were sent under the old limit, so their overload replies are not counted again; the limit
  that was overloaded is not probed again for a while;
- never above `upper` (the user's bound), never below 1.

It is plain arithmetic on the times the caller reports (no clock, no I/O), so it can be tested by
simulation; pipeline/realtime.py feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLIMB, SETTLE = "climb", "settle"
AUTO_START = 16  # where a run's climb starts (pipeline/realtime.py); the class default suits simulations


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
    _ends_to_ignore: int = field(init=False, default=0)  # requests in flight when it last backed off
    backoffs: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.upper = max(1, self.upper)
        self.limit = self.best_limit = max(1, min(self.start, self.upper))

    def window_size(self) -> int:
        # Enough completions that a window measures the steady state at this limit, not the ramp: two
        # rounds of the limit. (Three made the climb from 16 to 64 take 336 completions, longer than a
        # 300-row run on the local engine, measured with benchmarks/engine_batch.py.)
        return max(8, 2 * self.limit)

    def finished(self, now: float, overloaded: bool = False) -> None:
        """One request ended at `now` (seconds, any monotonic origin); `overloaded` when its reply
        said the server is over capacity (429, 503, 529) or the connection failed."""
        if self._ends_to_ignore:
            self._ends_to_ignore -= 1
            if overloaded:
                return
        if overloaded:
            self._back_off()
            return
        if self._window_start is None:
            self._window_start = now
            return
        self._done += 1
        if self._done >= self.window_size() and now > self._window_start:
            self._end_window(self._done / (now - self._window_start))

    def _new_window(self) -> None:
        self._window_start, self._done = None, 0

    def _set(self, limit: int) -> None:
        self.limit = max(1, min(self.upper, limit))
        self._new_window()

    def _back_off(self) -> None:
        self.backoffs += 1
        self._ends_to_ignore = self.limit - 1  # the others sent under this limit
        self.overloaded_at = self.limit
        self.phase, self._probing_from, self._settled_windows = SETTLE, None, 0
        self.best_limit = max(1, self.limit // 2)
        self.best_rate = 0.0  # measured again at the lower limit
        self._set(self.best_limit)

    def _end_window(self, rate: float) -> None:
        if self.phase == CLIMB:
            if rate >= self.best_rate * self.gain:
                self.best_rate, self.best_limit = rate, self.limit
                if self.limit >= self.upper:
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
        room = self.limit + step < (self.overloaded_at or self.upper + 1) and self.limit < self.upper
        if self._settled_windows >= self.probe_every and room:
            self._probing_from = self.limit
            self._set(self.limit + step)
        else:
            self._new_window()
