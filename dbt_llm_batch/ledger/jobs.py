"""Writes to `llm_batch_jobs`: a job's way from intent to harvest (transition table: status.py).

Each method that changes a status names the statuses it may start from in its WHERE clause, so a
change the table does not allow changes nothing."""

from __future__ import annotations

import json

from dbt_llm_batch.ledger.base import LedgerBase
from dbt_llm_batch.ledger.status import PRE_SUBMISSION, JobStatus, sql, sql_in


class JobWrites(LedgerBase):
    def open_jobs(self) -> list[dict]:
        """Jobs of this model that may still yield results: intents and unharvested batches."""
        rows = self.con.execute(
            f"""select job_id, batch_id, status, provider, created_at, llm_model, provider_options
                from {self.table("llm_batch_jobs")}
                where model = ? and harvested_at is null and status <> {sql(JobStatus.VOIDED)}
                order by created_at""",
            [self.model],
        ).fetchall()
        names = ("job_id", "batch_id", "status", "provider", "created_at", "llm_model", "provider_options")
        return [dict(zip(names, r, strict=True)) for r in rows]

    def recorded_output_schemas(self, every_model: bool) -> list[dict]:
        """The distinct output schemas jobs were asked with (llm_batch_jobs.output_schema, recorded per
        job since ledger version 18): this model's, or with `every_model` (llm_dedup = 'ledger') any
        model's. Jobs are few, so this is one small query."""
        scope = "" if every_model else "where model = ?"
        recorded = self.con.execute(
            f"select distinct output_schema from {self.table('llm_batch_jobs')} {scope}",
            [] if every_model else [self.model],
        ).fetchall()
        schemas = [json.loads(text) if text else None for (text,) in recorded]
        return [schema for schema in schemas if isinstance(schema, dict)]

    def mark_uploading(self, job_id: str) -> None:
        """intent -> uploading: the request file's upload is about to be called (no batch can exist yet)."""
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set status = {sql(JobStatus.UPLOADING)}, updated_at = now()
                where job_id = ? and status = {sql(JobStatus.INTENT)}""",
            [job_id],
        )

    def mark_submitting(self, job_id: str, input_file_id: str | None) -> None:
        """uploading -> submitting: `create` is about to be called (from here the batch may exist)."""
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set status = {sql(JobStatus.SUBMITTING)}, input_file_id = ?,
                  updated_at = now() where job_id = ? and status = {sql(JobStatus.UPLOADING)}""",
            [input_file_id, job_id],
        )

    def record_submission(self, job_id: str, batch_id: str, input_file_id: str | None, status: str) -> None:
        """submitting -> the provider's word: the batch exists (created now, or adopted by reconciliation)."""
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set batch_id = ?, input_file_id = ?, status = ?,
                  submitted_at = now(), updated_at = now() where job_id = ? and status = {sql(JobStatus.SUBMITTING)}""",
            [batch_id, input_file_id, status, job_id],
        )

    def record_provider_status(self, job_id: str, status: str, **fields) -> None:
        """A submitted batch's latest provider status word (polled, or answered to a cancel), as is,
        with `fields` (e.g. who cancelled it)."""
        sets = "".join(f", {k} = ?" for k in fields)
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set status = ?{sets}, updated_at = now()
                where job_id = ? and batch_id is not null""",
            [status, *fields.values(), job_id],
        )

    def mark_job_voided(self, job_id: str, error: str | None = None, input_file_id: str | None = None) -> None:
        """A submission that made no batch (intent, uploading or submitting) -> voided; `error` and
        `input_file_id` (a file it uploaded) are recorded when given."""
        fields = {k: v for k, v in (("error", error), ("input_file_id", input_file_id)) if v is not None}
        sets = "".join(f", {k} = ?" for k in fields)
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set status = {sql(JobStatus.VOIDED)}{sets}, updated_at = now()
                where job_id = ? and status in {sql_in(PRE_SUBMISSION)}""",
            [*fields.values(), job_id],
        )

    def update_job(self, job_id: str, **fields) -> None:
        """Fields of a job other than its status (errors, provider file bookkeeping)."""
        if "status" in fields:
            raise ValueError("a job's status changes through the ledger's transition methods (ledger/status.py)")
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.execute(
            f"update {self.table('llm_batch_jobs')} set {sets}, updated_at = now() where job_id = ?",
            [*fields.values(), job_id],
        )

    def mark_harvested(self, ended: str) -> None:
        """Inside harvest's transaction: the jobs of `ended` (job_id, status, error, output_file_id,
        error_file_id) take their final provider word and are harvested."""
        self.con.execute(
            f"""update {self.table("llm_batch_jobs")} j set status = e.status, error = e.error,
                  output_file_id = e.output_file_id, error_file_id = e.error_file_id,
                  ended_at = coalesce(ended_at, now()), harvested_at = now(), updated_at = now()
                from {ended} e where j.job_id = e.job_id"""
        )
