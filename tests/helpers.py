"""Helpers for tests that check the model table against the emulator's answer function."""

from __future__ import annotations

import collections
import json

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
