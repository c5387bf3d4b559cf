"""The modelled project: what the test believes the dbt project is (rows, each model's config), and the
files that say it to dbt.

Four llm_batch models over one seed of tickets, at test prices. Every sixth ticket repeats the text of
the ticket two before it (body_of): rows of one model asking the same prompt share one request and
split its cost.
- `mb_triage` (OpenAI) with variants (at first 'claude' on Anthropic, answering a sample of half the
  keys), urgent rows sent realtime;
- `mb_twin` (OpenAI) asking the same requests as mb_triage's default variant while their prompts,
  providers and model names agree (shared requests across models, `llm_dedup = 'ledger'` for both);
  an edit may move either to another model name, or mb_twin to Anthropic or Gemini (and back);
- `mb_embed` (OpenAI, `llm_task = 'embed'`): each ticket's text as an 8-float vector, never edited; it
  sets `llm_updated_at` (a run with nothing new skips it);
- `mb_extract` (Anthropic) with a nested output (a STRUCT holding a LIST, an integer, a date-time and a
  nullable string), its own
  requests (no `llm_dedup = 'ledger'`: a rename without `llm_ledger_identity` warns before paying again).
  An edit may rename its file, keeping its ledger identity or not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from decimal import Decimal

from helpers import PRICES

EDITED = ("mb_triage", "mb_twin", "mb_extract")  # the models edits draw from
MODELS = (*EDITED, "mb_embed")
EMBED_MODEL, EMBED_SIZE = "text-embedding-3-small", 8
TRIAGE_OUTPUT = {"category": ["billing", "bug", "how_to", "other"], "urgent": "boolean"}
EXTRACT_OUTPUT = {
    "contact": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "topics": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "topics"],
    },
    "effort": "integer",
    # A date-time (TIMESTAMP WITH TIME ZONE) and a nullable string: JSON null is SQL NULL, a string its text.
    "due": {"type": "string", "format": "date-time"},
    "note": {"type": ["string", "null"]},
}
NULLABLE = {"note"}  # output columns whose NULL is an answer (JSON null), not a lost value
# Another model name at the same test price, for the model switch (the billing check prices by face).
OTHER_MODEL = {"openai": "gpt-test-2", "anthropic": "claude-test-2", "gemini": "gemini-test-2"}
FIRST_MODEL = {"openai": "gpt-test", "anthropic": "claude-test", "gemini": "gemini-test"}
AZURE_DEPLOYMENT = "batch-test"
# Gemini (the sandbox's Gemini Batch Mode face) at a test price of its own, (input, output) per million
# tokens, so the billing check would see a Gemini request priced as another provider's. Only mb_twin
# moves there (a provider switch): llm_provider 'gemini' has no realtime path, so the plugin refuses it
# as a variant of mb_triage, whose urgent rows go realtime (llm_realtime_when cannot differ per variant).
GEMINI_PRICE = (Decimal("1.00"), Decimal("4.00"))
# A variant's config by the name the generator gives it (the name is what a rename changes); "sample"
# is its llm_variant_sample fraction (the share of keys it answers), which a rename carries along.
VARIANT_CONFIGS = {
    "claude": {"llm_provider": "anthropic", "llm_model": "claude-test", "sample": 0.5},
    # On Azure OpenAI (a Global Batch deployment, at OpenAI's test price): a third provider face.
    "terse": {
        "llm_system": "Category of the ticket, nothing else.",
        "llm_provider": "azure_openai",
        "llm_model": AZURE_DEPLOYMENT,
    },
}


def system_of(model: str, version: int) -> str:
    return f"Sort the support ticket into a category (prompt {model.removeprefix('mb_')} v{version})."


def in_sample(key: int, fraction: float) -> bool:
    """Whether the key of unique_key value `key` is in a sample of `fraction` (llm_variant_sample: the
    first 32 bits of the md5 of the ledger key, ["<key>"], below the fraction)."""
    digest = hashlib.md5(json.dumps([str(key)]).encode()).hexdigest()
    return int(digest[:8], 16) / 2**32 < fraction


# unique_key -> its value for the ticket of id i (i + offset). 'id' and 'ticket_no' are always selected,
# so every stored row (the row a request was made from) holds them; 'tno' is selected only while it is
# the key (a computed column the key edit adds): the rows stored before hold no 'tno', so the plugin
# re-keys their requests by the prompt's fingerprint, and a merge takes a missing key column from the
# ledger's key (docs/table.md "Changing unique_key"). A table that lacks the new key's column is rebuilt
# from the ledger by the next run (pipeline/schema_change.py).
KEY_OFFSETS = {"id": 0, "ticket_no": 1000, "tno": 2000}


def key_value(key: str, i: int) -> int:
    """The value of unique_key `key` for the ticket of id `i`."""
    return i + KEY_OFFSETS[key]


@dataclasses.dataclass
class ModelState:
    version: int = 0  # the prompt's version: an edit makes a new one, never one used before
    extra_column: bool = False  # a 'summary' output column (mb_triage and mb_twin only)
    variants: dict[str, dict] = dataclasses.field(default_factory=dict)  # name -> config
    key: str = "id"  # unique_key: 'id', 'ticket_no' (= id + 1000) or 'tno' (= id + 2000, selected only as the key)
    provider: str = "openai"
    llm_model: str = "gpt-test"
    file: str = ""  # the model's .sql file and table name ('' until World.initial sets it)
    identity: str | None = None  # llm_ledger_identity, set by a rename that keeps it
    # Ledger identities this model had before a rename that did not keep them: their requests are
    # paid again under the new name (after the warning), and their batches are no one's to harvest.
    dropped_identities: tuple[str, ...] = ()

    def ledger_name(self) -> str:
        return self.identity or f"main.{self.file}"


@dataclasses.dataclass
class World:
    rows: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> priority ('urgent' or 'normal')
    models: dict[str, ModelState] = dataclasses.field(default_factory=dict)

    @classmethod
    def initial(cls, rows: int = 8) -> World:
        world = cls(models={m: ModelState(file=m) for m in MODELS})
        world.models["mb_extract"].provider, world.models["mb_extract"].llm_model = "anthropic", "claude-test"
        world.models["mb_embed"].llm_model = EMBED_MODEL
        world.models["mb_triage"].variants = {"claude": dict(VARIANT_CONFIGS["claude"])}
        # mb_twin starts at mb_triage's prompt version: their requests are shared from the first run.
        for i in range(rows):
            world.rows[i] = "urgent" if i % 5 == 3 else "normal"
        return world

    def variants_of(self, model: str) -> set[str]:
        return {"default", *self.models[model].variants}

    def table(self, model: str) -> str:
        return self.models[model].file

    def answers(self, model: str, variant: str, key: int) -> bool:
        """Whether `variant` of `model` answers the row of unique_key value `key`: every row, or for a
        sampled variant the documented share of keys (llm_variant_sample: the first 32 bits of the
        md5 of the ledger key, ["<key>"], below the fraction), computed apart from the plugin."""
        fraction = self.models[model].variants.get(variant, {}).get("sample")
        return fraction is None or in_sample(key, fraction)

    def llm_model_of(self, model: str, variant: str) -> str:
        """The model name that answers `variant` of `model` now (a variant's own llm_model, else the model's)."""
        return self.models[model].variants.get(variant, {}).get("llm_model", self.models[model].llm_model)

    def output_columns(self, model: str) -> list[str]:
        if model == "mb_extract":
            return sorted(EXTRACT_OUTPUT)
        if model == "mb_embed":
            return ["llm_embedding"]
        return sorted([*TRIAGE_OUTPUT, *(["summary"] if self.models[model].extra_column else [])])


def body_of(i: int) -> str:
    """Every sixth ticket repeats the text of the ticket two before it: rows of one model asking the
    same prompt share one request (llm_dedup, on by default) and split its cost; among them an urgent
    row (sent realtime) and a normal one (i % 5 == 3: ticket 3 and ticket 5)."""
    n = i - 2 if i % 6 == 5 else i
    return f"Ticket {n}: the export of report {n % 4} fails with error {n * 13 % 97}."


def row_version(priority: str, body: str) -> int:
    """A ticket's `row_version`: changes whenever its row does (mb_embed's llm_updated_at)."""
    return int(hashlib.md5(f"{priority}|{body}".encode()).hexdigest()[:7], 16)  # fits an INTEGER, as the seed infers it


def seed_csv(world: World) -> str:
    return "id,priority,body,row_version\n" + "".join(
        f'{i},{p},"{body_of(i)}",{row_version(p, body_of(i))}\n' for i, p in sorted(world.rows.items())
    )


def model_sql(world: World, model: str) -> str:
    state = world.models[model]
    if model == "mb_embed":  # each ticket's text embedded (llm_task = 'embed'), in batches like the others
        config = {"llm_task": "embed", "llm_model": state.llm_model, "llm_dimensions": EMBED_SIZE}
        # A run with nothing new reads only its key and row_version (#36: pipeline/settled.py).
        config["llm_updated_at"] = "row_version"
        prompt = "body"
    elif model == "mb_extract":
        config = {
            "llm_provider": state.provider,
            "llm_model": state.llm_model,
            "llm_output": EXTRACT_OUTPUT,
            "llm_system": f"Extract the contact and the effort (v{state.version}).",
        }
        prompt = "'Extract from: ' || body"
    else:
        output = dict(TRIAGE_OUTPUT, **({"summary": "text"} if state.extra_column else {}))
        config = {"llm_provider": state.provider, "llm_model": state.llm_model, "llm_output": output}
        # The twin's prompt equals mb_triage's while their versions agree: one request for both.
        config["llm_system"] = system_of("mb_triage", state.version)
        prompt = "'Ticket: ' || body"
    if model != "mb_embed":
        config["llm_max_tokens"] = 60
    config["llm_price_table"] = "main.llm_prices"
    if model != "mb_extract":
        config["llm_dedup"] = "ledger"
    if state.identity:
        config["llm_ledger_identity"] = state.identity
    if model == "mb_triage":
        config["llm_realtime_when"] = "priority = 'urgent'"
        if state.variants:
            config["llm_variants"] = {
                n: {k: v for k, v in c.items() if k != "sample"} for n, c in state.variants.items()
            }
            sampled = {n: c["sample"] for n, c in state.variants.items() if "sample" in c}
            if sampled:
                config["llm_variant_sample"] = sampled
    args = ",\n    ".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    return f"""{{{{ config(
    materialized = 'llm_batch', tags = ['mb'], unique_key = {state.key!r},
    {args}
) }}}}
select id, id + 1000 as ticket_no,{" id + 2000 as tno," if state.key == "tno" else ""} priority, {prompt} as prompt{", row_version" if model == "mb_embed" else ""}
from {{{{ ref('mb_tickets') }}}}
where id < {{{{ var('mb_below', 1000000) }}}}
"""


def write_project(project, world: World) -> None:
    """The project as `world` says; the integration project's own models are removed (a quicker parse)."""
    for folder in ("batch", "local", "extraction", "evaluation"):
        shutil.rmtree(project.root / "models" / folder, ignore_errors=True)
    others = "".join(
        line.replace(f",{FIRST_MODEL[p]},", f",{OTHER_MODEL[p]},") + "\n"
        for line in PRICES.splitlines()
        for p in FIRST_MODEL
        if line.startswith(f"{p},{FIRST_MODEL[p]},")
    )
    azure = next(line for line in PRICES.splitlines() if line.startswith(f"openai,{FIRST_MODEL['openai']},"))
    azure = azure.replace(f"openai,{FIRST_MODEL['openai']},", f"azure_openai,{AZURE_DEPLOYMENT},") + "\n"
    # The embedding model at the chat model's test price: the billing check prices every OpenAI line so.
    embed = azure.replace(f"azure_openai,{AZURE_DEPLOYMENT},", f"openai,{EMBED_MODEL},")
    price_in, price_out = GEMINI_PRICE
    gemini = "".join(
        f"gemini,{name},token,{price_in},{price_out},0,{price_in / 4},,0.5,2026-11-29,test prices\n"
        for name in (FIRST_MODEL["gemini"], OTHER_MODEL["gemini"])
    )
    project.write("seeds/llm_prices.csv", PRICES + others + azure + embed + gemini)
    write_models(project, world)
    write_seed(project, world)


def write_models(project, world: World) -> None:
    """Each model's file under its current name; a renamed model's old file is gone."""
    for old in (project.root / "models" / "mb").glob("*.sql"):
        old.unlink()
    for model in MODELS:
        project.write(f"models/mb/{world.table(model)}.sql", model_sql(world, model))


def write_seed(project, world: World) -> None:
    project.write("seeds/mb_tickets.csv", seed_csv(world))
