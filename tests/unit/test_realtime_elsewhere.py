"""A run waits for another model's realtime answers its rows share (pipeline/shared.py,
wait_for_realtime_elsewhere: llm_dedup = 'ledger' under dbt's threads) only while there is something to
wait for: until they are answered, the other model's run ends, or the deadline passes. In-memory DuckDB,
no dbt; the end-to-end case is tests/test_threads.py's two urgent models."""

from __future__ import annotations

import threading
import time

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import ModelLock
from dbt_llm_batch.pipeline import shared


def sending_and_sharing(con) -> tuple[Ledger, ModelLock]:
    """main.other's run (its lock held) is sending request r1 in realtime; main.ours's row 1 shares it."""
    ours, other = Ledger(con, "main", "main.ours"), Ledger(con, "main", "main.other")
    ours.migrate()
    other_lock = ModelLock(other)
    other_lock.acquire()
    con.execute("insert into main.llm_batch_jobs (job_id, model, status) values ('j1', 'main.other', 'realtime')")
    con.execute(
        """insert into main.llm_batch_requests (custom_id, model, key, job_id, status, is_final)
           values ('r1', 'main.other', '[1]', 'j1', 'queued', false)"""
    )
    con.execute(
        """insert into main.llm_batch_row_answers (model, variant, key, custom_id)
           values ('main.ours', '', '[1]', 'r1')"""
    )
    return ours, other_lock


def test_it_waits_until_the_shared_request_is_answered(memory_con):
    ours, _ = sending_and_sharing(memory_con)
    cursor = memory_con.cursor()

    def answer():
        time.sleep(0.6)
        cursor.execute("update main.llm_batch_requests set status = 'succeeded', is_final = true")

    answering = threading.Thread(target=answer)
    answering.start()
    waiting, seconds = shared.wait_for_realtime_elsewhere(ours, time.monotonic() + 30)
    answering.join()
    assert waiting == 0 and 0.5 <= seconds < 10, (waiting, seconds)


def test_it_gives_up_at_the_deadline(memory_con):
    ours, _ = sending_and_sharing(memory_con)
    waiting, seconds = shared.wait_for_realtime_elsewhere(ours, time.monotonic() + 0.5)
    assert waiting == 1 and seconds >= 0.5, (waiting, seconds)


def test_it_does_not_wait_once_the_other_run_ended(memory_con):
    # The other run ended (its lock released) with its request still unanswered: it waits for a later run.
    ours, other_lock = sending_and_sharing(memory_con)
    other_lock.release()
    waiting, seconds = shared.wait_for_realtime_elsewhere(ours, time.monotonic() + 30)
    assert waiting == 0 and seconds < shared.REALTIME_POLL_SECONDS, (waiting, seconds)


def test_it_does_not_wait_for_a_batch(memory_con):
    ours, _ = sending_and_sharing(memory_con)
    memory_con.execute("update main.llm_batch_jobs set status = 'in_progress', batch_id = 'b1'")
    waiting, seconds = shared.wait_for_realtime_elsewhere(ours, time.monotonic() + 30)
    assert waiting == 0 and seconds < shared.REALTIME_POLL_SECONDS, (waiting, seconds)
