"""Statement profile of benchmarks/scale.py's steps (not a test): which statements a step runs, the
time of each, and DuckDB's own profile of the slowest ones (their costliest operators), so a step
that grows faster than its rows can be traced to the statement and the operator that do.

    .venv/bin/python benchmarks/scale_profile.py --rows 1000000
    .venv/bin/python benchmarks/scale_profile.py --rows 10000000 --memory-limit 4GB --json /tmp/p10m.json
    .venv/bin/python benchmarks/scale_profile.py --compare /tmp/p1m.json /tmp/p10m.json

A plain model's harvest (step (b): harvest + merge of a completed batch) on this tree and on an
older one, each with its own venv, statement by statement (the same ledger state is built on each):

    /path/to/venv-of-old-checkout/bin/python benchmarks/scale_profile.py --tree /path/to/old-checkout \
        --steps b --rows 100000 --repeat 3 --json /tmp/hv_pre.json
    .venv/bin/python benchmarks/scale_profile.py --steps b --rows 100000 --repeat 3 --json /tmp/hv_now.json
    .venv/bin/python benchmarks/scale_profile.py --compare /tmp/hv_pre.json /tmp/hv_now.json

`--steps r` times the whole run that harvests instead (runner.run_model with the offline provider:
reconcile, harvest, plan nothing new, merge, report), as benchmarks/dbt_run.py's harvest step does in dbt.

The real code gets a connection wrapped by `ProfiledConnection`: every `execute` is timed and, with
DuckDB's JSON profiling on, its operator tree is read back after it ends. Statements are grouped by
their text with literals blanked, per step. Shares within one run are robust to other work on the
machine; `--compare` sets two runs side by side with each statement's growth. With `--repeat R`
each step's time is the median of R rounds (each on a fresh database) and each statement's the mean.
`--tree DIR` imports the package and benchmarks/scale.py from DIR (a checkout whose venv runs this).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import duckdb


def load_tree(tree: str | None) -> SimpleNamespace:
    """The package and benchmarks/scale.py's steps (run here unchanged) of this checkout or of `tree`,
    so one profile runs on two trees: an older checkout keeps its own scale.py, which drives its code."""
    root = os.path.abspath(tree) if tree else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(root, "benchmarks"), root]
    import scale

    from dbt_llm_batch.config import parse_config
    from dbt_llm_batch.ledger import Ledger
    from dbt_llm_batch.pipeline import merge, plan, runner

    return SimpleNamespace(scale=scale, parse_config=parse_config, Ledger=Ledger, merge=merge, plan=plan, runner=runner)


def statement_shape(sql: str) -> str:
    """The statement with literals and whitespace runs blanked, so each run of one statement groups."""
    text = re.sub(r"'(?:[^']|'')*'", "?", sql)
    text = re.sub(r"\b\d+\b", "N", text)
    return " ".join(text.split())[:160]


def operators(node: dict, out: list) -> None:
    """Every operator of a DuckDB JSON profile (names differ across DuckDB versions)."""
    for top in node.get("operator", []):  # DuckDB 2.x: the plan under "operator"
        operators(top, out)
    name = node.get("operator_name") or node.get("name")
    timing = node.get("operator_timing", node.get("timing"))
    if name and timing is not None:
        rows = node.get("operator_cardinality", node.get("intermediate_rows", 0))
        out.append((float(timing), name.strip(), int(rows or 0)))
    for child in node.get("children", []):
        operators(child, out)


class Recorder:
    """The statements of one run, per step, with their times and costliest operators."""

    def __init__(self, directory: str):
        self.directory = directory
        self.step = "setup"
        self.lock = threading.Lock()
        self.local = threading.local()  # the first write of each thread's open transaction
        self.stats: dict = defaultdict(
            lambda: {"calls": 0, "seconds": 0.0, "spilled_mb": 0.0, "ops": defaultdict(float), "rows": {}}
        )
        self.step_seconds: dict = {}

    def record(self, sql: str, seconds: float) -> tuple:
        shape = statement_shape(sql)
        if shape.lower() == "commit":  # a commit writes its transaction's changes: named by its first write
            shape = f"commit of: {getattr(self.local, 'first_write', '?')[:80]}"
        elif shape.lower().startswith("begin"):
            self.local.first_write = "?"
        elif getattr(self.local, "first_write", "?") == "?" and not shape.lower().startswith("select"):
            self.local.first_write = shape
        with self.lock:
            entry = self.stats[(self.step, shape)]
            entry["calls"] += 1
            entry["seconds"] += seconds
        return (self.step, shape)

    def record_operators(self, statement: tuple, profile: str) -> None:
        """The operators of DuckDB's profile of the statement just run (get_profiling_information)."""
        ops: list = []
        try:
            tree = json.loads(profile)
        except ValueError:
            return
        operators(tree, ops)
        spilled = (tree.get("system") or {}).get("total_bytes_spilled") or 0
        with self.lock:
            entry = self.stats[statement]
            entry["spilled_mb"] += spilled / 1e6
            for timing, name, rows in ops:
                entry["ops"][name] += timing
                entry["rows"][name] = max(entry["rows"].get(name, 0), rows)

    def as_json(self) -> dict:
        return {
            "steps": self.step_seconds,
            "statements": [
                {
                    "step": step,
                    "sql": sql,
                    "calls": e["calls"],
                    "seconds": e["seconds"],
                    "spilled_mb": e["spilled_mb"],
                    "ops": dict(e["ops"]),
                    "rows": e["rows"],
                }
                for (step, sql), e in self.stats.items()
            ],
        }


class ProfiledConnection:
    """A DuckDB connection whose `execute` is timed and profiled; all else is passed through."""

    def __init__(self, con, recorder: Recorder):
        self._con = con
        self._recorder = recorder
        con.execute("pragma enable_profiling = 'no_output'")

    def execute(self, sql, *args, **kwargs):
        start = time.perf_counter()
        result = self._con.execute(sql, *args, **kwargs)
        seconds = time.perf_counter() - start
        self._recorder.record_operators(
            self._recorder.record(sql, seconds), self._con.get_profiling_information(format="json")
        )
        return self if result is self._con else result

    def cursor(self):
        return ProfiledConnection(self._con.cursor(), self._recorder)

    def __getattr__(self, name):
        return getattr(self._con, name)


def profiled_round(
    m: SimpleNamespace, n: int, steps: str, memory_limit: str | None, temp_directory: str | None
) -> dict:
    """One round of scale.run_once's (a), (b), (c) (those named in `steps`), the real code on a profiled
    connection; a step left out still builds the ledger state the next one needs, untimed."""
    scale, plan, merge, Ledger = m.scale, m.plan, m.merge, m.Ledger
    config = m.parse_config(scale.RAW_CONFIG)
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_profile_") as directory:
        recorder = Recorder(directory)
        raw = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        if memory_limit:
            raw.execute(f"set memory_limit = '{memory_limit}'")
        if temp_directory:
            raw.execute(f"set temp_directory = '{temp_directory}'")
        raw.execute(f"create table src as {scale.SOURCE.format(n=n)}")
        raw.execute(f"create temp table {plan.INPUT} as select * from src")
        Ledger(raw, "main", "main.bench").migrate()
        con = ProfiledConnection(raw, recorder)

        def step(name, fn):
            if name[0] not in steps:
                recorder.step = "setup"
                return fn()
            recorder.step = name
            start, cpu = time.perf_counter(), time.process_time()
            result = fn()
            recorder.step_seconds[name] = time.perf_counter() - start
            recorder.step_seconds[name + " (CPU)"] = time.process_time() - cpu  # all threads; moves less under load
            print(f"{name}: {recorder.step_seconds[name]:.2f} s (CPU {recorder.step_seconds[name + ' (CPU)']:.2f} s)")
            return result

        if "a" in steps:
            step("a_baseline", lambda: scale.baseline_copy(raw, directory))
        step("a_plugin", lambda: scale.plan_and_write(con, config, directory))
        recorder.step = "setup"
        scale.write_results(raw, directory)
        merge.merge(Ledger(raw, "main", "main.bench"), config, "main.bench", plan.describe(raw, plan.INPUT), True)

        def run(sql):
            return m.runner.run_model(
                con, schema="main", identifier="bench", target="main.bench", raw_config=scale.RAW_CONFIG, sql=sql
            )

        if "r" in steps:  # in place of (b): the whole run that harvests, as dbt_run.py's harvest step
            step("r_run", lambda: offline_run(m, directory, lambda: run("select * from src")))
        else:
            if "b" in steps:
                step("b_baseline", lambda: scale.baseline_ingest(raw, scale.result_paths(directory)))
            step("b_plugin", lambda: scale.ingest(con, config, directory))

        if "c" in steps:
            step("c_empty", lambda: run("select * from src where false"))
            step("c_noop", lambda: run("select * from src"))
            step("c_floor", lambda: scale.floor_noop(raw, config, "select * from src"))
        result = recorder.as_json()
        result["rows"] = n
        result["peak_rss_mb"] = scale.max_rss_mb()
        raw.close()
    return result


def offline_run(m: SimpleNamespace, directory: str, fn):
    """`fn` (a runner.run_model call) with every ModelRun given scale.py's offline provider, whose
    result files the round wrote: the run's own work on a completed batch, no network, no sandbox."""
    init = m.runner.ModelRun.__init__

    def offline_init(self, con, config, *args, **kwargs):
        init(self, con, config, *args, **{**kwargs, "provider": m.scale.OfflineProvider(config, directory)})

    m.runner.ModelRun.__init__ = offline_init
    try:
        return fn()
    finally:
        m.runner.ModelRun.__init__ = init


def combine_rounds(rounds: list[dict]) -> dict:
    """R rounds as one profile: each step's median time (and every round's), each statement's mean."""
    by_statement: dict = {}
    for r in rounds:
        for s in r["statements"]:
            entry = by_statement.setdefault(
                (s["step"], s["sql"]), {**s, "calls": 0, "seconds": 0.0, "spilled_mb": 0.0, "ops": defaultdict(float)}
            )
            entry["calls"] += s["calls"] / len(rounds)
            entry["seconds"] += s["seconds"] / len(rounds)
            entry["spilled_mb"] += s["spilled_mb"] / len(rounds)
            for name, t in s["ops"].items():
                entry["ops"][name] += t / len(rounds)
    steps = {name: statistics.median(r["steps"][name] for r in rounds) for name in rounds[0]["steps"]}
    return {
        "rows": rounds[0]["rows"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rounds),
        "steps": steps,
        "rounds": [r["steps"] for r in rounds],
        "load_average": os.getloadavg(),
        "statements": [{**e, "calls": round(e["calls"]), "ops": dict(e["ops"])} for e in by_statement.values()],
    }


def print_profile(result: dict, top: int) -> None:
    print(f"rows {result['rows']:,}, peak RSS {result['peak_rss_mb']:.0f} MB")
    if len(result.get("rounds", [])) > 1:
        for name in result["steps"]:
            times = ", ".join(f"{r[name]:.2f}" for r in result["rounds"])
            print(f"{name}: median {result['steps'][name]:.2f} s of rounds {times}")
        print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in result["load_average"]))
    for step_name, seconds in result["steps"].items():
        if step_name.endswith("(CPU)"):  # a step's CPU time: its statements are under its wall time
            continue
        rows = sorted((s for s in result["statements"] if s["step"] == step_name), key=lambda s: -s["seconds"])
        print(f"\n== {step_name}: {seconds:.2f} s, statements {sum(s['seconds'] for s in rows):.2f} s")
        for s in rows[:top]:
            ops = sorted(s["ops"].items(), key=lambda kv: -kv[1])[:3]
            print(f"  {s['seconds']:7.2f} s x{s['calls']:<3} spilled {s['spilled_mb']:,.0f} MB  {s['sql'][:100]}")
            print("            " + ", ".join(f"{name} {t:.2f} s ({s['rows'].get(name, 0):,} rows)" for name, t in ops))


def print_compare(small: dict, large: dict, top: int) -> None:
    """Each step's and each statement's time at both row counts and their growth against the rows'."""
    rows_growth = large["rows"] / small["rows"]
    print(
        f"{small['rows']:,} -> {large['rows']:,} rows ({rows_growth:.0f}x); peak RSS "
        f"{small['peak_rss_mb']:.0f} -> {large['peak_rss_mb']:.0f} MB"
    )
    index = {(s["step"], s["sql"]): s for s in small["statements"]}
    for step_name, seconds in large["steps"].items():
        before = small["steps"].get(step_name, 0.0)
        print(f"\n== {step_name}: {before:.2f} -> {seconds:.2f} s ({seconds / max(before, 1e-9):.2f}x)")
        if step_name.endswith("(CPU)"):
            continue
        rows = sorted((s for s in large["statements"] if s["step"] == step_name), key=lambda s: -s["seconds"])
        for s in rows[:top]:
            was = index.get((s["step"], s["sql"]), {"seconds": 0.0})["seconds"]
            spilled = s.get("spilled_mb", 0.0)
            print(
                f"  {was:7.2f} -> {s['seconds']:7.2f} s ({s['seconds'] / max(was, 1e-9):5.1f}x) "
                f"spilled {spilled:,.0f} MB  {s['sql'][:100]}"
            )
            ops = sorted(s["ops"].items(), key=lambda kv: -kv[1])[:3]
            was_ops = index.get((s["step"], s["sql"]), {"ops": {}})["ops"]
            print("            " + ", ".join(f"{name} {was_ops.get(name, 0):.2f} -> {t:.2f} s" for name, t in ops))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--memory-limit", default=None, help="DuckDB memory_limit (default: DuckDB's)")
    parser.add_argument("--temp-directory", default=None, help="DuckDB temp_directory (where it spills)")
    parser.add_argument("--json", help="write the profile here as JSON (for --compare)")
    parser.add_argument("--top", type=int, default=8, help="statements shown per step")
    parser.add_argument("--compare", nargs=2, metavar=("SMALL.json", "LARGE.json"))
    parser.add_argument(
        "--steps",
        default="abc",
        help="the steps timed, of a, b, c (the others run untimed); r: in place of b, the "
        "whole run (runner.run_model) that harvests the completed batch and merges it",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds, each on a fresh database")
    parser.add_argument("--tree", default=None, help="profile this checkout's package and scale.py instead")
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            print_compare(json.load(a), json.load(b), args.top)
        return 0
    m = load_tree(args.tree)
    rounds = []
    for _ in range(args.repeat):
        rounds.append(profiled_round(m, args.rows, args.steps, args.memory_limit, args.temp_directory))
    result = combine_rounds(rounds)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    print_profile(result, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
