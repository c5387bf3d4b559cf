"""Gemini API Batch Mode, through the official `google-genai` SDK (`client.batches`, `client.files`).

The SDK reads the key from GOOGLE_API_KEY or GEMINI_API_KEY (GOOGLE_API_KEY wins when both are set)
and the base URL from GOOGLE_GEMINI_BASE_URL, at run time; that is also how tests point it at the
sandbox. Behaviour follows the Gemini Batch API guide (ai.google.dev/gemini-api/docs/batch-api) and
the SDK's own sources (google-genai 3.6). What shapes this module:

- a batch is created from the requests inline (the whole create body under 20 MB) or from a JSONL
  file uploaded through the Files API, one `{"key": ..., "request": GenerateContentRequest}` per line;
  `llm_gemini_input` chooses, `auto` by size. The request file is written once, in the file's shape
  (request_line_sql); inline, each line becomes the SDK's InlinedRequest with the key as metadata;
- results come back as they went: inline responses in the job (`dest.inlined_responses`, each with
  the request's metadata) or a JSONL file of `{"key", "response"}` / `{"key", "error"}` lines. Both are
  stored as lines of the file's shape, so one `outcomes_sql` reads them (the ledger finds the
  request's id under `key`);
- a job carries no metadata, only a display name: it is the ledger's job id (`display_name`), which
  reconciliation lists back to adopt a job whose create answer was lost, never creating it twice;
- the SDK maps the wire's BATCH_STATE_* words to JOB_STATE_*; the ledger records the SDK's word;
- cost: `usageMetadata` (promptTokenCount includes cached tokens; thinking tokens are billed as output).
"""

from __future__ import annotations

import json
import os
from typing import Any

from dbt_llm_batch.config_keys import Key
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers.base import (
    CUSTOM_ID_MARK,
    PROMPT_MARK,
    REFUSED,
    REJECTED,
    BatchProvider,
    BatchState,
    Submission,
    json_object_text,
    spliced_line_sql,
)
from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.sql import literal

# The SDK's order: GOOGLE_API_KEY first, then GEMINI_API_KEY (google/genai/_api_client.get_env_api_key).
KEY_VARIABLES = ("GOOGLE_API_KEY", "GEMINI_API_KEY")
DISPLAY_PREFIX = "dbt_llm_batch-"
# "Inline requests ... keep the total request size under 20MB" (Batch API guide), read as decimal
# megabytes; room is kept for the create body's wrapper around the requests.
INLINE_MAX_BYTES = 20_000_000 - 64 * 1024
ENDED = ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED")
INPUT_CHOICES = ("auto", "inline", "file")
# Gemini's structured output (`responseJsonSchema`) takes a subset of JSON Schema (the structured-output
# guide lists type, format, title, description, enum, items, prefixItems, min/maxItems, minimum,
# maximum, anyOf, properties, additionalProperties, required, $ref/$defs): these keywords of the
# canonical schema are not among them.
UNSUPPORTED_KEYWORDS = ("pattern", "minLength", "maxLength", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# finishReason words that mean the model's answer was withheld: the same request would be withheld again.
WITHHELD = ("SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY", "LANGUAGE")


def display_name(token: str) -> str:
    """The job's (and its uploaded file's) display name: the ledger's job id, so a job whose create
    answer was lost is found again by listing, and a file left by an interrupted upload is deleted."""
    return DISPLAY_PREFIX + token


def gemini_schema(node: dict) -> dict:
    """The canonical schema as responseJsonSchema takes it: enum lists strings and numbers only, so a
    nullable enum says null in its type (`["string", "null"]`), not among its values."""
    out = dict(node)
    if "enum" in out and None in out["enum"]:
        out["enum"] = [v for v in out["enum"] if v is not None]
        declared = out.get("type", "string")
        types = declared if isinstance(declared, list) else [declared]
        out["type"] = types if "null" in types else [*types, "null"]
    if "properties" in out:
        out["properties"] = {name: gemini_schema(sub) for name, sub in out["properties"].items()}
    if "items" in out:
        out["items"] = gemini_schema(out["items"])
    if "anyOf" in out:
        out["anyOf"] = [gemini_schema(sub) for sub in out["anyOf"]]
    return out


class GeminiBatchProvider(BatchProvider):
    name = "gemini"
    key_env_var = "GEMINI_API_KEY"  # or GOOGLE_API_KEY, which the SDK prefers (check_credentials)
    # No per-batch request count is published; this keeps one job's results (polled inline, or one
    # file) a size a run downloads in one go.
    max_requests_per_batch = 100_000
    # "JSONL files up to 2 GB" (secondary sources; the Files API's per-file limit), decimal.
    max_bytes_per_batch = 2_000_000_000
    # Context windows by model-name prefix (Gemini models page: 1,048,576 input tokens for 2.x/3.x).
    context_windows = {"gemini-2.": 1_048_576, "gemini-3": 1_048_576}
    # What the capability table says (docs/providers/index.md; each is shown in docs/providers/gemini.md).
    structured_output = "JSON Schema in `responseJsonSchema` (Gemini's subset; others refused at parse)"
    prompt_caching = "Gemini's implicit caching of a shared prefix; cached tokens priced at the cache-read rate"
    unfinished_batch = (
        "expires (after about 48 h, unverified); finished requests are kept (and billed), the rest sent again;"
        " a failed job's rest after a back-off"
    )
    environment_hint = "Gemini reads GOOGLE_API_KEY or GEMINI_API_KEY and GOOGLE_GEMINI_BASE_URL from the environment"
    # `finishReason` of a candidate (Gemini API reference, Candidate.FinishReason).
    finish_reasons = {
        "STOP": "stop",
        "MAX_TOKENS": "length",
        "SAFETY": "content_filter",
        "RECITATION": "content_filter",
        "BLOCKLIST": "content_filter",
        "PROHIBITED_CONTENT": "content_filter",
        "SPII": "content_filter",
        "LANGUAGE": "content_filter",
        "MALFORMED_FUNCTION_CALL": "tool_call",
    }
    config_keys = {
        "llm_gemini_input": Key(
            "llm_gemini_input",
            "'auto' | 'inline' | 'file'",
            "auto",
            "how a Gemini batch takes its requests: inline in the create call (under 20 MB) or as a JSONL "
            "file through the Files API; `auto` sends a request file inline when it fits",
        )
    }

    @classmethod
    def parse_options(cls, values: dict[str, Any], errors: list[str]) -> dict[str, Any]:
        mode = values["llm_gemini_input"]
        if mode not in INPUT_CHOICES:
            errors.append(f"llm_gemini_input must be one of {list(INPUT_CHOICES)}, got {mode!r}")
            mode = "auto"
        return {"input": mode}

    @classmethod
    def check_output_schema(cls, schema: dict, errors: list[str]) -> None:
        def walk(node: dict, where: str) -> None:
            for keyword in UNSUPPORTED_KEYWORDS:
                if keyword in node:
                    errors.append(
                        f"{where or 'llm_output'}: Gemini structured output (responseJsonSchema) does not "
                        f"support '{keyword}': remove it (llm_provider 'gemini')"
                    )
            fmt = node.get("format")
            if fmt is not None and fmt not in ("date", "date-time", "time"):
                errors.append(
                    f"{where or 'llm_output'}: Gemini structured output supports the string formats date, "
                    f"date-time and time, not {fmt!r} (llm_provider 'gemini')"
                )
            for name, sub in node.get("properties", {}).items():
                walk(sub, f"{where}.{name}" if where else f"llm_output['{name}']")
            if "items" in node:
                walk(node["items"], f"{where}.items")

        walk(schema, "")

    def __init__(self, config):
        super().__init__(config)
        self._client = None
        self._inline_requests: dict[str, list] = {}  # token -> the InlinedRequests `upload` built for `create`

    def check_credentials(self) -> None:
        _genai()  # before anything is sent: the SDK is an optional extra
        if not any(os.environ.get(v) for v in KEY_VARIABLES):
            raise ConfigError(
                "neither GEMINI_API_KEY nor GOOGLE_API_KEY is set: export one in the shell that runs dbt "
                "(never put the key in dbt config; dbt writes config into target/)"
            )

    @property
    def client(self):
        if self._client is None:
            genai, types = _genai()
            # The SDK retries nothing unless asked (HttpOptions.retry_options unset): self.calls retries
            # idempotent calls inside the run's budget, and `create` is never retried (calls.py).
            self._client = genai.Client(http_options=types.HttpOptions(timeout=120_000))
        return self._client

    # --- requests ---------------------------------------------------------------------------------

    def request(self) -> dict:
        """One GenerateContentRequest (REST shape), with PROMPT_MARK where the row's prompt goes."""
        cfg = self.config
        turns = [
            {"role": "model" if m["role"] == "assistant" else "user", "parts": [{"text": m["content"]}]}
            for m in self.render_messages()
        ]
        request: dict = {"contents": [*turns, {"role": "user", "parts": [{"text": PROMPT_MARK}]}]}
        if cfg.system:
            request["systemInstruction"] = {"parts": [{"text": cfg.system}]}
        generation: dict = {}
        if cfg.max_tokens is not None:
            generation["maxOutputTokens"] = cfg.max_tokens
        if cfg.temperature is not None:
            generation["temperature"] = cfg.temperature
        schema = cfg.output_json_schema()
        if schema is not None:
            generation["responseMimeType"] = "application/json"
            generation["responseJsonSchema"] = gemini_schema(schema)
        generation.update(cfg.params)  # llm_params are generationConfig fields (topP, thinkingConfig, ...)
        if generation:
            request["generationConfig"] = generation
        return request

    def request_line_sql(self) -> str:
        return spliced_line_sql({"key": CUSTOM_ID_MARK, "request": self.request()})

    # Realtime is not offered yet (has_realtime False): config refuses llm_realtime_when and
    # llm_fallback for this provider, so these are never called by a run.
    has_realtime = False

    def realtime_body(self) -> dict:
        return self.request()

    def realtime_transports(self) -> list:
        raise NotImplementedError("llm_provider 'gemini' has no realtime path yet")

    def realtime_result_line(self, custom_id, status, text):
        body = json_object_text(text)
        if status == 200 and body:
            return f'{{"key":{json.dumps(custom_id)},"response":{body}}}'
        error = {"code": int(status), "message": f"HTTP {status}: {text[:500]}"}
        return json.dumps({"key": custom_id, "error": error})

    # --- submission -------------------------------------------------------------------------------

    def _inline(self, jsonl_path: str) -> bool:
        mode = self.config.options.get("input", "auto")
        return mode == "inline" or (mode == "auto" and os.path.getsize(jsonl_path) <= INLINE_MAX_BYTES)

    def upload(self, jsonl_path, token):
        if self._inline(jsonl_path):
            # The requests go inline with `create`. Built now, before any call: what the SDK's types
            # refuse (an llm_params field it does not know) fails this step, and nothing is sent.
            self._inline_requests[token] = self._read_inline(jsonl_path)
            return None

        def upload():  # safe to repeat: an unused file bills nothing
            return self.client.files.upload(
                file=jsonl_path, config={"display_name": display_name(token), "mime_type": "application/jsonl"}
            )

        return self.calls.call("upload the request file", upload).name

    def create(self, jsonl_path, file_id, token, model_name):
        src: Any = file_id
        if file_id is None:
            src = self._inline_requests.pop(token, None) or self._read_inline(jsonl_path)
        # Not idempotent: never retried (the SDK retries nothing here); a lost answer is reconciliation's.
        job = self.client.batches.create(model=self.config.model, src=src, config={"display_name": display_name(token)})
        return Submission(batch_id=job.name, status=_state(job), input_file_id=file_id)

    def _read_inline(self, jsonl_path: str) -> list:
        """Each line's request as the SDK's InlinedRequest, its key as metadata."""
        import pydantic

        _, types = _genai()

        try:
            with open(jsonl_path, encoding="utf-8") as f:
                return [_inlined_request(types, json.loads(line)) for line in f if line.strip()]
        except pydantic.ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(p) for p in problem["loc"])
            raise ConfigError(
                f"llm_params: the google-genai SDK refuses the Gemini request ({where}: {problem['msg']}); "
                f"llm_params of llm_provider 'gemini' are GenerationConfig fields, e.g. topP or thinkingConfig"
            ) from None

    def find_upload(self, token, since_epoch):
        wanted = display_name(token)

        def find():
            for f in self.client.files.list(config={"page_size": 100}):  # every page
                if f.display_name == wanted:
                    return f.name
            return None

        return self.calls.call("list files", find)

    def find_submission(self, token, since_epoch, custom_ids, known_batch_ids=frozenset()):
        """The job whose display name is this submission's job id (never one another ledger job owns)."""
        wanted = display_name(token)

        def find():
            for job in self.client.batches.list(config={"page_size": 100}):  # every page: no order relied on
                if job.display_name == wanted and job.name not in known_batch_ids:
                    return Submission(batch_id=job.name, status=_state(job))
            return None

        return self.calls.call("list batches", find)

    # --- harvest ----------------------------------------------------------------------------------

    def poll(self, batch_id):
        job = self.calls.call(f"poll batch {batch_id}", lambda: self.client.batches.get(name=batch_id))
        state = _state(job)
        error = None
        if state == "JOB_STATE_FAILED":
            said = job.error.message if job.error is not None and job.error.message else "no error given"
            error = f"batch {state} ({said})"
        dest = job.dest
        return BatchState(
            status=state,
            ended=state in ENDED,
            failed=state == "JOB_STATE_FAILED",
            error=error,
            output_file_id=dest.file_name if dest is not None else None,
        )

    def download_results(self, state, batch_id, directory):
        path = os.path.join(directory, f"{batch_id.replace('/', '_')}-output.jsonl")
        if state.output_file_id:
            file_name = state.output_file_id
            try:
                self.calls.call(
                    f"download results of {batch_id}",
                    lambda: self.client.files.download(file=file_name, destination=path),
                )
            except Exception as exc:
                if status_of(exc) not in (403, 404):
                    raise
                state.results_gone = True  # the responses file was deleted (files are kept 48 hours)
                return []
            return [("output", path)]
        # Inline responses live in the job: written as lines of the file's shape (key from metadata).
        job = self.calls.call(f"read results of {batch_id}", lambda: self.client.batches.get(name=batch_id))
        responses = (job.dest.inlined_responses if job.dest is not None else None) or []
        if not responses:
            return []
        with open(path, "w", encoding="utf-8") as f:
            for item in responses:
                f.write(json.dumps(_inline_result_line(item), ensure_ascii=False, separators=(",", ":")) + "\n")
        return [("output", path)]

    def cancel(self, batch_id):
        self.client.batches.cancel(name=batch_id)
        return _state(self.client.batches.get(name=batch_id))

    def delete_files(self, batch_id, file_ids):
        """The uploaded input and the responses file, then the job (which holds inline responses)."""
        deleted = []
        for file_id in file_ids:
            try:
                self.client.files.delete(name=file_id)
            except Exception as exc:
                if status_of(exc) not in (403, 404):
                    raise  # already gone (deleted before, or expired after 48 hours) counts as deleted
            deleted.append(file_id)
        try:
            self.client.batches.delete(name=batch_id)
        except Exception as exc:
            if status_of(exc) != 404:
                raise
        return [*deleted, batch_id]

    result_structure = {
        "key": "VARCHAR",
        "response": {
            "candidates": [
                {"content": {"parts": [{"text": "VARCHAR", "thought": "BOOLEAN"}]}, "finishReason": "VARCHAR"}
            ],
            "promptFeedback": {"blockReason": "VARCHAR"},
            "usageMetadata": {
                "promptTokenCount": "BIGINT",
                "candidatesTokenCount": "BIGINT",
                "thoughtsTokenCount": "BIGINT",
                "cachedContentTokenCount": "BIGINT",
                "toolUsePromptTokenCount": "BIGINT",
            },
        },
        "error": {"code": "INTEGER", "message": "VARCHAR", "status": "VARCHAR"},
    }

    def outcomes_sql(self, r):
        response, candidate = f"{r}.response", f"{r}.response.candidates[1]"
        usage = f"{response}.usageMetadata"
        finish = f"{candidate}.finishReason"
        # The answer is the candidate's text parts, thought summaries left out.
        answer = (
            f"array_to_string(list_transform(list_filter({candidate}.content.parts, "
            f"lambda p: not coalesce(p.thought, false)), lambda p: p.text), '')"
        )
        blocked = f"{response}.promptFeedback.blockReason"
        return f"""
            {r}.key as custom_id,
            case when {r}.error is not null or {blocked} is not null or {finish} in {_in(WITHHELD)} then 'error'
                 when {response} is not null and {candidate}.content.parts is not null then 'ok'
                 when {response} is not null then 'error'
                 else 'void' end as outcome,
            case when {r}.error is null and {finish} not in {_in(WITHHELD)} then {answer} end as answer,
            {finish} as finish_reason,
            coalesce({finish} = 'MAX_TOKENS', false) as truncated,
            coalesce({r}.error.message,
                     case when {blocked} is not null then 'prompt blocked (' || {blocked} || ')' end,
                     case when {finish} in {_in(WITHHELD)} then 'answer withheld (finish reason ' || {finish} || ')' end,
                     case when {response} is not null and {candidate}.content.parts is null
                          then 'no answer in the response (finish reason ' || coalesce({finish}, 'none') || ')' end)
                as error,
            -- promptTokenCount includes the cached tokens (and tool-use prompts are billed as input).
            case when {usage} is not null then coalesce({usage}.promptTokenCount, 0)
                 + coalesce({usage}.toolUsePromptTokenCount, 0) end as input_tokens,
            -- Thinking tokens are billed at the output rate.
            case when {usage} is not null then coalesce({usage}.candidatesTokenCount, 0)
                 + coalesce({usage}.thoughtsTokenCount, 0) end as output_tokens,
            {usage}.cachedContentTokenCount as cached_tokens,
            null::bigint as cache_write_tokens,
            -- A withheld answer or blocked prompt comes back the same; so does a request the API rejects
            -- (400 INVALID_ARGUMENT, 404 NOT_FOUND); 429 and 5xx are transient.
            case when {blocked} is not null or {finish} in {_in(WITHHELD)} then {literal(REFUSED)}
                 when {r}.error.code in (400, 404) then {literal(REJECTED)} end as not_retried,
            null::bigint as cache_write_1h_tokens"""


def _genai():
    """The google-genai SDK and its types module, which only this provider needs (the `gemini` extra)."""
    try:
        from google import genai
        from google.genai import types
    except ImportError:
        raise ConfigError(
            "llm_provider 'gemini' needs the google-genai SDK: pip install 'dbt-llm-batch[gemini]' in dbt's environment"
        ) from None
    return genai, types


def _in(words: tuple[str, ...]) -> str:
    return "(" + ", ".join(literal(w) for w in words) + ")"


def _state(job) -> str:
    """The job's state word as the SDK names it (JOB_STATE_*)."""
    state = job.state
    return getattr(state, "value", None) or str(state or "JOB_STATE_UNSPECIFIED")


def _inlined_request(types, line: dict):
    """A request-file line ({"key", "request"}) as the SDK's InlinedRequest: the REST request's
    generationConfig and systemInstruction become the SDK's config, the key the request's metadata."""
    request = line["request"]
    config = dict(request.get("generationConfig", {}))  # the SDK's types take the REST (camelCase) names too
    if "systemInstruction" in request:
        config["systemInstruction"] = request["systemInstruction"]
    return types.InlinedRequest.model_validate(
        {"contents": request["contents"], "metadata": {"key": line["key"]}, "config": config or None}
    )


def _inline_result_line(item) -> dict:
    """One InlinedResponse as a result-file line: {"key", "response"} or {"key", "error"}."""
    line: dict = {"key": (item.metadata or {}).get("key")}
    if item.error is not None:
        line["error"] = item.error.model_dump(mode="json", by_alias=True, exclude_none=True)
    if item.response is not None:
        line["response"] = item.response.model_dump(mode="json", by_alias=True, exclude_none=True)
    return line
