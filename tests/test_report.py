"""`dbt-llm-batch report`: the integration project run against the sandbox (batch models harvested, an
evaluation run with its report, one request failed, one batch left open), then the HTML report opened
in a real browser (Debian's Chromium driven by Playwright) and the FOCUS export checked against the
FOCUS 1.2 column list. Every figure is compared with the ledger's views, queried here in SQL of the
test's own (not through the report's query layer)."""

from __future__ import annotations

import csv
import json
import re
import shutil
import uuid
from decimal import Decimal
from pathlib import Path

import duckdb
import pytest
from conftest import INTEGRATION, REPO, Project

from dbt_llm_batch.ops import cli
from dbt_llm_batch.pipeline.costs import fmt_usd

pytestmark = pytest.mark.dbt  # real dbt, on a project of its own (not the `project` fixture)

ARTIFACTS = REPO / "tests" / "artifacts"  # gitignored: the browser's screenshots
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FOCUS_COLUMNS = REPO / "tests" / "data" / "focus_1_2_columns.csv"
# Allowed values, from the same FOCUS 1.2 column definitions.
FOCUS_ALLOWED = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeFrequency": {"One-Time", "Recurring", "Usage-Based"},
    "PricingCategory": {"Standard", "Dynamic", "Committed", "Other"},
    "ServiceCategory": {"AI and Machine Learning"},  # (of 18; the only one an LLM call is)
    "ServiceSubcategory": {"Generative AI"},  # (under AI and Machine Learning)
}
# The specification's attributes/datetime_format.md ('YYYY-MM-DDTHH:mm:ssZ', UTC) and numeric_format.md
# (an integer, a decimal or E notation "mEn"; no sign for a positive value, no thousands separator).
FOCUS_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
FOCUS_NUMERIC = re.compile(r"^-?\d+(\.\d+)?(E-?\d+)?$")
FAILING_TICKET = "charged twice"  # ticket 1's body: its triage request answers an error line


def test_report_and_focus_export_of_a_sandbox_run(tmp_path):
    """One story (one dbt run for the three checks; xdist would run a module fixture once per worker)."""
    from dbt_llm_batch.sandbox import Emulator

    tmp = tmp_path
    root = tmp / "project"
    shutil.copytree(INTEGRATION, root, ignore=shutil.ignore_patterns("target", "logs", "dbt_packages", "*.duckdb*"))
    (root / "packages.yml").write_text(f"packages:\n  - local: {REPO}\n")
    key = "sk-test-" + uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp, Emulator(api_key=key) as emu:
        mp.setenv("OPENAI_BASE_URL", emu.openai_base_url)
        mp.setenv("OPENAI_API_KEY", key)
        mp.setenv("ANTHROPIC_BASE_URL", emu.base_url)
        mp.setenv("ANTHROPIC_API_KEY", key)
        project = Project(root, mp)
        project.dbt("deps")
        project.dbt("seed")
        emu.add_fault(prompt_contains=FAILING_TICKET, status_code=400, message="Invalid prompt.", times=None)
        # Submit, harvest and merge: the batch models and the evaluation run (three variants, two providers).
        project.dbt("run", "-s", "ticket_triage", "review_summary", "ticket_triage_eval")
        emu.complete_all()
        # Merged; the judge grades the variants' answers (its batch harvested by the next run, with the report).
        project.dbt("run", "-s", "ticket_triage", "review_summary", "ticket_triage_eval", "ticket_triage_judge")
        emu.complete_all()
        # Left in flight: the extraction model's batch.
        project.dbt("run", "-s", "ticket_triage_judge", "ticket_triage_eval_report", "resume_extraction")
        project.release_database()
        html_path, focus_path = tmp / "report.html", tmp / "focus.csv"
        argv = ["report", "--database", str(project.db_path), "--out", str(html_path), "--focus", str(focus_path)]
        assert cli.main(argv) == 0
        emu.raise_internal_errors()
    check_focus_export(project, html_path.with_name("focus.csv"))
    check_report_in_browser(project, html_path)
    check_served_report(project, focus_path)


def views(project: Project, sql: str) -> list[tuple]:
    with duckdb.connect(str(project.db_path), read_only=True) as con:
        return con.execute(sql).fetchall()


def check_focus_export(project: Project, focus_path: Path) -> None:
    """The FOCUS export against the FOCUS 1.2 column list and the ledger's costs."""
    lines = FOCUS_COLUMNS.read_text().splitlines()
    spec = {r["column"]: r for r in csv.DictReader(line for line in lines if not line.startswith("#"))}
    assert len(spec) == 57  # FOCUS 1.2 defines 57 columns
    with focus_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    columns = list(rows[0])
    assert set(columns) <= set(spec), set(columns) - set(spec)  # no column FOCUS does not define
    mandatory = {c for c, r in spec.items() if r["feature_level"] == "Mandatory"}
    assert mandatory <= set(columns), mandatory - set(columns)
    assert {"SkuId", "Tags", "ConsumedQuantity", "ResourceId"} <= set(columns)
    for row in rows:
        for column, value in row.items():
            kind = spec[column]
            if kind["allows_nulls"] == "False":
                assert value != "", column
            if value and kind["data_type"] == "Decimal":
                assert FOCUS_NUMERIC.match(value), (column, value)
            if value and kind["data_type"] == "Date/Time":
                assert FOCUS_DATETIME.match(value), (column, value)
            if value and kind["data_type"] == "JSON":  # attributes/key_value_format.md: an object of scalars
                parsed = json.loads(value)
                assert isinstance(parsed, dict), (column, value)
                assert all(not isinstance(v, dict | list) for v in parsed.values()), (column, value)
            if column in FOCUS_ALLOWED:
                assert value in FOCUS_ALLOWED[column], (column, value)
        assert row["ChargeClass"] == ""  # not a correction
        assert row["ChargePeriodStart"] < row["ChargePeriodEnd"]
        assert row["BillingPeriodStart"] <= row["ChargePeriodStart"] < row["BillingPeriodEnd"]
        assert Decimal(row["BilledCost"]) == Decimal(row["EffectiveCost"]) <= Decimal(row["ListCost"])

    # The ledger's costs, as finance sees them: per provider and LLM model, and per dbt model and variant.
    costs = views(
        project,
        """select provider, llm_model, model, coalesce(nullif(variant, ''), 'default'), sum(cost_usd),
                  sum(realtime_cost_usd)
           from main.llm_batch_costs where cost_usd is not null group by all""",
    )
    exported: dict[tuple, list[Decimal]] = {}
    for row in rows:
        tags = json.loads(row["Tags"])
        key = (row["ServiceName"], row["SkuId"], tags["dbt_model"], tags["variant"])
        acc = exported.setdefault(key, [Decimal(0), Decimal(0)])
        acc[0] += Decimal(row["BilledCost"])
        acc[1] += Decimal(row["ListCost"])
    assert exported == {(p, m, dm, v): [c, r] for p, m, dm, v, c, r in costs}
    assert {k[0] for k in exported} == {"openai", "anthropic"}  # the evaluation's 'claude' variant
    # The model's own variant is named as its table and the views name it (llm_default_variant 'baseline').
    assert {k[3] for k in exported if k[2] == "main.ticket_triage_eval"} == {"baseline", "concise", "claude"}


def check_report_in_browser(project: Project, html_path: Path) -> None:
    """The page in Chromium: no console error, no request, each chart drawn with the ledger's figures."""
    from playwright import sync_api  # the dev extra installs it

    assert CHROMIUM.exists(), "scripts/setup.sh installs Debian's chromium (apt-get install -y chromium)"
    url = html_path.as_uri()
    console, errors, requests = [], [], []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url, wait_until="load")
            charts = page.eval_on_selector_all(".js-plotly-plot", "els => els.map(e => e.id)")
            page.wait_for_function("ids => ids.every(id => document.getElementById(id)._fullLayout)", arg=charts)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report-integration.png"), full_page=True)
            page.locator("#evaluation-0").screenshot(path=str(ARTIFACTS / "report-evaluation.png"))

            def chart(div_id: str) -> dict:
                """What the browser drew: the title, the SVG's data points, and the traces' data."""
                return page.evaluate(
                    """id => { const el = document.getElementById(id);
                               return {title: el.querySelector('.gtitle') && el.querySelector('.gtitle').textContent,
                                       svg: el.querySelectorAll('svg.main-svg').length,
                                       points: el.querySelectorAll('.point').length,
                                       traces: el.data.map(t => ({name: t.name, x: t.x, y: t.y, text: t.text}))}; }""",
                    div_id,
                )

            drawn = {div_id: chart(div_id) for div_id in charts}
            kpi = {
                k: page.eval_on_selector(f"#{k}", "e => [e.dataset.value, e.textContent]")
                for k in (
                    "total-cost",
                    "total-realtime",
                    "total-saved",
                    "saved-batch",
                    "saved-caching",
                    "saved-dedup",
                    "committed",
                )
            }
            pick = page.eval_on_selector("#pick-0", "e => [e.dataset.variant, e.textContent]")
        finally:
            browser.close()

    assert errors == [] and [c for c in console if c.startswith(("error", "warning"))] == []
    assert [r for r in requests if r != url] == []  # nothing fetched: plotly.js is in the page
    expected_charts = {
        "chart-spend-by-day",
        "chart-spend-by-model",
        "chart-savings",
        "chart-open-batches",
        "chart-waiting",
        "chart-failures",
        "chart-evaluation-0",
    }
    assert set(drawn) == expected_charts
    for div_id, c in drawn.items():
        assert c["svg"] > 0 and c["title"], div_id
        n = sum(len(t["y"]) for t in c["traces"])
        assert c["points"] == n > 0, (div_id, c["points"], n)

    def ys(div_id: str) -> list[list[float]]:
        return [t["y"] for t in drawn[div_id]["traces"]]

    def close(a: list, b: list) -> bool:
        return len(a) == len(b) and all(abs(float(x) - float(y)) < 1e-9 for x, y in zip(a, b, strict=True))

    # Totals and savings against llm_batch_costs.
    (cost, realtime, batch, caching, dedup, committed), *_ = views(
        project,
        """select sum(cost_usd), sum(coalesce(realtime_cost_usd, cost_usd)), sum(savings_usd), sum(cache_saved_usd),
                  sum(dedup_saved_usd), sum(committed_not_billed_usd) from main.llm_batch_costs""",
    )
    for key, value in {
        "total-cost": cost,
        "total-realtime": realtime,
        "total-saved": realtime - cost,
        "saved-batch": batch,
        "saved-caching": caching,
        "saved-dedup": dedup,
        "committed": committed,
    }.items():
        assert kpi[key][1] == fmt_usd(value) and abs(float(kpi[key][0]) - float(value)) < 1e-9, key
    assert cost > 0 and batch > 0 and committed > 0
    assert close(ys("chart-savings")[0], [batch, caching, dedup])

    by_day = views(
        project,
        """select day, sum(cost_usd), sum(coalesce(realtime_cost_usd, cost_usd)) from main.llm_batch_costs
           where cost_usd is not null group by day order by day""",
    )
    assert [str(x)[:10] for x in drawn["chart-spend-by-day"]["traces"][0]["x"]] == [str(d) for d, _, _ in by_day]
    assert close(ys("chart-spend-by-day")[0], [c for _, c, _ in by_day])
    assert close(ys("chart-spend-by-day")[1], [r for *_, r in by_day])
    by_model = views(
        project,
        """select model, coalesce(nullif(variant, ''), 'default') as v, sum(cost_usd),
                  sum(coalesce(realtime_cost_usd, cost_usd))
           from main.llm_batch_costs where cost_usd is not null group by all order by model, v""",
    )
    assert drawn["chart-spend-by-model"]["traces"][0]["x"] == [
        m if v == "default" else f"{m} / {v}" for m, v, *_ in by_model
    ]
    assert close(ys("chart-spend-by-model")[0], [c for *_, c, _ in by_model])
    assert close(ys("chart-spend-by-model")[1], [r for *_, r in by_model])

    # Work in flight: the extraction model's open batch, its pending rows; the failed ticket.
    (open_batch,) = views(project, "select batch_id, model from main.llm_batch_in_flight where batch_id is not null")
    bars = drawn["chart-open-batches"]["traces"][0]
    assert bars["y"] == [f"openai {open_batch[0]}"] and 0 <= bars["x"][0] < 1  # hours: submitted just now
    waiting = views(
        project,
        """select model, rows_pending, requests_waiting, requests_held from main.llm_batch_progress
           where rows_pending + requests_waiting + requests_held > 0 order by model, variant""",
    )
    assert drawn["chart-waiting"]["traces"][0]["x"] == ["main.resume_extraction"] == [w[0] for w in waiting]
    assert close([t[0] for t in ys("chart-waiting")], list(waiting[0][1:]))
    failures = views(
        project,
        """select failure_kind, sum(requests_final), sum(requests_retried) from main.llm_batch_failures
           group by 1 order by 1""",
    )
    assert failures and drawn["chart-failures"]["traces"][0]["x"] == [k for k, _, _ in failures]
    assert close(ys("chart-failures")[0], [f for _, f, _ in failures])
    assert close(ys("chart-failures")[1], [r for *_, r in failures])

    # The evaluation run: one point per variant at its accuracy and cost, the cheapest near the best named.
    variants = views(
        project,
        "select variant, category_accuracy, cost_usd from main.ticket_triage_eval_report order by variant",
    )
    points = drawn["chart-evaluation-0"]["traces"][0]
    assert points["text"] == [v for v, _, _ in variants] == ["baseline", "claude", "concise"]
    assert close(points["y"], [a for _, a, _ in variants]) and close(points["x"], [c for *_, c in variants])
    best = max(a for _, a, _ in variants)
    cheapest = min((c, v) for v, a, c in variants if a >= best - 0.02)[1]
    assert pick[0] == cheapest and f"is {cheapest} (" in pick[1]
    # The sentence's figures: the best variant's accuracy, and the pick's accuracy and cost.
    (pick_accuracy, pick_cost), *_ = [(a, c) for v, a, c in variants if v == cheapest]
    best_named = re.search(r"best category_accuracy \((\w+), ([\d.]+)\)", pick[1])
    assert best_named and {v for v, a, _ in variants if a == best} >= {best_named[1]}, pick[1]
    assert best_named[2] == f"{best:.3f}" and f"({pick_accuracy:.3f} at {fmt_usd(pick_cost)})." in pick[1], pick[1]


def check_served_report(project: Project, focus_path: Path) -> None:
    """`report --serve`: read again at each request; a 503 page, not a hang, while another process
    holds the file."""
    import subprocess
    import sys
    import threading
    import urllib.error
    import urllib.request

    from dbt_llm_batch.ops.report_server import make_server

    server = make_server(str(project.db_path), "main", 0.02, port=0, refresh=5)
    assert server.server_address[0] == "127.0.0.1"
    base = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def total_shown(page: str, cost) -> bool:
        return f'id="total-cost" data-value="{float(cost)!r}">{fmt_usd(cost)}<' in page

    try:
        page = urllib.request.urlopen(f"{base}/").read().decode()
        assert '<meta http-equiv="refresh" content="5">' in page
        ((cost,),) = views(project, "select sum(cost_usd) from main.llm_batch_costs")
        assert total_shown(page, cost)
        assert urllib.request.urlopen(f"{base}/focus.csv").read() == focus_path.read_bytes()
        # Another process writes the ledger (holding the file): the page says so and reloads later.
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(project.db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "holding"
            try:
                urllib.request.urlopen(f"{base}/")
                raise AssertionError("served a page while another process held the file")
            except urllib.error.HTTPError as exc:
                busy = exc.read().decode()
                assert exc.code == 503 and "cannot read it" in busy and 'content="5"' in busy, busy
        finally:
            writer.communicate("", timeout=60)
        assert writer.returncode == 0
        # What it wrote shows at the next reload: the server keeps no copy of the page.
        page = urllib.request.urlopen(f"{base}/").read().decode()
        assert total_shown(page, cost * 2)
    finally:
        server.shutdown()
        server.server_close()
        with duckdb.connect(str(project.db_path)) as con:
            con.execute("update main.llm_batch_requests set cost_usd = cost_usd / 2 where cost_usd is not null")


# A process that holds the DuckDB file read-write, doubling every cost, until its stdin closes.
WRITER = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
con.execute("update main.llm_batch_requests set cost_usd = cost_usd * 2 where cost_usd is not null")
print("holding", flush=True)
sys.stdin.read()
con.close()
"""
