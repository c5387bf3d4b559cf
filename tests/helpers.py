"""Helpers shared by the test modules (no test module imports another): the triage model and its
expected answers, request lines for driving the sandbox with the SDKs, and dbt-story helpers.
Fixtures are in conftest.py."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from decimal import Decimal
from pathlib import Path

import duckdb

from dbt_llm_batch.sandbox import expected_answer

TRIAGE_SYSTEM = (
    "You triage customer support tickets. Answer with the category, whether it is urgent, and a one-line summary."
)
TRIAGE_OUTPUT = {
    "category": ["billing", "bug", "how_to", "feature_request", "other"],
    "urgent": "boolean",
    "summary": "text",
}
# As sent: the plugin sorts the output columns by name (dbt's parse does not keep a dict's order).
TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": TRIAGE_OUTPUT["category"]},
        "summary": {"type": "string"},
        "urgent": {"type": "boolean"},
    },
    "required": ["category", "summary", "urgent"],
    "additionalProperties": False,
}


SANDBOX_KEY = "sk-sandbox-test-key-0001"  # the key the `emu` fixture's emulator expects

PROVIDER_MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-5"}
GEMINI_MODEL = (
    "gemini-2.5-flash"  # not in PROVIDER_MODELS: the `provider` fixture's stories are OpenAI's and Anthropic's
)


def triage_model(system: str = TRIAGE_SYSTEM, extra_config: str = "", where: str = "", provider: str = "openai") -> str:
    return f"""
{{{{ config(
    materialized = 'llm_batch',
    llm_provider = '{provider}',
    llm_model = '{PROVIDER_MODELS[provider]}',
    unique_key = 'ticket_id',
    llm_system = {json.dumps(system)},
    llm_output = {json.dumps(TRIAGE_OUTPUT)},
    llm_max_tokens = 200,
    {extra_config}
) }}}}
select ticket_id, subject, priority, 'Subject: ' || subject || chr(10) || chr(10) || body as prompt
from {{{{ ref('support_tickets') }}}}
{where}
"""


def gemini_triage_model(extra_config: str = "") -> str:
    """The triage model on llm_provider 'gemini'."""
    return (
        triage_model(extra_config=extra_config)
        .replace("llm_provider = 'openai'", "llm_provider = 'gemini'")
        .replace(f"llm_model = '{PROVIDER_MODELS['openai']}'", f"llm_model = '{GEMINI_MODEL}'")
    )


def expected_triage(system: str, prompt: str) -> tuple:
    answer = json.loads(expected_answer(system, prompt, TRIAGE_SCHEMA))
    return answer["category"], answer["urgent"], answer["summary"]


def batch_input_lines(emu, batch: dict) -> list[dict]:
    """The request lines the batch was created with, from the emulator's record (a run deletes the
    file at the provider once the batch's results are stored)."""
    data = emu.file_bytes(batch["input_file_id"])
    return [json.loads(line) for line in data.decode().splitlines() if line]


def sorted_batches(emu) -> list[dict]:
    return list(reversed(emu.batches()))  # the emulator lists newest first, like the provider


def is_anthropic(batch: dict) -> bool:
    return batch.get("type") == "message_batch"


def batch_counts(emu) -> list[int]:
    """Number of requests in each batch the emulator received, in creation order."""
    return [
        sum(b["request_counts"].values()) if is_anthropic(b) else len(batch_input_lines(emu, b))
        for b in sorted_batches(emu)
    ]


def billed_per_key(emulator, key_of_prompt: dict) -> collections.Counter:
    """How many times the provider billed each key, by the sandbox's own record (Emulator.billed()).

    Every batch still open is finished first: a batch the last run left behind bills when it ends. Then
    everything billed counts: succeeded batch lines whatever the batch's final status (a line answered
    before the batch expired or was cancelled is billed too) and realtime calls (also one whose answer
    never reached the client). `key_of_prompt` maps each row's prompt to its key."""
    emulator.complete_all()
    return collections.Counter(key_of_prompt[b["prompt"]] for b in emulator.billed())


# -- The sandbox driven with the official SDKs (tests/test_emulator*.py; clients: conftest.py) ------

SCHEMA = {  # five field types, asked through both faces
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["pos", "neg", "neutral"]},
        "count": {"type": "integer"},
        "score": {"type": "number"},
        "flag": {"type": "boolean"},
        "note": {"type": "string"},
    },
}


def line(custom_id, prompt, model="gpt-x", system=None, schema=None, **body_extra):
    """An OpenAI Batch request line."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, **body_extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit(client, lines, raw: bytes | None = None, **create_kw):
    data = raw if raw is not None else "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("input.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", **create_kw
    )


def download(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def control(emu, method, path, body=None):
    """A call to the emulator's own control API (/_emulator/...)."""
    req = urllib.request.Request(
        emu.base_url + path, method=method, data=None if body is None else json.dumps(body).encode()
    )
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


CLAUDE_MODEL = "claude-x"

TOOL = {"name": "classify", "description": "Record the classification.", "input_schema": SCHEMA}


def req(custom_id, prompt, system=None, tool=False, max_tokens=200, **params):
    """An Anthropic Message Batches request."""
    p = {"model": CLAUDE_MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}], **params}
    if system is not None:
        p["system"] = system
    if tool:
        p["tools"], p["tool_choice"] = [TOOL], {"type": "tool", "name": TOOL["name"]}
    return {"custom_id": custom_id, "params": p}


def results_of(client, batch_id):
    return {r.custom_id: r.result for r in client.messages.batches.results(batch_id)}


def raw(emu, method, path, headers=None, body=None):
    """(status, headers, body bytes) of a plain HTTP call."""
    request = urllib.request.Request(
        emu.base_url + path,
        method=method,
        headers=headers or {},
        data=None if body is None else json.dumps(body).encode(),
    )
    try:
        with urllib.request.urlopen(request) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def tokens(chars):
    return math.ceil(chars / 4)


# -- dbt stories: processes, the ledger, the operator commands -------------------------------------


def dbt_subprocess(project, env_extra: dict) -> subprocess.CompletedProcess:
    """`dbt run -s triage` in a process of its own, with extra environment (a crash point, say)."""
    dbt = Path(sys.executable).parent / "dbt"
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [str(dbt), "run", "-s", "triage", "--project-dir", str(project.root), "--profiles-dir", str(project.root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def kill_then_run_on(project, emulator, marker, point: str, env_extra: dict | None = None) -> None:
    """Kill `dbt run -s triage` (SIGKILL) at crash point `point`, checking it died there, then run it
    as the nightly schedule would: three runs with every batch completed after each, and a last one."""
    project.release_database()
    killed = dbt_subprocess(
        project, {"DBT_LLM_BATCH_CRASH_AT": point, "DBT_LLM_BATCH_CRASH_MARKER": str(marker), **(env_extra or {})}
    )
    assert killed.returncode == -9, killed.stdout[-2000:]
    assert marker.read_text() == point
    for _ in range(3):
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    project.dbt("run", "-s", "triage")


def succeeded_custom_ids(emulator) -> list[str]:
    """custom_ids of every successful result the emulator returned, over all batches, from the
    emulator's own record (runs delete the files and batches at the provider once results are stored)."""
    ids = []
    for batch in sorted_batches(emulator):
        if is_anthropic(batch):
            if batch["processing_status"] == "ended":
                lines = [json.loads(line) for line in emulator.anthropic_results(batch["id"]).splitlines() if line]
                ids += [r["custom_id"] for r in lines if r["result"]["type"] == "succeeded"]
        elif batch.get("output_file_id"):
            content = emulator.file_bytes(batch["output_file_id"]).decode()
            ids += [line.split('"custom_id":', 1)[1].split('"')[1] for line in content.splitlines() if line]
    return ids


def log_text(project) -> str:
    return (project.root / "logs" / "dbt.log").read_text()


def command(project, capsys, *args: str) -> tuple[int, str, str]:
    """`dbt-llm-batch <args>` on the project's database (for the model triage): (exit code, out, err)."""
    from dbt_llm_batch.ops.cli import main as cli

    capsys.readouterr()
    model = ["--model", "triage"] if args[0] != "status" else []
    rc = cli([*args, "--database", str(project.db_path), "--schema", "main", *model])
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- The model `m` over `things` (a table of `a`, `prompt`), for the provider-outcome stories ------

THINGS_SYSTEM = "Summarise."


def things_model(provider: str, extra: str = "") -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='{provider}',
            llm_model='{PROVIDER_MODELS[provider]}', llm_system={THINGS_SYSTEM!r}, llm_max_tokens=100, {extra}) }}}}
select * from {{{{ ref('things') }}}}
"""


def setup(project, provider: str, extra: str = "", rows: int = 6) -> None:
    values = ", ".join(f"({i}, 'row {i}')" for i in range(rows))
    project.write("models/things.sql", f"select * from (values {values}) t(a, prompt)")
    project.write("models/m.sql", things_model(provider, extra))
    project.dbt("run", "-s", "things")


def run(project, expect_ok: bool = True):
    return project.dbt("run", "-s", "m", expect_ok=expect_ok)


def table(project) -> dict:
    return {a: (s, e, o) for a, s, e, o in project.query("select a, llm_status, llm_error, llm_output from main.m")}


def assert_all_succeeded(project, rows: int = 6) -> None:
    got = project.query("select prompt, llm_status, llm_output from main.m")
    assert len(got) == rows
    assert all(s == "succeeded" and o == expected_answer(THINGS_SYSTEM, p, None) for p, s, o in got), got


def request_statuses(project) -> list[tuple]:
    return project.query("select status, count(*) from main.llm_batch_requests group by 1 order by 1")


def end_backoff(project) -> None:
    project.release_database()
    project.query(
        "update main.llm_batch_requests set not_before = now() - interval 1 second where not_before is not null"
    )


def assert_triage_rows_answered(project) -> None:
    """The triage table holds all 6 tickets, each succeeded with the sandbox's answer to its own prompt."""
    rows = project.query("""select s.subject, s.body, t.category, t.urgent, t.summary, t.llm_status
                            from main.triage t join main.support_tickets s using (ticket_id)""")
    assert len(rows) == 6
    for subject, body, category, urgent, summary, status in rows:
        assert status == "succeeded"
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}\n\n{body}")


@contextlib.contextmanager
def file_held_by_another_process(path):
    """A DuckDB file opened (and so locked) by another process until the block ends."""
    duckdb.connect(str(path)).close()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb,time; c=duckdb.connect({str(path)!r}); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        yield holder
    finally:
        holder.kill()
        holder.wait()


# -- Deduplication stories: rows `id, prompt` whose prompts repeat (`question <n>`), a free-text model
# at test prices (tests/test_dedup.py, tests/test_under_change.py) -------------------------------

PRICES = """provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,per_hour,batch_discount,as_of,source
openai,gpt-test,token,2.00,8.00,0,1.00,,0.5,2026-11-29,test prices
anthropic,claude-test,token,3.00,15.00,3.75,0.30,,0.5,2026-11-29,test prices
"""
MODEL = {"openai": "gpt-test", "anthropic": "claude-test"}
PRICE = {"openai": (Decimal("2.00"), Decimal("8.00")), "anthropic": (Decimal("3.00"), Decimal("15.00"))}


def prompt_of(n: int) -> str:
    return f"question {n}: why does the export of report {n} time out?"


def dup_model(provider: str, name: str = "dup", extra: str = "") -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='id', llm_provider='{provider}', llm_model='{MODEL[provider]}',
            llm_max_tokens=50, llm_price_table='main.llm_prices', {extra}) }}}}
select * from {{{{ ref('dup_rows') }}}}
"""


def write_rows(project, rows: dict[int, int]) -> None:
    """rows: {id: the prompt number it asks}."""
    project.write("seeds/dup_rows.csv", "id,prompt\n" + "".join(f'{i},"{prompt_of(n)}"\n' for i, n in rows.items()))
    project.dbt("seed")


def billed_cost(emulator, provider: str) -> Decimal:
    """What the sandbox billed (its usage totals of succeeded requests) at the test prices, batch half price."""
    usage = emulator.stats()["usage_by_face"][provider]
    if provider == "openai":
        tokens_in, tokens_out = usage["prompt_tokens"], usage["completion_tokens"]
    else:
        tokens_in, tokens_out = usage["input_tokens"], usage["output_tokens"]
    price_in, price_out = PRICE[provider]
    return (tokens_in * price_in + tokens_out * price_out) / Decimal(1_000_000) * Decimal("0.5")


def append_result_lines(emulator, batch: dict, lines: list[dict]) -> None:
    """Make the provider misbehave: extra lines in an ended batch's results."""
    extra = "".join(json.dumps(x) + "\n" for x in lines).encode()
    face = {f.name: f for f in emulator.faces}
    if batch.get("type") == "message_batch":
        face["anthropic"].jobs[batch["id"]].jsonl += extra
    else:
        face["openai"].contents[batch["output_file_id"]] += extra


def result_lines(emulator, batch: dict) -> list[dict]:
    """The result lines of an ended batch, as the provider would return them."""
    face = {f.name: f for f in emulator.faces}
    if batch.get("type") == "message_batch":
        return [json.loads(x) for x in face["anthropic"].jobs[batch["id"]].jsonl.splitlines()]
    return [json.loads(x) for x in face["openai"].contents[batch["output_file_id"]].splitlines()]


def line_for_an_unknown_custom_id(line: dict) -> dict:
    """A copy of a result line naming a custom_id no batch sent."""
    stranger = json.loads(json.dumps(line))
    stranger["custom_id"] = "r_not_ours"
    return stranger


# What marks a test's tier beyond its fixtures (conftest.tier_of): names its code reads, itself or
# through the functions it calls (of its module and of this one, followed by name), and text its
# string constants hold.
KILLS_A_PROCESS = ({"SIGKILL", "SIGINT", "SIGTERM"}, {"DBT_LLM_BATCH_CRASH_AT"})  # a signal sent; a crash point
# Popen.kill / os.kill count only beside a process the test starts (os.kill(pid, 0) alone only probes a PID).
KILL, STARTS_A_PROCESS = ({"kill"}, set()), ({"Popen", "subprocess"}, set())
STARTS_A_SANDBOX = ({"Emulator", "Popen"}, set())  # the emulator in process, or a server process


def uses_any(fn, signs: tuple[set[str], set[str]], _seen: set | None = None) -> bool:
    """Does test function `fn` read one of the names of `signs`, or hold one of its texts in a string
    constant, itself or through the functions it calls?"""
    names_wanted, texts = signs
    seen = set() if _seen is None else _seen
    if fn is None or not hasattr(fn, "__code__") or fn in seen:
        return False
    seen.add(fn)
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        consts = list(code.co_consts)
        while consts:
            const = consts.pop()
            if hasattr(const, "co_names"):
                codes.append(const)
            elif isinstance(const, (tuple, frozenset)):  # a dict's constant keys, a literal set
                consts.extend(const)
            elif isinstance(const, str) and any(text in const for text in texts):
                return True
    if names & names_wanted:
        return True
    module = getattr(fn, "__globals__", {})
    return any(uses_any(module.get(name), signs, seen) for name in names if callable(module.get(name)))
