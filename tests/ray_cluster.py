"""A local single-node Ray cluster for the Ray tests (tests/conftest.py's `ray_cluster` fixture).

`ray start --head --block` on loopback with 2 CPUs and a small object store, in a session of its own:
stopping it is a signal to that process group (never `ray stop`, which stops every Ray process of the
user). The job drivers run `python` from the PATH the head was started with: this venv's, so the job
module is the checked-out package's. The engine key the tests' engines want is in the head's
environment, as a real cluster has its secrets (never in a job's runtime_env, which Ray shows).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ENGINE_KEY_ENV = "RAY_ENGINE_KEY"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root: int) -> list[int]:
    """Every living process descended from `root` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class RayCluster:
    def __init__(self, engine_key: str):
        self.engine_key = engine_key
        # Short: Ray's unix socket paths live under it (at most 107 characters).
        self.temp_dir = Path(tempfile.gettempdir()) / f"ray-{uuid.uuid4().hex[:8]}"
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.process: subprocess.Popen | None = None
        self.started_in_seconds = 0.0

    def start(self, timeout: float = 120) -> RayCluster:
        bin_dir = Path(sys.executable).parent
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0",
            ENGINE_KEY_ENV: self.engine_key,
        }
        command = [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--port=0",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=2",
            "--object-store-memory=100000000",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        began = time.monotonic()
        self.log = open(self.temp_dir.with_suffix(".log"), "w")
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        from ray.job_submission import JobSubmissionClient

        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}: see {self.log.name}")
            try:
                JobSubmissionClient(self.address).list_jobs()
                break
            except Exception:
                if time.monotonic() - began > timeout:
                    self.stop()
                    raise
                time.sleep(0.5)  # waiting for a server to come up, not timing anything
        self.started_in_seconds = time.monotonic() - began
        return self

    def client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address)

    def stop(self) -> None:
        """Kill the cluster: `ray start`'s process group and every process descended from it (workers
        start sessions of their own). A test cluster keeps nothing worth a graceful stop."""
        if self.process is not None and self.process.poll() is None:
            pids = descendants(self.process.pid)
            os.killpg(os.getpgid(self.process.pid), signal.SIGKILL)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
