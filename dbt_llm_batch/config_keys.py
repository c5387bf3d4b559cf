"""Every config key the plugin reads, declared once: name, type, default, validator, and what it is for.

This table drives every consumer of a key, so adding or changing one is one edit here:
- parsing (config.parse_config): the defaults, each key's validator, unknown-key errors and their
  did-you-mean;
- variants: the keys a variant may set (`variant`);
- the fingerprint: the keys that change an answer (`fingerprint` names the ModelConfig attribute
  that holds the key's parsed value in the fingerprint; a changed fingerprint re-asks every row);
- the settle snapshot `poll` reads (config.settle_snapshot): the keys it keeps (`snapshot`);
- the configuration reference, docs/configuration.md (ops/config_reference.py generates it).

The validators are config_values.py's. A key whose meaning depends on other keys (llm_provider, whose
class is loaded; llm_output and the YAML columns, checked by the provider; the variant keys) has none
here: config.py parses it with the keys it depends on. Tests hold the table to what the code does
(tests/unit/test_config_keys.py) and the fingerprints of existing configs to their values
(tests/unit/test_fingerprint_pins.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbt_llm_batch import config_values as v
from dbt_llm_batch.config_values import (
    FALLBACKS,
    OUTPUT_FORMATS,
    RESERVED_PARAMS,
    TASKS,
    Validator,
    boolean,
    choice,
    integer,
    number,
    text,
)


@dataclass(frozen=True)
class Key:
    name: str
    type: str  # as the reference page says it
    default: Any
    doc: str  # what it does, as the reference page says it
    parse: Validator | None = None  # None: parsed by config.py with the keys it depends on
    field: str | None = None  # the ModelConfig attribute its validated value is stored in, as is
    fingerprint: str | None = None  # the ModelConfig attribute its answer-defining value is in
    variant: bool = False  # a variant (llm_variants) may set it
    snapshot: bool = True  # the settle snapshot keeps it (False: a prompt's text, which is never stored)
    default_doc: str | None = None  # the default as the reference page says it, when not the value
    source: str = "config"  # 'config': set in config(); 'yaml': the model's YAML, passed by the macro
    # A key added after fingerprints were pinned: left out of the fingerprint while at its default, so the
    # stored fingerprints of every model that does not set it stay what they were (nothing is re-asked).
    fingerprint_omits_default: bool = False

    @property
    def changes_answer(self) -> bool:
        return self.fingerprint is not None


# --- the table ----------------------------------------------------------------------------------------

# llm_concurrency = 'auto' (pipeline/concurrency.py): where its climb starts against a server that says
# nothing of its load, and its bound when llm_max_concurrency is unset and the engine says no more.
AUTO_START = 16
AUTO_MAX_CONCURRENCY = 64

_PARAMS_DOC = ", ".join(f"`{p}`" for p in RESERVED_PARAMS)

# Each section is a heading of the reference page, in this order.
ASKED: tuple[Key, ...] = (
    Key(
        "unique_key",
        "column name or list",
        None,
        "identifies a row; NULL or duplicate values fail the model before sending",
        v.unique_key,
        field="unique_key",
        default_doc="required",
    ),
    Key(
        "llm_provider",
        "`'openai'`, `'anthropic'` or `'openai_compatible'` (or one another package registers)",
        "openai",
        "which batch API, or a self-hosted engine (switching re-asks every row, nothing else changes)",
        field="provider",
        fingerprint="provider",
        variant=True,
    ),
    Key(
        "llm_model",
        "string",
        None,
        "the provider's model name",
        v.model,
        field="model",
        fingerprint="model",
        variant=True,
        default_doc="required",
    ),
    Key(
        "llm_task",
        "`'answer'` or `'embed'`",
        "answer",
        "`'embed'`: each row's prompt is embedded (one `FLOAT[n]` column `llm_embedding`, no system prompt, "
        "examples or `llm_output`); only providers with an embeddings API take it (docs/embeddings.md)",
        choice(*TASKS),
        field="task",
        fingerprint="task",
        fingerprint_omits_default=True,
    ),
    Key(
        "llm_dimensions",
        "integer >= 1",
        None,
        "with `llm_task = 'embed'`: the vectors' size. OpenAI's text-embedding-3 models shorten to it (the "
        "`dimensions` parameter); a model that cannot (text-embedding-ada-002) refuses it; a self-hosted "
        "engine's model needs it (its native size, checked on every vector)",
        integer(1),
        field="dimensions",
        fingerprint="dimensions",
        fingerprint_omits_default=True,
        default_doc="the model's native size",
    ),
    Key(
        "llm_prompt_column",
        "string",
        "prompt",
        "the selected column sent as the user message (its value is in the fingerprint)",
        v.column_name,
        field="prompt_column",
        variant=True,
    ),
    Key(
        "llm_system",
        "string",
        None,
        "system prompt",
        text("a string"),
        field="system",
        fingerprint="system",
        variant=True,
        snapshot=False,
    ),
    Key(
        "llm_examples",
        "list of `{'input': str, 'output': str or dict}`",
        [],
        "few-shot pairs, rendered identically before every prompt (a dict output is sent as JSON)",
        v.examples,
        field="examples",
        fingerprint="examples",
        variant=True,
        snapshot=False,
    ),
    Key(
        "llm_cache_prefix",
        "`true`, `false`, `'5m'` or `'1h'`",
        False,
        "mark system + examples as a cacheable prefix: Anthropic `cache_control` on the end of the prefix "
        "(TTL 5 min, or 1 h; a 1 h cache write costs 2x the input price, a 5 min one 1.25x), OpenAI a stable "
        "prefix plus `prompt_cache_key`. If the prefix is shorter than the provider's minimum (about 1,024 "
        "tokens; 2,048 for Claude Haiku), the run log says no saving will happen",
        v.cache_prefix,
        field="cache_prefix",
        variant=True,
    ),
    Key(
        "llm_max_tokens",
        "integer >= 1",
        None,
        "output token limit (`max_completion_tokens` / `max_tokens`)",
        integer(1),
        field="max_tokens",
        fingerprint="max_tokens",
        variant=True,
        default_doc="OpenAI: provider default; Anthropic: 1024 (required there)",
    ),
    Key(
        "llm_temperature",
        "number 0-2",
        None,
        "sampling temperature",
        number(0, 2),
        field="temperature",
        fingerprint="temperature",
        variant=True,
        default_doc="provider default",
    ),
    Key(
        "llm_params",
        "dict",
        {},
        f"other request-body parameters, passed through; may not set what the keys above set ({_PARAMS_DOC})",
        v.params,
        field="params",
        fingerprint="params",
        variant=True,
        snapshot=False,
    ),
)
OUTPUT: tuple[Key, ...] = (
    Key(
        "llm_output",
        "dict",
        None,
        "output columns (names may not be those of the status columns, in any case): `'text'`->VARCHAR, "
        "`'integer'`->BIGINT, `'number'`->DOUBLE, `'boolean'`->BOOLEAN, a list of allowed strings (enum, "
        "VARCHAR), or a JSON Schema fragment for nested and typed values ([extract nested fields](guides/extract.md#reference)); "
        "OpenAI: a strict JSON-schema `response_format`; Anthropic: a forced tool call whose `input_schema` "
        "is that schema",
        fingerprint="output_schema",
        default_doc="one text column `llm_output`",
    ),
    Key(
        "llm_output_format",
        "`'columns'` or `'json'`",
        "columns",
        "`'json'`: keep the whole structured answer as one `JSON` column `llm_output` instead of one column "
        "per field (the schema is still sent and every answer checked against it)",
        choice(*OUTPUT_FORMATS),
        field="output_format",
    ),
    Key(
        "llm_output_from_columns",
        "boolean",
        False,
        "`true`: the model's YAML `columns:` with a `data_type` (except the unique_key, prompt and status "
        "columns) are the output columns, instead of `llm_output`; a column's description is sent with its "
        "field",
        boolean,
        fingerprint="output_schema",
    ),
    Key(
        "columns",
        "the model's YAML `columns:`",
        None,
        "not a config key: with `llm_output_from_columns`, the materialization (and `dbt-llm-batch check`, "
        "from the manifest) pass each column's name, data_type and description",
        fingerprint="output_schema",
        source="yaml",
        default_doc="none",
    ),
)
RUN: tuple[Key, ...] = (
    Key(
        "llm_max_attempts",
        "integer >= 1",
        3,
        "attempts per (key, fingerprint) before a row is final `failed`; raising it re-queues failed rows "
        "(not those that failed in a way no retry changes: [guarantees](guarantees.md#failures-that-are-not-retried))",
        integer(1),
        field="max_attempts",
    ),
    Key(
        "llm_wait_seconds",
        "number >= 0",
        0,
        "wait up to this long for batches to end within the run",
        number(0),
        field="wait_seconds",
    ),
    Key(
        "llm_ledger_schema",
        "string",
        None,
        "where the ledger tables live",
        text("the name of a schema"),
        field="ledger_schema",
        default_doc="the model's schema",
    ),
    Key(
        "llm_ledger_identity",
        "string",
        None,
        "the name the ledger records the model's requests under; set it to the old `schema.name` after "
        "renaming a model's file to keep its answers and batches in flight",
        text("a name, e.g. the model's old 'schema.name' after a rename", blank_ok=False),
        field="ledger_identity",
        default_doc="`schema.model_name`",
    ),
    Key(
        "llm_on_unselected",
        "`'keep'` or `'delete'`",
        "keep",
        "rows of keys the model no longer selects (a narrowed `where`, deleted source rows): kept, or deleted "
        "by the next run; the ledger keeps their answers either way",
        choice("keep", "delete"),
        field="on_unselected",
    ),
    Key(
        "llm_updated_at",
        "column name",
        None,
        "a selected column that changes whenever anything the prompt reads changes (dbt snapshots' `timestamp` "
        "strategy rests on the same promise): a run whose selection, config and SQL are unchanged since a run "
        "that left every row answered reads only the key and this column and sends nothing. SQL models only. "
        "A row changed without a new value here is not asked again until it gets one, or the run after a "
        "`--full-refresh` ([large models](large-models.md))",
        text("a column name", blank_ok=False),
        field="updated_at",
    ),
    Key(
        "on_schema_change",
        "`'append_new_columns'`, `'sync_all_columns'` or `'fail'` (dbt's own key)",
        "append_new_columns",
        "when the model's columns change (a SELECT or `llm_output` edit): add the new ones (a changed `llm_output` is "
        "asked again in the same run; dropped columns stay), also drop the removed ones and change types, or fail "
        "naming the model; a changed `unique_key` rebuilds the table from the ledger (nothing is sent for "
        "it). dbt's default `'ignore'` is read as `'append_new_columns'`. docs: *Schema changes*",
        v.schema_change,
        field="on_schema_change",
        snapshot=False,
    ),
    Key(
        "llm_dedup",
        "`true`, `'ledger'`, `false`",
        None,
        "send each distinct request once and share its answer among the rows that ask it: within the model "
        "(`true`), also across the models of the ledger schema (`'ledger'`), or one request per row (`false`). "
        "See [costs](costs.md#deduplication)",
        v.dedup,
        default_doc="`true` (`false` when `llm_temperature` > 0)",
    ),
    Key(
        "llm_delete_provider_files",
        "boolean",
        True,
        "once a batch's results are stored in the ledger, delete its uploaded input file and its output and "
        "error files (OpenAI), or the ended batch (Anthropic), at the provider. Recorded in "
        "`llm_batch_jobs.files_deleted_at`; a failed delete is logged, recorded in `files_delete_error`, retried "
        "by the next run and never fails a run",
        boolean,
        field="delete_provider_files",
    ),
    Key(
        "llm_max_batches_in_flight",
        "integer >= 1",
        20,
        "most batches this model may have open at the provider",
        integer(1),
        field="max_batches_in_flight",
    ),
    Key(
        "llm_max_tokens_in_flight",
        "integer >= 1",
        None,
        "most estimated input tokens this model may have in flight (OpenAI fails a batch over the "
        "enqueued-token limit of your tier; raise it on a higher tier). Anthropic's queue limit is on requests: "
        "at most 100,000 in flight per model",
        integer(1),
        field="max_tokens_in_flight",
        default_doc="OpenAI: 2,000,000; Anthropic: none",
    ),
    Key(
        "llm_retry_budget_seconds",
        "number >= 0",
        300,
        "how long one run keeps retrying throttled or failing provider calls (429, 5xx, timeouts, dropped "
        "connections), from its first failure on; then the rest stays pending for the next run",
        number(0),
        field="retry_budget_seconds",
    ),
    Key(
        "llm_on_unavailable",
        "`'warn'` or `'error'`",
        "warn",
        "when the provider kept failing for the whole `llm_retry_budget_seconds`: end with a dbt warning, or "
        "fail the run (after merging what was final)",
        choice("warn", "error"),
        field="on_unavailable",
    ),
    Key(
        "llm_max_context_tokens",
        "integer >= 1",
        None,
        "a row whose estimated input tokens plus `llm_max_tokens` exceed it fails alone, unsent; for models "
        "whose window is not known nothing is checked unless you set it",
        integer(1),
        field="max_context_tokens",
        default_doc="the model's context window where known (OpenAI gpt-4o / gpt-4o-mini 128,000, gpt-4.1* "
        "1,047,576; Anthropic claude-* 200,000)",
    ),
)
COST: tuple[Key, ...] = (
    Key(
        "llm_max_cost_usd",
        "number >= 0",
        None,
        "budget per model per run: refuse (before any upload) when the estimate of what would be sent plus "
        "what this model already has in flight exceeds it",
        number(0),
        field="max_cost_usd",
    ),
    Key(
        "llm_dry_run",
        "boolean",
        False,
        "plan, estimate and report: no provider call, no request recorded, the model table left as it is (the "
        "ledger tables are created if missing, and a model that never ran gets its empty table, so `dbt build`'s "
        "tests run on it)",
        boolean,
        field="dry_run",
    ),
    Key(
        "llm_price_table",
        "relation name, e.g. `'main.llm_prices'`",
        None,
        "your price rows (same columns as the shipped table), replacing or extending it",
        text("the name of a relation, e.g. 'main.llm_prices'"),
        field="price_table",
    ),
    Key(
        "llm_budget_basis",
        "`'ceiling'` or `'expected'`",
        "ceiling",
        "what estimates and budgets count per answer: `llm_max_tokens` (the most it can cost), or the "
        "expected length from this model's earlier answers",
        choice("ceiling", "expected"),
        field="budget_basis",
    ),
)
# The realtime path: every row of a provider without a batch API (a self-hosted engine), urgent rows
# of a batch provider (llm_realtime_when), and rows whose batch attempts are exhausted (llm_fallback).
REALTIME: tuple[Key, ...] = (
    Key(
        "llm_realtime_when",
        "SQL boolean expression over the selected columns",
        None,
        "rows where it is true go to the provider's realtime endpoint in this run, at list prices; the rest "
        "are batched",
        v.realtime_when,
        field="realtime_when",
        snapshot=False,
    ),
    Key(
        "llm_fallback",
        "`'realtime'`",
        None,
        "a row whose batch attempts are used up gets one more try in realtime",
        choice(*FALLBACKS),
        field="fallback",
    ),
    # Measured on the local engine (benchmarks/engine_batch.py), a fixed 16 ran at 0.82x the best fixed
    # number; 'auto' finds it (pipeline/concurrency.py).
    Key(
        "llm_concurrency",
        "integer 1-1024 or `'auto'`",
        "auto",
        "realtime requests in flight at once; `'auto'` finds the number while sending: against a vLLM engine it "
        "starts where the engine's `/metrics` says its KV cache has room and comes down to the batch the engine "
        "runs plus half of it when requests wait there for a place in it; against another server it "
        f"starts at {AUTO_START}, doubles it while throughput rises, settles at the best and probes higher now "
        "and then; it halves it on a 429/503/529, a timeout or a failed connection, never above "
        "`llm_max_concurrency`",
        v.concurrency,
    ),
    Key(
        "llm_max_concurrency",
        "integer 1-1024",
        None,
        "with `llm_concurrency = 'auto'`: the most requests in flight it may try",
        integer(1, 1024),
        field="max_concurrency",
        default_doc=f"what the engine's `/metrics` says its KV cache holds, if more than {AUTO_MAX_CONCURRENCY}; "
        f"else {AUTO_MAX_CONCURRENCY}",
    ),
    Key(
        "llm_realtime_budget_seconds",
        "number >= 1",
        600,
        "a run starts no realtime request (or retry) after this long; what is left waits for the next run",
        number(1),
        field="realtime_budget_seconds",
    ),
)
# Evaluation variants (pipeline/variants.py), parsed by config._parse_variants.
VARIANTS: tuple[Key, ...] = (
    Key(
        "llm_variants",
        "dict: variant name -> dict of `llm_*` keys",
        None,
        "evaluation variants: every selected row is also asked of each variant (its keys over the model's), "
        "one table row per key and variant (`llm_variant`); each variant's answers are fingerprinted by its "
        "own keys. See [evaluate](guides/evaluate.md)",
    ),
    Key(
        "llm_default_variant",
        "string",
        "default",
        "the `llm_variant` of the rows the model's own keys answer",
    ),
    Key(
        "llm_variant_sample",
        "dict: variant name -> fraction (0, 1]",
        None,
        "a variant answers only this deterministic share of keys (the same keys every run); the default "
        "variant answers all",
    ),
)

SECTIONS: dict[str, tuple[Key, ...]] = {
    "What is asked, and of whom": ASKED,
    "The answer's columns": OUTPUT,
    "How rows are sent, retried and kept": RUN,
    "Cost": COST,
    "Realtime: urgent rows, fallbacks and self-hosted engines": REALTIME,
    "Evaluation variants": VARIANTS,
}
KEYS: tuple[Key, ...] = tuple(key for section in SECTIONS.values() for key in section)
BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
# The keys `config()` sets (the table's others come from the model's YAML).
CONFIG_KEYS: tuple[Key, ...] = tuple(key for key in KEYS if key.source == "config")
VARIANT_KEYS: tuple[str, ...] = tuple(key.name for key in KEYS if key.variant)
VARIANT_CONFIG_KEYS: tuple[str, ...] = tuple(key.name for key in VARIANTS)
