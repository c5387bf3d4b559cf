"""The planner's first steps on in-memory DuckDB: checking the selected rows, one desired row per
key (fingerprint, prompt, realtime route), and the plan read back joined to the input."""

from __future__ import annotations

import hashlib
import json

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError, InputError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.status import RequestStatus, sql
from dbt_llm_batch.pipeline import costs, model_input, plan
from dbt_llm_batch.pipeline.scratch import Scratch

BASE = {"unique_key": ["shop", "id"], "llm_model": "gpt-4o-mini", "llm_system": "Be brief."}


def given_input(con, rows, columns="shop varchar, id integer, priority varchar, prompt varchar") -> None:
    con.execute(f"create or replace temp table {plan.INPUT} ({columns})")
    con.executemany(f"insert into {plan.INPUT} values ({', '.join('?' * len(rows[0]))})", rows)


def desired(con) -> dict:
    rows = con.execute(
        f"select key, fingerprint, has_prompt, prompt_chars, realtime, row_id from {plan.DESIRED}"
    ).fetchall()
    return {tuple(json.loads(r[0])): r[1:] for r in rows}


ROWS = [("a", 1, "urgent", "Refund please"), ("a", 2, "low", ""), ("b", 1, "low", None), ("b", 2, "low", "Héllo")]


def test_one_desired_row_per_key_with_its_fingerprint(memory_con):
    config = parse_config(BASE)
    given_input(memory_con, ROWS)
    columns = plan.check_input(memory_con, plan.INPUT, config)
    plan.build_desired(memory_con, plan.INPUT, columns, config)
    got = desired(memory_con)

    def md5(prompt: str) -> str:
        return hashlib.md5((config.fingerprint_prefix() + prompt).encode()).hexdigest()

    # The key is a JSON list of the key columns as text, so a composite key stays unambiguous.
    assert set(got) == {("a", "1"), ("a", "2"), ("b", "1"), ("b", "2")}
    assert got[("a", "1")][:4] == (md5("Refund please"), True, 13, False)
    assert got[("a", "2")][:4] == (md5(""), False, 0, False)  # an empty prompt is not sent
    assert got[("b", "1")][:4] == (md5(""), False, None, False)  # nor a NULL one
    assert got[("b", "2")][:4] == (md5("Héllo"), True, 5, False)  # characters, not bytes


def test_the_key_is_the_text_the_ledger_stores_so_joins_with_the_ledger_cast_nothing(memory_con):
    """The ledger stores keys as VARCHAR; a JSON-typed key would make every join with the ledger
    (the hash lookup, the planner's anti-join, the merge) cast each stored key to JSON, which cost
    most of a run with nothing new. The text is the one earlier versions stored: ledgers still match."""
    config = parse_config(BASE)
    given_input(memory_con, ROWS)
    plan.build_desired(memory_con, plan.INPUT, plan.check_input(memory_con, plan.INPUT, config), config)
    types = memory_con.execute(f"select distinct typeof(key) from {plan.DESIRED}").fetchall()
    assert types == [("VARCHAR",)]
    keys = memory_con.execute(f"select key from {plan.DESIRED} order by key").fetchall()
    assert keys == [('["a","1"]',), ('["a","2"]',), ('["b","1"]',), ('["b","2"]',)]
    Ledger(memory_con, "main", "m").migrate()
    memory_con.execute(f"insert into main.llm_batch_row_answers (model, key) select 'm', key from {plan.DESIRED}")
    explained = memory_con.execute(
        f"explain select * from {plan.DESIRED} d semi join main.llm_batch_row_answers a on a.key = d.key"
    ).fetchall()
    assert "JSON" not in str(explained)


def test_the_fingerprint_changes_with_what_is_asked_not_with_how(memory_con):
    given_input(memory_con, ROWS)
    fingerprints = {}
    for name, extra in {"base": {}, "retries": {"llm_max_attempts": 7}, "system": {"llm_system": "Be long."}}.items():
        config = parse_config({**BASE, **extra})
        plan.build_desired(memory_con, plan.INPUT, plan.check_input(memory_con, plan.INPUT, config), config)
        fingerprints[name] = {k: v[0] for k, v in desired(memory_con).items()}
    assert fingerprints["retries"] == fingerprints["base"]
    assert all(fingerprints["system"][k] != fingerprints["base"][k] for k in fingerprints["base"])


def test_realtime_when_routes_rows_and_a_bad_expression_is_a_config_error(memory_con):
    given_input(memory_con, ROWS)
    config = parse_config({**BASE, "llm_realtime_when": "priority = 'urgent' -- the rest waits for a batch"})
    plan.build_desired(memory_con, plan.INPUT, plan.check_input(memory_con, plan.INPUT, config), config)
    assert {k: v[3] for k, v in desired(memory_con).items()} == {
        ("a", "1"): True,
        ("a", "2"): False,
        ("b", "1"): False,
        ("b", "2"): False,
    }
    bad = parse_config({**BASE, "llm_realtime_when": "no_such_column > 1"})
    with pytest.raises(ConfigError, match=r"llm_realtime_when = 'no_such_column > 1' is not a boolean SQL expression"):
        plan.build_desired(memory_con, plan.INPUT, plan.check_input(memory_con, plan.INPUT, bad), bad)


def test_bad_input_is_refused_naming_examples(memory_con):
    config = parse_config(BASE)
    given_input(memory_con, [*ROWS, ("a", 1, "low", "again"), ("a", 1, "low", "and again")])
    with pytest.raises(InputError, match=r"1 unique_key value\(s\) are duplicated, for example \('a', 1\) \(3 rows\)"):
        plan.check_input(memory_con, plan.INPUT, config)
    # One key column (its distinct values counted first): the same refusal, the same examples.
    single = parse_config({**BASE, "unique_key": "shop"})
    with pytest.raises(
        InputError, match=r"2 unique_key value\(s\) are duplicated, for example 'a' \(4 rows\), 'b' \(2 rows\)"
    ):
        plan.check_input(memory_con, plan.INPUT, single)
    given_input(memory_con, [("a", 1, "low", "x"), ("b", 1, "low", "y")])
    assert plan.check_input(memory_con, plan.INPUT, single)
    given_input(memory_con, [*ROWS, (None, 3, "low", "x")])
    with pytest.raises(InputError, match=r"1 selected row\(s\) have a NULL in unique_key \(shop, id\)"):
        plan.check_input(memory_con, plan.INPUT, config)
    given_input(memory_con, [("a", 1, "x")], columns="shop varchar, id integer, text varchar")
    with pytest.raises(ConfigError, match="prompt column 'prompt' is not selected by the model"):
        plan.check_input(memory_con, plan.INPUT, config)


def test_plan_rows_reads_prompt_and_row_from_the_input_or_from_a_deferred_request(memory_con):
    config = parse_config(BASE)
    given_input(memory_con, ROWS)
    columns = plan.check_input(memory_con, plan.INPUT, config)
    plan.build_desired(memory_con, plan.INPUT, columns, config)
    # A plan of two rows: one read from the input; one a deferred request that brings its own.
    memory_con.execute(
        f"""create temp table my_plan as
            select row_id, null::varchar as deferred_prompt, null::varchar as deferred_row_json
            from {plan.DESIRED} where key = '["a","1"]'
            union all select null, 'kept prompt', '{{"shop":"z"}}'"""
    )
    rows = memory_con.execute(
        f"select prompt, json_extract_string(row_json, '$.shop'), plan_row from {plan.plan_rows(config, columns, 'my_plan')} order by plan_row"
    ).fetchall()
    assert rows == [("Refund please", "a", 0), ("kept prompt", "z", 1)]
    # With `sent`: only the rows written to a request file, each with its file and line.
    memory_con.execute("create temp table my_sent as select 1::bigint as plan_row, 3 as chunk, 7 as line")
    sent = plan.plan_rows(config, columns, "my_plan", sent="my_sent")
    rows = memory_con.execute(
        f"select prompt, json_extract_string(row_json, '$.shop'), plan_row, chunk, line from {sent}"
    )
    assert rows.fetchall() == [("kept prompt", "z", 1, 3, 7)]
    memory_con.execute("insert into my_sent values (0, 0, 1)")
    rows = memory_con.execute(
        f"select prompt, json_extract_string(row_json, '$.shop'), plan_row, chunk, line from {sent}"
    )
    assert sorted(rows.fetchall()) == [("Refund please", "a", 0, 0, 1), ("kept prompt", "z", 1, 3, 7)]


def given_desired_rows(memory_con):
    """ROWS selected by a model of BASE's config with an empty ledger, and their desired rows built
    (md5 for every row): (config, columns, ledger)."""
    config = parse_config(BASE)
    given_input(memory_con, ROWS)
    columns = plan.check_input(memory_con, plan.INPUT, config)
    ledger = Ledger(memory_con, "main", "main.m")
    ledger.migrate()
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    return config, columns, ledger


def test_a_stored_prompt_hash_gives_the_stored_fingerprint_and_md5_is_the_fallback(memory_con):
    """A row answer's prompt_hash (DuckDB's hash() of the fingerprint's prefix and the prompt) lets a
    run take the stored fingerprint of the same key without md5; a hash that does not match (the
    prompt changed, or a DuckDB that hashes differently) falls back to md5, and the row answers learn
    the new hash."""
    config, columns, ledger = given_desired_rows(memory_con)
    computed = {k: v[0] for k, v in desired(memory_con).items()}  # no hash stored yet: md5 for every row
    answers = ledger.table("llm_batch_row_answers")
    # Row answers whose fingerprint is a marker md5 can never give: seen only if the stored one is taken.
    memory_con.execute(
        f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, prompt_hash)
            select 'main.m', key, '', 'stored-' || key, 'r_' || key, false,
                   case when key = '["a","1"]' then prompt_hash else xor(prompt_hash, 1::ubigint) end
            from {plan.DESIRED} where key in ('["a","1"]', '["b","2"]')"""
    )
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    got = {k: v[0] for k, v in desired(memory_con).items()}
    assert got[("a", "1")] == 'stored-["a","1"]'  # the hash matched: md5 was not computed
    assert got[("b", "2")] == computed[("b", "2")]  # another hash: md5, the same fingerprint as ever
    assert got[("a", "2")] == computed[("a", "2")]

    # The mismatched hash is replaced only where the fingerprint agrees (here none: the marker).
    assert ledger.remember_prompt_hashes(plan.DESIRED) == 0
    memory_con.execute(f'update {answers} set fingerprint = ? where key = \'["b","2"]\'', [computed[("b", "2")]])
    assert ledger.remember_prompt_hashes(plan.DESIRED) == 1
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    assert memory_con.execute(f"select count(*) from {plan.DESIRED} where fingerprint_stored").fetchall() == [(2,)]

    # A changed prompt of a key with a stored hash: md5 of the new prompt.
    memory_con.execute(f"update {plan.INPUT} set prompt = 'Refund now' where shop = 'a' and id = 1")
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    expected = hashlib.md5((config.fingerprint_prefix() + "Refund now").encode()).hexdigest()
    assert {k: v[0] for k, v in desired(memory_con).items()}[("a", "1")] == expected


def given_an_earlier_failed_attempt(con, ledger: Ledger, key: tuple) -> dict:
    """A failed batch attempt ('r_earlier', seq 0) of `key` at its current fingerprint; returns every
    desired key's fingerprint."""
    fingerprint = {k: v[0] for k, v in desired(con).items()}
    con.execute(
        f"""insert into {ledger.table("llm_batch_requests")} (custom_id, model, key, fingerprint, seq, status, is_final, queued_at, route)
            values ('r_earlier', 'main.m', ?, ?, 0, {sql(RequestStatus.FAILED)}, false, now(), 'batch')""",
        [json.dumps(list(key), separators=(",", ":")), fingerprint[key]],
    )
    return fingerprint


def test_dedup_plans_one_request_per_group_for_its_first_key_at_its_most_urgent_route(memory_con):
    """With llm_dedup, each distinct request is planned once, for the key an earlier attempt was sent
    for, else the lowest key; the group's other rows are members pointing at its custom_id (one per
    model, fingerprint and attempt: the ids of existing ledgers stay what they were); a group with one
    urgent row goes realtime, estimated at list price. Members count as duplicates, not as reuse."""
    config = parse_config({**BASE, "llm_realtime_when": "priority = 'urgent'"})
    assert config.dedup is not None  # on by default
    given_input(
        memory_con,
        [
            ("b", 1, "urgent", "same"),  # group "same": (a,1) asks, (a,2) and (b,1) are members; (b,1) is urgent
            ("a", 2, "low", "same"),
            ("a", 1, "low", "same"),
            ("b", 2, "low", "solo"),  # alone: its own request, by batch
            ("a", 3, "low", "again"),  # group "again": (b,3) asked it before (a failed attempt), so it asks again
            ("b", 3, "low", "again"),
        ],
    )
    columns = plan.check_input(memory_con, plan.INPUT, config)
    ledger = Ledger(memory_con, "main", "main.m")
    ledger.migrate()
    costs.load_prices(memory_con, None)
    price = costs.price_of(memory_con, config.provider, config.model)
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    fingerprint = given_an_earlier_failed_attempt(memory_con, ledger, ("b", "3"))
    assert plan.build_plan(ledger, config, plan.INPUT, columns, price) == 3

    def custom_id(key: tuple, seq: int) -> str:
        return "r_" + hashlib.sha256(f"main.m{fingerprint[key]}{seq}".encode()).hexdigest()[:40]

    def estimate(prompt: str, route: str):
        cost = costs.estimated_cost_sql(config, price, route_sql=f"'{route}'", chars_sql=str(len(prompt)))
        return memory_con.execute(f"select {cost}").fetchall()[0][0]

    planned = memory_con.execute(
        f"select key, custom_id, seq, route, estimated_cost_usd from {plan.PLAN} order by key"
    ).fetchall()
    assert planned == [
        ('["a","1"]', custom_id(("a", "1"), 0), 0, "realtime", estimate("same", "realtime")),
        ('["b","2"]', custom_id(("b", "2"), 0), 0, "batch", estimate("solo", "batch")),
        ('["b","3"]', custom_id(("b", "3"), 1), 1, "batch", estimate("again", "batch")),
    ]
    assert estimate("same", "realtime") > estimate("same", "batch")  # the urgent row's route priced the group
    members = memory_con.execute(
        f"select key, custom_id, reused, duplicate from {Scratch.plan_members} order by key"
    ).fetchall()
    assert members == [
        ('["a","2"]', custom_id(("a", "1"), 0), False, True),
        ('["a","3"]', custom_id(("b", "3"), 1), False, True),
        ('["b","1"]', custom_id(("a", "1"), 0), False, True),
    ]
    assert plan.dedup_counts(memory_con) == (3, 0)


class Recording:
    """A connection that records each statement it runs (what a step asks of DuckDB, not how long)."""

    def __init__(self, con):
        self.con, self.statements = con, []

    def execute(self, statement, *args):
        self.statements.append(" ".join(statement.split()))
        return self.con.execute(statement, *args)

    def __getattr__(self, name):
        return getattr(self.con, name)


def test_with_nothing_to_reject_or_retry_the_steps_before_the_plan_leave_the_ledger_alone(memory_con):
    """A run whose rows can all be sent (the usual run, and every run with nothing new) records no
    never-sent failure and fails no deferred request: each of those looked every selected key up
    among the ledger's requests, which was a good part of a run with nothing to do. A plan of new
    rows with llm_dedup has no earlier attempt whose key it keeps: the candidates are not joined
    with their history."""
    from dbt_llm_batch.pipeline import validate

    config = parse_config({**BASE, "llm_max_context_tokens": 1000})
    given_input(memory_con, [("a", 1, "low", "same"), ("a", 2, "low", "same"), ("b", 1, "low", "solo")])
    columns = plan.check_input(memory_con, plan.INPUT, config)
    con = Recording(memory_con)
    ledger = Ledger(con, "main", "main.m")
    ledger.migrate()
    plan.build_desired(con, plan.INPUT, columns, config, ledger)
    con.statements.clear()
    assert plan.reject_empty_prompts(ledger, plan.INPUT, columns) == 0
    assert validate.reject_unsendable(ledger, config, columns) == 0
    assert validate.reject_deferred_without_prompt(ledger, config) == 0
    requests = ledger.table("llm_batch_requests")
    assert not [s for s in con.statements if s.startswith(("insert", "update")) and requests in s]

    costs.load_prices(memory_con, None)
    con.statements.clear()
    assert plan.build_plan(ledger, config, plan.INPUT, columns) == 2
    assert not [s for s in con.statements if "prior_key = c.key" in s]
    assert plan.dedup_counts(memory_con) == (1, 0)


def test_dedup_without_repeated_prompts_plans_each_row_as_its_own_request(memory_con):
    """No fingerprint repeats (the usual plan of new rows): a request per row, for its own key, at its own
    route, a key asked before at its next attempt, and no members."""
    config = parse_config({**BASE, "llm_realtime_when": "priority = 'urgent'"})
    rows = [("b", 1, "urgent", "one"), ("a", 2, "low", "two"), ("a", 3, "low", "three")]
    given_input(memory_con, rows)
    columns = plan.check_input(memory_con, plan.INPUT, config)
    ledger = Ledger(memory_con, "main", "main.m")
    ledger.migrate()
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    fingerprint = given_an_earlier_failed_attempt(memory_con, ledger, ("a", "3"))
    assert plan.build_plan(ledger, config, plan.INPUT, columns) == 3

    def custom_id(key: tuple, seq: int) -> str:
        return "r_" + hashlib.sha256(f"main.m{fingerprint[key]}{seq}".encode()).hexdigest()[:40]

    planned = memory_con.execute(f"select key, custom_id, seq, route, row_id from {plan.PLAN} order by key").fetchall()
    assert planned == [
        ('["a","2"]', custom_id(("a", "2"), 0), 0, "batch", 1),
        ('["a","3"]', custom_id(("a", "3"), 1), 1, "batch", 2),
        ('["b","1"]', custom_id(("b", "1"), 0), 0, "realtime", 0),
    ]
    assert memory_con.execute(f"select count(*) from {Scratch.plan_members}").fetchall()[0][0] == 0


INTEGER_EDGES = {
    "tinyint": ["-128", "0", "127"],
    "smallint": ["-32768", "-1", "32767"],
    "integer": ["-2147483648", "7", "2147483647"],
    "bigint": ["-9223372036854775808", "-10", "9223372036854775807"],
    "hugeint": ["-170141183460469231731687303715884105728", "170141183460469231731687303715884105727"],
    "utinyint": ["0", "255"],
    "usmallint": ["0", "65535"],
    "uinteger": ["0", "4294967295"],
    "ubigint": ["0", "18446744073709551615"],
    "uhugeint": ["0", "340282366920938463463374607431768211455"],
}


@pytest.mark.parametrize("type_name", sorted(INTEGER_EDGES))
def test_integer_keys_are_concatenated_to_the_text_to_json_gives(memory_con, type_name):
    # Stored keys must not change: the concatenation taken for integer key columns gives, byte for
    # byte, the text to_json gives, for one key column and for a composite key (an integer next to
    # a negative bigint), at each type's extremes.
    memory_con.execute(
        f"""create or replace temp table k as
            select cast(v as {type_name}) as id, cast(w as bigint) as part
            from unnest(?) t(v), unnest(['-9223372036854775808', '0', '42']) u(w)""",
        [INTEGER_EDGES[type_name]],
    )
    columns = plan.describe(memory_con, "k")
    for unique_key in (["id"], ["id", "part"], ["part", "id"]):
        config = parse_config({**BASE, "unique_key": unique_key})
        fast = plan.key_sql(config, columns)
        assert "to_json" not in fast  # the concatenation is what is compared
        mismatched = memory_con.execute(
            f"""select count(*), count(*) filter (where {fast} is distinct from {plan.key_sql(config)})
                from k"""
        ).fetchall()[0]
        assert mismatched == (len(INTEGER_EDGES[type_name]) * 3, 0), (unique_key, mismatched)


def test_other_key_types_keep_to_json(memory_con):
    # Text needs JSON's escaping (a quote, a backslash, a newline): to_json stays for any key that
    # has a column of another type.
    memory_con.execute("""create or replace temp table k as select 'a"b\\c' || chr(10) as name, 1 as id""")
    columns = plan.describe(memory_con, "k")
    config = parse_config({**BASE, "unique_key": ["id", "name"]})
    assert "to_json" in plan.key_sql(config, columns)
    assert memory_con.execute(f"select {plan.key_sql(config, columns)} from k").fetchall()[0][0] == (
        '["1","a\\"b\\\\c\\n"]'
    )


def desired_table(con) -> list[tuple]:
    return con.execute(
        f"""select key, fingerprint, has_prompt, prompt_chars, realtime, prompt_hash, fingerprint_stored
            from {plan.DESIRED} order by key"""
    ).fetchall()


@pytest.mark.parametrize(
    ("unique_key", "columns", "prompt"),
    [
        (["shop", "id"], "shop varchar, id integer, priority varchar, prompt varchar", "varchar"),
        (["id"], "shop varchar, id integer, priority varchar, prompt varchar", "varchar"),
        (["id"], "shop varchar, id integer, priority varchar, prompt blob", "blob"),
    ],
)
def test_facts_computed_while_the_rows_are_copied_give_the_same_desired_rows(memory_con, unique_key, columns, prompt):
    """model_input.load_input computes each row's key, prompt hash and prompt length as it copies the
    model's rows (plan.PRECOMPUTED): the desired rows are the ones computed from the plain copy, with
    no stored hash (md5 for all), with stored hashes (found: the stored fingerprint; not found: md5),
    and the selected columns are the model's own."""
    config = parse_config({**BASE, "unique_key": unique_key, "llm_realtime_when": "priority = 'urgent'"})
    rows = [("a", 1, "urgent", "Refund please"), ("a", 2, "low", ""), ("b", 3, "low", None), ("b", 4, "low", "Héllo")]
    memory_con.execute("create table source_text (shop varchar, id integer, priority varchar, prompt varchar)")
    memory_con.executemany("insert into source_text values (?, ?, ?, ?)", rows)
    memory_con.execute(
        f"create table source ({columns}); insert into source select shop, id, priority, "
        f"{'encode(prompt)' if prompt == 'blob' else 'prompt'} from source_text"
    )
    if prompt == "blob":
        memory_con.execute("insert into source values ('c', 5, 'low', '\\xC3\\x28'::blob)")  # not UTF-8
    ledger = Ledger(memory_con, "main", "main.m")
    ledger.migrate()

    def both() -> tuple[list, list]:
        model_input.load_input(memory_con, "select * from source -- a comment", None)
        plain = plan.check_input(memory_con, plan.INPUT, config)
        plan.build_desired(memory_con, plan.INPUT, plain, config, ledger)
        expected = desired_table(memory_con)
        assert model_input.load_input(memory_con, "select * from source -- a comment", None, config)
        assert plan.check_input(memory_con, plan.INPUT, config, precomputed=True) == plain
        plan.build_desired(memory_con, plan.INPUT, plain, config, ledger, precomputed=True)
        return expected, desired_table(memory_con)

    expected, got = both()
    assert got == expected and not any(r[-1] for r in got)  # nothing stored: md5 for every row
    # Row answers for some keys: one with this very hash (found), one with another (md5 again).
    memory_con.execute(
        f"""insert into {ledger.table("llm_batch_row_answers")} (model, key, variant, fingerprint, custom_id, reused, prompt_hash)
            select 'main.m', key, '', fingerprint, 'r_' || key, false,
                   case when row_number() over (order by key) = 1 then prompt_hash else xor(prompt_hash, 1::ubigint) end
            from {plan.DESIRED} where has_prompt"""
    )
    expected, got = both()
    assert got == expected
    assert [r[-1] for r in got].count(True) == 1


def test_a_key_with_two_row_answers_of_one_prompt_is_one_desired_row(memory_con):
    """Row answers are joined as they are when no request of the model was tried again; a key with two
    of the same prompt hash all the same (a variant asking the same, an operator's edit) gives one
    desired row, with the stored fingerprint."""
    config, columns, ledger = given_desired_rows(memory_con)
    memory_con.execute(
        f"""insert into {ledger.table("llm_batch_row_answers")} (model, key, variant, fingerprint, custom_id, reused, prompt_hash)
            select 'main.m', key, variant, 'stored', 'r_' || key || variant, false, prompt_hash
            from {plan.DESIRED}, (values (''), ('other')) v(variant)"""
    )
    assert not ledger.has_retries()
    plan.build_desired(memory_con, plan.INPUT, columns, config, ledger)
    got = desired_table(memory_con)
    assert len(got) == len(ROWS) and {r[1] for r in got} == {"stored"}


def test_an_interrupted_copy_of_the_rows_stops_at_once_and_is_not_run_again(memory_con):
    """Ctrl-C while the model's rows are copied (dbt interrupts the query) stops the run with the
    interrupt: the copy with the rows' facts is not retried as a plain copy (a second interrupt would
    then be reported as the model's SQL failing), and nothing runs on afterwards."""
    import threading
    import time

    import duckdb

    config = parse_config({**BASE, "unique_key": "id"})
    slow = "select i as id, md5(repeat(cast(i as varchar), 2000)) as prompt from range(1000000000) t(i)"
    outcome: list = []

    def copy():
        try:
            model_input.load_input(memory_con, slow, None, config)
        except BaseException as exc:  # noqa: BLE001 - the test looks at which one
            outcome.append(exc)

    worker = threading.Thread(target=copy)
    worker.start()
    # Interrupted again and again until the copy ends (the query would take minutes): on a loaded
    # machine the first interrupt may come before the query started, when it does nothing.
    deadline = time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
        memory_con.interrupt()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], duckdb.InterruptException), outcome


ANSWERED_ROWS = [("a", i, "low", f"Question {i}") for i in range(1, 7)]


def plan_of(ledger: Ledger, config, columns) -> set[tuple]:
    plan.build_plan(ledger, config, plan.INPUT, columns)
    return set(ledger.con.execute(f"select key, fingerprint, seq, custom_id, route from {plan.PLAN}").fetchall())


def given_answered_rows_desired(memory_con, config):
    """ANSWERED_ROWS selected, an empty ledger whose statements are recorded, and their desired rows
    built; returns (the recording connection, the ledger, the selected columns)."""
    given_input(memory_con, ANSWERED_ROWS)
    columns = plan.check_input(memory_con, plan.INPUT, config)
    con = Recording(memory_con)
    ledger = Ledger(con, "main", "main.m")
    ledger.migrate()
    plan.build_desired(con, plan.INPUT, columns, config, ledger)
    costs.load_prices(memory_con, None)
    return con, ledger, columns


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("retries", [False, True])
def test_rows_decided_by_the_lookups_row_answer_plan_as_the_join_with_every_row_answer(memory_con, dedup, retries):
    """The candidates: a row whose fingerprint came from a row answer of this variant (answer_id) whose
    request blocks replanning is left out without a join; every other row is joined with the row
    answers as before. The plan is the one the join alone gives, for rows with a stored hash (answered,
    and in flight when the desired rows were built but failed by the harvest before planning), a hash
    that does not match, no stored hash, another variant's row answer, and none; with the row answers
    joined as they are or grouped (a request of the model tried again)."""
    config = parse_config({**BASE, "llm_dedup": dedup})
    con, ledger, columns = given_answered_rows_desired(memory_con, config)
    requests, answers = ledger.table("llm_batch_requests"), ledger.table("llm_batch_row_answers")
    # id: (request status, the row answer's prompt_hash: the row's, another, none; its variant)
    given = {
        1: (RequestStatus.SUCCEEDED, "same", ""),
        2: (RequestStatus.QUEUED, "same", ""),  # failed by the harvest below, after the lookup
        3: (RequestStatus.SUCCEEDED, "other", ""),
        4: (RequestStatus.QUEUED, "none", ""),
        5: (RequestStatus.SUCCEEDED, "same", "other"),
    }
    for i, (status, hashed, variant) in given.items():
        key = json.dumps(["a", str(i)], separators=(",", ":"))
        seq = 1 if retries and i == 1 else 0  # with a retry, the lookup groups the row answers
        memory_con.execute(
            f"""insert into {requests} (custom_id, model, key, fingerprint, seq, status, is_final, queued_at, route)
                select 'r_' || $i, 'main.m', key, fingerprint, $seq, $status, false, now(), 'batch'
                from {plan.DESIRED} where key = $key""",
            {"i": str(i), "seq": seq, "status": status, "key": key},
        )
        prompt_hash = {"same": "prompt_hash", "other": "xor(prompt_hash, 1::ubigint)", "none": "null"}[hashed]
        memory_con.execute(
            f"""insert into {answers} (model, key, variant, fingerprint, custom_id, reused, prompt_hash)
                select 'main.m', key, $variant, fingerprint, 'r_' || $i, false, {prompt_hash}
                from {plan.DESIRED} where key = $key""",
            {"i": str(i), "variant": variant, "key": key},
        )
    assert ledger.has_retries() == retries
    plan.build_desired(con, plan.INPUT, columns, config, ledger)
    answer_ids = dict(memory_con.execute(f"select key, answer_id from {plan.DESIRED}").fetchall())
    assert {k: v for k, v in answer_ids.items() if v} == {'["a","1"]': "r_1", '["a","2"]': "r_2"}
    memory_con.execute(f"update {requests} set status = {sql(RequestStatus.FAILED)} where custom_id = 'r_2'")

    con.statements.clear()
    got = plan_of(ledger, config, columns)
    assert any("anti join" in s for s in con.statements)  # rows 2 to 6 are undecided
    memory_con.execute(f"update {plan.DESIRED} set answer_id = null")  # every row joined, as before
    assert plan_of(ledger, config, columns) == got
    # Row 5 is a candidate (its row answer is another variant's), but its request succeeded: not sent.
    assert {(k, seq) for k, _, seq, _, _ in got} == {('["a","2"]', 1), ('["a","6"]', 0)}


def test_a_run_with_every_row_answered_plans_without_joining_the_row_answers(memory_con):
    """Every selected row's fingerprint came from a row answer whose request succeeded or is in flight:
    nothing to send, decided from the desired rows alone."""
    config = parse_config(BASE)
    con, ledger, columns = given_answered_rows_desired(memory_con, config)
    for table, values in (
        ("llm_batch_requests", f"'r_' || key, 'main.m', key, fingerprint, 0, {sql(RequestStatus.SUCCEEDED)}"),
        ("llm_batch_row_answers", "'main.m', key, '', fingerprint, 'r_' || key, prompt_hash"),
    ):
        names = (
            "custom_id, model, key, fingerprint, seq, status"
            if table == "llm_batch_requests"
            else "model, key, variant, fingerprint, custom_id, prompt_hash"
        )
        memory_con.execute(f"insert into {ledger.table(table)} ({names}) select {values} from {plan.DESIRED}")
    memory_con.execute(
        f"update {ledger.table('llm_batch_requests')} set status = {sql(RequestStatus.QUEUED)} where key like '%\"6\"%'"
    )
    plan.build_desired(con, plan.INPUT, columns, config, ledger)
    con.statements.clear()
    assert plan.build_plan(ledger, config, plan.INPUT, columns) == 0
    assert not [s for s in con.statements if "anti join" in s]
