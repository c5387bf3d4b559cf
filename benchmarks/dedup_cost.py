"""Cost benchmark (not a test): what deduplication, prompt caching and the batch discount each save on
a reference workload, through real dbt against the sandbox, at the shipped prices.

    .venv/bin/python benchmarks/dedup_cost.py                 # 10,000 tickets
    .venv/bin/python benchmarks/dedup_cost.py --tickets 2000  # smaller, same shares

The workload: N support tickets of which 30 % repeat another ticket's text word for word; a shared
system prompt plus few-shot examples of about 2,000 tokens, sent with llm_cache_prefix; a structured
triage answer. One model per provider (gpt-4o-mini and claude-sonnet-4-5 from
dbt_llm_batch/pipeline/prices.csv) is run to the end with dbt-llm-batch's defaults (dedup on, batch).

Every figure is computed from the token usage the sandbox reported for each request it answered (as
the ledger stored it), at the shipped prices; the sandbox counts tokens as 4 characters each, so the
absolute amounts are the sandbox's, the ratios are what the levers do. The levers are applied one
after the other, so each one's share is what it saves on top of the ones before it:
  realtime list price, one request per ticket, no cache   (the baseline)
  + dedup     one request per distinct ticket text
  + cache     the cached prefix read at the cache price (the usage the sandbox reported)
  + batch     the batch discount: what the ledger and the table show
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import duckdb

from dbt_llm_batch.sandbox import Emulator

REPO = Path(__file__).resolve().parent.parent
MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-5"}
SYSTEM = (
    "You triage customer support tickets for a software company. Read the ticket, decide its category, "
    "whether it is urgent, and write a one-line summary a support engineer can act on. "
) + " ".join(
    f"Rule {i}: tickets that mention {topic} belong to {category}; urgency depends on customer impact, "
    f"data loss, security exposure and whether a workaround exists."
    for i, (topic, category) in enumerate(
        [("invoices", "billing"), ("refunds", "billing"), ("crashes", "bug"), ("errors", "bug"), ("setup", "how_to")]
        * 12
    )
)
EXAMPLES = [
    (
        f"Subject: example {i}\n\nThe dashboard shows error {500 + i} when I open report {i}; nothing was lost.",
        '{"category":"bug","urgent":false,"summary":"Dashboard error ' + str(500 + i) + ' on report open"}',
    )
    for i in range(6)
]
OUTPUT = {"category": ["billing", "bug", "how_to", "feature_request", "other"], "urgent": "boolean", "summary": "text"}
TOPICS = ["invoice", "export", "login", "webhook", "dashboard", "API key", "refund", "import", "SSO", "report"]


def ticket_text(i: int) -> str:
    """Ticket i's text; tickets whose number ends in 0, 1 or 2 repeat the text of the one ending in 3."""
    if i % 10 < 3:
        i = i - i % 10 + 3
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Subject: {topic} problem #{i}\n\nHello, since yesterday the {topic} page fails with code {i % 997} for "
        f"account {i * 7919 % 100000}. We tried again twice. Please advise, this blocks our team of {i % 40 + 2}."
    )


def model_sql(provider: str) -> str:
    examples = [{"input": i, "output": o} for i, o in EXAMPLES]
    return f"""
{{{{ config(materialized='llm_batch', unique_key='ticket_id', llm_provider='{provider}',
            llm_model='{MODELS[provider]}', llm_system={SYSTEM!r}, llm_examples={examples!r},
            llm_output={OUTPUT!r}, llm_max_tokens=100, llm_cache_prefix=true) }}}}
select ticket_id, text as prompt from {{{{ ref('tickets') }}}}
"""


def dbt(root: Path, *args: str) -> None:
    from dbt.cli.main import dbtRunner

    result = dbtRunner().invoke([*args, "--project-dir", str(root), "--profiles-dir", str(root), "--quiet"])
    if not result.success:
        raise SystemExit(f"dbt {' '.join(args)} failed: {result.exception}")


def answered(root: Path) -> int:
    """Rows in both models' tables, and requests the last run left in flight or waiting."""
    with duckdb.connect(str(root / "warehouse.duckdb")) as con:
        tables = {name for (name,) in con.execute("select table_name from information_schema.tables").fetchall()}
        rows = sum(
            con.execute(f"select count(*) from main.triage_{p}").fetchall()[0][0]
            for p in MODELS
            if f"triage_{p}" in tables
        )
        waiting = con.execute(
            "select count(*) from main.llm_batch_requests where status in ('queued', 'deferred')"
        ).fetchall()[0][0]
    return rows - waiting


def levers(con, provider: str) -> dict[str, Decimal]:
    """The four totals of the module's docstring, from the ledger's per-request usage."""
    price = con.execute(
        "select input_per_mtok, output_per_mtok from read_csv(?, header = true, all_varchar = true) "
        "where provider = ? and model = ?",
        [str(REPO / "dbt_llm_batch/pipeline/prices.csv"), provider, MODELS[provider]],
    ).fetchall()[0]
    p_in, p_out = Decimal(price[0]), Decimal(price[1])
    model = f"main.triage_{provider}"
    rows = con.execute(
        """select r.input_tokens, r.output_tokens, r.realtime_cost_usd, r.cost_usd, a.n
           from main.llm_batch_requests r
                join (select custom_id, count(*) as n from main.llm_batch_row_answers where model = ?
                      group by custom_id) a using (custom_id)
           where r.status = 'succeeded'""",
        [model],
    ).fetchall()
    uncached = [(Decimal(i) * p_in + Decimal(o) * p_out) / Decimal(1_000_000) for i, o, *_ in rows]
    table_cost = con.execute(f"select sum(llm_cost_usd), count(*) from {model}").fetchall()[0]
    return {
        "tickets": Decimal(sum(r[4] for r in rows)),
        "table_rows": Decimal(table_cost[1]),
        "requests": Decimal(len(rows)),
        "baseline": sum((u * r[4] for u, r in zip(uncached, rows, strict=True)), Decimal(0)),
        "dedup": sum(uncached, Decimal(0)),
        "cache": sum((r[2] for r in rows), Decimal(0)),
        "batch": sum((r[3] for r in rows), Decimal(0)),
        "table": table_cost[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tickets", type=int, default=10_000)
    args = parser.parse_args()
    os.environ.setdefault("DO_NOT_TRACK", "1")
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_cost_") as tmp, Emulator(api_key="sk-bench") as emu:
        root = Path(tmp) / "project"
        shutil.copytree(
            REPO / "integration_project",
            root,
            ignore=shutil.ignore_patterns("target", "logs", "dbt_packages", "*.duckdb*", "models"),
        )
        (root / "models").mkdir()
        (root / "packages.yml").write_text(f"packages:\n  - local: {REPO}\n")
        os.environ.update(
            DBT_LLM_BATCH_DUCKDB=str(root / "warehouse.duckdb"),
            OPENAI_BASE_URL=emu.openai_base_url,
            OPENAI_API_KEY="sk-bench",
            ANTHROPIC_BASE_URL=emu.base_url,
            ANTHROPIC_API_KEY="sk-bench",
        )
        lines = "".join(f'{i},"{ticket_text(i)}"\n' for i in range(args.tickets))
        (root / "seeds" / "tickets.csv").write_text("ticket_id,text\n" + lines)
        for provider in MODELS:
            (root / "models" / f"triage_{provider}.sql").write_text(model_sql(provider))
        started = time.monotonic()
        dbt(root, "deps")
        dbt(root, "seed", "-s", "tickets")
        # Until every ticket is answered: the provider's in-flight token cap (OpenAI's enqueued-token
        # limit, llm_max_tokens_in_flight) lets a run send only part of the work, the rest waits.
        rounds = 0
        while rounds == 0 or answered(root) < 2 * args.tickets:
            rounds += 1
            dbt(root, "run", "-s", "triage_openai", "triage_anthropic")
            emu.complete_all()
        dbt(root, "run", "-s", "triage_openai", "triage_anthropic")
        seconds = time.monotonic() - started
        usage = emu.stats()["usage_by_face"]
        with duckdb.connect(str(root / "warehouse.duckdb")) as con:
            prefix = con.execute(
                "select max(cached_tokens) from main.llm_batch_requests where model = 'main.triage_openai'"
            ).fetchall()[0][0]
            results = {provider: levers(con, provider) for provider in MODELS}

    print(
        f"{args.tickets:,} tickets, 30 % repeating another ticket's text; shared system prompt + "
        f"{len(EXAMPLES)} examples ~{prefix:,} tokens (cached prefix as the sandbox reported it), llm_cache_prefix; "
        f"through real dbt against the sandbox in {rounds} rounds of dbt run, {seconds:.0f} s. Figures from the sandbox's reported usage "
        "(4 characters a token) at the shipped prices."
    )
    for provider, f in results.items():
        base = f["baseline"]
        saved = {
            "dedup": base - f["dedup"],
            "cache": f["dedup"] - f["cache"],
            "batch": f["cache"] - f["batch"],
        }
        total_saved = base - f["batch"]
        print(
            f"{provider} {MODELS[provider]}: {int(f['tickets']):,} rows answered by {int(f['requests']):,} requests "
            f"(table: {int(f['table_rows']):,} rows, sum(llm_cost_usd) ${f['table']:.6f}); sandbox usage "
            f"{usage[provider]}"
        )
        print(
            f"  realtime list price, no dedup, no cache: ${base:.6f}\n"
            f"  + dedup ${f['dedup']:.6f}  + cache ${f['cache']:.6f}  + batch ${f['batch']:.6f}\n"
            f"  total with dedup + cache + batch = {f['batch'] / base:.3f}x of the baseline; of the saving, "
            + ", ".join(f"{k} {v / total_saved:.0%} ({v / base:.1%} of the baseline)" for k, v in saved.items())
        )
        assert f["table"] == f["batch"], "the table's costs add up to what the requests were billed"
    return 0


if __name__ == "__main__":
    sys.exit(main())
