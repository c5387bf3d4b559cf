"""Who runs a model: an owner id per run (host:pid:random), and whether that run is still alive.

A run's owner holds its model's lock (locks.py) and the project-wide claims it makes (claims.py):
both end with the run, and both outlive a killed run only until its owner is seen to be dead.
"""

from __future__ import annotations

import os
import socket
import uuid

# A live run refreshes its heartbeat at least every 30 s while it waits (runner.ModelRun.wait); the
# other steps of a run take seconds to minutes. Ten minutes without a heartbeat means the owner is gone.
STALE_AFTER_SECONDS = 600


def new_owner() -> str:
    """host:pid:random: which machine and process to look at, and unique per run."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def process_is_gone(owner: str) -> bool:
    """True if the owner ran on this host under a PID that no longer exists (a killed run, say), so its
    lock need not wait for the heartbeat timeout. A reused PID only makes us wait: the safe side."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: existence check only
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by another user
        return False
    return False


def is_live(owner: str, heartbeat_age: float | None, stale_after: float = STALE_AFTER_SECONDS) -> bool:
    """A run is live while it holds its model's lock (`heartbeat_age`: seconds since its lock's last
    heartbeat, None when it holds none), the heartbeat is fresh, and its process exists."""
    return heartbeat_age is not None and heartbeat_age < stale_after and not process_is_gone(owner)
