"""Project-wide claims end with their run (ledger/claims.py): a reservation of the project budget
counts while its run holds its model's lock with a fresh heartbeat and a living process, and stops
counting when the run releases its lock, is killed, or stops heartbeating. In-memory DuckDB, no dbt."""

from __future__ import annotations

import os
import socket
from decimal import Decimal

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import ModelLock
from dbt_llm_batch.ledger.owners import new_owner

LIMIT = Decimal("0.0015")
ESTIMATE = Decimal("0.001")


def running(con, model: str, owner: str | None = None) -> tuple[Ledger, ModelLock]:
    """A model's run that took its lock (owner: this process's, unless given)."""
    ledger = Ledger(con, "main", model)
    ledger.migrate()
    lock = ModelLock(ledger, owner=owner)
    lock.acquire()
    return ledger, lock


def dead_pid() -> int:
    """A PID no process of this host has."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def reservations(con) -> list[tuple]:
    return con.execute("select model, reserved_usd from main.llm_batch_reservations order by model").fetchall()


def test_a_live_runs_reservation_counts_until_its_run_ends(memory_con):
    first, first_lock = running(memory_con, "main.a")
    second, _ = running(memory_con, "main.b")

    assert first.reserve_budget(ESTIMATE, LIMIT) is None
    assert second.reserve_budget(ESTIMATE, LIMIT) == (Decimal(0), ESTIMATE), "refused: 0 in flight, $0.001 reserved"
    assert reservations(memory_con) == [("main.a", ESTIMATE)]

    first_lock.release()
    assert reservations(memory_con) == []
    assert second.reserve_budget(ESTIMATE, LIMIT) is None


def test_a_killed_runs_reservation_stops_counting(memory_con):
    killed, _ = running(memory_con, "main.a", owner=f"{socket.gethostname()}:{dead_pid()}:deadbeef")
    assert killed.reserve_budget(ESTIMATE, LIMIT) is None

    live, _ = running(memory_con, "main.b")
    assert live.reserve_budget(ESTIMATE, LIMIT) is None
    assert reservations(memory_con) == [("main.b", ESTIMATE)], "the killed run's reservation was removed"


def test_a_reservation_whose_run_stopped_heartbeating_stops_counting(memory_con):
    silent, _ = running(memory_con, "main.a", owner=f"another-host:1:{new_owner()[-8:]}")
    assert silent.reserve_budget(ESTIMATE, LIMIT) is None
    live, _ = running(memory_con, "main.b")
    assert live.reserve_budget(ESTIMATE, LIMIT) is not None, "a fresh heartbeat on another host counts"

    memory_con.execute(
        "update main.llm_batch_locks set heartbeat_at = now() - interval 11 minutes where model = 'main.a'"
    )
    assert live.reserve_budget(ESTIMATE, LIMIT) is None


def test_recording_the_requests_turns_the_reservation_into_committed_cost(memory_con):
    ledger, _ = running(memory_con, "main.a")
    assert ledger.reserve_budget(ESTIMATE, LIMIT) is None
    memory_con.execute(
        f"""create temp table planned as
            select 'r_1' as custom_id, '["1"]' as key, 'f1' as fingerprint, 0 as seq, '{{}}' as row_json,
                   {ESTIMATE - Decimal("0.0004")}::decimal(18, 9) as estimated_cost_usd, 10 as estimated_input_tokens,
                   'batch' as route, 0 as line, 0::bigint as chunk, null::ubigint as prompt_hash"""
    )
    ledger.write_intents("openai", "gpt-test", "planned", [0])

    assert reservations(memory_con) == [("main.a", Decimal("0.0004"))]
    other, _ = running(memory_con, "main.b")
    # $0.0006 in flight and $0.0004 still reserved: $0.0005 more fits, $0.0006 does not.
    assert other.reserve_budget(Decimal("0.0006"), LIMIT) == (Decimal("0.0006"), Decimal("0.0004"))
    assert other.reserve_budget(Decimal("0.0005"), LIMIT) is None


def plan_of(con, fingerprints: list[str], model: str, realtime: tuple[str, ...] = ()) -> str:
    """A plan of `fingerprints`, those of `realtime` sent in realtime (urgent rows), the rest in a batch."""
    con.execute(
        """create or replace temp table planned as
           select unnest(?) as fingerprint, unnest(?) as custom_id, unnest(?) as route""",
        [
            fingerprints,
            [f"r_{model}_{f}" for f in fingerprints],
            ["realtime" if f in realtime else "batch" for f in fingerprints],
        ],
    )
    return "planned"


def taken(con) -> list[tuple]:
    return con.execute("select fingerprint, custom_id, answered from __taken order by 1").fetchall()


def test_a_request_claimed_by_a_live_run_is_taken_until_that_run_ends_or_dies(memory_con):
    first, first_lock = running(memory_con, "main.a")
    second, _ = running(memory_con, "main.b")
    first.claim_requests(plan_of(memory_con, ["f1", "f2"], "a"), "__taken")
    assert taken(memory_con) == []

    second.claim_requests(plan_of(memory_con, ["f2", "f3"], "b"), "__taken")
    assert taken(memory_con) == [("f2", None, False)], "claimed by a, not recorded yet: no request to point at"

    first_lock.release()
    second.claim_requests(plan_of(memory_con, ["f1", "f2"], "b"), "__taken")
    assert taken(memory_con) == [], "a's run ended: its claims with it"

    killed, _ = running(memory_con, "main.c", owner=f"{socket.gethostname()}:{dead_pid()}:deadbeef")
    killed.claim_requests(plan_of(memory_con, ["f9"], "c"), "__taken")
    second.claim_requests(plan_of(memory_con, ["f9"], "b"), "__taken")
    assert taken(memory_con) == [], "a killed run's claim does not count"


def test_an_urgent_request_is_not_taken_by_another_runs_claim_for_a_batch(memory_con):
    """Another run's claim of a request for its batch does not answer an urgent row (llm_realtime_when),
    as its recorded request in a batch does not; its claim of one it sends in realtime does."""
    first, _ = running(memory_con, "main.a")
    second, _ = running(memory_con, "main.b")
    first.claim_requests(plan_of(memory_con, ["f1", "f2"], "a", realtime=("f2",)), "__taken")
    urgent = "(select fingerprint from planned where route = 'realtime')"
    second.claim_requests(plan_of(memory_con, ["f1", "f2", "f3"], "b", realtime=("f1", "f2")), "__taken", urgent)
    assert taken(memory_con) == [("f2", None, False)], "f1 is b's to send at once; a sends f2 in realtime itself"
    second.claim_requests(plan_of(memory_con, ["f1"], "b"), "__taken", urgent)
    assert taken(memory_con) == [("f1", None, False)], "not urgent: a's batch answers it"


def test_a_request_another_model_recorded_is_taken_with_its_custom_id(memory_con):
    first, _ = running(memory_con, "main.a")
    memory_con.execute(
        """create temp table recorded as
           select 'r_a_f1' as custom_id, '["1"]' as key, 'f1' as fingerprint, 0 as seq, '{}' as row_json,
                  null::decimal(18, 9) as estimated_cost_usd, 10 as estimated_input_tokens, 'batch' as route,
                  0 as line, 0::bigint as chunk, null::ubigint as prompt_hash"""
    )
    first.write_intents("openai", "gpt-test", "recorded", [0])

    second, _ = running(memory_con, "main.b")
    second.claim_requests(plan_of(memory_con, ["f1", "f2"], "b"), "__taken")
    assert taken(memory_con) == [("f1", "r_a_f1", False)]
