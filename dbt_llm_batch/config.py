"""A model's `llm_*` configuration: parsed, validated (every problem reported at once), fingerprinted.

Validation happens before the ledger or any provider is touched, so a bad config never pays for a
request. The fingerprint covers exactly what can change an answer; see `answer_defining_fields`.
Each key (its default, validator, and whether it is in the fingerprint, may differ per variant or
is kept in the settle snapshot) is declared once, in config_keys.py's table, which drives this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from dbt_llm_batch import embeddings, output_schema, registry
from dbt_llm_batch.config_keys import (
    AUTO_MAX_CONCURRENCY,
    BY_NAME,
    CONFIG_KEYS,
    KEYS,
    VARIANT_CONFIG_KEYS,
    VARIANT_KEYS,
    Key,
)
from dbt_llm_batch.config_values import canonical
from dbt_llm_batch.errors import ConfigError

# The types a user may write in `llm_output` (compact names, enums, JSON Schema fragments) and the
# DuckDB types they become are output_schema.py's. Each key is declared once, in config_keys.py.

# Columns the plugin appends to every model table, in this order (later issues append after these).
STATUS_COLUMNS = [
    ("llm_status", "VARCHAR"),
    ("llm_error", "VARCHAR"),
    ("llm_finish_reason", "VARCHAR"),
    ("llm_input_tokens", "BIGINT"),
    ("llm_output_tokens", "BIGINT"),
    ("llm_model", "VARCHAR"),
    ("llm_batch_id", "VARCHAR"),
    ("llm_fingerprint", "VARCHAR"),
    ("llm_completed_at", "TIMESTAMP WITH TIME ZONE"),
    ("llm_cache_read_tokens", "BIGINT"),
    ("llm_cache_write_tokens", "BIGINT"),
    ("llm_cost_usd", "DECIMAL(18,9)"),
    ("llm_realtime_cost_usd", "DECIMAL(18,9)"),
    ("llm_route", "VARCHAR"),
]

# Every key the plugin understands, with its default (config_keys.py declares each key once); a
# provider adds its own (Provider.config_keys, e.g. a self-hosted engine's llm_base_url). Keys starting
# with `llm_` that are in neither are reported as errors (with a did-you-mean), because a typo would
# otherwise silently change nothing.
DEFAULTS: dict[str, Any] = {key.name: key.default for key in CONFIG_KEYS if key.name.startswith("llm_")}


@dataclass(frozen=True)
class OutputColumn:
    name: str
    duckdb_type: str
    json_schema: dict


@dataclass(frozen=True)
class ModelConfig:
    unique_key: tuple[str, ...]
    provider: str
    model: str
    prompt_column: str
    system: str | None
    examples: tuple[tuple[str, str], ...]  # few-shot (input, output) pairs, rendered before the prompt
    cache_prefix: str | None  # None, or the cache TTL ('5m' | '1h') of the system + examples prefix
    output: dict | None  # the user's llm_output as written, or None for one text column
    output_columns: tuple[OutputColumn, ...]
    max_tokens: int | None
    temperature: float | None
    params: dict = field(default_factory=dict)
    max_attempts: int = 3
    wait_seconds: float = 0
    ledger_schema: str | None = None
    ledger_identity: str | None = None  # keeps a model's ledger across a rename of its file
    max_cost_usd: float | None = None  # per model per run, counting what is already in flight
    dry_run: bool = False
    price_table: str | None = None  # the user's price rows (a relation), overriding the shipped table
    max_batches_in_flight: int = 20
    max_tokens_in_flight: int | None = None  # estimated input tokens; None: the provider's default
    # The provider's own keys as its parse_options returned them (e.g. a self-hosted engine's URLs).
    options: dict = field(default_factory=dict)
    concurrency: int = 16  # the most realtime requests in flight (with 'auto', the bound it adapts under)
    adaptive_concurrency: bool = False  # llm_concurrency = 'auto'
    max_concurrency: int | None = None  # llm_max_concurrency as set (None: the engine's KV room, if larger)
    realtime_when: str | None = None
    fallback: str | None = None
    realtime_budget_seconds: float = 600
    retry_budget_seconds: float = 300  # retrying 429 / 5xx / timeouts, from a run's first failure on
    on_unavailable: str = "warn"  # 'warn' | 'error': what a run does when the provider stayed down
    max_context_tokens: int | None = None  # None: the known context window of llm_model, if any
    delete_provider_files: bool = True
    on_unselected: str = "keep"  # 'keep' | 'delete': the table's rows of keys no longer selected (merge.py)
    # 'append_new_columns' | 'sync_all_columns' | 'fail': a table whose columns the model changed (schema_change.py)
    on_schema_change: str = "append_new_columns"
    budget_basis: str = "ceiling"  # 'ceiling' | 'expected': the output tokens estimates count (costs.py)
    # The fingerprint prefix earlier versions computed for this config from the key order dbt's parse
    # gave (see legacy_fingerprint_prefix); None when it equals fingerprint_prefix().
    legacy_prefix: str | None = None
    output_format: str = "columns"  # llm_output_format: not in the fingerprint (it changes no answer)
    task: str = "answer"  # llm_task: 'answer' (chat) or 'embed' (embeddings.py: one FLOAT[n] column)
    dimensions: int | None = None  # llm_dimensions as written (the vectors' size is output_columns')
    # llm_updated_at: the selected column whose unchanged values let a run with nothing new skip (settled.py)
    updated_at: str | None = None

    @property
    def embeds(self) -> bool:
        return self.task == embeddings.EMBED

    @property
    def embedding_size(self) -> int | None:
        """The size n of the FLOAT[n] column of an embedding model; None for a chat model."""
        if not self.embeds:
            return None
        return int(self.output_columns[0].duckdb_type.removeprefix("FLOAT[").removesuffix("]"))

    def table_outputs(self) -> list[tuple[str, str]]:
        """The output columns of the model table: one per field, or the whole answer as one JSON column."""
        if self.structured and self.output_format == "json":
            return [("llm_output", "JSON")]
        return [(c.name, c.duckdb_type) for c in self.output_columns]

    # Sending each distinct request once (plan.py): 'model', 'ledger' or None (one request per row).
    # How rows are asked, never what: not in the fingerprint.
    dedup: str | None = "model"
    dedup_defaulted_off: bool = False  # llm_dedup unset and llm_temperature > 0 (the run log says so)
    # Evaluation variants (pipeline/variants.py). `variant` is the name the ledger's row answers carry
    # ('' for the default variant, so adding variants to a model keeps its answers); `variant_name` the
    # name the table shows in llm_variant (None: the model has no variants, and no such column);
    # `variants` the other variants' configs (the default's only); `variant_sample` the fraction of keys
    # a sampled variant answers. None of them is in the fingerprint: a variant's answers are defined by
    # its own fields, so identical variants share their requests.
    variant: str = ""
    variant_name: str | None = None
    variants: tuple[ModelConfig, ...] = ()
    variant_sample: float | None = None

    def all_variants(self) -> tuple[ModelConfig, ...]:
        """The default variant (this config) first, then the others; just this config without variants."""
        return (self, *self.variants)

    @property
    def structured(self) -> bool:
        return self.output is not None

    def output_json_schema(self) -> dict | None:
        """The JSON schema sent as structured output; None for free text."""
        if not self.structured:
            return None
        return output_schema.object_schema({c.name: c.json_schema for c in self.output_columns})

    @property
    def output_schema(self) -> dict | None:
        return self.output_json_schema()

    def answer_defining_fields(self) -> dict:
        """Everything except the prompt that can change an answer (the fingerprint's constant part):
        the attribute named by each key the table (config_keys.py) says changes the answer. Tuples are
        JSON lists in the hash, as they were when the fields were listed here."""
        return {
            key.fingerprint: getattr(self, key.fingerprint)
            for key in KEYS
            if key.fingerprint and not (key.fingerprint_omits_default and getattr(self, key.fingerprint) == key.default)
        }

    def fingerprint_prefix(self) -> str:
        """Hash of the constant part; a row's fingerprint is md5(prefix || prompt), computed in SQL."""
        return _prefix_hash(self.answer_defining_fields())

    def fingerprint_prefix_asking(self, schema: dict) -> str:
        """The prefix this config would have with `schema` as its output schema (wider_answers.py: the
        requests asked with a recorded wider schema)."""
        return _prefix_hash({**self.answer_defining_fields(), "output_schema": schema})


def _prefix_hash(fields: dict) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def legacy_fingerprint_prefix(config: ModelConfig, raw_output, raw_examples) -> str | None:
    """The prefix versions before canonical configs computed: the output schema's `required` list and
    dict example answers followed the order dbt's parse gave. For a model whose parse order was
    stable (any int or float in config() makes dbt render it in the order written), the ledger's
    fingerprints are these; planner.adopt_legacy_fingerprints renames them to the canonical ones, so
    upgrading does not ask any row again. None when both prefixes are the same."""
    fields = config.answer_defining_fields()
    if config.structured and isinstance(raw_output, dict):
        fields["output_schema"]["required"] = [name for name in raw_output]
    if isinstance(raw_examples, list):
        fields["examples"] = [
            [
                e["input"],
                e["output"]
                if isinstance(e["output"], str)
                else json.dumps(e["output"], ensure_ascii=False, separators=(",", ":")),
            ]
            for e in raw_examples
        ]
    legacy = _prefix_hash(fields)
    return None if legacy == config.fingerprint_prefix() else legacy


def parse_config(raw: dict) -> ModelConfig:
    """Validate a model's raw config dict; raise one ConfigError listing every problem."""
    variants_raw = raw.get("llm_variants")
    if variants_raw is None and raw.get("llm_variant_sample") is None:
        return _parse_one(raw)
    return _parse_variants(raw)


def _parse_one(raw: dict) -> ModelConfig:
    """One variant's config (or the model's, without variants): each key validated by its entry in
    the table (config_keys.py), then what depends on several keys (the provider, the output)."""
    errors: list[str] = []
    given: dict[str, Any] = {
        key.name: raw.get(key.name) if raw.get(key.name) is not None else key.default for key in CONFIG_KEYS
    }
    provider = _provider_class(given["llm_provider"], errors)
    _check_keys(raw, provider, errors)
    values: dict[str, Any] = {
        key.name: key.parse(key.name, given[key.name], errors) if key.parse else given[key.name] for key in CONFIG_KEYS
    }
    fields: dict[str, Any] = {key.field: values[key.name] for key in CONFIG_KEYS if key.field}

    from_columns = values["llm_output_from_columns"] is True
    output = _yaml_output(raw, values, fields["unique_key"], errors) if from_columns else values["llm_output"]
    before = len(errors)
    if values["llm_task"] == embeddings.EMBED:
        output_columns = _embedding_output(raw, values, provider, errors)
    else:
        output_columns = _parse_output(output, errors)
        if values["llm_dimensions"] is not None:
            errors.append("llm_dimensions is the size of an embedding: it needs llm_task='embed'")
    if values["llm_output_format"] == "json" and output is None:
        errors.append("llm_output_format='json' keeps a structured answer as one JSON column: it needs llm_output")
    if provider is not None and output is not None and output_columns and len(errors) == before:
        # The provider refuses, before anything is sent, a schema its API would not take (with the rule).
        schema = output_schema.object_schema({c.name: c.json_schema for c in output_columns})
        provider.check_output_schema(schema, errors)
    _check_realtime(values, provider, errors)
    options: dict[str, Any] = {}
    if provider is not None:
        # The provider validates its own keys (and their defaults), e.g. an engine's llm_base_url.
        own = {k: (raw.get(k) if raw.get(k) is not None else d) for k, d in _provider_defaults(provider).items()}
        options = provider.parse_options(own, errors)

    if errors:
        raise ConfigError("invalid llm_batch config:\n  - " + "\n  - ".join(errors))
    dedup, dedup_defaulted_off = _dedup_scope(values["llm_dedup"], values["llm_temperature"])
    adaptive = values["llm_concurrency"] == "auto"
    config = ModelConfig(
        **fields,
        output=canonical(output),
        output_columns=output_columns,
        options=options,
        concurrency=(values["llm_max_concurrency"] or AUTO_MAX_CONCURRENCY) if adaptive else values["llm_concurrency"],
        adaptive_concurrency=adaptive,
        dedup=dedup,
        dedup_defaulted_off=dedup_defaulted_off,
    )
    legacy = (
        legacy_fingerprint_prefix(config, given["llm_output"], given["llm_examples"])
        if config.examples or config.output
        else None
    )
    return dataclasses.replace(config, legacy_prefix=legacy) if legacy else config


def settle_snapshot(raw: dict, dbt_name: str | None = None) -> str:
    """What settling a model's results needs of its raw config (output columns, with the YAML columns
    llm_output_from_columns reads; provider and model, prices, attempts, the provider's own keys such
    as an engine's URL and its key's variable NAME), as canonical JSON, for the poller to rebuild the
    config with parse_config without the dbt project: the keys the table (config_keys.py) marks
    `snapshot`, and every provider's own llm_* key. A system prompt, examples and request parameters
    are prompts, never kept outside a run's request files. No secret is in it: keys are read from
    environment variables, never from config. `dbt_name` is the model's name in dbt (what a selector
    names); the ledger knows the model as schema.name."""

    def kept(keys: dict) -> dict:
        return {
            k: v
            for k, v in keys.items()
            if (k in BY_NAME and BY_NAME[k].snapshot) or (k not in BY_NAME and k.startswith("llm_"))
        }

    snapshot = kept(raw)
    if isinstance(snapshot.get("llm_variants"), dict):  # a variant's system prompt and examples are prompts too
        snapshot["llm_variants"] = {
            name: kept(keys) if isinstance(keys, dict) else keys for name, keys in snapshot["llm_variants"].items()
        }
    return json.dumps({"config": canonical(snapshot), "dbt_name": dbt_name}, sort_keys=True, separators=(",", ":"))


def _parse_variants(raw: dict) -> ModelConfig:
    """llm_variants: the model's own keys are the default variant (named llm_default_variant); each
    other variant is the model's config with its own keys over it, parsed and validated like a model's
    (every problem of every variant at once, each named), before anything is recorded or sent."""
    errors: list[str] = []
    base_raw = {k: v for k, v in raw.items() if k not in VARIANT_CONFIG_KEYS}
    default_name = raw.get("llm_default_variant")
    default_name = DEFAULTS["llm_default_variant"] if default_name is None else default_name
    if not _variant_name_ok(default_name):
        errors.append(f"llm_default_variant must be a name of letters, digits, '_', '-' or '.', got {default_name!r}")
    base = _collect(lambda: _parse_one(base_raw), errors, "")
    model_errors = list(errors)  # a problem of the model's own keys is said once, not once per variant
    variants_raw = raw.get("llm_variants")
    if variants_raw is None:
        variants_raw = {}
    if not isinstance(variants_raw, dict):
        errors.append("llm_variants must be a dict from a variant name to the llm_* keys that differ for it")
        variants_raw = {}
    others: list[ModelConfig] = []
    for name in sorted(variants_raw, key=str):  # dbt's parse does not keep a dict's order (see canonical)
        where = f"llm_variants[{name!r}]"
        overrides = variants_raw[name]
        if not _variant_name_ok(name):
            errors.append(f"{where}: a variant name is letters, digits, '_', '-' or '.'")
            continue
        if name == default_name:
            errors.append(
                f"{where}: '{name}' is the default variant (llm_default_variant), whose keys are the model's own: "
                "choose another name"
            )
            continue
        if not isinstance(overrides, dict):
            errors.append(f"{where} must be a dict of the llm_* keys that differ for it")
            continue
        bad = sorted(k for k in overrides if k not in VARIANT_KEYS)
        known = {*BY_NAME, *_provider_keys()} if bad else set()  # every key the plugin or a provider reads
        for key in bad:
            if key not in known:  # a typo: say which key was meant, not the variant rule
                errors.append(f"{where}: {_unknown_key(key, VARIANT_KEYS)}")
                continue
            errors.append(
                f"{where}: '{key}' cannot differ per variant (every variant answers into the same table "
                f"and run); a variant may set {', '.join(VARIANT_KEYS)}"
            )
        if bad:
            continue
        config = _collect(
            lambda overrides=overrides: _parse_one({**base_raw, **overrides}), errors, where + ": ", model_errors
        )
        if config is None:
            continue
        if base is not None and config.table_outputs() != base.table_outputs():
            errors.append(f"{where}: its output columns differ from the model's; every variant fills the same columns")
            continue
        others.append(dataclasses.replace(config, variant=name, variant_name=name))
    samples = raw.get("llm_variant_sample")
    samples = {} if samples is None else samples
    if not isinstance(samples, dict):
        errors.append("llm_variant_sample must be a dict from a variant name to the fraction of keys it answers")
        samples = {}
    for name, fraction in sorted(samples.items(), key=lambda item: str(item[0])):
        if name == default_name:
            errors.append(
                f"llm_variant_sample[{name!r}]: the default variant answers every row; sample another variant"
            )
        elif name not in variants_raw:
            errors.append(f"llm_variant_sample[{name!r}]: no such variant in llm_variants")
        elif isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            errors.append(f"llm_variant_sample[{name!r}] must be a fraction above 0 and at most 1, got {fraction!r}")
    if errors:
        raise ConfigError("invalid llm_batch config:\n  - " + "\n  - ".join(errors))
    assert base is not None
    others = [
        dataclasses.replace(c, variant_sample=float(samples[c.variant]) if c.variant in samples else None)
        for c in others
    ]
    return dataclasses.replace(base, variant="", variant_name=default_name, variants=tuple(others))


def _variant_name_ok(name) -> bool:
    return isinstance(name, str) and bool(name) and len(name) <= 64 and all(c.isalnum() or c in "_-." for c in name)


def _collect(parse, errors: list[str], prefix: str, known: list[str] | None = None):
    """parse(), or None with its problems added to `errors` (each prefixed: which variant), except
    those in `known` (the model's own, reported already)."""
    try:
        return parse()
    except ConfigError as exc:
        lines = str(exc).split("\n  - ")[1:] or [str(exc)]
        errors.extend(prefix + line for line in lines if line not in (known or []))
        return None


def _dedup_scope(value, temperature) -> tuple[str | None, bool]:
    """llm_dedup as (scope or None, whether it is off only because llm_temperature is above 0): at a
    temperature above 0 each row should get its own sample, so sharing is then off unless asked for."""
    if value is None:
        if isinstance(temperature, (int, float)) and temperature > 0:
            return None, True
        return "model", False
    return (None, False) if value is False else (value, False)


def _provider_defaults(provider) -> dict[str, Any]:
    """The provider's own keys with their defaults: Provider.config_keys maps each to a Key of the
    table's kind (config_keys.Key) or, from a provider written before Keys, to its default."""
    return {k: d.default if isinstance(d, Key) else d for k, d in provider.config_keys.items()}


def _check_realtime(values: dict, provider, errors: list[str]) -> None:
    """The realtime keys against the provider: routing rows to realtime needs a batch provider with a
    realtime path (a provider's own keys, e.g. an engine's URLs, are its parse_options')."""
    when, fallback = values["llm_realtime_when"], values["llm_fallback"]
    if provider is not None and not provider.has_batch_api and (when is not None or fallback is not None):
        errors.append(
            "llm_realtime_when and llm_fallback route rows of a batch provider to its realtime "
            f"path; with llm_provider {provider.name!r} every row is already realtime"
        )
    if provider is not None and not provider.has_realtime and (when is not None or fallback is not None):
        errors.append(
            "llm_realtime_when and llm_fallback send rows through the provider's realtime path, which "
            f"llm_provider {provider.name!r} does not have"
        )


def _embedding_output(raw: dict, values: dict, provider, errors: list[str]) -> tuple[OutputColumn, ...]:
    """llm_task = 'embed': the one FLOAT[n] column, its size from the provider (llm_model and
    llm_dimensions); a provider without an embeddings API, and chat-only keys, are refused."""
    embeddings.check_keys(raw, DEFAULTS, errors)
    if provider is None:
        return ()
    if not provider.has_embeddings:
        able = [n for n in registry.provider_names() if getattr(_provider_class(n, []), "has_embeddings", False)]
        embeddings.refuse_provider(provider.name, able, errors)
        return ()
    size = provider.embedding_size(values["llm_model"], values["llm_dimensions"], errors)
    if size is None:
        return ()
    return (OutputColumn(embeddings.COLUMN, embeddings.column_type(size), embeddings.column_schema(size)),)


def _provider_class(name, errors: list[str]):
    """The registered provider class named `name` (registry.py), or None with the reason in `errors`."""
    if not registry.is_registered(name):
        # The default provider first, then the others as registered.
        known = sorted(registry.provider_names(), key=lambda n: n != DEFAULTS["llm_provider"])
        errors.append(f"llm_provider must be one of {known}, got {name!r}")
        return None
    try:
        return registry.load_provider(name)
    except ConfigError as exc:  # registered, but its class cannot be loaded
        errors.append(str(exc))
        return None


def _check_keys(raw: dict, provider, errors: list[str]) -> None:
    """Report each `llm_` key neither the core nor the model's provider reads: another provider's
    key (with where this provider reads that setting instead), or an unknown one (with a did-you-mean)."""
    own = provider.config_keys if provider is not None else {}
    strays = sorted(
        k for k in raw if k.startswith("llm_") and k not in DEFAULTS and k not in own and k not in VARIANT_CONFIG_KEYS
    )
    if not strays:
        return
    owners = _provider_keys()  # every registered provider's keys: read only on this error path
    for key in strays:
        if key in owners:
            if raw[key] is None or provider is None:
                continue  # unset, or the provider itself is unknown (reported already)
            hint = f" ({provider.environment_hint})" if provider.environment_hint else ""
            names = " or ".join(repr(n) for n in owners[key])
            errors.append(f"{key} is only for llm_provider {names}{hint}")
            continue
        errors.append(_unknown_key(key, [*DEFAULTS, *own, *owners]))


def _provider_keys() -> dict[str, list[str]]:
    """Each registered provider's own keys, with the providers that read it."""
    owners: dict[str, list[str]] = {}
    for name in registry.provider_names():
        try:
            provider = registry.load_provider(name)
        except ConfigError:
            continue  # a broken registration is reported when a model names it
        for key in provider.config_keys:
            owners.setdefault(key, []).append(name)
    return owners


def _unknown_key(key: str, candidates) -> str:
    """The error for a key nothing reads, with the closest of `candidates` (a typo would otherwise
    silently change nothing)."""
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f"unknown config key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else "")


def _parse_output(output, errors) -> tuple[OutputColumn, ...]:
    """The output columns, in name order, each with its canonical JSON Schema (output_schema.py)."""
    if output is None:
        return (OutputColumn("llm_output", "VARCHAR", {"type": "string"}),)
    if not isinstance(output, dict) or not output:
        errors.append(f"llm_output must be a dict from column name to a type: {output_schema.TYPE_HELP}")
        return ()
    columns = []
    reserved = {name.lower() for name, _ in STATUS_COLUMNS}
    seen: dict[str, str] = {}
    # Sorted: dbt's parse does not keep a config() dict's order (see canonical), so a new table's
    # output columns are in name order; an existing table keeps its own order (merge.py).
    for name, spec in sorted(output.items(), key=lambda item: str(item[0])):
        if not isinstance(name, str) or not name.isidentifier():
            errors.append(f"llm_output column name {name!r} must be a plain identifier")
        elif name.lower() in reserved or name.lower() == "rowid":
            errors.append(
                f"llm_output column '{name}' has the name of a column dbt-llm-batch adds to every table "
                f"({', '.join(n for n, _ in STATUS_COLUMNS)}): choose another name"
            )
        elif name.lower() in seen:
            errors.append(
                f"llm_output columns '{seen[name.lower()]}' and '{name}' differ only in case, which "
                "DuckDB column names do not: rename one"
            )
        else:
            seen[name.lower()] = name
            schema = output_schema.column_schema(spec, f"llm_output['{name}']", errors)
            if schema is not None:
                columns.append(OutputColumn(name, output_schema.duckdb_type(schema), schema))
    return tuple(columns)


def _yaml_output(raw: dict, values: dict, keys: tuple[str, ...], errors: list[str]) -> dict | None:
    """llm_output_from_columns: the model's YAML columns that have a data_type (the macro passes them
    as `columns`: name, data_type, description), except the unique_key, prompt and status columns, as
    llm_output; a column without a data_type is documentation only. A data_type is a compact type
    ('text', ...) or a DuckDB type (VARCHAR, BIGINT, DATE, STRUCT(...), T[], ...); the description
    is sent to the provider with the field."""
    if values["llm_output"] is not None:
        errors.append("set either llm_output or llm_output_from_columns, not both")
        return None
    skip = {k.lower() for k in keys} | {str(values["llm_prompt_column"]).lower()} | {n for n, _ in STATUS_COLUMNS}
    output: dict = {}
    for col in raw.get("columns") or []:
        name = col.get("name")
        if not isinstance(name, str) or name.lower() in skip:
            continue
        data_type = col.get("data_type")
        where = f"column '{name}' (the model's YAML)"
        if data_type is None:
            continue
        if not isinstance(data_type, str) or not data_type.strip():
            errors.append(f"{where}: data_type must be a type name, got {data_type!r}")
            continue
        spec = (
            data_type
            if data_type in output_schema.COMPACT
            else output_schema.from_duckdb_type(data_type, where, errors)
        )
        if spec is None:
            continue
        if isinstance(spec, str):
            spec = {"type": output_schema.COMPACT[spec]}
        if isinstance(col.get("description"), str) and col["description"].strip():
            spec = {**spec, "description": col["description"].strip()}
        output[name] = spec
    if not output:
        errors.append(
            "llm_output_from_columns is true but the model's YAML lists no output column: add `columns:` "
            "with a name and a data_type for each field the LLM fills"
        )
        return None
    return output
