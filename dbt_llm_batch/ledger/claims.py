"""Project-wide claims: what models running at the same time (dbt's threads) must not both take.

Two things are shared by every model of a ledger, where the model's lock (locks.py) guards nothing:
the project budget (var llm_batch_max_cost_usd) and, with llm_dedup = 'ledger', a request that two
models' rows ask. A run claims them here, before anything is uploaded:

- a *reservation*: the estimate of what the run is about to send, granted only if the requests in
  flight (every model's) plus the other live runs' reservations plus it stay within the budget.
  Recording the run's requests (Ledger.write_intents) turns the reserved amount into committed cost
  in the same transaction (`record_reserved`), so the sum other runs read never counts it twice;
- a *request claim*: the fingerprints the run is about to send; one that another live run claimed,
  or that another model has in flight or answered, is not sent again.

Why a claim cannot be granted twice. DuckDB runs transactions optimistically: two transactions that
each read a sum and insert a row of their own do not conflict (write skew), so both would pass. Every
claim therefore first updates the one row of llm_batch_claim_turn: of two concurrent claims DuckDB
fails the second's update ("Conflict on update"), and retry_on_conflict runs it again in a new
transaction, which sees the first's rows. Claims are serial. This covers several processes too:
DuckDB lets one process at a time open a database file for writing, so the runs that share a ledger
are threads of that one process (a second process cannot open the file; locks.lock_conflict_message).

A claim lasts as long as its run: it counts while its owner holds a model lock with a fresh heartbeat
and a living process (owners.is_live). ModelLock.release deletes the owner's claims when the run ends,
however it ends; a killed run's claims stop counting at once (same host) or when its heartbeat goes
stale, and the next claim removes them.
"""

from __future__ import annotations

from decimal import Decimal

from dbt_llm_batch.ledger.base import LedgerBase, retry_on_conflict, transaction
from dbt_llm_batch.ledger.owners import is_live
from dbt_llm_batch.ledger.status import IN_FLIGHT, IN_FLIGHT_SQL, RequestStatus, sql, sql_in
from dbt_llm_batch.sql import in_list


class ClaimWrites(LedgerBase):
    def _claim(self, step):
        """Run step() in one transaction serial with every other claim (see the module docstring), after
        removing the claims of runs that are no longer live."""

        assert self.owner is not None, "a claim belongs to a run holding its model's lock"
        self.claimed = True

        def once():
            with transaction(self.con):
                self.con.execute(f"update {self.table('llm_batch_claim_turn')} set turn = turn + 1")
                live = in_list(self._live_owners())
                for table in ("llm_batch_reservations", "llm_batch_request_claims"):
                    self.con.execute(f"delete from {self.table(table)} where owner not in {live}")
                return step()

        return retry_on_conflict(once)

    def _live_owners(self) -> list[str]:
        owners = self.con.execute(
            f"""select o.owner, epoch(now() - l.heartbeat_at)
                from (select owner from {self.table("llm_batch_reservations")}
                      union select owner from {self.table("llm_batch_request_claims")}) o
                     left join {self.table("llm_batch_locks")} l using (owner)"""
        ).fetchall()
        # This run's own owner always: the list is never empty (`not in (NULL)` would match nothing).
        return [self.owner or "", *(owner for owner, age in owners if owner != self.owner and is_live(owner, age))]

    def reserve_budget(self, estimate: Decimal, limit: Decimal) -> tuple[Decimal, Decimal] | None:
        """Reserve `estimate` of the project budget `limit` for this run (replacing what it reserved
        before), if the requests in flight of every model, the other live runs' reservations and it
        fit. Returns None when reserved, else (in flight, reserved by other runs): nothing is reserved.
        Needs the run's owner (`self.owner`, set when its model's lock is taken)."""
        reservations = self.table("llm_batch_reservations")

        def step():
            in_flight = self.con.execute(
                f"""select coalesce(sum(estimated_cost_usd), 0) from {self.table("llm_batch_requests")}
                    where status in {IN_FLIGHT_SQL}"""
            ).fetchall()[0][0]
            others = self.con.execute(
                f"select coalesce(sum(reserved_usd), 0) from {reservations} where owner <> ?", [self.owner]
            ).fetchall()[0][0]
            if in_flight + others + estimate > limit:
                return in_flight, others
            self.con.execute(f"delete from {reservations} where owner = ?", [self.owner])
            self.con.execute(f"insert into {reservations} values (?, ?, ?, now())", [self.owner, self.model, estimate])
            return None

        return self._claim(step)

    def claim_requests(self, planned: str, taken: str, urgent: str | None = None) -> None:
        """Claim the requests of `planned` (fingerprint, custom_id, route: the requests this run is
        about to send), except those another run claimed while it is live or another model has in
        flight or answered: those are written to the temp table `taken` (fingerprint, custom_id of the
        other model's request answering it, or NULL while it is only claimed; answered), and not
        claimed. `urgent` (fingerprints this run sends in realtime): another model's request still in a
        batch does not answer those, nor another run's claim of one for a batch (an urgent row follows
        its own model's llm_realtime_when): this run claims them too, and sends them at once."""
        claims, requests = self.table("llm_batch_request_claims"), self.table("llm_batch_requests")
        recorded = f"model <> $model and status in {sql_in((RequestStatus.SUCCEEDED, *IN_FLIGHT))}"
        claimed = "owner <> $owner"
        if urgent is not None:
            not_for_urgent = (
                f"coalesce(route, 'batch') <> 'realtime' and fingerprint in (select fingerprint from {urgent})"
            )
            recorded += f" and not (status in {sql_in(IN_FLIGHT)} and {not_for_urgent})"
            claimed += f" and not ({not_for_urgent})"

        def step():
            self.con.execute(
                f"""create or replace temp table {taken} as
                    select fingerprint, r.custom_id, coalesce(r.answered, false) as answered
                    from (select fingerprint from {claims}
                          where {claimed} and fingerprint in (select fingerprint from {planned})
                          union
                          select fingerprint from {requests}
                          where {recorded} and fingerprint in (select fingerprint from {planned})) c
                         left join (select fingerprint,
                                           arg_max(custom_id, (status = {sql(RequestStatus.SUCCEEDED)}, queued_at))
                                               as custom_id,
                                           bool_or(status = {sql(RequestStatus.SUCCEEDED)}) as answered
                                    from {requests}
                                    where {recorded} and fingerprint in (select fingerprint from {planned})
                                    group by fingerprint) r using (fingerprint)""",
                {"owner": self.owner, "model": self.model},
            )
            self.con.execute(
                f"delete from {claims} where owner = ? and fingerprint in (select fingerprint from {planned})",
                [self.owner],
            )
            self.con.execute(
                f"""insert into {claims} (fingerprint, custom_id, model, owner, claimed_at, route)
                    select fingerprint, custom_id, ?, ?, now(), route from {planned}
                    where fingerprint not in (select fingerprint from {taken})""",
                [self.model, self.owner],
            )

        self._claim(step)

    def release_claims(self) -> None:
        """The run ends: what it reserved and did not record, and its request claims, stop counting."""
        if not self.claimed:  # a run without a project budget or shared requests writes nothing here
            return
        self.claimed = False
        for table in ("llm_batch_reservations", "llm_batch_request_claims"):
            self.execute(f"delete from {self.table(table)} where owner = ?", [self.owner])


def record_reserved(con, reservations: str, owner: str | None, written: str) -> None:
    """In the transaction that records a run's requests (`written`): their estimated cost is committed
    in flight from now on, so it leaves the run's reservation (never below zero)."""
    if owner is None:
        return
    con.execute(
        f"""update {reservations}
            set reserved_usd = greatest(reserved_usd - (select coalesce(sum(estimated_cost_usd), 0) from {written}), 0)
            where owner = ?""",
        [owner],
    )
