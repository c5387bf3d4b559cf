"""The examples of the Markdown docs, read and run as the page shows them (docs/contributing-docs.md).

A page opts in with an HTML comment: `<!-- docs-test: new project -->` (its examples start from an empty
directory) or `<!-- docs-test: continues README.md -->` (they run after the named page's, in the same
directory and shell state). In an opted-in page, the first line of a fenced block says what it is:

- `# file: PATH` / `-- file: PATH`: the block is written to PATH (relative to the current directory);
- `# not run by the docs tests: REASON` (`--` in SQL): skipped, the reason stays visible on the page;
- `# in a second terminal ...`: a shell block started in the background, stopped after the last page;
- `# the output includes:`: (a `text` block) each further line must appear in the output of the
  command just before it, spaces collapsed;
- any other `bash` / `sh` / `shell` block is run, one command at a time; each must succeed.

A `sql`, `yaml`, `yml` or `python` block with none of these first lines is an error: every example of an
opted-in page either runs or says why not. The sandbox's port 8787 is replaced by a free port, so that
tests running at once do not share a sandbox.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

OPT_IN = re.compile(r"<!--\s*docs-test:\s*(new project|continues\s+(\S+))\s*-->")
FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>```+)(?P<info>[^\n`]*)$")
FILE = re.compile(r"^(?:#|--)\s*file:\s*(\S+)\s*$")
NOT_RUN = "not run by the docs tests:"  # after `#` or `--`, the block's language's comment
BACKGROUND = "# in a second terminal"
OUTPUT = "# the output includes:"
SHELL = {"bash", "sh", "shell"}
MUST_BE_MARKED = {"sql", "yaml", "yml", "python"}
SANDBOX_PORT = "8787"


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        first = self.first_line
        if FILE.match(first):
            return "file"
        if re.match(r"^(#|--)\s*" + NOT_RUN, first):
            return "not run"
        if first.startswith(BACKGROUND) and self.lang in SHELL:
            return "background"
        if first.startswith(OUTPUT):
            return "output"
        if self.lang in SHELL:
            return "run"
        if self.lang in MUST_BE_MARKED:
            return "unmarked"
        return "prose"  # text, json, console output: shown, not run


def file_text(lang: str, text: str) -> str:
    """What a `file:` block writes: all of it, its marker a comment, except in a language without
    comments (csv, json, text), where the marker line is left out."""
    return text if lang in SHELL | MUST_BE_MARKED | {"cron", "jinja"} else text.split("\n", 1)[1]


def opt_in(markdown: str) -> str | None:
    """None (not opted in), 'new project', or the page this one continues."""
    found = OPT_IN.search(markdown)
    if not found:
        return None
    return found.group(2) or "new project"


def blocks(page: str, markdown: str) -> list[Block]:
    found, lines, i = [], markdown.split("\n"), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening.group("info").strip():
            i += 1
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        lang = opening.group("info").strip().split()[0].lower()
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return found


def pages_in_order(repo: Path) -> list[str]:
    """README.md, then the pages of mkdocs.yml's nav in nav order, then any other page under docs/."""
    nav = re.findall(r":\s*(\S+\.md)\s*$", (repo / "mkdocs.yml").read_text(), flags=re.MULTILINE)
    listed = ["README.md"] + [f"docs/{p}" for p in nav]
    others = sorted(str(p.relative_to(repo)) for p in (repo / "docs").rglob("*.md"))
    return [p for p in listed if (repo / p).exists()] + [p for p in others if p not in listed]


def chain(repo: Path, first: str) -> list[str]:
    """`first` (a 'new project' page), then every page that continues it, directly or through another."""
    order, pages = [first], pages_in_order(repo)
    for page in pages:
        follows = opt_in((repo / page).read_text())
        if follows not in (None, "new project") and page not in order:
            base = (Path(page).parent / follows).as_posix() if "/" in page else follows
            if _normal(base) in order or follows in order:
                order.append(page)
    return order


def _normal(path: str) -> str:
    return os.path.normpath(path).replace(os.sep, "/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(script: str) -> list[str]:
    """A shell block's commands as written: backslash continuations joined, blank and comment-only lines
    dropped, and `a && b` split (each must succeed anyway). A trailing comment stays: bash ignores it."""
    out = []
    for line in script.replace("\\\n", " ").split("\n"):
        if shlex.split(line, comments=True):
            out.extend(part.strip() for part in line.split(" && "))
    return out


class Session:
    """One reader following pages in one directory: files written, commands run, exports kept.

    `dbt` and `dbt-llm-batch` commands run in this process (dbt through dbtRunner), which is what keeps
    the guides' test fast; creating or activating a virtual environment and `pip install` are skipped (the
    test runs in the project's own environment, where this checkout is installed); anything else runs
    with bash. tests/test_readme_quickstart.py runs the README's quickstart for real, in a fresh venv."""

    def __init__(self, root: Path, port: int, monkeypatch):
        self.cwd, self.port, self.monkeypatch = root, port, monkeypatch
        self.background: list[subprocess.Popen] = []
        self.last_output = ""
        self.ran: list[str] = []
        monkeypatch.setenv("DO_NOT_TRACK", "1")
        monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def follow(self, block: Block) -> None:
        text = block.text.replace(SANDBOX_PORT, str(self.port))
        kind = block.kind
        if kind == "unmarked":
            raise AssertionError(
                f"{block.where}: a {block.lang} block of an opted-in page must start with a comment `file: PATH` or "
                f"`{NOT_RUN} REASON` (docs/contributing-docs.md)"
            )
        if kind == "file":
            path = self.cwd / FILE.match(block.first_line).group(1)  # type: ignore[union-attr]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(file_text(block.lang, text))
        elif kind == "background":
            self._start(block, text)
        elif kind == "output":
            expected = [line for line in text.split("\n")[1:] if line.strip()]
            shown = _collapse(self.last_output)
            missing = [line for line in expected if _collapse(line) not in shown]
            assert not missing, f"{block.where}: the output lacks {missing}; it was:\n{self.last_output[-3000:]}"
        elif kind == "run":
            for command in commands(text):
                self._run(block, command)

    def _start(self, block: Block, text: str) -> None:
        script = "\n".join(c for c in commands(text))
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.background.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a second terminal's sandbox: wait until it answers
            assert proc.poll() is None, f"{block.where}: the background command ended: {proc.stderr.read()}"  # type: ignore[union-attr]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_emulator/stats", timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{block.where}: nothing answers on port {self.port} after 30 s")

    def _run(self, block: Block, command: str) -> None:
        words = shlex.split(command, comments=True)
        self.ran.append(command)
        if words[0] == "export":
            for assignment in words[1:]:
                name, _, value = assignment.partition("=")
                self.monkeypatch.setenv(name, os.path.expandvars(value))
        elif words[0] == "cd":
            self.cwd = (self.cwd / words[1]).resolve()
        elif words[:3] in (["python3", "-m", "venv"], ["python", "-m", "venv"]) or words[0] in (".", "source", "pip"):
            pass  # the test's own environment has the package (see the class docstring)
        elif words[0] == "dbt":
            self._dbt(block, words[1:])
        elif words[0] == "dbt-llm-batch":
            self._cli(block, words[1:])
        else:
            done = subprocess.run(["bash", "-c", command], cwd=self.cwd, capture_output=True, text=True, timeout=300)
            self.last_output = done.stdout + done.stderr
            assert done.returncode == 0, f"{block.where}: `{command}` exited {done.returncode}:\n{self.last_output}"

    def _dbt(self, block: Block, args: list[str]) -> None:
        from dbt.adapters.duckdb.connections import DuckDBConnectionManager
        from dbt.cli.main import dbtRunner

        output = io.StringIO()
        with _chdir(self.cwd), contextlib.redirect_stdout(output):
            result = dbtRunner().invoke(args)
        if DuckDBConnectionManager._ENV is not None:  # let the next command (or process) open the file
            DuckDBConnectionManager._ENV.close()
            DuckDBConnectionManager._ENV = None
        self.last_output = output.getvalue() + _show_output(result)
        assert result.success, f"{block.where}: `dbt {' '.join(args)}` failed: {result.exception}\n{self.last_output}"

    def _cli(self, block: Block, args: list[str]) -> None:
        from dbt_llm_batch.ops.cli import main

        output = io.StringIO()
        with _chdir(self.cwd), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = main(args)
        self.last_output = output.getvalue()
        assert code == 0, f"{block.where}: `dbt-llm-batch {' '.join(args)}` exited {code}:\n{self.last_output}"

    def close(self) -> None:
        for proc in self.background:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _show_output(result) -> str:
    """`dbt show` prints its table through dbt's event logger, which an in-process run may not send to
    stdout: the rows are taken from the result as well."""
    rows = []
    for node_result in getattr(getattr(result, "result", None), "results", None) or []:
        table = getattr(node_result, "agate_table", None)
        if table is not None:
            rows.append(" | ".join(table.column_names))
            rows += [" | ".join(str(v) for v in row) for row in table.rows]
    return "\n".join(rows)


def _collapse(text: str) -> str:
    return " ".join(text.split())


@contextlib.contextmanager
def _chdir(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)
