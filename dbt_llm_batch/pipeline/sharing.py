"""Shared requests under dbt's threads (llm_dedup = 'ledger'): a request that several models' rows
ask is sent once per project run, also when those models run in parallel.

The plan (plan.build_plan) leaves out a request another model has answered or in flight, but two
models planning at the same time see neither's request yet. So, before anything is written or sent,
the plan's requests are claimed in the ledger (Ledger.claim_requests, serial with every other claim:
ledger/claims.py); of two runs planning one request, the second finds the first's claim:

- if the first model's request is recorded (in flight or answered), this model's rows point at it, as
  they would have had the plan seen it (members of that request, plan.build_plan's `reuse`);
- if it is only claimed (the first run has not recorded it yet), this run claims again until it is
  recorded (the first run records its requests before it uploads anything, seconds after its claim)
  and then points its rows at it, so they are pending in this model from this run on. If the first
  run has not recorded it within RECORD_WAIT_SECONDS, the request leaves this plan and its rows wait:
  the next run finds the first model's request and points them at it. If the first run ends without
  sending it (refused, say), its claim ends with it and this run plans it after all.
"""

from __future__ import annotations

import time

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline.scratch import Scratch

PLAN, MEMBERS, TAKEN = Scratch.plan, Scratch.plan_members, Scratch.taken
# How long a run waits for another run to record the requests it claimed, asking again every
# CLAIM_RETRY_SECONDS. The other run records them once its request files are written: seconds.
RECORD_WAIT_SECONDS = 30.0
CLAIM_RETRY_SECONDS = 0.25


def claim_shared(ledger: Ledger) -> int:
    """Claim the plan's requests; take out of the plan (Scratch.plan, Scratch.plan_members) those another
    run sends. Returns how many requests wait for another model's run to record them."""
    con = ledger.con
    # The selected rows' requests. A deferred one (an earlier run's, row_id NULL) is left as the plan has
    # it: the plan does not share those with other models either, and leaving it out would drop it.
    # A request sent in realtime (an urgent row) is not answered by another model's batch in flight.
    deadline = time.monotonic() + RECORD_WAIT_SECONDS
    while True:
        ledger.claim_requests(
            f"(select fingerprint, custom_id, route from {PLAN} where row_id is not null)",
            TAKEN,
            urgent=f"(select fingerprint from {PLAN} where route = 'realtime')",
        )
        unrecorded = con.execute(f"select count(*) from {TAKEN} where custom_id is null").fetchall()[0][0]
        if not unrecorded or time.monotonic() >= deadline:
            break
        time.sleep(CLAIM_RETRY_SECONDS)
    if not con.execute(f"select count(*) > 0 from {TAKEN}").fetchall()[0][0]:
        con.execute(f"drop table {TAKEN}")
        return 0
    # Recorded by another model: the request's first row and its duplicates become its members.
    con.execute(
        f"""insert into {MEMBERS}
            select p.row_id, p.key, p.fingerprint, t.custom_id, t.answered, false, p.prompt_hash
            from {PLAN} p join {TAKEN} t using (fingerprint)
            where t.custom_id is not null and p.row_id is not null"""
    )
    con.execute(
        f"""update {MEMBERS} m set custom_id = t.custom_id, reused = t.answered, duplicate = false
            from {TAKEN} t where m.fingerprint = t.fingerprint and m.duplicate and t.custom_id is not null"""
    )
    # Only claimed: its rows wait for a later run.
    con.execute(
        f"""delete from {MEMBERS}
            where duplicate and fingerprint in (select fingerprint from {TAKEN} where custom_id is null)"""
    )
    waiting = unrecorded
    con.execute(f"delete from {PLAN} where row_id is not null and fingerprint in (select fingerprint from {TAKEN})")
    con.execute(f"drop table {TAKEN}")
    if waiting:
        log.info(
            f"{ledger.model}: {waiting} request(s) are being sent by another model running now "
            f"(llm_dedup = 'ledger') that did not record them within {RECORD_WAIT_SECONDS:.0f} s, so they are not "
            "sent again: their rows are answered from that model's request by a later run"
        )
    return waiting
