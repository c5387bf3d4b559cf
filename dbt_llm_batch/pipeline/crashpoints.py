"""Named points where a crash test makes the process die, to prove that a later run recovers.

Set DBT_LLM_BATCH_CRASH_AT to a point's name (and DBT_LLM_BATCH_CRASH_MARKER to a file path): when
a run reaches that point it writes the marker and kills itself with SIGKILL, like an OOM kill or a
pulled plug, with no chance to clean up. DBT_LLM_BATCH_CRASH_OCCURRENCE=k (default 1) makes it die
the k-th time the process reaches the point instead (e.g. after the second chunk's `create`).
Unset (always, outside tests), `reach` does nothing.
"""

from __future__ import annotations

import collections
import os
import signal

POINTS = (
    "after_intents",
    "after_upload",
    "before_create",
    "after_create",
    "after_download",
    "after_store",
    "before_merge",
    "before_merge_insert",  # reached only by a merge that shows some rows' stored rows
    "after_realtime_group",
)

_reached: collections.Counter = collections.Counter()  # times this process reached each point


def reach(point: str) -> None:
    if os.environ.get("DBT_LLM_BATCH_CRASH_AT") != point:
        return
    _reached[point] += 1
    if _reached[point] < int(os.environ.get("DBT_LLM_BATCH_CRASH_OCCURRENCE") or 1):
        return
    marker = os.environ.get("DBT_LLM_BATCH_CRASH_MARKER")
    if marker:
        with open(marker, "w") as f:
            f.write(point)
    os.kill(os.getpid(), signal.SIGKILL)
