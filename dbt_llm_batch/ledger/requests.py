"""Writes to `llm_batch_requests`: a request's way from plan to outcome (transition table: status.py).

Each method that changes a status names the statuses it may start from in its WHERE clause, so a
change the table does not allow changes nothing. Methods documented "inside a transaction" run on
the connection as is: their caller holds a transaction (and retries it as a whole)."""

from __future__ import annotations

import uuid

from dbt_llm_batch.errors import LedgerInvariantError
from dbt_llm_batch.ledger.base import LedgerBase, retry_on_conflict, transaction
from dbt_llm_batch.ledger.claims import record_reserved
from dbt_llm_batch.ledger.status import BLOCKS_REPLANNING, IN_FLIGHT_SQL, LIVE, JobStatus, RequestStatus, sql, sql_in
from dbt_llm_batch.sql import in_list, joins_as_written, list_literal, literal

R = RequestStatus
QUEUED, DEFERRED, FAILED, VOIDED = sql(R.QUEUED), sql(R.DEFERRED), sql(R.FAILED), sql(R.VOIDED)
# Appended to an error when an operator releases a request.
_RELEASED_NOTE = "'; released by ' || ? || ' at ' || strftime(now(), '%Y-%m-%d %H:%M:%S')"


class RequestWrites(LedgerBase):
    def _refuse_second_live_request(self) -> None:
        """Inside a transaction that wrote requests: raise (so it rolls back) if a custom_id of this
        model now has two live requests (status.LIVE): deferred and in a job, or in two jobs. Either
        would be sent, and billed, twice."""
        # Grouped by the custom_id's hash first (8 bytes a request, not a 40-character string: at ten
        # million requests the string grouping outgrew memory and grew 40x from a million); only the
        # requests whose hash is there twice (a second live request, or a hash collision) are then
        # grouped by custom_id itself, so the answer is exact.
        live = f"""from {self.table("llm_batch_requests")} where model = $model and status in {sql_in(LIVE)}"""
        twice = self.con.execute(
            f"""select custom_id {live}
                  and hash(custom_id) in (select hash(custom_id) as h {live} group by h having count(*) > 1)
                group by custom_id having count(*) > 1 order by custom_id limit 3""",
            {"model": self.model},
        ).fetchall()
        if twice:
            raise LedgerInvariantError(
                f"{self.model}: refused to record a second live request for {', '.join(r[0] for r in twice)} "
                "(it would be sent twice); nothing was written. This is a bug of dbt-llm-batch: please report it "
                "with the run's log"
            )

    # --- planning ---------------------------------------------------------------------------

    def write_intents(
        self,
        provider: str,
        llm_model: str,
        plan_rows: str,
        chunks: list[int],
        status: str = JobStatus.INTENT,
        members: str | None = None,
        output_schema: str | None = None,
        per_row_variant: bool = False,
        answer_rows: str | None = None,
        provider_options: str | None = None,
    ) -> dict[int, str]:
        """Record one job intent per chunk and every request ('queued') in one transaction, before the
        provider is contacted; returns {chunk: job id}. `plan_rows` has each request's `chunk` and
        its `line` in the chunk's request file (NULL when there is no file: realtime), and its row's
        `prompt_hash` (plan.build_desired; NULL for a deferred one). `status` is the
        jobs' first status: JobStatus.INTENT, or JobStatus.REALTIME for the realtime path. Each request
        answers its own key, and the rows of `members` (key, fingerprint, custom_id, row_json, prompt_hash: the other
        rows asking the same request) whose request is among them: their row answers are written in the
        same transaction. `output_schema`: the llm_output schema the requests are asked with
        (output_schema.recorded), recorded on each job, as `provider_options` (the provider's own keys
        the requests are sent with, as JSON: pool.recorded_options) is. `per_row_variant`: the requests (and `members`)
        carry their evaluation variant in a `variant` column (a batch holding several variants'
        requests, pipeline/variants.py), instead of all being this ledger's `variant`; the job records
        its variants, comma-separated. `answer_rows`: the same requests without prompt and row (no
        join with the input), which is all the row answers read; `plan_rows` when not given.

        A crash after this point leaves a trace reconciliation can follow, and nothing is ever sent
        that the ledger does not know about. One transaction for the whole plan also lets DuckDB
        write large plans straight to the database file instead of through its log.
        """
        if status not in (JobStatus.INTENT, JobStatus.REALTIME):
            raise ValueError(f"a job starts as {JobStatus.INTENT} or {JobStatus.REALTIME}, not {status}")
        job_ids = {chunk: "job_" + uuid.uuid4().hex for chunk in chunks}
        # {chunk: job id} as a relation in the statements (a few rows: one per request file)
        chunk_list, job_id_list = list_literal(map(str, job_ids)), list_literal(job_ids.values())
        mapping = f"(select unnest({chunk_list})::bigint as chunk, unnest({job_id_list}) as job_id)"
        requests = self.table("llm_batch_requests")

        # `plan_rows` (a join of the plan, the input and the files) is read for the requests (their
        # rows) and the row answers (their prompt_hash); the other statements read the requests
        # written (their job ids are new).
        written = f"(select * from {requests} where job_id in (select job_id from {mapping}) and status = {QUEUED})"

        # Each row's variant: its own column, or this ledger's (the parameter after the model's).
        variant = "p.variant" if per_row_variant else "?"
        member_variant = "x.variant" if per_row_variant else "?"
        job_variant = "string_agg(distinct variant, ',' order by variant)" if per_row_variant else "?"
        own = [] if per_row_variant else [self.variant]

        def write():
            with transaction(self.con):
                deferred = self.con.execute(
                    f"select count(*) from {requests} where model = ? and status = {DEFERRED}", [self.model]
                ).fetchall()[0][0]
                with joins_as_written(self.con):  # the model's rows stream through (plan.plan_rows)
                    self.con.execute(
                        f"""insert into {requests} (custom_id, model, key, fingerprint, seq, job_id, status,
                              row_json, queued_at, estimated_cost_usd, estimated_input_tokens, route, file_line, variant)
                            select p.custom_id, ?, p.key, p.fingerprint, p.seq, m.job_id, {QUEUED}, p.row_json, now(),
                                   p.estimated_cost_usd, p.estimated_input_tokens, p.route, p.line, {variant}
                            from {plan_rows} p join {mapping} m using (chunk)""",
                        [self.model, *own],
                    )
                self.con.execute(
                    f"""insert into {self.table("llm_batch_jobs")} (job_id, model, provider, llm_model,
                          status, request_count, created_at, updated_at, variant, output_schema, provider_options)
                        select job_id, ?, ?, ?, ?, count(*), now(), now(), {job_variant}, ?, ?
                        from {written} group by job_id""",
                    [self.model, provider, llm_model, status, *own, output_schema, provider_options],
                )
                record_reserved(self.con, self.table("llm_batch_reservations"), self.owner, written)
                if deferred:  # a deferred request being sent now becomes a queued one
                    self.con.execute(
                        f"""delete from {requests} where model = ? and status = {DEFERRED} and custom_id in
                            (select custom_id from {written})""",
                        [self.model],
                    )
                answers = self.table("llm_batch_row_answers")
                self.con.execute(
                    f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, created_at, prompt_hash)
                        select ?, p.key, {variant}, p.fingerprint, p.custom_id, false, now(), p.prompt_hash
                        from {answer_rows or plan_rows} p join {mapping} m using (chunk)""",
                    [self.model, *own],
                )
                if members is not None:
                    self.con.execute(
                        f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, created_at, row_json,
                              prompt_hash)
                            select ?, x.key, {member_variant}, x.fingerprint, x.custom_id, false, now(), x.row_json,
                                   x.prompt_hash
                            from {members} x semi join (select custom_id from {written}) p using (custom_id)""",
                        [self.model, *own],
                    )
                self._refuse_second_live_request()

        retry_on_conflict(write)
        return job_ids

    def map_rows(self, members: str) -> int:
        """Row answers for rows whose request exists already (`members`: key, fingerprint, custom_id,
        reused, row_json, prompt_hash): answered (reused) or in flight; returns how many. No request is written.

        Whether a row is reused is read again here, from the request's status when the row answer is
        written, not taken from the plan: with llm_dedup = 'ledger' another model's run (another dbt
        thread) may harvest and merge the request between this run's plan and this write. That run split
        the cost among the rows mapped before it harvested; a row mapped after must cost $0, or the rows'
        costs would add up to more than was billed."""
        requests = self.table("llm_batch_requests")
        return self.count(
            f"""insert into {self.table("llm_batch_row_answers")}
                  (model, key, variant, fingerprint, custom_id, reused, created_at, row_json, prompt_hash)
                select ?, m.key, ?, m.fingerprint, m.custom_id, m.reused or coalesce(r.answered, false), now(),
                       m.row_json, m.prompt_hash
                from {members} m
                     left join (select custom_id, bool_or(status = {sql(R.SUCCEEDED)}) as answered from {requests}
                                where custom_id in (select custom_id from {members}) group by custom_id) r
                     using (custom_id)""",
            [self.model, self.variant],
        )

    def unmap_superseded(self, desired: str) -> int:
        """With llm_dedup: remove this model's row answers, for the keys of `desired` (key, fingerprint:
        the rows selected now), that point at a shared request (one answering several rows, of this
        model or others) still in flight for a fingerprint the key no longer asks (its prompt or config
        changed, e.g. another llm_provider, before the answer came); returns how many. A request's cost
        is split among the rows it answers when it is harvested: a row that stopped asking it would take
        a share that leaves the rows still asking it costing less than was billed. The request stays:
        harvested and costed, and a row asking it again is mapped to it again (plan.build_plan). A
        request answering one row only keeps it: that row shows its answer until the new one is final,
        as without llm_dedup."""
        answers, requests = self.table("llm_batch_row_answers"), self.table("llm_batch_requests")
        # Nothing in flight (a run with nothing new, usually): no join of every selected row with every
        # row answer to find none.
        if not self.con.execute(f"select exists (select 1 from {requests} where status in {IN_FLIGHT_SQL})").fetchall()[
            0
        ][0]:
            return 0
        return self.count(
            f"""delete from {answers} a using {desired} d
                where a.model = ? and a.variant = ? and a.key = d.key and a.fingerprint <> d.fingerprint
                  and a.custom_id in (select custom_id from {answers}
                                      where custom_id in (select custom_id from {requests} where status in {IN_FLIGHT_SQL})
                                      group by custom_id having count(*) > 1)""",
            [self.model, self.variant],
        )

    def remember_prompt_hashes(self, desired: str) -> int:
        """Store the prompt_hash of `desired`'s rows (key, fingerprint, prompt_hash, fingerprint_stored:
        plan.build_desired) on this model's row answers of the same key and fingerprint that lack it or
        have another (an earlier ledger, or a DuckDB that hashes differently); returns how many. Only
        the rows whose fingerprint was computed with md5 are looked at: the others matched already."""
        return self.count(
            f"""update {self.table("llm_batch_row_answers")} a set prompt_hash = d.prompt_hash
                from (select key, fingerprint, prompt_hash from {desired} where not fingerprint_stored) d
                where a.model = ? and a.key = d.key and a.fingerprint = d.fingerprint
                  and a.prompt_hash is distinct from d.prompt_hash""",
            [self.model],
        )

    def defer(self, plan_rows: str | None) -> None:
        """Replace this model's deferred requests with `plan_rows`, the plan's requests not sent (None:
        none): over an in-flight cap, they wait here (with their row) for a later run, which sends them
        even if it no longer selects them. Deferred requests superseded by this run's plan are dropped."""

        def write():
            with transaction(self.con):
                self.con.execute(
                    f"delete from {self.table('llm_batch_requests')} where model = ? and status = {DEFERRED} and variant = ?",
                    [self.model, self.variant],
                )
                if plan_rows is None:
                    return
                self.con.execute(
                    f"""insert into {self.table("llm_batch_requests")} (custom_id, model, key, fingerprint, seq,
                          status, row_json, queued_at, estimated_cost_usd, estimated_input_tokens, variant)
                        select custom_id, ?, key, fingerprint, seq, {DEFERRED}, row_json, now(), estimated_cost_usd,
                               estimated_input_tokens, ?
                        from {plan_rows}""",
                    [self.model, self.variant],
                )
                self._refuse_second_live_request()

        retry_on_conflict(write)

    def drop_deferred_of_removed_variants(self, variants: list[str]) -> dict[str, int]:
        """Deferred requests of evaluation variants the model no longer has (`variants`: the stored
        names it has, '' the default): never sent, so dropped (nothing was paid, no row of theirs is
        shown). Returns how many per removed variant, for the run to say once: once dropped, no run
        sees them again."""

        def write() -> dict[str, int]:
            with transaction(self.con):
                dropped = self.con.execute(
                    f"""delete from {self.table("llm_batch_requests")}
                        where model = ? and status = {DEFERRED} and variant not in {in_list(variants)}
                        returning variant""",
                    [self.model],
                ).fetchall()
            counts: dict[str, int] = {}
            for (variant,) in dropped:
                counts[variant] = counts.get(variant, 0) + 1
            return counts

        return retry_on_conflict(write)

    def return_to_deferred(self, job_ids: list[str]) -> None:
        """Jobs whose intents were written but whose upload was never attempted (an earlier chunk's
        submission failed): their requests wait as deferred again (without row answers), and the intents go."""

        def write():
            with transaction(self.con):
                for job_id in job_ids:
                    # A deferred request answers no row yet: its row answers are written again when it is sent.
                    self.con.execute(
                        f"""delete from {self.table("llm_batch_row_answers")} where custom_id in
                            (select custom_id from {self.table("llm_batch_requests")} where job_id = ? and status = {QUEUED})""",
                        [job_id],
                    )
                    self.con.execute(
                        f"""update {self.table("llm_batch_requests")} set status = {DEFERRED}, job_id = null
                                         where job_id = ? and status = {QUEUED}""",
                        [job_id],
                    )
                    self.con.execute(
                        f"delete from {self.table('llm_batch_jobs')} where job_id = ? and status = ?",
                        [job_id, JobStatus.INTENT],
                    )

        retry_on_conflict(write)

    def record_never_sent(self, rows: str, only_without_live_request: bool) -> int:
        """Record a final failure, never sent, for each row of `rows` (an SQL relation with key,
        fingerprint, error and row_json), once per key, fingerprint and
        variant: not if the ledger has a request for them already (this variant's, or one a row answer
        of this variant points at: a request shared by identical variants), or with
        `only_without_live_request`, not if it has one never sent or answered, in flight or held.
        Returns how many were recorded."""
        requests = self.table("llm_batch_requests")
        answers = self.table("llm_batch_row_answers")
        existing = "true"
        if only_without_live_request:
            existing = f"(r.job_id is null or r.status in {sql_in(BLOCKS_REPLANNING)})"
        # Two variants asking the same thing (identical configs) have the same fingerprint: the other
        # variant's failure answers none of this variant's rows, so each records its own.
        existing += f""" and (r.variant = $variant or exists (select 1 from {answers} a
                                                             where a.model = $model and a.variant = $variant
                                                               and a.key = u.key and a.custom_id = r.custom_id))"""
        # The default variant's ids are those of earlier versions; another variant's carry its name.
        variant_part = "" if not self.variant else f" || {literal(self.variant)}"
        new_ids = f"""(select custom_id from {requests} where model = ? and starts_with(custom_id, 'x_')
                       and custom_id not in (select custom_id from {answers} where model = ?))"""

        def write():
            with transaction(self.con):
                n = self.con.execute(
                    f"""insert into {requests} (custom_id, model, key, fingerprint, seq, status, is_final, error,
                          row_json, queued_at, completed_at, variant)
                        select 'x_' || substr(sha256($model || u.key || u.fingerprint{variant_part}), 1, 40), $model,
                               u.key, u.fingerprint, 0, {FAILED}, true, u.error, u.row_json, now(), now(), $variant
                        from {rows} u
                        where not exists (select 1 from {requests} r
                                          where r.model = $model and r.key = u.key and r.fingerprint = u.fingerprint
                                            and {existing})""",
                    {"model": self.model, "variant": self.variant},
                ).fetchall()[0][0]
                if n:  # a row that failed without a request answers itself with that failure
                    self.con.execute(
                        f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, created_at)
                            select model, key, variant, fingerprint, custom_id, false, now() from {requests}
                            where custom_id in {new_ids}""",
                        [self.model, self.model],
                    )
                return n

        return retry_on_conflict(write)

    def fail_deferred_without_field(self, selected_keys: str, path: str, field: str) -> int:
        """Deferred requests of keys not in `selected_keys` (a relation with `key`) whose stored row
        lacks `path` (the prompt column `field`) fail, final: they can never be sent."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} set status = {FAILED}, is_final = true, completed_at = now(),
                  error = 'waited over an in-flight cap, but its stored row has no prompt column ' || ? ||
                          ' (the model''s prompt column changed); nothing was sent'
                where model = ? and status = {DEFERRED} and variant = ? and key not in (select key from {selected_keys})
                  and json_extract_string(row_json, ?) is null""",
            [field, self.model, self.variant, path],
        )

    def finalize_exhausted(self, max_attempts: int) -> None:
        """Failures that reached the current llm_max_attempts are final (the limit may have been
        lowered since they were harvested); without this such a key would be neither sent nor merged."""
        requests = self.table("llm_batch_requests")
        self.execute(
            f"""update {requests} r set is_final = true
                from (select key, fingerprint from {requests} where model = ? and status = {FAILED}
                      group by key, fingerprint having count(*) >= ?) x
                where r.model = ? and r.status = {FAILED} and not r.is_final
                  and r.key = x.key and r.fingerprint = x.fingerprint""",
            [self.model, max_attempts, self.model],
        )

    # --- identity ---------------------------------------------------------------------------

    def rename_fingerprints(self, renames: str, params: list) -> int:
        """Give this model's requests and row answers whose fingerprint is `legacy` the new
        `fingerprint`, per key (`renames`: an SQL relation with key, fingerprint, legacy; `params` its
        parameters); returns how many of both it renamed."""

        def write():
            with transaction(self.con):
                answers = self.con.execute(
                    f"""update {self.table("llm_batch_row_answers")} r set fingerprint = d.fingerprint
                        from {renames} d
                        where r.model = ? and r.key = d.key and r.fingerprint = d.legacy""",
                    [*params, self.model],
                ).fetchall()[0][0]
                requests = self.con.execute(
                    f"""update {self.table("llm_batch_requests")} r set fingerprint = d.fingerprint
                        from {renames} d
                        where r.model = ? and r.key = d.key and r.fingerprint = d.legacy""",
                    [*params, self.model],
                ).fetchall()[0][0]
                return answers + requests

        return retry_on_conflict(write)

    def rekey(self, rekeys: str, aside_model: str, row_rekeys: str | None = None) -> None:
        """Give this model's requests the key `rekeys` (custom_id, new_key) maps them to; those mapped to
        NULL match no selected row: never sent (deferred) ones go, the rest are kept aside under
        `aside_model` (harvested and costed, never merged). Their row answers follow them; row answers
        with a row of their own take the key `row_rekeys` (custom_id, old_key, new_key) gives them, and
        go when it gives none (the request stays: a row asking its prompt is mapped to it again)."""
        con, requests = self.con, self.table("llm_batch_requests")
        answers = self.table("llm_batch_row_answers")

        def write():
            with transaction(con):
                # Row answers first, while they still match their request's old key: those of the
                # request's own row follow it; the others carry their own row (`row_rekeys`).
                con.execute(
                    f"""update {answers} a set key = k.new_key from {rekeys} k, {requests} r
                        where a.model = ? and a.row_json is null and a.custom_id = k.custom_id
                          and r.custom_id = k.custom_id and a.key = r.key and k.new_key is not null""",
                    [self.model],
                )
                if row_rekeys is not None:
                    con.execute(
                        f"""update {answers} a set key = k.new_key from {row_rekeys} k
                            where a.model = ? and a.custom_id = k.custom_id and a.key = k.old_key
                              and a.row_json is not null and k.new_key is not null""",
                        [self.model],
                    )
                    con.execute(
                        f"""delete from {answers} a using {row_rekeys} k
                            where a.model = ? and a.custom_id = k.custom_id and a.key = k.old_key
                              and a.row_json is not null and k.new_key is null""",
                        [self.model],
                    )
                con.execute(
                    f"""update {answers} a set model = ? from {rekeys} k, {requests} r
                        where a.model = ? and a.row_json is null and a.custom_id = k.custom_id
                          and r.custom_id = k.custom_id and a.key = r.key and k.new_key is null""",
                    [aside_model, self.model],
                )
                con.execute(
                    f"""update {requests} r set key = k.new_key from {rekeys} k
                                where r.model = ? and r.custom_id = k.custom_id and k.new_key is not null""",
                    [self.model],
                )
                con.execute(
                    f"""delete from {requests} where model = ? and status = {DEFERRED} and custom_id in
                                (select custom_id from {rekeys} where new_key is null)""",
                    [self.model],
                )
                con.execute(
                    f"""update {requests} set model = ? where model = ? and custom_id in
                                (select custom_id from {rekeys} where new_key is null)""",
                    [aside_model, self.model],
                )

        retry_on_conflict(write)

    def take_back(self, taken: str) -> None:
        """Give this model the requests kept aside that `taken` (custom_id, new_key, model: the name
        they were kept under) maps to one of its keys, and their own rows' row answers, not merged
        yet under that key (identity._take_back_aside)."""
        con, requests = self.con, self.table("llm_batch_requests")
        answers = self.table("llm_batch_row_answers")

        def write():
            with transaction(con):
                con.execute(
                    f"""update {answers} a set model = ?, key = t.new_key, emitted = null from {taken} t, {requests} r
                        where a.model = t.model and a.custom_id = t.custom_id and a.row_json is null
                          and r.custom_id = t.custom_id and a.key = r.key""",
                    [self.model],
                )
                con.execute(
                    f"""update {requests} r set model = ?, key = t.new_key from {taken} t
                        where r.model = t.model and r.custom_id = t.custom_id""",
                    [self.model],
                )

        retry_on_conflict(write)

    # --- merge --------------------------------------------------------------------------------

    def mark_emitted(self, emitted: str, scope: str, in_scope: int | None = None) -> None:
        """Inside the merge's transaction: row answers with a final request within `scope` (an SQL
        condition) are 'merged' if `emitted` (a relation with key and custom_id, each of its rows one
        row answer in scope) holds them, else 'superseded'. Two columns matched, not a (key, custom_id)
        struct: about a sixth faster at 10M rows. `in_scope`: how many row answers of this model
        `scope` holds, when the caller knows (counted here otherwise)."""
        answers = self.table("llm_batch_row_answers")
        if in_scope is None:
            in_scope = self.con.execute(
                f"select count(*) from {answers} where model = ? and ({scope})", [self.model]
            ).fetchall()[0][0]
        shown = self.con.execute(f"select count(*) from {emitted}").fetchall()[0][0]
        # Nothing in scope (a run with nothing new): skip the join with every final request.
        if not in_scope:
            return
        # Each row of `emitted` is one row answer in scope: as many as in scope means every one in scope
        # is shown (a first harvest), so none is superseded, and both joins are skipped (they were a
        # sixteenth of a 10M-row harvest, and grew faster than its rows).
        if in_scope == shown:
            self.con.execute(f"update {answers} set emitted = 'merged' where model = ? and ({scope})", [self.model])
            return
        self.con.execute(
            f"""update {answers} a
                set emitted = case when exists (select 1 from {emitted} e where e.key = a.key and e.custom_id = a.custom_id)
                                   then 'merged' else 'superseded' end
                where model = ? and ({scope}) and custom_id in
                      (select custom_id from {self.table("llm_batch_requests")} where is_final)""",
            [self.model],
        )

    # --- harvest ------------------------------------------------------------------------------

    def settle_outcomes(self, outcomes: str, max_attempts: int, cost: str, vectors: bool) -> int:
        """Inside harvest's transaction: each queued request of `outcomes` (outcomes.settle's
        outcomes table: lines, matched here to their job's request) takes its outcome: succeeded,
        failed, or voided (the provider settled nothing for it). `cost` is SQL assigning the cost
        columns (ending with a comma), or ''. With `vectors` (an embedding model's outcomes), each
        takes its vector too. Returns how many requests it settled."""
        # Only an embedding model's harvest writes `vector`: DuckDB updates a row whose LIST column is
        # set by deleting and inserting the whole row, which made a chat model's settle and its
        # commit cost about twice as much for a column that stays NULL.
        vector = "vector = o.vector," if vectors else ""
        return self.con.execute(
            f"""update {self.table("llm_batch_requests")} r set
                  status = case when o.outcome = 'void' then {VOIDED}
                                when o.outcome = 'ok' and o.problem is null then {sql(R.SUCCEEDED)} else {FAILED} end,
                  is_final = case when o.outcome = 'void' then false
                                  when o.outcome = 'ok' and o.problem is null then true
                                  when o.permanent then true
                                  else o.earlier_failures + 1 >= ? end,
                  error = case when o.outcome = 'ok' then o.problem
                               when o.permanent then coalesce(o.error, 'failed') || ' (' || o.not_retried || ')'
                               else o.error end,
                  failure_kind = case when o.permanent then 'deterministic' end,
                  finish_reason = o.finish_reason, answer = o.answer, {vector}
                  input_tokens = o.input_tokens, output_tokens = o.output_tokens, cached_tokens = o.cached_tokens,
                  cache_write_tokens = o.cache_write_tokens, cache_write_1h_tokens = o.cache_write_1h_tokens, {cost}
                  completed_at = now()
                from {outcomes} o where r.custom_id = o.custom_id and r.job_id = o.job_id and r.status = {QUEUED}""",
            [max_attempts],
        ).fetchall()[0][0]

    def fail_named_lines(self, line_errors: str, note: str) -> None:
        """Inside harvest's transaction: fail the queued requests whose lines validation named
        (`line_errors`: job_id, line, message), with its message and `note`: final at once."""
        requests = self.table("llm_batch_requests")
        self.con.execute(
            f"""update {requests} r set status = {FAILED}, completed_at = now(), is_final = true,
                  failure_kind = 'deterministic', error = x.message || ' (' || ? || ')'
                from (select n.custom_id, n.job_id, e.message
                      from (select custom_id, job_id,
                                   -- ledgers before version 9 wrote request files in custom_id order
                                   coalesce(file_line, row_number() over (partition by job_id order by custom_id)) as line
                            from {requests} where job_id in (select job_id from {line_errors})) n
                      join {line_errors} e using (job_id, line)) x
                where r.custom_id = x.custom_id and r.job_id = x.job_id and r.status = {QUEUED}""",
            [note],
        )

    def settle_plain_failures(self, failures: str, params: list, priced: bool) -> None:
        """Inside harvest's transaction: each queued request of `failures` (custom_id, job_id, give_up,
        not_before, error; `params` its parameters) of a batch that failed naming no request is voided
        (to be resubmitted after `not_before`), or with `give_up` failed and final. Unbilled: with
        `priced`, cost $0."""
        self.con.execute(
            f"""update {self.table("llm_batch_requests")} r set completed_at = now(),
                  status = case when f.give_up then {FAILED} else {VOIDED} end,
                  is_final = f.give_up,
                  failure_kind = case when f.give_up then 'gave_up' else 'batch_failed' end,
                  not_before = f.not_before, error = f.error
                  {", cost_usd = 0, realtime_cost_usd = 0" if priced else ""}
                from {failures} f where r.custom_id = f.custom_id and r.job_id = f.job_id and r.status = {QUEUED}""",
            params,
        )

    def spread_run_costs(self, ended: str) -> None:
        """Inside harvest's transaction: a job's cost as a whole (`ended`.run_cost_usd: a Ray job's GPU
        time) is shared evenly by the requests it answered (succeeded or failed with a line), on top of
        their token cost; its unanswered requests, sent again in another job, bear none of it."""
        requests, answered = self.table("llm_batch_requests"), f"({sql(R.SUCCEEDED)}, {FAILED})"
        by_a_line = "coalesce(q.failure_kind, '') not in ('gave_up', 'batch_failed')"  # not failed by the job's end
        self.con.execute(
            f"""update {requests} r set cost_usd = coalesce(r.cost_usd, 0) + s.share,
                  uncached_cost_usd = coalesce(r.uncached_cost_usd, 0) + s.share
                from (select q.job_id, cast(any_value(e.run_cost_usd) / count(*) as decimal(18, 9)) as share  -- the cost columns' type
                      from {requests} q join {ended} e using (job_id)
                      where e.run_cost_usd is not null and q.status in {answered} and {by_a_line} group by q.job_id) s
                where r.job_id = s.job_id and r.status in {answered} and {by_a_line.replace("q.", "r.")}"""
        )

    def void_unanswered(self, ended: str, priced: bool) -> None:
        """Inside harvest's transaction: queued requests of the jobs of `ended` (job_id, status, error,
        void_reason, backoff_seconds) that the batch ended without settling go back to the queue
        without using up an attempt (after the back-off, if any). Unbilled: with `priced`, cost $0."""
        self.con.execute(
            f"""update {self.table("llm_batch_requests")} r set status = {VOIDED}, completed_at = now(),
                  not_before = now() + to_seconds(e.backoff_seconds),
                  error = coalesce(e.void_reason, e.error,
                                   'batch ended (' || e.status || ') without a result for this request')
                  {", cost_usd = 0, realtime_cost_usd = 0" if priced else ""}
                from {ended} e where r.job_id = e.job_id and r.status in {IN_FLIGHT_SQL}"""
        )

    def void_job(self, job_id: str, reason: str) -> None:
        """The job produced no per-request outcome: its unresolved requests go back to the queue
        without using up an attempt."""
        self.execute(
            f"""update {self.table("llm_batch_requests")} set status = {VOIDED}, error = ?, completed_at = now()
                where job_id = ? and status in {IN_FLIGHT_SQL}""",
            [reason, job_id],
        )

    def count_lost_reply(self, custom_id: str, job_id: str) -> None:
        """One more send of this realtime request whose reply was lost (possibly billed), committed now."""
        self.execute(
            f"""update {self.table("llm_batch_requests")} set possibly_billed = coalesce(possibly_billed, 0) + 1
                where custom_id = ? and job_id = ?""",
            [custom_id, job_id],
        )

    # --- operator -----------------------------------------------------------------------------

    def hold_cancelled(self) -> int:
        """Voided requests of this model's operator-cancelled, harvested batches are held (until
        `release` or a new fingerprint). Returns how many."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} r set status = {sql(R.HELD)},
                  error = 'batch ' || j.batch_id || ' was cancelled by ' || j.cancelled_by || ' at '
                          || strftime(j.cancel_requested_at, '%Y-%m-%d %H:%M:%S') || ' before answering; held until '
                          || '`dbt-llm-batch release` or a change of prompt or config'
                from {self.table("llm_batch_jobs")} j
                where r.job_id = j.job_id and j.model = ? and j.cancel_requested_at is not null
                  and j.harvested_at is not null and r.status = {VOIDED}""",
            [self.model],
        )

    def release_held(self, who: str) -> int:
        """held -> released (planned again without using an attempt); returns how many."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} set status = {sql(R.RELEASED)}, error = error || {_RELEASED_NOTE}
                where model = ? and status = {sql(R.HELD)}""",
            [who, self.model],
        )

    def release_interrupted(self, job_id: str, who: str) -> int:
        """The in-flight requests of an interrupted submission (no batch id) -> released; returns how many."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} set status = {sql(R.RELEASED)},
                  error = 'its submission ' || job_id || ' was interrupted, never matched to a provider batch'
                          || {_RELEASED_NOTE}
                where job_id = ? and status in {IN_FLIGHT_SQL}""",
            [who, job_id],
        )

    def release_orphans(self, who: str) -> int:
        """In-flight requests of this model whose job row is missing -> released; returns how many."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} set status = {sql(R.RELEASED)},
                  error = 'its job ' || job_id || ' is missing from llm_batch_jobs' || {_RELEASED_NOTE}
                where model = ? and status in {IN_FLIGHT_SQL}
                  and job_id not in (select job_id from {self.table("llm_batch_jobs")})""",
            [who, self.model],
        )

    def requeue_failed(self) -> int:
        """This model's failed requests that were sent -> requeued (they stop counting as attempts)."""
        return self.count(
            f"""update {self.table("llm_batch_requests")} set status = {sql(R.REQUEUED)}, is_final = false
                where model = ? and status = {FAILED} and job_id is not null""",
            [self.model],
        )
