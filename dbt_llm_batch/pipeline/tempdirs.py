"""Private temporary directories for request files (prompts) and downloaded results (answers).

A run removes its directory when it ends, but a killed run (OOM, SIGKILL, a pulled plug) cannot:
its prompts would stay in $TMPDIR for good. So each directory's name carries its owner (PID and
host), and every run starts by removing the directories of owners that no longer exist on this
host. A directory of another host (a shared $TMPDIR) or of a live process is left alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from dbt_llm_batch.ledger.owners import process_is_gone
from dbt_llm_batch.log import log

PREFIX = "dbt_llm_batch_"


def _host() -> str:
    # Only characters safe in a file name, and no "_" (it separates the name's parts).
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())


def private_dir() -> tempfile.TemporaryDirectory:
    """A TemporaryDirectory (mode 0700) named after this process, so a later run can tell it is stale."""
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}_{_host()}_")


def remove_stale(parent: str | None = None) -> int:
    """Remove the directories private_dir() made for processes of this host that no longer exist;
    returns how many. Never fails a run: what cannot be removed is logged and left."""
    parent = parent or tempfile.gettempdir()
    host, removed = _host(), 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        pid, _, rest = name[len(PREFIX) :].partition("_")
        if not (name.startswith(PREFIX) and pid.isdigit() and rest.startswith(host + "_")):
            continue
        if not process_is_gone(f"{socket.gethostname()}:{pid}:"):
            continue
        path = os.path.join(parent, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
                removed += 1
        except OSError as exc:
            log.warning(f"could not remove {path}, left by a dbt-llm-batch run that died: {exc}")
    return removed
