"""A provider's SDK imported ahead of its first call, on a thread of its own.

The SDKs are slow to import (openai about half a second, anthropic over a second on this project's
2-core CI machine), and a run that will call a provider spends the time before its first call in
DuckDB (the fingerprints, the plan, the request files, the intents), which releases Python's lock.
Started as soon as a run knows it will call a provider (Pool.import_ahead), the import overlaps that
work instead of following it.

Before a client is made (Pool), `wait` joins the import of its SDK, so the client's own `import` finds
the module whole and no SDK module is ever imported by two threads at once.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterable

_imports: dict[str, threading.Thread] = {}
_lock = threading.Lock()


def start(modules: Iterable[str]) -> None:
    """Import each module not imported yet, each on a daemon thread; returns at once."""
    for name in modules:
        with _lock:  # dbt's threads run models at once: one import per module
            if name in sys.modules or name in _imports:
                continue
            thread = _imports[name] = threading.Thread(target=_import, args=(name,), name=f"import {name}", daemon=True)
        thread.start()


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # not installed or broken: the client's own import raises it, where it is reported
        pass


def wait(modules: Iterable[str]) -> None:
    """Until the imports `start` began of these modules have ended."""
    for name in modules:
        thread = _imports.get(name)
        if thread is not None:
            thread.join()


def wait_all() -> None:
    """Until every import begun has ended (a run that never made the client: no import outlives it)."""
    wait(list(_imports))
