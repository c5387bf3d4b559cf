"""What must hold after every step, read from the sandbox's billing record, the ledger and the tables;
and what must hold after a calm finish. Each check returns the broken invariants as sentences (empty:
all hold), so a failure names every invariant it breaks at once."""

from __future__ import annotations

import collections
from decimal import Decimal

from helpers import PRICE

from .world import MODELS, World

MILLION = Decimal(1_000_000)
FACE_TOKENS = {"openai": ("prompt_tokens", "completion_tokens"), "anthropic": ("input_tokens", "output_tokens")}


def billed_cost(billed: list[dict]) -> Decimal:
    """What the sandbox billed, at the test prices: list price in realtime, half price in a batch. The
    prompts are too short for the prompt cache, so no cache rate applies (checked)."""
    total = Decimal(0)
    for line in billed:
        usage = line["usage"]
        assert not any(
            usage.get(k) for k in ("cached_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        tokens_in, tokens_out = (usage[k] for k in FACE_TOKENS[line["face"]])
        price_in, price_out = PRICE[line["face"]]
        full = (tokens_in * price_in + tokens_out * price_out) / MILLION
        total += full if line["via"] == "realtime" else full * Decimal("0.5")
    return total


def after_step(project, emulator, world: World, reported: set[str] | None = None) -> list[str]:
    """`reported`: requests already reported billed twice (left out, then added to)."""
    broken: list[str] = []
    billed = emulator.billed()
    project.release_database()
    broken += billed_twice(project, billed, set() if reported is None else reported)
    stored = {r[0] for r in project.query("select custom_id from main.llm_batch_results")}
    ledger_cost = project.query("select coalesce(sum(cost_usd), 0) from main.llm_batch_requests")[0][0]
    paid = billed_cost(billed)
    harvested = all(b["custom_id"] in stored for b in billed if b["via"] == "batch")
    if ledger_cost > paid or (harvested and ledger_cost != paid):
        broken.append(f"the ledger's costs equal what was billed once harvested: ledger {ledger_cost}, billed {paid}")
    for model in MODELS:
        broken += table_invariants(project, world, model)
    return broken


def urgent_reask(project, lines: list[dict]) -> bool:
    """One request body billed once in another model's batch and once in realtime as a model's own
    request for its urgent rows: urgent rows follow their own model's llm_realtime_when, not another
    model's batch in flight (#30 item 6; README "Deduplication": the price of their urgency, paid on
    purpose), so this pair is not a request claimed twice. Two claims of one request in one project run
    (two models planning at once) are the claims' to prevent (tests/test_threads.py)."""
    if len(lines) != 2 or sorted(x["via"] == "realtime" for x in lines) != [False, True]:
        return False
    batch = next(x for x in lines if x["via"] != "realtime")
    return bool(
        project.query(
            """select 1 from main.llm_batch_requests b join main.llm_batch_requests r
                 on r.fingerprint = b.fingerprint and r.model <> b.model and r.route = 'realtime'
               where b.custom_id = ?""",
            [batch["custom_id"]],
        )
    )


def billed_twice(project, billed: list[dict], reported: set[str]) -> list[str]:
    """Requests (by the body asked) the sandbox billed more than once, each with the ledger's word on
    the lines that paid it: the model and variant that sent each, and whether one custom_id went twice
    (one model sent one request twice) or two custom_ids carry one request (two claims of one request)."""
    by_request = collections.defaultdict(list)
    for line in billed:
        by_request[line["request"]].append(line)
    twice = {
        r: lines
        for r, lines in by_request.items()
        if len(lines) > 1 and r not in reported and not urgent_reask(project, lines)
    }
    if not twice:
        return []
    reported.update(twice)
    sender = {
        c: f"{m}/{v or 'default'}"
        for c, m, v in project.query("select custom_id, model, variant from main.llm_batch_requests")
    }

    def paid(line: dict) -> str:
        if line["via"] == "realtime":
            return "realtime"
        return f"{line['custom_id'][:10]} of {sender.get(line['custom_id'], '?')}"

    same_id = sum(1 for lines in twice.values() if len({x["custom_id"] for x in lines}) < len(lines))
    examples = [
        f"{lines[0]['face']} {lines[0]['prompt'][8:22]!r}: " + " + ".join(paid(x) for x in lines)
        for lines in list(twice.values())[:4]
    ]
    return [
        f"no request billed twice: {sum(map(len, twice.values()))} lines billed for {len(twice)} requests "
        f"({same_id} of them under one custom_id sent twice), e.g. " + "; ".join(examples)
    ]


def table_invariants(project, world: World, model: str) -> list[str]:
    broken: list[str] = []
    key = world.models[model].key
    if not project.query(f"select 1 from information_schema.tables where table_name = '{model}'"):
        return broken
    has_variant = any(c[0] == "llm_variant" for c in project.query(f"describe main.{model}"))
    variant = "llm_variant" if has_variant else "'default'"
    dup = project.query(f"select {key}, {variant}, count(*) from main.{model} group by all having count(*) > 1 limit 5")
    if dup:
        broken.append(f"one row per (key, variant) in {model}: {dup}")
    # A succeeded row shows its request's answer. A column the answer holds must not be NULL; a column
    # it lacks was not asked then (an output edit shows the old answer until the new one is final, as
    # documented): NULL there is checked after a calm finish, when every row has its current answer.
    lost = " or ".join(
        f"(t.{c} is null and coalesce(json_type(r.answer, '$.{c}'), 'NULL') <> 'NULL')"
        for c in world.output_columns(model)
        if _is_column(project, model, c)
    )
    if lost:
        nulls = project.query(
            f"""select t.{key}, {variant} from main.{model} t
                join (select fingerprint, any_value(answer) as answer from main.llm_batch_requests
                      where status = 'succeeded' group by 1) r on r.fingerprint = t.llm_fingerprint
                where t.llm_status = 'succeeded' and ({lost}) limit 5"""
        )
        if nulls:
            broken.append(f"no succeeded row with NULL where its answer has a value, in {model}: {nulls}")
    over = project.query(
        f"""with t as (select llm_fingerprint, sum(llm_cost_usd) as cost from main.{model} group by 1),
                 l as (select fingerprint, sum(cost_usd) as cost from main.llm_batch_requests group by 1)
            select t.llm_fingerprint, t.cost, coalesce(l.cost, 0) from t left join l on l.fingerprint = t.llm_fingerprint
            where t.cost > coalesce(l.cost, 0) limit 5"""
    )
    if over:
        broken.append(f"table costs never exceed what their request was billed, in {model}: {over}")
    return broken


def _is_column(project, model: str, column: str) -> bool:
    return any(c[0] == column for c in project.query(f"describe main.{model}"))


def shared_table_costs(project) -> list[str]:
    """Across the models, the rows of one request together carry at most its cost."""
    union = " union all ".join(f"select llm_fingerprint, llm_cost_usd from main.{m}" for m in MODELS)
    over = project.query(
        f"""with t as (select llm_fingerprint, sum(llm_cost_usd) as cost from ({union}) group by 1),
                 l as (select fingerprint, sum(cost_usd) as cost from main.llm_batch_requests group by 1)
            select t.llm_fingerprint, t.cost, coalesce(l.cost, 0) from t left join l on l.fingerprint = t.llm_fingerprint
            where t.cost > coalesce(l.cost, 0) limit 5"""
    )
    return [f"the rows of one request carry at most its cost, across models: {over}"] if over else []


def after_calm_finish(project, world: World) -> list[str]:
    """Every selected row landed: one succeeded row per (key, current variant) in each model."""
    broken: list[str] = []
    for model in MODELS:
        state = world.models[model]
        has_variant = any(c[0] == "llm_variant" for c in project.query(f"describe main.{model}"))
        variant = "llm_variant" if has_variant else "'default'"
        nulls = " or ".join(f"{c} is null" for c in world.output_columns(model))
        null_rows = project.query(
            f"select {state.key}, {variant} from main.{model} where llm_status = 'succeeded' and ({nulls}) limit 5"
        )
        if null_rows:
            broken.append(f"after a calm finish no succeeded row of {model} has NULL in an output: {null_rows}")
        got = collections.Counter(
            (k, v, s) for k, v, s in project.query(f"select {state.key}, {variant}, llm_status from main.{model}")
        )
        offset = 1000 if state.key == "ticket_no" else 0
        want = collections.Counter((i + offset, v, "succeeded") for i in world.rows for v in world.variants_of(model))
        if got != want:
            missing, extra = want - got, got - want
            broken.append(
                f"after a calm finish every selected row of {model} landed once, succeeded: "
                f"missing {sorted(missing)[:6]} ({sum(missing.values())}), extra {sorted(extra)[:6]} ({sum(extra.values())})"
            )
    return broken
