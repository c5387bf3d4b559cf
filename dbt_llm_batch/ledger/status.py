"""The ledger's state machine: every status a request or a job row can have, and which changes are
allowed. The ledger package (requests.py, jobs.py, results.py) is the only code that writes these
words; the rest of the package reads them through the constants and SQL lists below, never as
literals.

Requests (`llm_batch_requests.status`). "new" means the row is inserted with that status, "deleted"
that the row is deleted. One row is one attempt: once it is succeeded, released or requeued it never
changes again (voided only becomes held); the planner plans a new row (seq + 1) for its key.

    from      to         who / when                                  why
    --------  ---------  ------------------------------------------  --------------------------------------
    new       deferred   Ledger.defer (after planning)               over an in-flight cap: waits, unsent
    new       queued     Ledger.write_intents (before any upload)    about to be sent (batch or realtime)
    new       failed     Ledger.record_never_sent (planning)         empty / too long / not UTF-8: final
    deferred  queued     Ledger.write_intents (deleted, re-inserted) a later run sends it
    deferred  failed     Ledger.fail_deferred_without_field          its stored row lost the prompt column
    deferred  deleted    Ledger.defer, Ledger.rekey                  superseded by a new plan / key change
    queued    deferred   Ledger.return_to_deferred                   its chunk was never uploaded
    queued    succeeded  Ledger.settle_outcomes (harvest)            an answer that passed the checks
    queued    failed     Ledger.settle_outcomes, fail_named_lines,   an error line, an unusable answer, a
                         settle_plain_failures (harvest)             line validation named, gave up
    queued    voided     Ledger.void_job (submission refused or      no outcome of its own: planned again
                         never made), settle_outcomes,               without using an attempt (maybe after
                         void_unanswered, settle_plain_failures      `not_before`)
    queued    released   Ledger.release_interrupted, release_orphans operator `release`: sent again
    voided    held       Ledger.hold_cancelled (after harvest)       its batch was cancelled by an operator
    held      released   Ledger.release_held                         operator `release`: sent again
    failed    requeued   Ledger.requeue_failed                       operator `requeue`: fresh attempts
    failed    failed     Ledger.finalize_exhausted (is_final only)   llm_max_attempts was lowered

`queued` is the only in-flight status (IN_FLIGHT): whether its job reached the provider is the job's
`batch_id`. Ledgers before schema version 13 also wrote `submitted` for the same state; migration 13
rewrites it to `queued` (LEGACY_REQUEST_STATUSES). `succeeded` and `failed` are outcomes (an attempt
used; `is_final` says whether the key is done); `voided` and `released` are planned again without
using an attempt, and `requeued` failures stop counting as attempts; `held` is not planned again
until `release` or a new fingerprint.

Jobs (`llm_batch_jobs.status`). A job row records two kinds of word: the ledger's own (before a batch
id is known, for the realtime path, and for a harvest that found no batch), and, once the provider
has the batch, the provider's own status word exactly as the provider's API returns it (OpenAI Batch
API `status`, Anthropic Message Batches `processing_status`): the ledger does not translate them, so
`llm_batch_in_flight` and operators see what the provider's console shows. PROVIDER_JOB_STATUSES
lists the words the providers' docs define; the ledger records a new word as is rather than fail a
run on it, and the provider moves its batch between its own words as it likes (the ledger only
records the latest word polled).

    from        to           who / when                              why
    ----------  -----------  --------------------------------------  ---------------------------------
    new         intent       Ledger.write_intents (batch path)       before the provider is contacted
    new         realtime     Ledger.write_intents (realtime path)    sent request by request in the run
    intent      uploading    Ledger.mark_uploading                   the request file's upload is called
    uploading   submitting   Ledger.mark_submitting                  `create` is called
    submitting  <provider>   Ledger.record_submission                `create` answered, or reconciliation
                                                                     adopted the batch it made
    intent      voided       Ledger.mark_job_voided                  never reached the provider
    uploading   voided       Ledger.mark_job_voided                  upload refused / interrupted
    submitting  voided       Ledger.mark_job_voided                  refused, or no batch is it, or
                                                                     operator `release`
    intent      deleted      Ledger.return_to_deferred               its chunk was never attempted
    <provider>  <provider>   Ledger.record_provider_status           polled, or an operator `cancel`
    <provider>  <provider>,  Ledger.mark_harvested                   the batch ended: harvested (also
                gone                                                 `gone`: the provider no longer has it)
    realtime    completed,   Ledger.mark_harvested                   the realtime job ends (`interrupted`:
                interrupted                                          the run sending it died)

`voided` jobs never yield results; `intent`, `uploading` and `submitting` are the interrupted
submissions reconciliation looks at (PRE_SUBMISSION).
"""

from __future__ import annotations

from typing import Final

from dbt_llm_batch.sql import in_list, literal


class RequestStatus:
    """The words of `llm_batch_requests.status`."""

    DEFERRED: Final = "deferred"
    QUEUED: Final = "queued"
    SUCCEEDED: Final = "succeeded"
    FAILED: Final = "failed"
    VOIDED: Final = "voided"
    HELD: Final = "held"
    RELEASED: Final = "released"
    REQUEUED: Final = "requeued"


class JobStatus:
    """The ledger's own words of `llm_batch_jobs.status` (the provider's words: PROVIDER_JOB_STATUSES)."""

    INTENT: Final = "intent"
    UPLOADING: Final = "uploading"
    SUBMITTING: Final = "submitting"
    REALTIME: Final = "realtime"
    VOIDED: Final = "voided"
    # A batch the provider no longer knows, taken as ended without results (harvest._poll).
    GONE: Final = "gone"
    # The realtime job's end: all sent (COMPLETED, the OpenAI word, also used for Anthropic realtime
    # jobs), or its run died (INTERRUPTED).
    COMPLETED: Final = "completed"
    INTERRUPTED: Final = "interrupted"


R, J = RequestStatus, JobStatus

REQUEST_STATUSES: Final = frozenset(
    {R.DEFERRED, R.QUEUED, R.SUCCEEDED, R.FAILED, R.VOIDED, R.HELD, R.RELEASED, R.REQUEUED}
)
# Ledgers before schema version 13 wrote these; migration 13 rewrites them.
LEGACY_REQUEST_STATUSES: Final = {"submitted": R.QUEUED}

# In flight: sent, or about to be; no outcome yet.
IN_FLIGHT: Final = (R.QUEUED,)
# Statuses that keep a key's (key, fingerprint) from being planned again: an answer, a request in
# flight, an operator's hold.
BLOCKS_REPLANNING: Final = (R.QUEUED, R.SUCCEEDED, R.HELD)
# Live: a request that is, or may still become, billed: waiting to be sent, in a job, or held by an
# operator. The ledger refuses a second live request for one custom_id (requests.py): a request is
# deferred or in a job, never both, and never in two jobs.
LIVE: Final = (R.DEFERRED, R.QUEUED, R.HELD)
# An outcome: an attempt was used.
OUTCOMES: Final = (R.SUCCEEDED, R.FAILED)

# Provider batch status words, as their APIs return them (OpenAI Batch API `status`; Anthropic
# Message Batches `processing_status`; Ray Jobs' job status).
OPENAI_JOB_STATUSES: Final = frozenset(
    {"validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"}
)
ANTHROPIC_JOB_STATUSES: Final = frozenset({"in_progress", "canceling", "ended"})
RAY_JOB_STATUSES: Final = frozenset(
    {"PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"}
)  # ray.job_submission.JobStatus
PROVIDER_JOB_STATUSES: Final = OPENAI_JOB_STATUSES | ANTHROPIC_JOB_STATUSES | RAY_JOB_STATUSES

LEDGER_JOB_STATUSES: Final = frozenset(
    {J.INTENT, J.UPLOADING, J.SUBMITTING, J.REALTIME, J.VOIDED, J.GONE, J.COMPLETED, J.INTERRUPTED}
)
JOB_STATUSES: Final = LEDGER_JOB_STATUSES | PROVIDER_JOB_STATUSES
# A submission whose batch id is not known yet (reconciliation, operator `release`).
PRE_SUBMISSION: Final = (J.INTENT, J.UPLOADING, J.SUBMITTING)

# "new" (inserted) and "gone" (deleted) are the ends of a row's life, not statuses.
NEW, DELETED = "<new>", "<deleted>"

REQUEST_TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    NEW: frozenset({R.DEFERRED, R.QUEUED, R.FAILED}),
    R.DEFERRED: frozenset({R.QUEUED, R.FAILED, DELETED}),
    R.QUEUED: frozenset({R.DEFERRED, R.SUCCEEDED, R.FAILED, R.VOIDED, R.RELEASED}),
    R.VOIDED: frozenset({R.HELD}),
    R.HELD: frozenset({R.RELEASED}),
    R.FAILED: frozenset({R.REQUEUED, R.FAILED}),
    R.SUCCEEDED: frozenset(),
    R.RELEASED: frozenset(),
    R.REQUEUED: frozenset(),
}

# "<provider>" stands for any word of PROVIDER_JOB_STATUSES (the provider's own state machine).
PROVIDER: Final = "<provider>"
JOB_TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    NEW: frozenset({J.INTENT, J.REALTIME}),
    J.INTENT: frozenset({J.UPLOADING, J.VOIDED, DELETED}),
    J.UPLOADING: frozenset({J.SUBMITTING, J.VOIDED}),
    J.SUBMITTING: frozenset({PROVIDER, J.VOIDED}),
    PROVIDER: frozenset({PROVIDER, J.GONE}),
    J.REALTIME: frozenset({J.COMPLETED, J.INTERRUPTED}),
    J.VOIDED: frozenset(),
    J.GONE: frozenset(),
    J.INTERRUPTED: frozenset(),
}


def job_state(status: str) -> str:
    """The transition table's name for a job status: a provider word is PROVIDER (COMPLETED is both
    the realtime job's end and an OpenAI word: it is terminal either way)."""
    return PROVIDER if status in PROVIDER_JOB_STATUSES else status


def request_transition_allowed(old: str, new: str) -> bool:
    return new in REQUEST_TRANSITIONS.get(old, frozenset())


def job_transition_allowed(old: str, new: str) -> bool:
    # `completed` is both a ledger word (the realtime job's end) and a provider word: try both readings.
    return any(n in JOB_TRANSITIONS.get(o, frozenset()) for o in {old, job_state(old)} for n in {new, job_state(new)})


def sql(status: str) -> str:
    """A status as an SQL literal."""
    return literal(status)


def sql_in(statuses) -> str:
    """Statuses as an SQL IN-list: `status in {sql_in(IN_FLIGHT)}`."""
    return in_list(sorted(statuses))


IN_FLIGHT_SQL: Final = sql_in(IN_FLIGHT)
