"""Writes to `llm_batch_results` (result lines, stored before any request changes status) and to
`llm_batch_models` (each model's identity as of its last run)."""

from __future__ import annotations

from dbt_llm_batch.ledger.base import LedgerBase, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL


class ResultWrites(LedgerBase):
    def store_result_files(self, downloads: str, paths: list[str]) -> None:
        """Inside the caller's transaction: store every line of the files `paths`, matched to their
        job and source through `downloads` (path, job_id, source). A line names its request's id
        `custom_id` (OpenAI, Anthropic) or `key` (Gemini Batch Mode)."""
        self.con.execute(
            f"""insert into {self.table("llm_batch_results")}
                select coalesce(r.json ->> 'custom_id', r.json ->> 'key'), ?, d.job_id, d.source, r.json, now()
                from read_ndjson_objects(?, filename = true) r join {downloads} d on d.path = r.filename""",
            [self.model, paths],
        )

    def store_lines(self, job_id: str, source: str, lines: str) -> None:
        """Store result lines (`lines`: a relation with custom_id, raw) of a job, in one transaction."""

        def store():
            with transaction(self.con):
                self.con.execute(
                    f"""insert into {self.table("llm_batch_results")}
                        select custom_id, ?, ?, ?, raw, now() from {lines}""",
                    [self.model, job_id, source],
                )

        retry_on_conflict(store)

    def store_lost_reply_failures(self, job_id: str, envelope: str) -> None:
        """A failure line (source 'realtime-lost') for each in-flight request of the job whose reply was
        lost after sending and that has no line yet. `envelope` is the SQL of its error envelope over
        the request's columns; the line carries it in both providers' error shapes at once."""
        requests, results = self.table("llm_batch_requests"), self.table("llm_batch_results")
        self.execute(
            f"""insert into {results}
                select custom_id, model, job_id, 'realtime-lost',
                       json_object('custom_id', custom_id, 'error', null,
                                   'response', json_object('status_code', 0, 'body', envelope),
                                   'result', json_object('type', 'errored', 'error', envelope)), now()
                from (select custom_id, model, job_id, {envelope} as envelope
                      from {requests} r
                      where job_id = ? and status in {IN_FLIGHT_SQL} and possibly_billed > 0
                        and not exists (select 1 from {results} l where l.job_id = r.job_id and l.custom_id = r.custom_id))""",
            [job_id],
        )

    def record_model_identity(self, key_columns: str, fingerprint_prefix: str) -> None:
        """This model's key columns and fingerprint prefix as of this run (identity.py)."""
        models = self.table("llm_batch_models")

        def write():
            with transaction(self.con):
                self.con.execute(f"delete from {models} where model = ?", [self.model])
                self.con.execute(
                    f"insert into {models} (model, key_columns, updated_at, fingerprint_prefix) values (?, ?, now(), ?)",
                    [self.model, key_columns, fingerprint_prefix],
                )

        retry_on_conflict(write)

    def merged_into(self) -> str | None:
        """The table this model's last merge wrote (NULL before ledger version 33, or before a merge)."""
        row = self.con.execute(
            f"select merged_into from {self.table('llm_batch_models')} where model = ?", [self.model]
        ).fetchall()
        return row[0][0] if row else None

    def record_merged_into(self, target: str) -> None:
        """This model's merge wrote `target` (its row answers' `emitted` marks say what `target` shows)."""
        self.execute(
            f"update {self.table('llm_batch_models')} set merged_into = ? where model = ?", [target, self.model]
        )

    def record_config_snapshot(self, snapshot: str) -> None:
        """The settle-relevant part of this model's config as of this run (config.settle_snapshot),
        for the poller; written only when it changed (its row exists: identity.prepare_ledger)."""
        self.execute(
            f"""update {self.table("llm_batch_models")} set config_snapshot = ?
                where model = ? and config_snapshot is distinct from ?""",
            [snapshot, self.model, snapshot],
        )
