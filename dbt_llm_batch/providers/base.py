"""The provider boundary: what the core needs from a provider, and nothing provider-specific.

Every provider (Provider) declares its capabilities and its own config keys, renders requests (as
SQL expressions, so they are built in bulk), sends rows through its realtime path, and says how to
read its result lines into the normalised outcome columns the core understands. A provider with a
batch API (BatchProvider) also turns planned rows into request lines, submits a file of lines as
one batch, polls it and downloads its result lines.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.embeddings import EmbeddingModel
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.calls import CallBudget
from dbt_llm_batch.providers.engine_load import EngineLoad
from dbt_llm_batch.sql import literal

# Columns every provider's `outcomes_sql` must produce, one row per result line:
#   custom_id, outcome ('ok' | 'error' | 'void'), answer (text, or the JSON of a structured answer),
#   finish_reason (the provider's word), truncated (the answer was cut off at the token limit), error,
#   input_tokens (ALL input tokens, cache reads and writes included), output_tokens,
#   cached_tokens (cache reads), cache_write_tokens (cache writes, of every TTL),
#   not_retried (for an 'error': why the same request would fail the same way again, e.g. the
#   provider rejected it as invalid or the model refused; NULL for a failure a retry may fix),
#   cache_write_1h_tokens (the cache writes with Anthropic's 1 h TTL, billed at a higher rate; NULL elsewhere)
# 'void' is an outcome that says nothing about the request itself (expired, cancelled before it
# ran): the request is sent again without using up an attempt.
OUTCOME_COLUMNS = (
    "custom_id",
    "outcome",
    "answer",
    "finish_reason",
    "truncated",
    "error",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "cache_write_tokens",
    "not_retried",
    "cache_write_1h_tokens",
)

# Why an error outcome is final at once (providers' outcomes_sql): retrying would pay for the same failure.
REJECTED = (
    "not retried: the provider rejected the request itself, which would be rejected again; "
    "fix the prompt or the model's config"
)
REFUSED = "not retried: the same request would be refused again; change the prompt"


# find_submission's answer when it cannot yet tell whether a submission reached the provider.
UNRESOLVED = "unresolved"

# Markers for where a row's values go in a request line rendered once for all rows.
CUSTOM_ID_MARK = "\u0001"
PROMPT_MARK = "\u0000__dbt_llm_batch_prompt__\u0000"


def spliced_line_sql(line: dict) -> str:
    """A DuckDB expression (over columns `custom_id` and `prompt`) giving `line` as one JSON line per
    row. The line, with CUSTOM_ID_MARK and PROMPT_MARK as values, is rendered once; each row's
    values are spliced in with to_json, so lines are built in bulk, never a Python object per row."""
    head, middle, tail = line_parts(line)
    return f"{literal(head)} || to_json(custom_id) || {literal(middle)} || to_json(prompt) || {literal(tail)}"


def line_parts(line: dict) -> tuple[str, str, str]:
    """`line` rendered once, as the text before its custom_id, between it and the prompt, and after."""
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"))
    head, rest = text.split(json.dumps(CUSTOM_ID_MARK))
    middle, tail = rest.split(json.dumps(PROMPT_MARK))
    return head, middle, tail


def spliced_body_sql(body: dict) -> str:
    """A DuckDB expression (over column `prompt`) giving one realtime request body per row, built like
    spliced_line_sql: rendered once, each row's prompt spliced in with to_json."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    head, tail = text.split(json.dumps(PROMPT_MARK))
    return f"{literal(head)} || to_json(prompt) || {literal(tail)}"


def json_object_text(text: str) -> str | None:
    """`text` if it is one JSON object (a reply body that can go into a result line as is), else None."""
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


@dataclass
class Submission:
    batch_id: str
    status: str
    input_file_id: str | None = None


@dataclass
class BatchState:
    status: str  # the provider's own status word, recorded in the ledger as is
    ended: bool  # nothing more will happen; results (if any) can be downloaded
    error: str | None = None  # batch-level failure text (the batch produced no per-request outcome)
    counts: dict = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    # OpenAI validation errors that name input lines: {1-based line of the request file: message}.
    line_errors: dict = field(default_factory=dict)
    # The batch failed as a whole (OpenAI `failed`, Ray `FAILED`, Gemini JOB_STATE_FAILED, Bedrock `Failed`):
    # the requests it left unanswered are resubmitted after a back-off, and given up after repeated
    # failures (batch_failures.py).
    failed: bool = False
    token_limit: bool = False  # failed on the provider's enqueued-token limit: resubmit after a back-off
    results_gone: bool = False  # set by poll (archived) or download_results: results could no longer be fetched
    requests_done: int | None = None  # requests the provider has finished either way, from its counts (progress)
    # What the batch cost as a whole, beyond its requests' tokens: a Ray job's run time x GPUs x the user's
    # price per GPU-hour (llm_gpu_hour_usd). Set once it ended; settle spreads it over the requests it answered.
    run_cost_usd: float | None = None


class Provider(ABC):
    """What every provider has: its capabilities, its own config keys, credentials, request rendering,
    the realtime path, and how its result lines read. The core asks these, never a provider's name.

    A provider with a batch API subclasses BatchProvider instead."""

    name: ClassVar[str]  # the llm_provider value it is registered under (entry-point group dbt_llm_batch.providers)
    key_env_var: ClassVar[str] = ""  # the environment variable holding the API key ("": none, or set per model)

    # --- capabilities ----------------------------------------------------------------------------
    has_batch_api: ClassVar[bool] = False  # True on BatchProvider: rows go in batches unless routed to realtime
    has_realtime: ClassVar[bool] = True  # every provider has the realtime path (urgent rows, fallback, no batch API)
    # A self-hosted engine: it bills nothing itself (cost comes from llm_price_table only), so there is no
    # realtime counterfactual, and a lost reply costs nothing to send again.
    self_hosted: ClassVar[bool] = False
    min_cacheable_tokens: int = 1024  # shorter prefixes are not cached (an instance may say per model)
    # Context windows in tokens (input + output) by model-name prefix; the longest matching prefix wins.
    # llm_max_context_tokens overrides. Empty: unknown, nothing is checked.
    context_windows: ClassVar[dict[str, int]] = {}
    # Output tokens a request reserves when llm_max_tokens is not set; None: nothing reserved in advance.
    default_output_tokens: ClassVar[int | None] = None
    # Defaults for what a model may have in flight, under the provider's published queue limits.
    default_max_tokens_in_flight: ClassVar[int | None] = None
    max_requests_in_flight: ClassVar[int | None] = None
    # The provider's finish-reason words and the word llm_finish_reason shows for each, the same for
    # every provider: stop, length, content_filter, tool_call. The ledger keeps the provider's own
    # word (llm_batch_requests.finish_reason); a word not listed is shown as the provider wrote it.
    finish_reasons: ClassVar[dict[str, str]] = {}
    # How llm_output is asked of this API, and what its prompt caching is: said in the providers'
    # capability table (docs/providers/index.md, generated by ops/provider_table.py).
    structured_output: ClassVar[str] = "not stated"
    prompt_caching: ClassVar[str] = "not stated"

    # --- embeddings (llm_task = 'embed', embeddings.py) -------------------------------------------
    # The provider has an embeddings API: a model may embed its rows through it (others refuse the config).
    has_embeddings: ClassVar[bool] = False
    # The embedding models it knows, by model-name prefix (the longest matching prefix wins); a model not
    # listed needs llm_dimensions (its vectors' size), which is then only checked, never sent.
    embedding_models: ClassVar[dict[str, EmbeddingModel]] = {}
    # Packing: how many embedding inputs one request line may carry (an input array), and their estimated
    # tokens together. 1: one input per line.
    max_inputs_per_line: ClassVar[int] = 1
    max_tokens_per_line: ClassVar[int | None] = None

    # --- the provider's own config keys ------------------------------------------------------------
    # llm_* keys only this provider reads: each name to its declaration (a config_keys.Key: type,
    # default, doc, for docs/configuration.md) or, as before Keys existed, to its default alone;
    # parse_options validates them.
    config_keys: ClassVar[dict[str, Any]] = {}
    # Said when a model of this provider sets another provider's key (where this provider reads it instead).
    environment_hint: ClassVar[str | None] = None

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        """Validate this provider's own keys (`values` holds each of config_keys, defaults filled in);
        append one message per problem to `errors`; return the parsed values (ModelConfig.options)."""
        return dict(values)

    @classmethod
    def check_output_schema(cls, schema: dict, errors: list[str]) -> None:
        """Append why this provider's API would refuse the output `schema` (config.py's canonical
        JSON Schema of llm_output), naming the field and the rule: checked when the config is parsed,
        so a schema the provider cannot take is refused before any request is recorded or sent."""
        return  # a provider that takes any JSON Schema refuses nothing

    @classmethod
    def context_window(cls, model: str) -> int | None:
        """The model's context window in tokens, if known (the longest listed prefix of its name wins)."""
        matches = [(len(prefix), n) for prefix, n in cls.context_windows.items() if model.startswith(prefix)]
        return max(matches)[1] if matches else None

    @classmethod
    def price_key(cls, config: ModelConfig) -> tuple[str, str]:
        """The (provider, model) row of the price table that prices `config`'s requests: its own
        provider and model, unless the provider bills by something else (an Azure deployment's model,
        an OpenAI-compatible host's own prices)."""
        return config.provider, config.model

    @classmethod
    def default_max_tokens(cls, model: str) -> int | None:
        """Output tokens a request of `model` reserves when llm_max_tokens is not set (None: nothing)."""
        return cls.default_output_tokens

    @classmethod
    def embedding_model(cls, model: str) -> EmbeddingModel | None:
        matches = [(len(prefix), m) for prefix, m in cls.embedding_models.items() if model.startswith(prefix)]
        return max(matches, key=lambda x: x[0])[1] if matches else None

    @classmethod
    def embedding_size(cls, model: str, dimensions: int | None, errors: list[str]) -> int | None:
        """The size of `model`'s vectors given llm_dimensions (None: unset), or None with why in `errors`:
        a known model that cannot shorten its vectors refuses llm_dimensions, one that can takes at most
        its native size; an unknown model needs llm_dimensions."""
        known = cls.embedding_model(model) if isinstance(model, str) else None
        if known is None and isinstance(model, str) and cls.embedding_models and cls.context_window(model):
            # A chat model the provider lists (its context window): its embeddings endpoint would refuse
            # every request, found only at harvest. A model it does not know stays allowed (self-hosted).
            errors.append(
                f"llm_model {model!r} is a chat model of llm_provider {cls.name!r}, not an embedding model: "
                f"llm_task = 'embed' needs one, such as {', '.join(repr(m) for m in cls.embedding_models)}"
            )
            return None
        if known is None:
            if dimensions is None:
                errors.append(
                    f"llm_dimensions is required for llm_model {model!r} (llm_provider {cls.name!r} does not know "
                    "its vectors' size): set it to the size the model returns"
                )
            return dimensions
        if dimensions is None:
            return known.size
        if not known.shortenable:
            errors.append(
                f"llm_model {model!r} does not take llm_dimensions (its vectors always have {known.size} "
                "numbers): remove it, or use a model that can shorten them (text-embedding-3-small/-large)"
            )
            return None
        if dimensions > known.size:
            errors.append(f"llm_dimensions for {model!r} may be at most {known.size}, got {dimensions}")
            return None
        return dimensions

    def dimensions_param(self) -> int | None:
        """The `dimensions` to send: llm_dimensions for a known model that shortens its vectors, else None
        (an unknown model's llm_dimensions is its size, checked on each vector, not asked)."""
        known = self.embedding_model(self.config.model)
        return self.config.dimensions if known is not None and known.shortenable else None

    def __init__(self, config: ModelConfig):
        self.config = config
        # Retries of idempotent calls (poll, list, download, upload) share one budget per run.
        self.calls = CallBudget(config.retry_budget_seconds, owner=self)

    def check_credentials(self) -> None:
        """Raise a ConfigError naming the variable to set when the API key is missing."""
        if self.key_env_var and not os.environ.get(self.key_env_var):
            raise ConfigError(
                f"{self.key_env_var} is not set: export it in the shell that runs dbt "
                f"(never put the key in dbt config; dbt writes config into target/)"
            )

    def render_messages(self) -> list[dict]:
        """The few-shot examples as alternating user/assistant turns (the prompt follows them)."""
        turns = []
        for example_input, example_output in self.config.examples:
            turns += [{"role": "user", "content": example_input}, {"role": "assistant", "content": example_output}]
        return turns

    def prefix_tokens_estimate(self) -> int:
        """Rough size of the system + examples prefix (4 characters a token), for the cache warning."""
        text = (self.config.system or "") + "".join(a + b for a, b in self.config.examples)
        return len(text) // 4

    # --- the realtime path (urgent rows, exhausted batch attempts, providers without a batch API) ---

    @abstractmethod
    def realtime_body(self) -> dict:
        """The body of one realtime request, with PROMPT_MARK where the row's prompt goes."""

    def realtime_body_sql(self) -> str:
        return spliced_body_sql(self.realtime_body())

    @abstractmethod
    def realtime_transports(self) -> list:
        """Transports (providers/realtime_transport.py) to send realtime requests through."""

    def engine_load(self) -> EngineLoad | None:
        """What the server says of its own load (providers/engine_load.py), for llm_concurrency='auto';
        None: it says nothing (a hosted API). Blocking (HTTP): call it from a thread."""
        return None

    @abstractmethod
    def realtime_result_line(self, custom_id: str, status: int, text: str) -> str:
        """One realtime reply as a result line of this provider's format (its batch results' format, if
        it has a batch API), so that it is stored and settled exactly like a batch result."""

    # DuckDB json_transform structure of one result line: parsed once, then read as a STRUCT.
    result_structure: ClassVar[dict]

    @abstractmethod
    def outcomes_sql(self, r: str) -> str:
        """SELECT-list expressions (aliased as OUTCOME_COLUMNS) over `r`, one result line parsed
        with `result_structure`."""


class BatchProvider(Provider):
    """A provider with a batch API: request files are submitted as batches, polled and downloaded."""

    has_batch_api = True
    max_requests_per_batch: ClassVar[int]
    max_bytes_per_batch: ClassVar[int]
    # The fewest requests the provider accepts in one batch (Bedrock: 100). A file under it is never
    # submitted: its requests wait for more rows, or go realtime when under_minimum() says so.
    min_requests_per_batch: ClassVar[int] = 1
    under_minimum_hint: ClassVar[str] = ""  # said when requests wait for the minimum: how to send them now

    def under_minimum(self) -> str:
        """What a model's requests do when fewer than min_requests_per_batch would be sent: 'wait'
        (deferred until more rows come) or 'realtime' (sent now through the realtime path)."""
        return "wait"

    # What the provider does with a batch it did not finish (for the capability table).
    unfinished_batch: ClassVar[str] = "not stated"

    @classmethod
    def batch_limits(cls, config: ModelConfig) -> tuple[int, int]:
        """Requests and bytes one batch of `config` may hold (a provider whose limits depend on where it
        sends, an OpenAI-compatible host, says so per config)."""
        return cls.max_requests_per_batch, cls.max_bytes_per_batch

    @abstractmethod
    def request_line_sql(self) -> str:
        """A DuckDB expression over columns `custom_id` and `prompt` giving one JSONL request line."""

    def request_line_parts(self) -> tuple[str, str, str]:
        """A packed line's text before its custom_id, before its input array, and after (line_parts):
        asked only of a provider whose max_inputs_per_line is above 1 (pipeline/packing.py)."""
        raise NotImplementedError(f"{self.name} does not pack several inputs into one request line")

    # Submitting is two calls, so that the ledger knows which one failed or was interrupted: an
    # upload (idempotent; nothing is billed until a batch uses the file) and a `create` (not
    # idempotent: never retried, see submit.py).
    def upload(self, jsonl_path: str, token: str) -> str | None:
        """Upload the request file, named after `token`; returns its file id. None: the provider takes
        the requests inline with `create` (nothing to upload)."""
        return None

    @abstractmethod
    def create(self, jsonl_path: str, file_id: str | None, token: str, model_name: str) -> Submission:
        """Create one batch tagged with `token`, of the uploaded `file_id` (or of the file's lines)."""

    def submit(self, jsonl_path: str, token: str, model_name: str) -> Submission:
        """Upload the request file and create one batch tagged with `token` (both phases at once)."""
        return self.create(jsonl_path, self.upload(jsonl_path, token), token, model_name)

    def find_upload(self, token: str, since_epoch: float) -> str | None:
        """After a crash between the upload and the ledger write: the id of the file uploaded for this
        job (named after `token`), to delete it; None if there is none (or nothing is uploaded)."""
        return None

    @abstractmethod
    def find_submission(
        self, token: str, since_epoch: float, custom_ids: set[str], known_batch_ids: frozenset = frozenset()
    ) -> Submission | str | None:
        """After a crash between `create` and the ledger write: the batch created for this job
        (tagged with `token`, or holding exactly `custom_ids`; never one of `known_batch_ids`, which
        the ledger already gives to other jobs), None if no batch at the provider can be it, or
        UNRESOLVED while one that could be it has not ended (then nothing is resent)."""

    @abstractmethod
    def poll(self, batch_id: str) -> BatchState:
        """The batch's current state (one provider call)."""

    @abstractmethod
    def download_results(self, state: BatchState, batch_id: str, directory: str) -> list[tuple[str, str]]:
        """Write the batch's result lines to files in `directory`; returns [(source, path)]."""

    # Operator controls (operator.py). Not abstract: a provider without them says so when called.
    def cancel(self, batch_id: str) -> str:
        """Ask the provider to cancel the batch; returns its status word after the call."""
        raise NotImplementedError(f"{self.name} batches cannot be cancelled by dbt-llm-batch")

    def delete_files(self, batch_id: str, file_ids: list[str]) -> list[str]:
        """Delete what the provider keeps of an ended, harvested batch (uploaded input, result files);
        returns what was deleted. Something already gone counts as deleted."""
        return []
