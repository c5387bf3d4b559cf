"""The steps of a model-based sequence: a seeded generator draws a plan (a list of steps, each with a
line that says what it does), and `apply` carries one step out on the project and the sandbox.

The plan is drawn in full before anything runs, from the seed alone: edits change only the modelled
World, never depend on what dbt did, so a seed always replays the same steps. What dbt's 4 threads do
within a step (which model creates its batch first, say) may differ between replays."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from dbt_llm_batch.pipeline.crashpoints import POINTS

from .invariants import budget_kept, rename_warned
from .world import EDITED, FIRST_MODEL, OTHER_MODEL, VARIANT_CONFIGS, World, body_of, write_models, write_seed

SELECT = ("-s", "tag:mb", "--threads", "4")
# A Gemini job's states once it has ended (the sandbox's control view shows the wire's BATCH_STATE_*).
GEMINI_ENDED = ("BATCH_STATE_SUCCEEDED", "BATCH_STATE_FAILED", "BATCH_STATE_CANCELLED", "BATCH_STATE_EXPIRED")
# Project budgets (var llm_batch_max_cost_usd) a run may have: at the test prices one model's 8 rows
# are estimated at about $0.002-0.006 (the ceiling of 60 output tokens), so on a first run these let
# one or two of the three through; later, it depends on what is in flight.
BUDGETS = (0.003, 0.006, 0.01)
# Faults of a provider's submission: before the handler (nothing happened at the
# provider) or after it (the batch exists, the client sees an error).
FAULTS = (
    {"endpoint": "POST /v1/batches", "status_code": 500, "when": "after"},
    {"endpoint": "POST /v1/messages/batches", "status_code": 500, "when": "after"},
    {"endpoint": "POST /v1/files", "status_code": 503, "when": "before"},
    {"endpoint": "POST /v1/messages/batches", "status_code": 529, "when": "before"},
)
# Answers a column cannot hold, as a real model sometimes gives them: each `complete` step makes the
# sandbox answer one of mb_extract's rows so (a content fault, once) when it completes its batch. Taken
# in turn by the plan, not drawn: a seed's plan draws the same steps as before they existed.
INVALID_ANSWERS = (
    ("due", "next tuesday"),
    ("effort", 1e20),  # a JSON integer past BIGINT
    ("due", "2026-02-30T10:00:00Z"),  # a date-time of no day
)
VALID_EXTRACT = {
    "contact": {"name": "Ada", "topics": ["export"]},
    "effort": 3,
    "due": "2026-01-05T09:00:00Z",
    "note": None,
}
KINDS = {  # kind -> weight in the draw
    "run": 4,
    "narrow_run": 2,
    "complete": 3,
    "advance": 1,
    "fault_run": 3,
    "budget_run": 2,
    "crash": 2,
    "edit": 4,
    "new_rows": 2,
    "poll": 1,
    "reparse_run": 1,
}


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    line: str  # what the step does, as the failure report prints it
    args: dict = dataclasses.field(default_factory=dict)
    world: World | None = None  # the World after an edit or new rows


def plan(seed: int, steps: int, world: World) -> list[Step]:
    """`steps` steps drawn from `seed`; the first is a run, with a fault, a budget or neither. `world`
    is copied, not changed."""
    rng = random.Random(seed)
    world = _copy(world)
    out: list[Step] = []
    kinds, weights = zip(*KINDS.items(), strict=True)
    while len(out) < steps:
        kind = rng.choices(kinds, weights)[0] if out else rng.choice(["run", "fault_run", "budget_run"])
        if kind == "fault_run":
            fault = rng.choice(FAULTS)
            out.append(Step(kind, f"fault {_fault_text(fault)} (twice), then dbt run", {"fault": fault}))
        elif kind == "budget_run":
            limit = rng.choice(BUDGETS)
            out.append(Step(kind, f"dbt run --vars '{{llm_batch_max_cost_usd: {limit}}}'", {"limit": limit}))
        elif kind == "crash":
            point = rng.choice(POINTS)
            out.append(Step(kind, f"dbt run in a subprocess, SIGKILLed at {point}", {"point": point}))
        elif kind == "advance":
            out.append(Step(kind, "sandbox: every open batch one stage along"))
        elif kind == "complete":
            n = sum(1 for s in out if s.kind == "complete")
            field, value = INVALID_ANSWERS[n % len(INVALID_ANSWERS)]
            row = sorted(world.rows)[(3 * n + 1) % len(world.rows)]
            line = f"sandbox: complete every batch; mb_extract's answer for ticket {row} has {field} = {value!r} (once)"
            out.append(Step(kind, line, {"row": row, "content": json.dumps({**VALID_EXTRACT, field: value})}))
        elif kind == "poll":
            out.append(Step(kind, "dbt-llm-batch poll --then 'dbt run -s {models}'"))
        elif kind == "narrow_run":
            below = rng.randrange(2, max(world.rows))
            out.append(Step(kind, f"dbt run --vars '{{mb_below: {below}}}' (a narrower selection)", {"below": below}))
        elif kind == "run":
            out.append(Step(kind, "dbt run (threads 4)"))
        elif kind == "reparse_run":
            out.append(Step(kind, "dbt run --no-partial-parse (a full re-parse)"))
        elif kind == "new_rows":
            first = max(world.rows) + 1
            for i in range(first, first + 2):
                world.rows[i] = "urgent" if rng.random() < 0.3 else "normal"
            out.append(Step(kind, f"new seed rows {first}, {first + 1}, then dbt seed", world=_copy(world)))
        else:
            # One or two edits between runs, as a user makes them; an edit that needs a run of its own
            # (an output change's --full-refresh, a rename's first run) has it right after.
            lines = [_edit(rng, world) for _ in range(rng.choice([1, 2]))]
            out.append(Step("edit", "; ".join(lines), {"edits": lines}, world=_copy(world)))
    return out


def _edit(rng: random.Random, world: World) -> str:
    """Change `world` by one edit a user makes between runs; returns what it did."""
    triage = world.models["mb_triage"]
    choices = ["prompt", "output", "key", "variant_add", "variant_remove", "variant_rename", "switch", "rename"]
    what = rng.choice(choices)
    if what == "switch":
        model = rng.choice(["mb_triage", "mb_twin", "mb_twin"])
        state = world.models[model]
        draw = rng.random() if model == "mb_twin" else 1.0
        if draw < 0.5:
            # From OpenAI to Anthropic, or to Gemini (the lower half of the same draw: a seed's plan
            # draws the same steps as before Gemini was among them); from either back to OpenAI.
            if state.provider == "openai":
                state.provider = "gemini" if draw < 0.25 else "anthropic"
            else:
                state.provider = "openai"
            state.llm_model = FIRST_MODEL[state.provider]
            return f"edit: {model} switched provider to {state.provider} ({state.llm_model})"
        first = FIRST_MODEL[state.provider]
        state.llm_model = OTHER_MODEL[state.provider] if state.llm_model == first else first
        return f"edit: {model} switched model to {state.llm_model}"
    if what == "rename":
        state = world.models["mb_extract"]
        old = state.file
        state.file = "mb_extract_r" if old == "mb_extract" else "mb_extract"
        if rng.random() < 0.5:
            state.identity = state.ledger_name() if state.identity else f"main.{old}"
            return f"edit: file of mb_extract renamed {old} -> {state.file}, llm_ledger_identity kept, then dbt run"
        state.dropped_identities += (state.identity or f"main.{old}",)
        state.identity = None
        return f"edit: file of mb_extract renamed {old} -> {state.file}, no llm_ledger_identity, then dbt run"
    if what == "prompt":
        version = 1 + max(s.version for s in world.models.values())
        models = rng.choice([["mb_triage"], ["mb_twin"], ["mb_extract"], ["mb_triage", "mb_twin"]])
        for m in models:
            world.models[m].version = version
        return f"edit: the prompt of {' and '.join(models)} (v{version})"
    if what == "output":
        model = rng.choice(["mb_triage", "mb_twin"])
        state = world.models[model]
        state.extra_column = not state.extra_column
        return f"edit: {model} output {'gains' if state.extra_column else 'loses'} 'summary', dbt run --full-refresh"
    if what == "key":
        model = rng.choice(EDITED)
        state = world.models[model]
        # Half the time to 'tno', a column the stored rows lack (selected only while it is the key), by a
        # draw that does not advance the generator: every seed's plan draws the same steps as before 'tno'
        # was among them, a key edit's target aside. Otherwise between 'id' and 'ticket_no', as before.
        if state.key != "tno" and _peek(rng, "key") < 0.5:
            state.key = "tno"
        elif state.key == "tno":
            state.key = "id" if _peek(rng, "key") < 0.5 else "ticket_no"
        else:
            state.key = "ticket_no" if state.key == "id" else "id"
        return f"edit: {model} unique_key = {state.key!r}"
    present = {name.removesuffix("_2") for name in triage.variants}  # a renamed variant is still that variant
    free = [name for name in VARIANT_CONFIGS if name not in present]
    if what == "variant_add" and free:
        name = rng.choice(free)
        triage.variants[name] = dict(VARIANT_CONFIGS[name])
        return f"edit: mb_triage variant {name!r} added"
    if what == "variant_remove" and triage.variants:
        name = rng.choice(sorted(triage.variants))
        del triage.variants[name]
        # The last variant gone, the table loses its llm_variant column: a full refresh, as documented.
        return f"edit: mb_triage variant {name!r} removed" + ("" if triage.variants else ", dbt run --full-refresh")
    if triage.variants:
        old = rng.choice(sorted(triage.variants))
        new = old + "_2" if not old.endswith("_2") else old.removesuffix("_2")
        if new not in triage.variants:
            triage.variants[new] = triage.variants.pop(old)
            return f"edit: mb_triage variant {old!r} renamed {new!r}"
    version = 1 + max(s.version for s in world.models.values())
    world.models["mb_extract"].version = version
    return f"edit: the prompt of mb_extract (v{version})"


def _peek(rng: random.Random, salt: str) -> float:
    """A number in [0, 1) drawn from `rng`'s state (the md5 of it and `salt`) without advancing it: a
    branch on it leaves every later draw of the plan as it was."""
    digest = hashlib.md5(f"{salt}|{rng.getstate()!r}".encode()).hexdigest()
    return int(digest[:8], 16) / 2**32


def _copy(world: World) -> World:
    return copy.deepcopy(world)


def _fault_text(fault: dict) -> str:
    return f"{fault['endpoint']} {fault['status_code']} {fault['when']} the handler"


# -- carrying a step out -----------------------------------------------------------------------


def apply(step: Step, project, emulator, world: World, tmp: Path) -> tuple[World, str, list[str]]:
    """Carry `step` out; returns the World after it, a note of what happened (the plan's line plus
    an outcome a replay wants to see: a dbt run that failed, where a crash died, a poll's exit code),
    and the broken invariants of the step's own kind (a budget run's, a rename's)."""
    before = world
    if step.world is not None:
        world = step.world
    note = ""
    broken: list[str] = []
    if step.kind in ("run", "reparse_run"):
        flags = ("--no-partial-parse",) if step.kind == "reparse_run" else ()
        note = _run(project, *flags)
    elif step.kind == "narrow_run":
        note = _run(project, "--vars", f"{{mb_below: {step.args['below']}}}")
    elif step.kind == "complete":
        # Fires if that row's request is in a batch completing now, else when one next completes.
        prompt = f"Extract from: {body_of(step.args['row'])}"  # its text (a repeated one: both rows' request)
        emulator.add_fault(kind="content", prompt_contains=prompt, content=step.args["content"], times=1)
        emulator.complete_all()
    elif step.kind == "advance":
        for batch in emulator.batches():
            if batch.get("status", batch.get("processing_status")) not in (
                "completed",
                "ended",
                "failed",
                "cancelled",
                "expired",
                *GEMINI_ENDED,
            ):
                emulator.advance(batch["id"])
    elif step.kind == "budget_run":
        limit = step.args["limit"]
        project.release_database()
        requests = _requests(project)
        result = project.dbt("run", *SELECT, "--vars", f"{{llm_batch_max_cost_usd: {limit}}}", expect_ok=False)
        note = outcome(result)
        refused = {r.node.name for r in result.result.results if "refusing to submit" in str(r.message or "")}
        project.release_database()
        broken = budget_kept(project, world, limit, requests, refused)
        note += f" refused: {', '.join(sorted(refused)) or 'none'}"
    elif step.kind == "fault_run":
        # Twice: the provider stays flaky for both models that may create a batch there in this run
        # (dbt's threads decide which one creates first).
        emulator.add_fault(kind="http_error", times=2, **step.args["fault"])
        note = _run(project)
        emulator.clear_faults()
    elif step.kind == "crash":
        note = _crash(project, step.args["point"], tmp)
    elif step.kind == "new_rows":
        write_seed(project, world)
        project.dbt("seed", "-s", "mb_tickets")
    elif step.kind == "edit":
        write_models(project, world)
        for line in step.args["edits"]:
            if "--full-refresh" in line:
                note += _run(project, "--full-refresh", select=world.table(line.split()[1]))
            elif line.startswith("edit: file"):
                broken += _rename_run(project, world, before)
    elif step.kind == "poll":
        note = _poll(project, tmp)
    return world, note, broken + no_traceback(note)


def _rename_run(project, world: World, before: World) -> list[str]:
    """The first run after mb_extract's file was renamed, and what its log says about the rename."""
    log = project.root / "logs" / "dbt.log"
    start = log.stat().st_size if log.exists() else 0
    project.release_database()
    asked, ran = _asked(project), _identities_run(project)
    note = _run(project)
    project.release_database()
    after = _asked(project)
    with log.open(errors="replace") as f:
        f.seek(start)
        return rename_warned(world, before.models["mb_extract"], asked, ran, after, f.read(), note)


def _asked(project) -> list[tuple[str, str, str]]:
    """(ledger model, fingerprint, status) of each request the ledger records now."""
    if not project.query("select 1 from information_schema.tables where table_name = 'llm_batch_requests'"):
        return []
    return project.query("select model, fingerprint, status from main.llm_batch_requests")


def _identities_run(project) -> set[str]:
    """The ledger identities that have had a run (a row in llm_batch_models: a model's first run records it)."""
    if not project.query("select 1 from information_schema.tables where table_name = 'llm_batch_models'"):
        return set()
    return {m for (m,) in project.query("select model from main.llm_batch_models")}


def _requests(project) -> dict[str, tuple[str, str, object]]:
    """custom_id -> (ledger model, status, estimated cost): the ledger's requests now."""
    if not project.query("select 1 from information_schema.tables where table_name = 'llm_batch_requests'"):
        return {}
    rows = project.query("select custom_id, model, status, estimated_cost_usd from main.llm_batch_requests")
    return {c: (m, s, e) for c, m, s, e in rows}


def _run(project, *flags: str, select: str = "tag:mb") -> str:
    return outcome(project.dbt("run", "-s", select, "--threads", "4", *flags, expect_ok=False))


TRACEBACK = "Python traceback"


def outcome(result) -> str:
    """A dbt run's outcome for the step's note: '' when it succeeded, else each failed model's message;
    a message that is a Python traceback is marked (TRACEBACK, and its last line): an error a user sees
    says how to fix it (dbt_llm_batch.errors), never a traceback."""
    if result.success:
        return ""
    failed = []
    for r in result.result.results if result.result else ():
        if r.status == "error":
            message = str(r.message)
            if "Traceback (most recent call last)" in message:
                last = message.strip().splitlines()[-1].strip()
                failed.append(f"{r.node.name}: {TRACEBACK}: {last[:200]}")
            else:
                failed.append(f"{r.node.name}: {message[:200]}")
    return "dbt run failed: " + ("; ".join(failed) or repr(result.exception))


def no_traceback(note: str) -> list[str]:
    if TRACEBACK not in note:
        return []
    return [f"a run that fails says why, never with a Python traceback: {note}"]


def _crash(project, point: str, tmp: Path) -> str:
    project.release_database()
    marker = tmp / "crash-marker"
    marker.unlink(missing_ok=True)
    dbt = Path(sys.executable).parent / "dbt"
    argv = [str(dbt), "run", *SELECT, "--project-dir", str(project.root), "--profiles-dir", str(project.root)]
    env = {**os.environ, "DBT_LLM_BATCH_CRASH_AT": point, "DBT_LLM_BATCH_CRASH_MARKER": str(marker)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == -9:
        return f"killed at {point}"
    return f"never reached {point} (exit {done.returncode})"


def _poll(project, tmp: Path) -> str:
    from dbt_llm_batch.ops.cli import main as cli

    project.release_database()
    dbt = Path(sys.executable).parent / "dbt"
    then = f"{dbt} run -s {{models}} --threads 4 --project-dir {project.root} --profiles-dir {project.root}"
    rc = cli(["poll", "--database", str(project.db_path), "--then", then])
    return f"poll exit {rc}"
