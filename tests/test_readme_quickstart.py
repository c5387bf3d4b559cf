"""A newcomer's path, for real: the README's quickstart, its blocks read from README.md in order and run
by one bash, in a FRESH virtual environment (`python3 -m venv`, then `pip install` of a copy of this
checkout, with pip's cache), against the sandbox it starts, ending with the query of the table.

The only change to the README's text is the sandbox's port (8787 becomes a free port, so that tests
running at once do not share a sandbox), and the `git clone` block is replaced by a copy of this
checkout (it says so: "not run by the docs tests"). tests/test_docs_examples.py runs the same blocks in
process, fast, together with the guides.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from docs_blocks import SANDBOX_PORT, blocks, file_text, free_port

REPO = Path(__file__).resolve().parent.parent
MARK = "@@docs-block "


def _copy_checkout(dest: Path) -> None:
    """The files git would give a clone (tracked, plus new files not ignored): no .venv, no build output."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _script(port: int) -> tuple[str, dict[str, list[str]]]:
    """The README's quickstart as one bash script, and the lines each output block expects, by block."""
    lines, expected = ["set -eo pipefail"], {}
    previous = None
    for block in blocks("README.md", (REPO / "README.md").read_text()):
        text = block.text.replace(SANDBOX_PORT, str(port))
        kind = block.kind
        if kind == "file":
            path = text.split("\n", 1)[0].split("file:", 1)[1].strip()
            lines += [f"cat > '{path}' <<'DOCS_EOF'", file_text(block.lang, text).rstrip("\n"), "DOCS_EOF"]
        elif kind == "run":
            lines += [f"echo '{MARK}{block.where}'", text]
            previous = block.where
        elif kind == "background":  # the second terminal: the same environment, in the background
            lines += [
                f"( {text.strip()} ) >sandbox.log 2>&1 &",
                f"for _ in $(seq 150); do curl -fs http://127.0.0.1:{port}/_emulator/stats >/dev/null && break; sleep 0.2; done",
            ]
        elif kind == "output":
            assert previous, f"{block.where}: an output block before any command"
            expected[previous] = [line for line in text.split("\n")[1:] if line.strip()]
    return "\n".join(lines) + "\n", expected


@pytest.mark.slow
def test_a_newcomer_follows_the_readme_quickstart_in_a_fresh_venv(tmp_path):
    _copy_checkout(tmp_path / "dbt-llm-batch")
    script, expected = _script(free_port())
    assert expected, "the quickstart ends with a query whose output the README shows"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    # The reader's shell: no venv on PATH, so `python3` is the system's and the venv is the one it creates.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(REPO)))
    env["DO_NOT_TRACK"] = "1"
    started = time.monotonic()
    # A session of its own: the sandbox it starts in the background is stopped with it, by its group.
    reader = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = reader.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reader.pid, signal.SIGTERM)
    done = subprocess.CompletedProcess(reader.args, reader.returncode, stdout, stderr)
    seconds = time.monotonic() - started
    print(f"the README quickstart, fresh venv to queried table: {seconds:.0f} s")
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert (tmp_path / "my_project" / "warehouse.duckdb").exists()
    # The venv is the fresh one, with the copy installed (not this checkout's editable install).
    where = subprocess.run(
        [str(tmp_path / ".venv/bin/python"), "-c", "import dbt_llm_batch; print(dbt_llm_batch.__file__)"],
        cwd=tmp_path / "my_project",  # not this checkout, whose package directory Python would find first
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(tmp_path / ".venv") in where and sys.prefix not in where
    outputs = dict(re.findall(rf"{MARK}(\S+)\n(.*?)(?={MARK}|\Z)", done.stdout, flags=re.S))
    for where, lines in expected.items():
        shown = " ".join(outputs[where].split())
        assert [line for line in lines if " ".join(line.split()) not in shown] == [], outputs[where]
