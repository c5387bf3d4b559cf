"""A plain model through real `dbt run` against the sandbox (not a test): submit N rows, complete the
batch, harvest it, and run once more with nothing new; for one or more installed trees, in alternating
rounds (the first tree of a round rotates), so that two versions are compared on the same machine at
the same time.

    .venv/bin/python benchmarks/dbt_run.py --rows 100000 --repeat 3
    .venv/bin/python benchmarks/dbt_run.py --rows 100000 --repeat 5 \\
        --tree before=/path/to/old/venv/bin/python:/path/to/old/checkout \\
        --tree now=.venv/bin/python:.

A tree is `label=python:checkout`: the Python whose `dbt` and dbt-llm-batch run the model, and the
checkout the project installs as its dbt package (`packages.yml` `local:`). The sandbox is this
checkout's, started once, the same for every tree, and reset before each tree's round. The model is a plain one (no variants, shared
requests, urgent rows or nested outputs): one enum and one boolean output, its rows generated in SQL.

For each `dbt run` it prints the model's own time (dbt's run_results.json `execution_time`: what dbt
shows as "OK in N s") and the process's wall time; wall minus model is dbt's start-up and parse with
this plugin loaded. The medians over the rounds, and the ratio of each tree's to the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
API_KEY = "sk-sandbox"
MODEL = """{{{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_provider = 'openai',
    llm_model = 'gpt-4o-mini',
    llm_system = 'You triage customer support tickets.',
    llm_output = {{'category': ['billing', 'bug', 'how_to', 'other'], 'urgent': 'boolean'}},
    llm_max_tokens = 50,
    llm_max_tokens_in_flight = 1000000000000,
    llm_max_batches_in_flight = 1000,
) }}}}
select i as ticket_id, 'Ticket ' || i || ': the export button crashes the app on page ' || (i % 97) as prompt
from range({rows}) t(i)
"""
STEPS = ("submit", "harvest", "nothing new")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, method: str, path: str) -> dict:
    request = urllib.request.Request(base + path, method=method, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read() or b"{}")


def write_project(root: Path, checkout: Path, rows: int) -> None:
    (root / "models").mkdir(parents=True)
    (root / "dbt_project.yml").write_text(
        "name: bench\nversion: '1.0'\nconfig-version: 2\nprofile: bench\n"
        "flags:\n  send_anonymous_usage_stats: false\n"
        "  warn_error_options:\n    silence: [CustomKeyInConfigDeprecation]\n"
    )
    (root / "profiles.yml").write_text(
        "bench:\n  target: dev\n  outputs:\n    dev:\n      type: duckdb\n      path: warehouse.duckdb\n      threads: 4\n"
    )
    (root / "packages.yml").write_text(f"packages:\n  - local: {checkout}\n")
    (root / "models" / "tickets_triage.sql").write_text(MODEL.format(rows=rows))


def dbt(python: str, root: Path, env: dict, *args: str) -> tuple[float, float]:
    """One dbt command in its own process: (wall seconds, the model's execution_time or 0)."""
    began = time.perf_counter()
    done = subprocess.run(
        [python, "-c", "from dbt.cli.main import cli; cli()", *args, "--profiles-dir", str(root)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(f"dbt {' '.join(args)} failed ({python}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    results = root / "target" / "run_results.json"
    model = 0.0
    if args[0] == "run" and results.exists():
        model = sum(r["execution_time"] for r in json.loads(results.read_text())["results"])
    return wall, model


def distributions(python: str) -> set[str]:
    """The distributions installed in a tree's environment (lower-case names)."""
    listing = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m; print(*{(d.metadata['Name'] or '').lower() for d in m.distributions()})",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(listing.split()) - {"", "dbt-llm-batch"}


# Packages a run was seen loading when installed (py-spy of a 100k submit): named first in the warning.
LOADED_WHEN_PRESENT = ("pandas", "aiohttp")


def _loaded_first(name: str) -> tuple[bool, str]:
    return name not in LOADED_WHEN_PRESENT, name


def unequal_environments(trees) -> list[str]:
    """A warning per tree whose installed packages differ from the first tree's. Libraries load optional
    packages when they are installed, inside the timed run (pyarrow imports pandas on its first array,
    openai its aiohttp client: about 0.3 s of a 100k submit on the 2-core machine), so such trees are not
    compared like for like: install the same packages in each (pip install them into the older venv)."""
    first_label, first_python, _ = trees[0]
    first = distributions(first_python)
    warnings = []
    for label, python, _ in trees[1:]:
        other = distributions(python)
        lacks, has = sorted(first - other, key=_loaded_first), sorted(other - first, key=_loaded_first)
        if lacks or has:
            warnings.append(
                f"warning: {label}'s environment lacks {len(lacks)} package(s) {first_label}'s has "
                f"({', '.join(lacks[:15])}{', ...' if len(lacks) > 15 else ''}) and has {len(has)} it lacks "
                f"({', '.join(has[:15])}{', ...' if len(has) > 15 else ''})"
            )
    return warnings


def one_round(label: str, python: str, checkout: Path, rows: int, sandbox: str) -> dict[str, tuple[float, float]]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    try:
        write_project(root, checkout, rows)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
            "DO_NOT_TRACK": "1",
            "OPENAI_BASE_URL": sandbox + "/v1",
            "OPENAI_API_KEY": API_KEY,
        }
        dbt(python, root, env, "deps")
        # An empty sandbox for every tree's round: it keeps every file and batch in memory (20 GB after
        # twenty 100k-row runs), and a later round's uploads would wait on its growing heap.
        call(sandbox, "POST", "/_emulator/reset")
        times = {"submit": dbt(python, root, env, "run")}
        call(sandbox, "POST", "/_emulator/complete_all")
        times["harvest"] = dbt(python, root, env, "run")
        times["nothing new"] = dbt(python, root, env, "run")
        return times
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", action="append", help="label=python:checkout (default: this checkout)")
    args = parser.parse_args()
    trees = []
    for spec in args.tree or [f"now={sys.executable}:{REPO}"]:
        label, _, rest = spec.partition("=")
        python, _, checkout = rest.partition(":")
        trees.append((label, python, Path(checkout).resolve()))

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dbt_llm_batch.sandbox", "--port", str(port), "--api-key", API_KEY, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sandbox = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                call(sandbox, "GET", "/_emulator/stats")
                break
            except OSError:
                time.sleep(0.2)
        for warning in unequal_environments(trees):
            print(warning)
        print(
            f"{args.rows:,} rows, {args.repeat} round(s), trees: {', '.join(t[0] for t in trees)}; load {os.getloadavg()[0]:.2f}"
        )
        seen: dict[str, list[dict[str, tuple[float, float]]]] = {label: [] for label, *_ in trees}
        for r in range(args.repeat):
            # Each round runs every tree once, and which tree goes first rotates: with a fixed order, any
            # cost of running first after the previous round (the sandbox's and the machine's state
            # left by the runs before) fell on the first tree named in every round. Use a multiple of
            # the number of trees as --repeat, so each tree goes first equally often.
            shift = r % len(trees)
            for label, python, checkout in trees[shift:] + trees[:shift]:
                times = one_round(label, python, checkout, args.rows, sandbox)
                seen[label].append(times)
                shown = "  ".join(f"{s}: model {m:.2f} s wall {w:.2f} s" for s, (w, m) in times.items())
                print(f"round {r + 1} {label:>8}: {shown}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)

    first = trees[0][0]
    print("\nmedians (model time = dbt's 'OK in'; start-up = wall - model)")
    print(f"{'tree':>8} " + " ".join(f"{s + ' model':>18} {s + ' start-up':>20}" for s in STEPS))
    medians = {}
    for label in seen:
        medians[label] = {
            s: (
                statistics.median(t[s][1] for t in seen[label]),
                statistics.median(t[s][0] - t[s][1] for t in seen[label]),
            )
            for s in STEPS
        }
        print(f"{label:>8} " + " ".join(f"{m:>16.2f} s {u:>18.2f} s" for m, u in medians[label].values()))
    for label in list(seen)[1:]:
        ratios = "  ".join(
            f"{s}: model {medians[label][s][0] / medians[first][s][0]:.3f}x, "
            f"start-up {medians[label][s][1] - medians[first][s][1]:+.2f} s"
            for s in STEPS
        )
        print(f"{label} against {first}: {ratios}")


if __name__ == "__main__":
    main()
