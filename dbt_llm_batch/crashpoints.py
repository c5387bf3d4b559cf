"""Named points where a crash test makes the process die, to prove that a later run recovers.

Set DBT_LLM_BATCH_CRASH_AT to a point's name (and DBT_LLM_BATCH_CRASH_MARKER to a file path): when
a run reaches that point it writes the marker and kills itself with SIGKILL, like an OOM kill or a
pulled plug, with no chance to clean up. Unset (always, outside tests), `reach` does nothing.
"""

from __future__ import annotations

import os
import signal

POINTS = ("after_intents", "after_upload", "after_create", "after_download", "after_store", "before_merge",
          "after_realtime_group")


def reach(point: str) -> None:
    if os.environ.get("DBT_LLM_BATCH_CRASH_AT") != point:
        return
    marker = os.environ.get("DBT_LLM_BATCH_CRASH_MARKER")
    if marker:
        with open(marker, "w") as f:
            f.write(point)
    os.kill(os.getpid(), signal.SIGKILL)
