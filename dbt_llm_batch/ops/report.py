"""`dbt-llm-batch report`: the ledger as one self-contained HTML page (what the batch discount,
prompt caching and deduplication saved; the work in flight; the evaluation runs), and its costs as a
FinOps FOCUS CSV (`--focus`).

Every figure comes from ledger/reads.py (the reporting views), the same layer `status` reads. The
charts are plotly's: its Python package ships plotly.js, which is embedded in the page once, so the
page opens from a file, an e-mail attachment or a CI artifact with no network at all (the page's
Content-Security-Policy forbids every fetch, so a chart that tried would fail loudly in the console).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from dbt_llm_batch.errors import LlmBatchError
from dbt_llm_batch.ledger.focus import FOCUS_VERSION
from dbt_llm_batch.ledger.reads import LedgerReads
from dbt_llm_batch.pipeline.costs import fmt_usd

# The providers' batch completion window (OpenAI `completion_window`, Anthropic's 24 h processing limit).
BATCH_WINDOW_HOURS = 24
# The default of --within: a variant this close to the best accuracy (0.02 = 2 points) is good enough.
DEFAULT_WITHIN = 0.02
CSP = "default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:"


class ReportError(LlmBatchError):
    """The report cannot be made (no ledger, or plotly not installed): the message says how to fix it."""


@dataclass
class Evaluation:
    """One evaluation table: its variants' (name, accuracy, cost) and the cheapest near the best."""

    relation: str
    accuracy_column: str
    points: list[tuple[str, float, float]]
    within: float

    @property
    def best(self) -> tuple[str, float, float]:
        return max(self.points, key=lambda p: (p[1], -p[2]))

    @property
    def cheapest_near_best(self) -> tuple[str, float, float]:
        """The cheapest variant whose accuracy is within `within` of the best."""
        floor = self.best[1] - self.within
        return min((p for p in self.points if p[1] >= floor - 1e-12), key=lambda p: (p[2], -p[1]))


@dataclass
class ReportData:
    """Everything the page shows, read once from the ledger."""

    totals: dict
    by_day: list[tuple]
    by_model: list[tuple]
    savings: dict
    open_batches: list[tuple]
    waiting: list[tuple]  # (model, variant, rows_pending, requests_waiting, requests_held)
    failures: list[tuple]  # (failure_kind, requests_final, requests_retried)
    evaluations: list[Evaluation] = field(default_factory=list)


def _row(rel) -> dict:
    return dict(zip(rel.columns, rel.fetchall()[0], strict=True))


def read(ledger: LedgerReads, within: float = DEFAULT_WITHIN) -> ReportData:
    """The report's figures from the ledger's views (ReportError without a ledger of version 22)."""
    if not ledger.exists():
        raise ReportError(f"no dbt-llm-batch ledger in schema {ledger.schema}: pass the schema with --schema")
    if not ledger.has_report_views():
        raise ReportError(
            f"the ledger in schema {ledger.schema} predates the report's views: "
            "run any llm_batch model once (dbt run) to upgrade it"
        )
    evaluations = []
    for schema, table, accuracy in ledger.evaluation_relations():
        points = [(v, a, c) for v, a, c in ledger.evaluation(schema, table, accuracy).fetchall()]
        if points:
            evaluations.append(Evaluation(f"{schema}.{table}", accuracy, points, within))
    return ReportData(
        totals=_row(ledger.totals()),
        by_day=ledger.spend_by_day().fetchall(),
        by_model=ledger.spend_by_model().fetchall(),
        savings=_row(ledger.savings_by_lever()),
        open_batches=ledger.open_batches().fetchall(),
        waiting=ledger.progress()
        .select("model, coalesce(nullif(variant, ''), 'default'), rows_pending, requests_waiting, requests_held")
        .filter("rows_pending + requests_waiting + requests_held > 0")
        .fetchall(),
        failures=ledger.failures().fetchall(),
        evaluations=evaluations,
    )


# --- the page ---------------------------------------------------------------------------------------


def _f(value) -> float:
    return float(value) if value is not None else 0.0


def _figures(data: ReportData) -> list[tuple[str, str, object]]:
    """(element id, title, plotly figure) of each chart with something to show."""
    import plotly.graph_objects as go

    def bars(title: str, x: list, series: dict[str, list], barmode: str = "group", **layout) -> go.Figure:
        fig = go.Figure([go.Bar(name=name, x=x, y=y) for name, y in series.items()])
        fig.update_layout(title=title, barmode=barmode, **{"yaxis_title": "USD", **layout})
        return fig

    charts: list[tuple[str, str, object]] = []
    if data.by_day:
        title = "Spend against realtime, by day"
        days = [str(d) for d, _, _ in data.by_day]
        series = {"cost": [_f(c) for _, c, _ in data.by_day], "at realtime prices": [_f(r) for _, _, r in data.by_day]}
        charts.append(("chart-spend-by-day", title, bars(title, days, series, xaxis_type="category")))
    if data.by_model:
        title = "Spend against realtime, by model and variant"
        names = [m if v == "default" else f"{m} / {v}" for m, v, _, _ in data.by_model]
        series = {
            "cost": [_f(c) for *_, c, _ in data.by_model],
            "at realtime prices": [_f(r) for *_, r in data.by_model],
        }
        charts.append(("chart-spend-by-model", title, bars(title, names, series)))
    title = "Saving by lever"
    levers = {
        "batch discount": data.savings["batch_discount_usd"],
        "prompt caching": data.savings["prompt_caching_usd"],
        "deduplication": data.savings["deduplication_usd"],
    }
    charts.append(("chart-savings", title, bars(title, list(levers), {"saved": [_f(v) for v in levers.values()]})))
    if data.open_batches:
        title = f"Open batches: age against the {BATCH_WINDOW_HOURS} h window"
        labels = [f"{p} {b}" for p, _, _, b, *_ in data.open_batches]
        fig = go.Figure(
            go.Bar(
                x=[_f(b[-1]) for b in data.open_batches],
                y=labels,
                orientation="h",
                text=[f"{b[1]} ({b[4]}, {b[5]} requests)" for b in data.open_batches],
            )
        )
        fig.add_vline(x=BATCH_WINDOW_HOURS, line_dash="dash", annotation_text=f"{BATCH_WINDOW_HOURS} h")
        fig.update_layout(title=title, xaxis_title="hours since submission", xaxis_range=[0, BATCH_WINDOW_HOURS * 1.1])
        charts.append(("chart-open-batches", title, fig))
    if data.waiting:
        title = "Rows pending, requests waiting and held, by model"
        names = [m if v == "default" else f"{m} / {v}" for m, v, *_ in data.waiting]
        series = {
            "rows pending": [w[2] for w in data.waiting],
            "requests waiting": [w[3] for w in data.waiting],
            "requests held": [w[4] for w in data.waiting],
        }
        charts.append(("chart-waiting", title, bars(title, names, series, barmode="stack", yaxis_title="count")))
    if data.failures:
        title = "Failed requests by kind"
        kinds = [k for k, _, _ in data.failures]
        series = {"final": [f for _, f, _ in data.failures], "to be retried": [r for *_, r in data.failures]}
        charts.append(("chart-failures", title, bars(title, kinds, series, barmode="stack", yaxis_title="requests")))
    for i, ev in enumerate(data.evaluations):
        title = f"{ev.relation}: {ev.accuracy_column} against cost, per variant"
        pick = ev.cheapest_near_best[0]
        fig = go.Figure(
            go.Scatter(
                x=[c for _, _, c in ev.points],
                y=[a for _, a, _ in ev.points],
                text=[v for v, _, _ in ev.points],
                mode="markers+text",
                textposition="top center",
                marker={"size": [16 if v == pick else 10 for v, _, _ in ev.points]},
            )
        )
        fig.update_layout(title=title, xaxis_title="cost (USD)", yaxis_title=ev.accuracy_column)
        charts.append((f"chart-evaluation-{i}", title, fig))
    return charts


def _money(label: str, key: str, value) -> str:
    return f'<div class="kpi"><dt>{html.escape(label)}</dt><dd id="{key}" data-value="{_f(value)!r}">{fmt_usd(value)}</dd></div>'


def render(data: ReportData, refresh_seconds: int | None = None) -> str:
    """The page, with plotly.js embedded (ReportError when plotly is not installed); it reloads itself
    every `refresh_seconds` when given (report_server.py)."""
    try:
        import plotly.io as pio
        from plotly.offline import get_plotlyjs
    except ImportError as exc:
        raise ReportError("the report draws its charts with plotly: pip install 'dbt-llm-batch[report]'") from exc
    t, s = data.totals, data.savings
    saved = Decimal(str(t["realtime_cost_usd"])) - Decimal(str(t["cost_usd"]))
    kpis = "".join(
        [
            _money("Spent", "total-cost", t["cost_usd"]),
            _money("At realtime prices", "total-realtime", t["realtime_cost_usd"]),
            _money("Saved against realtime", "total-saved", saved),
            _money("Batch discount", "saved-batch", s["batch_discount_usd"]),
            _money("Prompt caching", "saved-caching", s["prompt_caching_usd"]),
            _money("Deduplication", "saved-dedup", s["deduplication_usd"]),
            _money("Committed, not billed yet", "committed", t["committed_not_billed_usd"]),
        ]
    )
    refresh = f'\n<meta http-equiv="refresh" content="{refresh_seconds}">' if refresh_seconds else ""
    sections = []
    config = {"displaylogo": False, "responsive": True}
    for div_id, _title, fig in _figures(data):
        chart = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, config=config)
        if div_id.startswith("chart-evaluation-"):  # the chart and the variant it names, together
            i = int(div_id.rsplit("-", 1)[1])
            ev = data.evaluations[i]
            best, pick = ev.best, ev.cheapest_near_best
            chart = f'<div id="evaluation-{i}">{chart}' + (
                f'<p class="pick" id="pick-{i}" data-variant="{html.escape(pick[0])}">'
                f"The cheapest variant within {ev.within:g} of the best {html.escape(ev.accuracy_column)} "
                f"({html.escape(best[0])}, {best[1]:.3f}) is <b>{html.escape(pick[0])}</b> "
                f"({pick[1]:.3f} at {fmt_usd(pick[2])}).</p></div>"
            )
        sections.append(f'<section class="chart">{chart}</section>')
    if not data.open_batches:
        sections.append('<section><h2>Open batches</h2><p id="no-open-batches">No batch is open.</p></section>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">{refresh}
<title>dbt-llm-batch report</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}
dl{{display:flex;flex-wrap:wrap;gap:1em}}.kpi{{border:1px solid #ddd;padding:.5em 1em}}
dd{{margin:0;font-size:1.4em}}</style>
<script>{get_plotlyjs()}</script></head>
<body><h1>dbt-llm-batch report</h1>
<dl id="totals">{kpis}</dl>
{"".join(sections)}
<p>FOCUS {FOCUS_VERSION} cost export: <code>dbt-llm-batch report --focus costs.csv</code>.</p>
</body></html>
"""


def write_report(ledger: LedgerReads, out: Path, within: float = DEFAULT_WITHIN) -> ReportData:
    data = read(ledger, within)
    out.write_text(render(data), encoding="utf-8")
    return data


def write_focus(ledger: LedgerReads, out: Path) -> int:
    """The FOCUS dataset as CSV (dates as ISO 8601 UTC, as FOCUS's DateTimeFormat asks); its row count."""
    if not ledger.has_report_views():
        raise ReportError(
            f"the ledger in schema {ledger.schema} has no FOCUS view yet: run any llm_batch model once to upgrade it"
        )
    dates = ["BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart"]
    rel = ledger.focus()
    columns = ", ".join(f"strftime({c}, '%Y-%m-%dT%H:%M:%SZ') as {c}" if c in dates else c for c in rel.columns)
    rel.select(columns).write_csv(str(out))
    return len(rel.fetchall())
