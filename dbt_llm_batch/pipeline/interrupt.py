"""Noticing that the user pressed Ctrl-C while a model waits for its batches (llm_wait_seconds).

dbt runs models on worker threads: Ctrl-C raises KeyboardInterrupt in dbt's main thread, which then
cancels the adapter's connections and joins the workers. A worker sleeping in our wait loop would go
on until llm_wait_seconds ran out. Python delivers signals to the main thread only, and no dbt or
DuckDB call reaches us, so the wait loop looks at the main thread instead: once it is no longer
alive, or is inside dbt's cancellation (`_cancel_connections`), the run is being stopped.
"""

from __future__ import annotations

import sys
import threading
import time

# dbt's main-thread function that runs after a KeyboardInterrupt (dbt/task/runnable.py).
DBT_CANCELLING = "_cancel_connections"


class Interrupted(Exception):
    """The user stopped the run while it waited; the ledger is consistent (nothing half-written)."""


def cancelled() -> bool:
    main = threading.main_thread()
    if main is threading.current_thread():
        return False  # KeyboardInterrupt reaches this thread directly
    if not main.is_alive():
        return True
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    while frame is not None:
        if frame.f_code.co_name == DBT_CANCELLING:
            return True
        frame = frame.f_back
    return False


def sleep(seconds: float, slice_seconds: float = 0.2) -> None:
    """time.sleep that ends early, raising Interrupted, once the run is being cancelled."""
    end = time.monotonic() + seconds
    while True:
        if cancelled():
            raise Interrupted(
                "the run was interrupted (Ctrl-C) while waiting for batches; nothing is lost: "
                "open batches stay in the ledger and the next run harvests them"
            )
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(slice_seconds, left))
