"""What must hold after every step, read from the sandbox's billing record, the ledger and the tables;
and what must hold after a calm finish. Each check returns the broken invariants as sentences (empty:
all hold), so a failure names every invariant it breaks at once."""

from __future__ import annotations

import collections
import json
from decimal import Decimal

from helpers import PRICE

from .world import EMBED_SIZE, GEMINI_PRICE, MODELS, NULLABLE, ModelState, World, in_sample, key_value

MILLION = Decimal(1_000_000)
FACE_TOKENS = {
    "openai": ("prompt_tokens", "completion_tokens"),
    "azure_openai": ("prompt_tokens", "completion_tokens"),
    "anthropic": ("input_tokens", "output_tokens"),
    "gemini": ("promptTokenCount", "candidatesTokenCount"),  # usageMetadata's, as the face bills them
}
# Cached tokens, as each face would bill them (Gemini: usageMetadata.cachedContentTokenCount).
CACHE_KEYS = ("cached_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "cachedContentTokenCount")
# The Azure deployment at OpenAI's test price, Gemini at its own (world.py).
FACE_PRICE = {**PRICE, "azure_openai": PRICE["openai"], "gemini": GEMINI_PRICE}


def billed_cost(billed: list[dict]) -> Decimal:
    """What the sandbox billed, at the test prices: list price in realtime, half price in a batch. The
    prompts are too short for the prompt cache, so no cache rate applies (checked)."""
    total = Decimal(0)
    for line in billed:
        usage = line["usage"]
        assert not any(usage.get(k) for k in CACHE_KEYS)
        tokens_in, tokens_out = (usage[k] for k in FACE_TOKENS[line["face"]])
        price_in, price_out = FACE_PRICE[line["face"]]
        full = (tokens_in * price_in + tokens_out * price_out) / MILLION
        total += full if line["via"] == "realtime" else full * Decimal("0.5")
    return total


def lost_in_a_kill(project, billed: list[dict], since: int) -> set[int]:
    """The realtime lines billed since line `since` (a run killed meanwhile) whose answer the ledger
    never stored: another dbt thread was waiting for them when the run died. They are paid and sent
    again by the next run, as documented (docs/guides/realtime.md: "a run killed while realtime
    requests are on their way sends those again in the next run, and they may have been billed
    already"). Returned as indexes of `billed`: each request still queued in realtime accounts for
    at most one line of its prompt."""
    project.release_database()
    unanswered = collections.Counter(
        prompt
        for (prompt,) in project.query(
            "select row_json ->> '$.prompt' from main.llm_batch_requests where route = 'realtime' and status = 'queued'"
        )
    )
    lost = set()
    for n in range(since, len(billed)):
        line = billed[n]
        if line["via"] == "realtime" and unanswered[line["prompt"]] > 0:
            unanswered[line["prompt"]] -= 1
            lost.add(n)
    return lost


def after_step(
    project, emulator, world: World, reported: set[str] | None = None, lost: set[int] | None = None
) -> list[str]:
    """`reported`: requests already reported billed twice (left out, then added to). `lost`: billed
    lines lost in a kill (lost_in_a_kill): paid, never in the ledger, and not a request paid twice."""
    broken: list[str] = []
    billed = [b for n, b in enumerate(emulator.billed()) if n not in (lost or set())]
    project.release_database()
    broken += billed_twice(project, billed, set() if reported is None else reported, world)
    # Harvested: stored *and settled* (harvest.py: a job is marked harvested in the transaction that
    # settles its requests and records their cost; a run killed between storing the lines and settling
    # them, crashpoint after_store, leaves lines stored but not yet costed, which the next run settles).
    stored = {
        r[0]
        for r in project.query(
            """select s.custom_id from main.llm_batch_results s join main.llm_batch_jobs j using (job_id)
               where j.harvested_at is not null"""
        )
    }
    ledger_cost = project.query("select coalesce(sum(cost_usd), 0) from main.llm_batch_requests")[0][0]
    paid = billed_cost(billed)
    harvested = all(b["custom_id"] in stored for b in billed if b["via"] == "batch")
    if ledger_cost > paid or (harvested and ledger_cost != paid):
        broken.append(f"the ledger's costs equal what was billed once harvested: ledger {ledger_cost}, billed {paid}")
    broken += no_unholdable_value_succeeded(project)
    for model in MODELS:
        broken += table_invariants(project, world, model)
    broken += answered_by_its_provider(project, world, emulator)
    return broken


def no_unholdable_value_succeeded(project) -> list[str]:
    """A value its column cannot hold (a date-time that is no instant, an integer past BIGINT: the
    sandbox answers some, as a real model sometimes does, steps.INVALID_ANSWERS) is a failed attempt
    with a reason, never a succeeded request whose row would show NULL (#30 item 4)."""
    wrong = project.query(
        """select model, custom_id[:10], answer ->> '$.due', answer ->> '$.effort' from main.llm_batch_requests
           where status = 'succeeded' and json_valid(answer) and json_type(answer) = 'OBJECT'
             and ((answer ->> '$.due' is not null and try_cast(answer ->> '$.due' as timestamptz) is null)
                  or (answer ->> '$.effort' is not null and try_cast(answer ->> '$.effort' as bigint) is null))
           limit 5"""
    )
    if wrong:
        return [
            f"a value its column cannot hold is a failed attempt, never succeeded: (model, request, due, effort) {wrong}"
        ]
    return []


def renamed_repaid(project, world: World, lines: list[dict]) -> bool:
    """One request billed once per ledger identity of mb_extract, after a rename of its file that did
    not keep llm_ledger_identity: the new identity's first run pays again, as the warning says it
    does (rename_warned checks the warning). Within one identity, as retried_after_failure has it,
    every line but one paid an attempt the ledger failed (a value its column cannot hold, asked
    again). Twice under one identity otherwise is still billed twice."""
    state = world.models["mb_extract"]
    if not state.dropped_identities:
        return False
    lineage = {*state.dropped_identities, state.ledger_name()}
    ids = [x.get("custom_id") for x in lines]
    if None in ids or len(set(ids)) != len(ids):
        return False
    senders = {
        c: (m, s)
        for c, m, s in project.query(
            f"select custom_id, model, status from main.llm_batch_requests where custom_id in ({', '.join('?' * len(ids))})",
            ids,
        )
    }
    if any(c not in senders or senders[c][0] not in lineage for c in ids):
        return False
    answered = collections.Counter(m for m, s in senders.values() if s != "failed")
    return all(n <= 1 for n in answered.values())


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


def retried_after_failure(project, lines: list[dict]) -> bool:
    """One request asked again after answers the ledger failed (a value its column cannot hold: the
    provider bills the answer, the package fails the attempt and asks again under a new custom_id, up
    to llm_max_attempts): every line but one paid an attempt the ledger records as failed."""
    ids = [x.get("custom_id") for x in lines]
    if None in ids or len(set(ids)) != len(ids):
        return False
    status = dict(
        project.query(
            f"select custom_id, status from main.llm_batch_requests where custom_id in ({', '.join('?' * len(ids))})",
            ids,
        )
    )
    return sum(status.get(c) != "failed" for c in ids) <= 1


def billed_twice(project, billed: list[dict], reported: set[str], world: World) -> list[str]:
    """Requests (by the body asked) the sandbox billed more than once, each with the ledger's word on
    the lines that paid it: the model and variant that sent each, and whether one custom_id went twice
    (one model sent one request twice) or two custom_ids carry one request (two claims of one request)."""
    by_request = collections.defaultdict(list)
    for line in billed:
        by_request[line["request"]].append(line)
    twice = {
        r: lines
        for r, lines in by_request.items()
        if len(lines) > 1
        and r not in reported
        and not urgent_reask(project, lines)
        and not renamed_repaid(project, world, lines)
        and not retried_after_failure(project, lines)
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


def table_invariants(project, world: World, logical: str) -> list[str]:
    broken: list[str] = []
    key = world.models[logical].key
    model = world.table(logical)
    if not project.query(f"select 1 from information_schema.tables where table_name = '{model}'"):
        return broken
    has_variant = any(c[0] == "llm_variant" for c in project.query(f"describe main.{model}"))
    variant = "llm_variant" if has_variant else "'default'"
    if _is_column(project, model, key):
        # A row without the key's value (a key column the table held before it was the key, NULL in the
        # rows written since) is no row of a key: after a calm finish every row has its key (after_calm_finish).
        dup = project.query(
            f"select {key}, {variant}, count(*) from main.{model} where {key} is not null "
            "group by all having count(*) > 1 limit 5"
        )
        if dup:
            broken.append(f"one row per (key, variant) in {model}: {dup}")
    else:
        # unique_key changed to a column the table lacks ('tno'): the next run rebuilds the table from
        # the ledger (pipeline/schema_change.py); until then its rows are listed by id.
        key = "id"
    # A succeeded row shows its request's answer. A column the answer holds must not be NULL; a column
    # it lacks was not asked then (an output edit shows the old answer until the new one is final, as
    # documented): NULL there is checked after a calm finish, when every row has its current answer.
    lost = " or ".join(
        f"(t.{c} is null and coalesce(json_type(r.answer, '$.{c}'), 'NULL') <> 'NULL')"
        for c in world.output_columns(logical)
        if _is_column(project, model, c)
    )
    if logical == "mb_embed":  # a vector, not a JSON answer: a succeeded row has one of its size
        lost = ""
        short = project.query(
            f"""select {key} from main.{model} where llm_status = 'succeeded'
                and (llm_embedding is null or len(llm_embedding) <> {EMBED_SIZE}) limit 5"""
        )
        if short:
            broken.append(f"no succeeded row without its vector, in {model}: {short}")
    if lost:
        nulls = project.query(
            f"""select t.{key}, {variant} from main.{model} t
                join (select fingerprint, any_value(answer) as answer from main.llm_batch_requests
                      where status = 'succeeded' group by 1) r on r.fingerprint = t.llm_fingerprint
                where t.llm_status = 'succeeded' and ({lost}) limit 5"""
        )
        if nulls:
            broken.append(f"no succeeded row with NULL where its answer has a value, in {model}: {nulls}")
    # A value is stored as answered: a nullable string's JSON null is SQL NULL (never the text 'null'),
    # a string is its text (never with its JSON quotes), a date-time is that instant.
    typed = {"note": "json_extract_string(r.answer, '$.note')", "due": "try_cast(r.answer ->> '$.due' as timestamptz)"}
    differs = " or ".join(f"t.{c} is distinct from {v}" for c, v in typed.items() if _is_column(project, model, c))
    if differs:
        wrong = project.query(
            f"""select t.{key}, {", ".join(c for c in typed if _is_column(project, model, c))} from main.{model} t
                join (select fingerprint, any_value(answer) as answer from main.llm_batch_requests
                      where status = 'succeeded' group by 1) r on r.fingerprint = t.llm_fingerprint
                where t.llm_status = 'succeeded' and ({differs}) limit 5"""
        )
        if wrong:
            broken.append(
                f"a succeeded row holds each value as answered (null as NULL, text unquoted), in {model}: {wrong}"
            )
    over = project.query(
        f"""with t as (select llm_fingerprint, sum(llm_cost_usd) as cost from main.{model} group by 1),
                 l as (select fingerprint, sum(cost_usd) as cost from main.llm_batch_requests group by 1),
                 {COMBINED_PARTS}
            select t.llm_fingerprint, t.cost, coalesce(l.cost, 0) + coalesce(b.cost, 0)
            from t left join l on l.fingerprint = t.llm_fingerprint left join b on b.fingerprint = t.llm_fingerprint
            where t.cost > coalesce(l.cost, 0) + coalesce(b.cost, 0) limit 5"""
    )
    if over:
        broken.append(f"table costs never exceed what their request was billed, in {model}: {over}")
    return broken


# A combined answer (pipeline/added_fields.py: a row asked only the fields added since its answer)
# carries its share of its own request (the table's llm_fingerprint is that request's) and of the
# earlier requests it is combined with (base_custom_ids): per request fingerprint, the distinct
# earlier requests its rows are combined with may add their cost.
COMBINED_PARTS = """b as (select fingerprint, sum(cost) as cost
                      from (select distinct o.fingerprint, p.custom_id, p.cost_usd as cost
                            from (select custom_id, unnest(base_custom_ids) as base from main.llm_batch_row_answers) a
                                 join main.llm_batch_requests o on o.custom_id = a.custom_id
                                 join main.llm_batch_requests p on p.custom_id = a.base)
                      group by 1)"""


def _is_column(project, model: str, column: str) -> bool:
    return any(c[0] == column for c in project.query(f"describe main.{model}"))


def shared_table_costs(project, world: World) -> list[str]:
    """Across the models, the rows of one request together carry at most its cost."""
    union = " union all ".join(f"select llm_fingerprint, llm_cost_usd from main.{world.table(m)}" for m in MODELS)
    over = project.query(
        f"""with t as (select llm_fingerprint, sum(llm_cost_usd) as cost from ({union}) group by 1),
                 l as (select fingerprint, sum(cost_usd) as cost from main.llm_batch_requests group by 1),
                 {COMBINED_PARTS}
            select t.llm_fingerprint, t.cost, coalesce(l.cost, 0) + coalesce(b.cost, 0)
            from t left join l on l.fingerprint = t.llm_fingerprint left join b on b.fingerprint = t.llm_fingerprint
            where t.cost > coalesce(l.cost, 0) + coalesce(b.cost, 0) limit 5"""
    )
    return [f"the rows of one request carry at most its cost, across models: {over}"] if over else []


class KeptRows:
    """A sampled variant's rows of keys that left its sample when unique_key changed: the table keeps
    them. Changing unique_key re-keys every variant's stored answers (docs/guides/evaluate.md, "Changing
    the set of variants"; tests/test_variants.py test_changing_the_unique_key_of_a_model_with_variants_
    asks_nothing_again: every variant's rows, as they were), and incremental runs keep the rows of keys
    the model no longer selects (docs/table.md, llm_on_unselected = 'keep'), a sampled challenger's
    rows of keys that left its sample too (tests/test_variants.py test_a_column_changed_while_the_
    champion_is_re_asked_refreshes_every_variants_rows). The sample is drawn from the key's values, so
    a key change moves it: the rows of the old sample's keys outside the new one stay, with their status.

    What the table holds is read when the edit is made (nothing writes the table between an edit and
    the run that applies it): `must` are the rows it then held, which must still be there after a calm
    finish. `may` are the keys that left the sample of any sampled variant the model has had (the ledger
    keeps a removed or renamed variant's answers and re-keys them too), whose rows may also land after
    the change: a request in flight under the old key, re-keyed; a variant removed and added back shows
    its answers again (evaluate.md). Removing or renaming the variant removes its rows (evaluate.md);
    a --full-refresh rebuilds the table, so it need no longer hold them (they may stay)."""

    def __init__(self) -> None:
        self.must: dict[tuple[str, str, int], str] = {}  # (model, variant, row id) -> its llm_status
        self.may: set[tuple[str, str, int]] = set()
        self.fractions: dict[tuple[str, str], float] = {}  # (model, variant) -> its llm_variant_sample, ever

    def _in_sample(self, world: World, model: str, variant: str, row: int) -> bool:
        """Whether `variant` (of fraction self.fractions) answers row `row` (its id) under `world`'s unique_key."""
        return in_sample(key_value(world.models[model].key, row), self.fractions[(model, variant)])

    def before_edit(self, project, before: World, after: World) -> None:
        """An edit step, before it is carried out: each model whose unique_key it changes."""
        for model in MODELS:
            for w in (before, after):
                self.fractions.update(
                    {(model, v): c["sample"] for v, c in w.models[model].variants.items() if "sample" in c}
                )
            if before.models[model].key == after.models[model].key:
                continue
            sampled = [v for m, v in self.fractions if m == model]
            # Keys back in the sample are selected rows again (after_calm_finish's own).
            self.must = {k: s for k, s in self.must.items() if k[0] != model or not self._in_sample(after, *k)}
            self.may = {k for k in self.may if k[0] != model or not self._in_sample(after, *k)}
            self.may |= {
                (model, v, i)
                for v in sampled
                for i in before.rows
                if self._in_sample(before, model, v, i) and not self._in_sample(after, model, v, i)
            }
            if _no_key_column(project, before.table(model), after.models[model].key):
                # A key column the table lacks ('tno', computed), or kept from an earlier key with NULL in
                # the rows written since: the next run rebuilds the table from the ledger, as a full
                # refresh does (pipeline/schema_change.py), which writes no row of a key outside a sampled
                # variant's sample: the table need no longer hold them (they may land again: a request in
                # flight under the old key, re-keyed, KeptRows.may).
                self.must = {k: s for k, s in self.must.items() if k[0] != model}
                continue
            present = set(before.models[model].variants) & set(after.models[model].variants)
            for i, v, status in _variant_rows(project, before.table(model)):
                if v in present and v in sampled and not self._in_sample(after, model, v, i):
                    self.must[(model, v, i)] = status
                    self.may.add((model, v, i))

    def after_edit(self, before: World, after: World, edits: list[str]) -> None:
        """An edit step, after it was carried out: a variant removed or renamed, a --full-refresh."""
        for model in MODELS:
            gone = set(before.models[model].variants) - set(after.models[model].variants)
            refreshed = any("--full-refresh" in e and e.split()[1] == model for e in edits)
            self.must = {k: s for k, s in self.must.items() if k[0] != model or not (refreshed or k[1] in gone)}


def _no_key_column(project, table: str, column: str) -> bool:
    """Whether `table` exists and has no column `column`, or one holding a NULL (kept from an earlier
    unique_key: no key to merge its rows by)."""
    project.release_database()
    columns = {
        c for (c,) in project.query(f"select column_name from information_schema.columns where table_name = '{table}'")
    }
    if not columns:
        return False
    return column not in columns or project.query(f"select count(*) from main.{table} where {column} is null") != [(0,)]


def _variant_rows(project, table: str) -> list[tuple[int, str, str]]:
    """(id, llm_variant, llm_status) of each row of `table`, if it has variants."""
    project.release_database()
    columns = {
        c for (c,) in project.query(f"select column_name from information_schema.columns where table_name = '{table}'")
    }
    if "llm_variant" not in columns:
        return []
    return project.query(f"select id, llm_variant, llm_status from main.{table}")


def after_calm_finish(project, world: World, kept: KeptRows | None = None) -> list[str]:
    """Every selected row landed: one succeeded row per (key, current variant) in each model; a
    sampled variant's rows of keys that left its sample with a unique_key change are kept (KeptRows)."""
    kept = kept or KeptRows()
    broken: list[str] = []
    for logical in MODELS:
        state, model = world.models[logical], world.table(logical)
        has_variant = any(c[0] == "llm_variant" for c in project.query(f"describe main.{model}"))
        variant = "llm_variant" if has_variant else "'default'"
        nulls = " or ".join(f"{c} is null" for c in world.output_columns(logical) if c not in NULLABLE)
        null_rows = project.query(
            f"select {state.key}, {variant} from main.{model} where llm_status = 'succeeded' and ({nulls}) limit 5"
        )
        if null_rows:
            broken.append(f"after a calm finish no succeeded row of {model} has NULL in an output: {null_rows}")
        got = collections.Counter(
            (k, v, s) for k, v, s in project.query(f"select {state.key}, {variant}, llm_status from main.{model}")
        )
        offset = key_value(state.key, 0)
        want = collections.Counter(
            (i + offset, v, "succeeded")
            for i in world.rows
            for v in world.variants_of(logical)
            if world.answers(logical, v, i + offset)
        )
        want.update(
            (i + offset, v, status)
            for (m, v, i), status in kept.must.items()
            if m == logical and v in world.variants_of(logical) and not world.answers(logical, v, i + offset)
        )
        missing, extra = want - got, got - want
        # A current variant's row of a key that left its sample may have landed after the change, or
        # been shown again (KeptRows.may): once, as any row. A row without its key (NULL) is never one.
        extra = collections.Counter(
            {
                (k, v, s): n
                for (k, v, s), n in extra.items()
                if k is None
                or (logical, v, k - offset) not in kept.may
                or v not in world.variants_of(logical)
                or got[(k, v, s)] > 1
            }
        )
        if missing or extra:
            broken.append(
                f"after a calm finish every selected row of {model} landed once, succeeded: "
                f"missing {sorted(missing)[:6]} ({sum(missing.values())}), extra {sorted(extra)[:6]} ({sum(extra.values())})"
            )
        # After a provider or model switch, the rows show the current model's answers, not the old one's.
        wrong = [
            (v, m, n)
            for v, m, n in project.query(f"select {variant}, llm_model, count(*) from main.{model} group by all")
            if m != world.llm_model_of(logical, v)
        ]
        if wrong:
            broken.append(
                f"after a calm finish every row of {model} is answered by its variant's current model: "
                f"(variant, llm_model, rows) {sorted(wrong)}"
            )
    return broken


def sandbox_models(emulator) -> dict[str, set[str]]:
    """batch_id -> the model names its requests asked, as the sandbox received them."""
    faces = {f.name: f for f in emulator.faces}
    asked: dict[str, set[str]] = {}
    for batch in emulator.batches():
        if batch.get("type") == "message_batch":
            face = faces["anthropic"]
            job = face.jobs.get(batch["id"]) or face.deleted[batch["id"]]  # deleted: still the sandbox's record
            asked[batch["id"]] = {r["params"]["model"] for r in job.requests}
        elif batch.get("input_file_id"):
            lines = emulator.file_bytes(batch["input_file_id"]).decode().splitlines()
            asked[batch["id"]] = {json.loads(x)["body"]["model"] for x in lines if x.strip()}
        elif batch.get("object") == "gemini_batch":
            # The model is the create call's path (models/<model>:batchGenerateContent), which the job
            # records; the ledger names the job as the API does, batches/<id>.
            asked[f"batches/{batch['id']}"] = {batch["metadata"]["model"].removeprefix("models/")}
    return asked


def answered_by_its_provider(project, world: World, emulator) -> list[str]:
    """A row answered in a batch names a model that batch asked: an answer from before a provider or
    model switch is never merged as the new model's (#30 brief: provider and model switch)."""
    asked = sandbox_models(emulator)
    broken = []
    for model in MODELS:
        table = world.table(model)
        if not project.query(f"select 1 from information_schema.tables where table_name = '{table}'"):
            continue
        rows = project.query(
            f"select llm_batch_id, llm_model, count(*) from main.{table} "
            "where llm_route = 'batch' and llm_batch_id is not null group by all"
        )
        wrong = [(b, m, n) for b, m, n in rows if m not in asked.get(b, set())]
        if wrong:
            broken.append(
                f"a row answered in a batch names a model that batch asked, in {table}: "
                f"(batch, llm_model, rows) {wrong[:4]} (asked: {[sorted(asked.get(b, ())) for b, _, _ in wrong[:4]]})"
            )
    return broken


def budget_kept(project, world: World, limit: float, before: dict, refused: set[str]) -> list[str]:
    """After a run with var llm_batch_max_cost_usd = `limit` (dbt threads 4): what the run committed
    (requests it put in flight) plus what stayed in flight through it fits the budget, and a model the
    budget refused sent nothing. `before`: custom_id -> (model, status, estimate) before the run."""
    broken: list[str] = []
    after = project.query("select custom_id, model, status, estimated_cost_usd, route from main.llm_batch_requests")
    in_flight = [(c, m, e) for c, m, s, e, _ in after if s == "queued"]
    sent_now = [(c, m, e) for c, m, e in in_flight if before.get(c, (None, None))[1] != "queued"]
    committed = sum((e or Decimal(0) for _, _, e in in_flight), Decimal(0))
    if sent_now and committed > Decimal(str(limit)):
        by_model = collections.Counter(m for _, m, _ in sent_now)
        broken.append(
            f"a run never commits past llm_batch_max_cost_usd = {limit}: {committed} estimated in flight after "
            f"it, of which this run sent {dict(by_model)}"
        )
    names = {world.table(m): world.models[m].ledger_name() for m in MODELS}
    for node in refused:
        name = names.get(node, f"main.{node}")
        # Recorded by this run, or put in flight by it (a request sent again keeps its custom_id).
        sent = [
            (c[:10], s, r)
            for c, m, s, _, r in after
            if m == name and (c not in before or (s == "queued" and before[c][1] != "queued"))
        ]
        if sent:
            broken.append(f"a model the budget refused sends nothing: {node} sent {sent[:4]} ({len(sent)})")
    return broken


def rename_warned(
    world: World, old: ModelState, asked: list, ran: set[str], after: list, log: str, note: str
) -> list[str]:
    """The run after mb_extract's file was renamed, and the warning the docs give (table.md "Renaming a
    model's file"; configuration.md llm_ledger_identity): a model's first run (its ledger identity has
    had no run and has no request) without llm_ledger_identity warns before paying again exactly when
    another model of the ledger already asked the same requests (the same prompt and settings: the
    same fingerprint, answered or still in flight), and names the model that asked most of them as the
    llm_ledger_identity that keeps them. A rename whose old identity asked other prompts (the prompt
    edited since its last run) asks nothing again and warns of nothing; so does a rename keeping
    llm_ledger_identity. `asked`, `ran`: the ledger's (model, fingerprint, status) and identities that
    have run, before the run; `after`: its requests after it (the new identity's are what it asks)."""
    state = world.models["mb_extract"]
    new, previous = state.ledger_name(), old.ledger_name()
    first_run = new not in ran and not any(m == new for m, _, _ in asked)
    asks = {f for m, f, _ in after if m == new}
    shared = collections.Counter(
        m for m, f in {(m, f) for m, f, s in asked if m != new and s in ("succeeded", "queued") and f in asks}
    )
    due = state.identity is None and first_run and bool(shared)
    warned = f"{new}: first run of this model" in log
    if due and not warned:
        return [
            f"a rename without llm_ledger_identity warns before paying again: no warning for {new} (renamed "
            f"from {previous}), whose requests were asked already by {dict(shared)}"
        ]
    if due:
        most = max(shared.values())
        named = [m for m, n in shared.items() if n == most and f"llm_ledger_identity = '{m}'" in log]
        if not named:
            return [
                f"a rename's warning names the model that asked most of its requests: {new} named none of "
                f"{sorted(m for m, n in shared.items() if n == most)}"
            ]
    if warned and not due:
        why = (
            f"llm_ledger_identity = {state.identity!r} kept"
            if state.identity is not None
            else "not its first run"
            if not first_run
            else f"no other model asked its {len(asks)} request(s)" + (f" (run: {note})" if note else "")
        )
        return [f"a rename warns only when another model asked the same requests: {new} warned, but {why}"]
    return []
