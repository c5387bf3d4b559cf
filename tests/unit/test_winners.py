"""Each key's winner (merge._winners) read without ranking when no key has two row answers: the same
rows, sharing and share ranks as the ranked reading, on in-memory DuckDB."""

from __future__ import annotations

import pytest

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import merge
from dbt_llm_batch.pipeline.scratch import Scratch

MODEL = "main.m"
# custom_id, is_final, queued_at (minutes)
REQUESTS = [("r1", True, 1), ("r2", True, 2), ("r3", False, 3), ("r4", True, 4), ("r5", True, 5)]
# key, custom_id, reused, emitted: r1 answers two rows (its cost is shared), r3 is not final yet,
# k5's answer is merged already, k6 is a reused answer of r2.
ANSWERS = [
    ("k1", "r1", False, None),
    ("k2", "r1", False, None),
    ("k3", "r2", False, None),
    ("k4", "r3", False, None),
    ("k5", "r4", False, "merged"),
    ("k6", "r2", True, None),
    ("k7", "r5", False, "superseded"),
]


@pytest.fixture
def ledger(memory_con):
    ledger = Ledger(memory_con, "main", MODEL)
    ledger.migrate()
    requests, answers = ledger.table("llm_batch_requests"), ledger.table("llm_batch_row_answers")
    for custom_id, final, minutes in REQUESTS:
        memory_con.execute(
            f"""insert into {requests} (custom_id, model, key, fingerprint, status, is_final, queued_at)
                values (?, ?, 'k', 'f', 'succeeded', ?, timestamptz '2026-01-01' + to_minutes(?))""",
            [custom_id, MODEL, final, minutes],
        )
    for key, custom_id, reused, emitted in ANSWERS:
        memory_con.execute(
            f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, created_at, emitted)
                values (?, ?, '', 'f', ?, ?, now(), ?)""",
            [MODEL, key, custom_id, reused, emitted],
        )
    keys = [(k,) for k, *_ in ANSWERS if k != "k7"]  # k7 is no longer selected
    memory_con.execute(f"create temp table {Scratch.desired} (key varchar, fingerprint varchar)")
    memory_con.executemany(f"insert into {Scratch.desired} values (?, 'f')", keys)
    return ledger


def winners(ledger, keys_sql: str, own_answer: str | None) -> tuple[bool, list]:
    """(whether the winners were ranked, the winners) for the keys of `keys_sql`."""
    query = merge._winners(ledger, keys_sql, "", own_answer)
    rows = ledger.con.execute(f"select * from ({query}) order by key").fetchall()
    return "arg_max" in query, rows


def a_second_answer_elsewhere(ledger) -> None:
    """A key with two answers by a request that is not final (never a winner): winners are ranked
    from now on, and no key's winner may change."""
    answers = ledger.table("llm_batch_row_answers")
    for fingerprint in ("f", "g"):
        ledger.con.execute(
            f"insert into {answers} (model, key, variant, fingerprint, custom_id, reused, created_at) "
            f"values (?, 'k9', '', ?, 'r3', false, now())",
            [MODEL, fingerprint],
        )


@pytest.mark.parametrize(
    "keys_sql, own_answer",
    [
        (f"select key from {Scratch.desired}", None),  # a full refresh: the selected keys
        ("select key from main.llm_batch_row_answers where emitted is null", "emitted is null"),
        (
            f"select key from main.llm_batch_row_answers where emitted = 'superseded' and key in (select key from {Scratch.desired})",
            f"(emitted = 'superseded' and key in (select key from {Scratch.desired}))",
        ),
    ],
)
def test_single_answers_read_without_ranking_are_the_ranked_winners(ledger, keys_sql, own_answer):
    ranked_before, single = winners(ledger, keys_sql, own_answer)
    a_second_answer_elsewhere(ledger)
    ranked_after, ranked = winners(ledger, keys_sql, own_answer)
    assert (ranked_before, ranked_after) == (False, True)
    assert single == ranked


def test_single_answers_keep_the_shared_cost_and_leave_out_unfinished_requests(ledger):
    _, rows = winners(ledger, f"select key from {Scratch.desired}", None)
    # (custom_id, key, sharing, share_rank): k4's request is not final; k7 is not selected.
    assert [(r[0], r[1], r[6], r[7]) for r in rows] == [
        ("r1", "k1", 2, 1),
        ("r1", "k2", 2, 2),
        ("r2", "k3", 1, 1),
        ("r4", "k5", 1, 1),
        ("r2", "k6", 1, 1),
    ]
