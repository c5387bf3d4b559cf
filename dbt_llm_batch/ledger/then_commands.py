"""Writes to `llm_batch_then_commands`: `dbt-llm-batch poll --then` commands owed, per model.

A then-command (ops/then_command.py) rebuilds the models whose results a poll stored. A poll with
`--then` records each such model here as owed when it stores the results, before the command runs,
so that a poll stopped before the command exits (cron's timeout, a reboot, `--wait` cut short) leaves
it owed too; a command that fails (non-zero exit) leaves it owed with its exit code. The next poll
with `--then` runs it again for the owed models even if that poll stores nothing new; a run that
succeeds settles every row it ran for. One row per model and streak: a model that fails again keeps
its row (attempts + 1, the last command, exit code and time), so the table says per model what is
owed and since when; a row whose command never failed (attempts 0) is deleted once it succeeds.
"""

from __future__ import annotations

from dbt_llm_batch.ledger.base import LedgerBase, retry_on_conflict, transaction


class ThenCommandWrites(LedgerBase):
    def owed_then_commands(self, model: str | None = None) -> list[dict]:
        """The models owed a then-command: their last one failed or did not finish (attempts 0: results
        stored, no command exited since), and none succeeded since; all, or those matching `model` (a
        dbt name or schema.name), oldest failure first."""
        rows = self.con.execute(
            f"""select model, dbt_name, command, exit_code, failed_at, attempts
                from {self.table("llm_batch_then_commands")}
                where succeeded_at is null {"and (model = ? or model like ?)" if model else ""}
                order by first_failed_at nulls last, model""",
            [model, "%." + model] if model else [],
        ).fetchall()
        names = ("model", "dbt_name", "command", "exit_code", "failed_at", "attempts")
        return [dict(zip(names, r, strict=True)) for r in rows]

    def record_then_owed(self, models: dict[str, str]) -> None:
        """A poll with --then stored new results for `models` ({ledger name: dbt name} of this schema):
        each is owed a then-command until one succeeds (a model already owed keeps its row)."""
        table = self.table("llm_batch_then_commands")

        def write():
            with transaction(self.con):
                for model, dbt_name in models.items():
                    self.con.execute(
                        f"""insert into {table} (model, dbt_name, attempts)
                            select ?, ?, 0
                            where not exists (select 1 from {table} where model = ? and succeeded_at is null)""",
                        [model, dbt_name, model],
                    )

        retry_on_conflict(write)

    def record_then_failed(self, models: dict[str, str], command: str, exit_code: int) -> None:
        """The then-command `command` (as run) exited with `exit_code` for `models` ({ledger name: dbt name}
        of this schema): each model is owed a run (a row it already has gets this attempt)."""
        table = self.table("llm_batch_then_commands")

        def write():
            with transaction(self.con):
                for model, dbt_name in models.items():
                    self.con.execute(
                        f"""update {table} set command = ?, exit_code = ?, failed_at = now(), attempts = attempts + 1,
                                   dbt_name = ?, first_failed_at = coalesce(first_failed_at, now())
                            where model = ? and succeeded_at is null""",
                        [command, exit_code, dbt_name, model],
                    )
                    self.con.execute(
                        f"""insert into {table} (model, dbt_name, command, exit_code, first_failed_at, failed_at, attempts)
                            select ?, ?, ?, ?, now(), now(), 1
                            where not exists (select 1 from {table} where model = ? and succeeded_at is null)""",
                        [model, dbt_name, command, exit_code, model],
                    )

        retry_on_conflict(write)

    def record_then_succeeded(self, models: list[str]) -> None:
        """A then-command ran for `models` (ledger names of this schema) and exited 0: nothing is owed them.
        A streak of failures keeps its row (with when it ended); an owed row that never failed is dropped."""
        table = self.table("llm_batch_then_commands")

        def write():
            with transaction(self.con):
                self.con.execute(
                    f"""delete from {table} where succeeded_at is null and attempts = 0
                        and model in (select unnest(?))""",
                    [models],
                )
                self.con.execute(
                    f"""update {table} set succeeded_at = now()
                        where succeeded_at is null and model in (select unnest(?))""",
                    [models],
                )

        retry_on_conflict(write)
