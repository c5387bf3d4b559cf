"""Edits and re-parses between runs never pay twice and never lose a paid batch.

Each test is one way a user changes a project between runs: a fresh parse (every CI checkout), a
provider or model switched while a batch is in flight, a key changed, a model renamed.
"""

from __future__ import annotations

import json

from conftest import failure_messages
from helpers import TRIAGE_SYSTEM as TRIAGE_SYSTEM_FOR_LEGACY
from helpers import batch_counts

# Several keys and no int or float anywhere in config(): dbt's static parser then reads config()
# itself, and returns its dicts in a different key order on each full parse.
ORDER_MODEL = """
{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_system = 'Extract fields from the ticket.',
    llm_output = {'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'],
                  'summary': 'text', 'language': 'text', 'sentiment': 'text',
                  'product': 'text'},
    llm_examples = [{'input': 'Subject: hi', 'output': {'category': 'other', 'summary': 'hello',
                     'language': 'en', 'sentiment': 'neutral', 'product': 'none'}}],
    llm_params = {'seed': 'x', 'user': 'dbt', 'metadata': {'b': 'x', 'a': 'y', 'c': 'z'}},
) }}
select ticket_id, subject, 'Subject: ' || subject || chr(10) || body as prompt
from {{ ref('support_tickets') }}
"""


def test_a_full_reparse_never_resends_or_breaks_the_table(project, emulator):
    """dbt's static parser returns config() dicts in another key order on each full parse: nothing
    that reaches a request, a fingerprint or the table's shape may depend on that order."""
    project.dbt("seed")
    project.write("models/extract.sql", ORDER_MODEL.replace("'seed': 'x', ", ""))
    project.dbt("run", "-s", "extract")
    emulator.complete_all()
    project.dbt("run", "-s", "extract")
    assert project.query("select count(*) from main.extract where llm_status = 'succeeded'") == [(6,)]
    orders = set()
    for _ in range(4):
        project.dbt("parse", "--no-partial-parse")
        manifest = json.loads((project.root / "target" / "manifest.json").read_text())
        node = next(n for n in manifest["nodes"].values() if n["name"] == "extract")
        orders.add(tuple(node["config"]["llm_output"]))
        project.dbt("run", "-s", "extract")
    emulator.complete_all()
    project.dbt("run", "-s", "extract")
    assert batch_counts(emulator) == [6], "a re-parse sent rows again"
    assert emulator.stats()["request_lines"] == 6
    assert project.query("select count(*) from main.extract where llm_status = 'succeeded'") == [(6,)]
    # The table's output columns are in the same order whatever order the parse produced.
    columns = [
        r[0]
        for r in project.query(
            "select column_name from information_schema.columns where table_name = 'extract' order by ordinal_position"
        )
    ]
    assert columns[3:8] == sorted(columns[3:8]) == ["category", "language", "product", "sentiment", "summary"]
    assert len(orders) > 1, f"the parses gave one order only: {orders}"


def batches_of(emulator, face: str) -> list[dict]:
    from helpers import is_anthropic, sorted_batches

    return [b for b in sorted_batches(emulator) if is_anthropic(b) == (face == "anthropic")]


def test_switching_provider_with_a_batch_in_flight_harvests_it_where_it_was_sent(project, emulator):
    """The batch in flight is polled, harvested and priced through the provider and model it was
    sent with: its paid answers reach the table and it is billed once."""
    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model().replace("gpt-4o-mini", "gpt-4o"))
    project.dbt("run", "-s", "triage")
    [openai_batch] = batches_of(emulator, "openai")
    project.write("models/triage.sql", triage_model(provider="anthropic"))
    project.dbt("run", "-s", "triage")  # polls the OpenAI batch at OpenAI; sends the new fingerprints to Anthropic
    emulator.advance(openai_batch["id"], "completed")
    project.dbt("run", "-s", "triage")
    rows = project.query(
        "select llm_model, llm_status, llm_batch_id, llm_cost_usd, llm_input_tokens, llm_output_tokens "
        "from main.triage order by ticket_id"
    )
    assert [r[:3] for r in rows] == [("gpt-4o", "succeeded", openai_batch["id"])] * 6, (
        "the OpenAI answers merge while the Anthropic batch is in flight"
    )
    # Priced at gpt-4o, the model the batch was sent with (not claude-sonnet-4-5, nor gpt-4o-mini).
    for *_, cost, tokens_in, tokens_out in rows:
        assert float(cost) == (tokens_in * 2.50 + tokens_out * 10.00) / 1e6 * 0.5
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select distinct llm_model from main.triage") == [("claude-sonnet-4-5",)]
    assert {f: n for f, n in emulator.stats()["batches_by_face"].items() if n} == {"openai": 1, "anthropic": 1}
    assert emulator.stats()["request_lines"] == 12, "each provider was asked each row once"
    assert project.query("select count(*) from main.llm_batch_jobs where harvested_at is null") == [(0,)]
    assert project.query("select count(*) from main.llm_batch_jobs where files_deleted_at is null") == [(0,)], (
        "the OpenAI batch's files are deleted at OpenAI too"
    )


def test_reserved_output_names_are_refused_before_anything_is_sent(project, emulator):
    from helpers import triage_model

    project.dbt("seed")
    for name in ("llm_error", "LLM_Status", "llm_batch_id"):
        model = triage_model().replace("llm_output = {", "llm_output = {" + f'"{name}": "text", ')
        project.write("models/triage.sql", model)
        message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
        assert f"llm_output column '{name}' has the name of a column dbt-llm-batch adds" in message
    assert emulator.stats()["calls"] == {}


def test_a_budget_refusal_still_merges_what_is_final(project, emulator):
    """Finished, paid results reach the table; only the new work is refused (and the run fails)."""
    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 3"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.write("models/triage.sql", triage_model(extra_config="llm_max_cost_usd = 0.0000001,"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "refusing to submit 3 request(s)" in message and "merged: 3 row(s)" in message
    assert project.query("select ticket_id, llm_status from main.triage order by 1") == [
        (1, "succeeded"),
        (2, "succeeded"),
        (3, "succeeded"),
    ]
    assert emulator.stats()["request_lines"] == 3


SELECTED_TYPES = """
    123456789.123456789::decimal(38,9) as amount, 170141183460469231731687303715884105727::hugeint as huge,
    18446744073709551615::ubigint as ubig, 0.1::double as ratio, 'nan'::double as not_a_number,
    '\\xC3\\x28'::blob as raw, interval '3 days 2 hours' as span, '2024-01-01 12:34:56.123456+02'::timestamptz as at_tz,
    '12:34:56.789'::time as clock, [1.5, 2.5]::decimal(10,2)[] as amounts, {'a': 1.25::decimal(20,10)} as nested,
    map {'k': 1} as mapping, 1.1::real as single, '2024-01-01 12:34:56.123456789'::timestamp_ns as at_ns,
    'a"b\\c' as quoted, 5::bit as bits, [1, 2]::integer[2] as pair, 'infinity'::date as forever"""


def test_selected_values_round_trip_exactly_in_incremental_runs_and_full_refreshes(project, emulator):
    """The table shows each selected value exactly as selected, whichever way it was written; a column
    added while requests were in flight is filled the same way by both."""
    from helpers import triage_model

    project.dbt("seed")
    base = triage_model().replace("select ticket_id, subject,", f"select ticket_id, subject, {SELECTED_TYPES},")
    project.write("models/triage.sql", base)
    project.dbt("run", "-s", "triage")
    added = base.replace("select ticket_id, subject,", "select ticket_id, subject, 'new' as added,")
    project.write("models/triage.sql", added)
    project.dbt("run", "-s", "triage", "--full-refresh")  # the column comes while the batch is in flight
    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # an incremental merge
    columns = (
        "amount, huge, ubig, ratio, not_a_number, raw, span, at_tz, clock, amounts, nested, mapping, single, "
        "at_ns, quoted, bits, pair, forever, added"
    )
    as_text = ", ".join(f"cast({c} as varchar)" for c in columns.split(", "))  # NaN equals itself as text
    want = project.query(f"select {as_text} from (select {SELECTED_TYPES}, 'new' as added)")
    assert project.query(f"select distinct {as_text} from main.triage") == want
    project.dbt("run", "-s", "triage", "--full-refresh")  # rebuilt from the ledger
    assert project.query(f"select distinct {as_text} from main.triage") == want
    assert project.query("select typeof(amount), typeof(bits) from main.triage limit 1") == [("DECIMAL(38,9)", "BIT")]


def test_changing_unique_key_with_a_batch_in_flight_rekeys_the_ledger(project, emulator):
    """No duplicate rows, nothing asked again: stored requests take the new key from their stored row,
    or (when the stored row lacks the new key's column) from the selected row with the same prompt."""
    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")  # in flight, keyed by ticket_id
    project.write("models/triage.sql", triage_model().replace("unique_key = 'ticket_id'", "unique_key = 'subject'"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query(
        "select count(*), count(distinct subject), count(*) filter (where llm_status = 'succeeded') from main.triage"
    ) == [(6, 6, 6)]
    # A key column the stored rows never had: matched by the prompt, during a full refresh.
    by_code = (
        triage_model()
        .replace("unique_key = 'ticket_id'", "unique_key = 'code'")
        .replace("select ticket_id,", "select 'T-' || ticket_id as code, ticket_id,")
    )
    project.write("models/triage.sql", by_code)
    project.dbt("run", "-s", "triage", "--full-refresh")
    project.dbt("run", "-s", "triage")
    assert project.query(
        "select count(*), count(distinct code), count(*) filter (where llm_status = 'succeeded') from main.triage"
    ) == [(6, 6, 6)]
    assert emulator.stats()["request_lines"] == 6, "changing the key asked nothing again"


def test_a_row_whose_new_key_was_another_rows_old_key_is_asked_after_the_rekey(project, emulator):
    """The selected rows' fingerprints are read from the row answers of the same key and prompt before
    the ledger is re-keyed; the plan must still see the row answers as the re-key left them. Every
    row asks the same prompt, and each row's new key (`code`) is another row's old key text: the stored
    requests move to the keys their stored rows give (ticket_id + 100), so the selected keys have no
    answer and are asked (llm_dedup = false: a request per key)."""
    from helpers import triage_model

    same_prompt = triage_model(extra_config="llm_dedup = false,").replace(
        "'Subject: ' || subject || chr(10) || chr(10) || body as prompt", "'One question' as prompt"
    )
    project.dbt("seed")
    project.write(
        "models/triage.sql", same_prompt.replace("select ticket_id,", "select ticket_id + 100 as code, ticket_id,")
    )
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["request_lines"] == 6
    by_code = same_prompt.replace("unique_key = 'ticket_id'", "unique_key = 'code'").replace(
        "select ticket_id,", "select ticket_id as code, ticket_id,"
    )
    project.write("models/triage.sql", by_code)
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["request_lines"] == 12, "the selected keys have no answer after the re-key"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    # (The rows of the old codes stay in the table: llm_on_unselected keeps them.)
    assert project.query(
        "select count(*), count(distinct code), count(*) filter (where llm_status = 'succeeded') from main.triage"
        " where code < 100"
    ) == [(6, 6, 6)]


def test_a_renamed_model_keeps_its_answers_with_llm_ledger_identity(project, emulator):
    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    (project.root / "models" / "triage.sql").unlink()
    # Renamed without saying so: the run says, before sending, that another model has these answers.
    project.write("models/triage_v2.sql", triage_model(where="where ticket_id = 1"))
    project.dbt("run", "-s", "triage_v2")
    log = (project.root / "logs" / "dbt.log").read_text()
    # Its batch is still in flight: asked, not answered.
    assert "1 of its requests were already asked for model 'main.triage' (0 answered, 1 still in flight;" in log
    assert "set llm_ledger_identity = 'main.triage'" in log
    # With the identity, the renamed model takes over the ledger, its batch in flight included.
    (project.root / "models" / "triage_v2.sql").unlink()
    project.write("models/triage_v3.sql", triage_model(extra_config="llm_ledger_identity = 'main.triage',"))
    project.dbt("run", "-s", "triage_v3")
    emulator.complete_all()
    project.dbt("run", "-s", "triage_v3")
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage_v3") == [(6,)]
    assert emulator.stats()["request_lines"] == 7, "six by the first name, one by the unannounced rename"


def test_a_model_renamed_back_rebuilds_the_table_its_first_name_left_behind(project, emulator):
    """triage, renamed triage_v2 keeping its ledger (llm_ledger_identity), answers two more rows and a
    changed prompt; renamed back to triage, whose table dbt left in place. The ledger marks those
    answers merged (into triage_v2's table): merged incrementally, the old table kept its four rows
    and their old prompt's answers. It is rebuilt from the ledger instead, and asks nothing."""
    from helpers import triage_model

    def shown(name: str) -> list[tuple]:
        return project.query(f"select ticket_id, llm_status, llm_fingerprint from main.{name} order by 1")

    project.dbt("seed")
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 4"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    (project.root / "models" / "triage.sql").unlink()
    renamed = triage_model(system="Triage the ticket.", extra_config="llm_ledger_identity = 'main.triage',")
    project.write("models/triage_v2.sql", renamed)
    project.dbt("run", "-s", "triage_v2")
    emulator.complete_all()
    project.dbt("run", "-s", "triage_v2")
    assert len(shown("triage_v2")) == 6 and {r[1] for r in shown("triage_v2")} == {"succeeded"}
    asked = emulator.stats()["request_lines"]

    (project.root / "models" / "triage_v2.sql").unlink()
    project.write("models/triage.sql", triage_model(system="Triage the ticket."))
    project.dbt("run", "-s", "triage")
    assert shown("triage") == shown("triage_v2"), "every row, with the answer to the prompt it asks now"
    assert emulator.stats()["request_lines"] == asked, "nothing asked again"
    assert "its last merge wrote" in (project.root / "logs" / "dbt.log").read_text()


def test_a_provider_down_all_run_is_a_dbt_warning_or_an_error_on_request(project, emulator):
    """A nightly job must not stay green while sending nothing: the run ends with a dbt warning
    (which --warn-error turns into a failure), or fails with llm_on_unavailable='error'."""
    from helpers import triage_model

    project.dbt("seed")
    emulator.add_fault(endpoint="POST /v1/files", kind="http_error", status_code=503, times=None)
    project.write("models/triage.sql", triage_model(extra_config="llm_retry_budget_seconds = 1,"))
    project.dbt("run", "-s", "triage")
    log = (project.root / "logs" / "dbt.log").read_text()
    warning = next(line for line in log.splitlines() if "the provider kept failing" in line)
    assert "[warn ]" in warning or "WARNING" in warning.upper()
    assert "nothing was sent this run" in warning and "6 request(s) pending or waiting" in warning
    strict = project.dbt(
        "run", "-s", "triage", "--warn-error-options", '{"error": ["JinjaLogWarning"]}', expect_ok=False
    )
    assert not strict.success and "nothing was sent this run" in failure_messages(strict)
    project.write(
        "models/triage.sql", triage_model(extra_config="llm_retry_budget_seconds = 1, llm_on_unavailable = 'error',")
    )
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "nothing was sent this run" in message and "llm_on_unavailable='error'" in message
    assert emulator.stats()["batches_created"] == 0


def test_status_names_a_missing_file_or_a_directory(tmp_path, capsys):
    from dbt_llm_batch.ops import cli

    assert cli.main(["status", "--database", str(tmp_path / "nope.duckdb")]) == 2
    assert f"no DuckDB file at {tmp_path / 'nope.duckdb'}" in capsys.readouterr().err
    assert cli.main(["status", "--database", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_config_messages_name_what_is_expected():
    import pytest

    from dbt_llm_batch.config import parse_config
    from dbt_llm_batch.errors import ConfigError

    cases = [
        ({"llm_max_tokens": 100.5}, "llm_max_tokens must be an integer, got 100.5"),
        ({"llm_temperature": "hot"}, "llm_temperature must be a number, got 'hot'"),
        ({"llm_output": {"a": "text", "A": "text"}}, "llm_output columns 'A' and 'a' differ only in case"),
        ({"llm_on_unavailable": "ignore"}, "llm_on_unavailable must be 'warn' or 'error', got 'ignore'"),
        ({"llm_ledger_identity": ""}, "llm_ledger_identity must be a name"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as err:
            parse_config({"unique_key": "id", "llm_model": "gpt-4o-mini", **extra})
        assert message in str(err.value)


def test_canonical_config_does_not_depend_on_dict_order():
    from dbt_llm_batch.config import parse_config

    output = {"b": "text", "a": ["x", "y"], "c": "integer"}
    examples = [{"input": "i", "output": {"c": 1, "b": "t", "a": "x"}}]
    params = {"z": {"q": 1, "p": 2}, "metadata": {"y": "1", "x": "2"}}
    one = parse_config(
        {"unique_key": "id", "llm_model": "m", "llm_output": output, "llm_examples": examples, "llm_params": params}
    )
    flipped = {k: output[k] for k in reversed(output)}
    two = parse_config(
        {
            "unique_key": "id",
            "llm_model": "m",
            "llm_output": flipped,
            "llm_examples": [{"input": "i", "output": {"a": "x", "b": "t", "c": 1}}],
            "llm_params": {"metadata": {"x": "2", "y": "1"}, "z": {"p": 2, "q": 1}},
        }
    )
    assert one.fingerprint_prefix() == two.fingerprint_prefix()
    assert [c.name for c in one.output_columns] == [c.name for c in two.output_columns] == ["a", "b", "c"]
    assert one.output_json_schema() == two.output_json_schema() and one.examples == two.examples
    assert list(one.params) == list(two.params) == ["metadata", "z"]
    # The order the config was written in (stable when dbt renders config() itself) gave the
    # fingerprints earlier versions stored: they are recognised, so an upgrade asks nothing again.
    assert one.legacy_prefix != two.legacy_prefix and None not in (one.legacy_prefix, two.legacy_prefix)


def test_upgrading_keeps_fingerprints_written_in_the_configs_own_order(project, emulator):
    """Earlier versions hashed the output schema's `required` list in config order: a ledger they
    wrote is recognised (its fingerprints renamed), so the upgrade asks nothing again."""
    from helpers import TRIAGE_OUTPUT, triage_model

    from dbt_llm_batch.config import parse_config

    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    config = parse_config(
        {
            "unique_key": "ticket_id",
            "llm_model": "gpt-4o-mini",
            "llm_output": TRIAGE_OUTPUT,
            "llm_system": TRIAGE_SYSTEM_FOR_LEGACY,
            "llm_max_tokens": 200,
        }
    )
    assert config.legacy_prefix, "the triage output is not in name order, so the two prefixes differ"
    project.release_database()
    project.query(
        "update main.llm_batch_requests set fingerprint = md5(? || json_extract_string(row_json, '$.prompt'))",
        [config.legacy_prefix],
    )  # what the earlier version stored
    project.query("delete from main.llm_batch_models")  # an earlier version's ledger has no such row
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6], "the upgrade asked nothing again"
    assert project.query(
        "select count(*) from main.llm_batch_requests where fingerprint = md5(? || "
        "json_extract_string(row_json, '$.prompt'))",
        [config.fingerprint_prefix()],
    ) == [(6,)]


def interrupt_main_thread(pid: int) -> None:
    """SIGINT to the process's main thread itself (tgkill: its thread id is the pid), where Python
    runs signal handlers, so no other thread can take it; a plain kill where tgkill is not known."""
    import ctypes
    import os
    import signal

    tgkill = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if tgkill is None or ctypes.CDLL(None, use_errno=True).syscall(tgkill, pid, pid, signal.SIGINT) != 0:
        os.kill(pid, signal.SIGINT)


def test_ctrl_c_stops_waiting_at_once_and_loses_nothing(project, emulator):
    """Ctrl-C during llm_wait_seconds stops the run within a poll slice, not when the wait runs out;
    the lock is released and the batch in flight is harvested by the next run."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model(extra_config="llm_wait_seconds = 3600,"))
    project.release_database()
    log = project.root / "logs" / "dbt.log"
    log.unlink(missing_ok=True)
    dbt = Path(sys.executable).parent / "dbt"
    stderr = project.root / "dbt-stderr.txt"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [str(dbt), "run", "-s", "triage", "--project-dir", str(project.root), "--profiles-dir", str(project.root)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            # faulthandler: a SIGABRT (sent below if the run hangs) prints every thread's stack to stderr
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            # Ctrl-C as a user's terminal delivers it: a suite started in the background by a shell
            # without job control inherits SIGINT ignored, and Python then installs no handler for it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and "waiting for 1 batch(es)" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started waiting"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            try:
                proc.wait(timeout=30)  # llm_wait_seconds is an hour: only the interrupt ends it in time
            except subprocess.TimeoutExpired:
                # Rarely the first SIGINT never reaches dbt's handler: a stack dump of such a run shows
                # dbt's main thread still blocked in its queue's join(), never having raised
                # KeyboardInterrupt (CPython, not this package, decides that). A user presses Ctrl-C
                # again; so does this test, once, sent to dbt's main thread, and the run must then
                # stop as promptly.
                interrupt_main_thread(proc.pid)
                proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            raise AssertionError(
                "the run did not stop after Ctrl-C; its threads:\n" + stderr.read_text()[-20000:]
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert project.query("select count(*) from main.llm_batch_locks") == [(0,)], "the lock was released"
    emulator.complete_all()
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert batch_counts(emulator) == [6]


def test_a_batch_of_a_provider_whose_key_is_gone_waits_and_the_run_still_merges(project, emulator, monkeypatch):
    """Switched to Anthropic and dropped the OpenAI key with an OpenAI batch in flight: runs warn and go
    on (the new provider's answers merge); once the key is back, the OpenAI batch is harvested."""
    from helpers import triage_model

    project.dbt("seed")
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 3"))
    project.dbt("run", "-s", "triage")
    openai_key = __import__("os").environ["OPENAI_API_KEY"]
    monkeypatch.delenv("OPENAI_API_KEY")
    project.write("models/triage.sql", triage_model(provider="anthropic", where="where ticket_id > 3"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "sent through openai are still open and cannot be checked: OPENAI_API_KEY is not set" in log
    assert project.query("select ticket_id, llm_model from main.triage order by 1") == [
        (4, "claude-sonnet-4-5"),
        (5, "claude-sonnet-4-5"),
        (6, "claude-sonnet-4-5"),
    ]
    monkeypatch.setenv("OPENAI_API_KEY", openai_key)
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_model = 'gpt-4o-mini'") == [(3,)]
    assert emulator.stats()["request_lines"] == 6


def test_release_never_voids_a_submission_no_run_has_looked_up(project, emulator, capsys):
    """A failed create may have made a batch: until a run looked it up and could not decide, `release`
    leaves it alone (the next run finds out: OpenAI by the batch's metadata token)."""
    from helpers import triage_model

    from dbt_llm_batch.ops.cli import main as cli

    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    emulator.add_fault(endpoint="POST /v1/batches", kind="http_error", status_code=502, times=1, when="after")
    project.dbt("run", "-s", "triage")  # the batch exists; this run does not reconcile its own create
    project.release_database()
    assert cli(["release", "--database", str(project.db_path), "--schema", "main", "--model", "triage"]) == 0
    assert project.query("select count(*) from main.llm_batch_requests where status = 'released'") == [(0,)]
    project.dbt("run", "-s", "triage")  # adopts the batch by its token
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert emulator.stats()["request_lines"] == 6, "nothing was sent twice"


def test_ctrl_c_while_submitting_sends_no_further_batch_and_the_rest_waits(project, emulator, monkeypatch):
    """Ctrl-C while a model submits its request files: dbt's main thread cancels the connections and
    waits for the worker, which used to go on creating every remaining batch (and billing it). Here
    the user presses Ctrl-C once the first of three batches exists: no further batch is created, the
    unsent requests wait in the ledger, and the next run sends them; nothing is billed twice."""
    import collections

    from helpers import triage_model

    from dbt_llm_batch.pipeline import interrupt
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    with monkeypatch.context() as patch:
        # Three request files of two requests (six tickets), as a large model makes several.
        patch.setattr(OpenAIBatchProvider, "batch_limits", classmethod(lambda cls, config: (2, 200_000_000)))
        # dbt's main thread inside its cancellation once the first batch exists (interrupt.cancelled
        # reads dbt's main thread; the in-process run's worker threads see this answer instead).
        patch.setattr(interrupt, "cancelled", lambda: emulator.stats()["batches_created"] >= 1)
        project.dbt("run", "-s", "triage")
    assert emulator.stats()["batches_created"] == 1, "no batch is created after Ctrl-C"
    statuses = dict(project.query("select status, count(*) from main.llm_batch_requests group by status"))
    assert statuses == {"queued": 2, "deferred": 4}, statuses  # two in the one batch, four waiting
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "pending 2; deferred 4 (the run was interrupted: they wait for the next run)" in log  # not a cap
    assert "in-flight caps are reached" not in log

    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # harvests the first batch and sends the four that waited
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    billed = collections.Counter(b["custom_id"] for b in emulator.billed())
    assert len(billed) == 6 and set(billed.values()) == {1}, billed


def test_a_model_renamed_back_with_a_batch_in_flight_rebuilds_from_both_names_answers(project, emulator):
    """triage sends tickets 1-4 and its batch stays out (its table: empty). Renamed triage_v2 keeping
    its ledger, it selects all six and changes ticket 3's prompt: its batch (3, 5, 6) goes out, and
    triage's batch, completed, is harvested under triage_v2. Renamed back to triage while triage_v2's
    batch is in flight: the empty table dbt left is rebuilt from the ledger (the answers harvested
    under triage_v2), and the batch in flight lands in it on a later run. Each request billed once."""
    import collections

    from helpers import TRIAGE_SYSTEM, batch_counts, expected_triage, sorted_batches, triage_model

    def model(**kw) -> str:  # ticket 3 asks a changed prompt
        return triage_model(**kw).replace(
            "chr(10) || body as prompt", "chr(10) || case when ticket_id = 3 then upper(body) else body end as prompt"
        )

    def shown(name: str) -> list[tuple]:
        return project.query(
            f"""select ticket_id, llm_status, llm_fingerprint, category, urgent, summary, llm_batch_id
                from main.{name} order by 1"""
        )

    project.dbt("seed")
    tickets = {i: (s, b) for i, s, b in project.query("select ticket_id, subject, body from main.support_tickets")}
    old = {i: f"Subject: {s}\n\n{b}" for i, (s, b) in tickets.items()}
    new = {**old, 3: f"Subject: {tickets[3][0]}\n\n{tickets[3][1].upper()}"}
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 4"))
    project.dbt("run", "-s", "triage")
    [first] = sorted_batches(emulator)
    assert shown("triage") == [], "nothing answered yet"

    (project.root / "models" / "triage.sql").unlink()
    project.write("models/triage_v2.sql", model(extra_config="llm_ledger_identity = 'main.triage',"))
    project.dbt("run", "-s", "triage_v2")
    second = sorted_batches(emulator)[1]
    assert batch_counts(emulator) == [4, 3], "triage's batch is in flight: only 3 (changed), 5 and 6 are asked"
    emulator.complete(first["id"])
    project.dbt("run", "-s", "triage_v2")  # harvests triage's batch; triage_v2's is still in flight
    by_name = shown("triage_v2")
    assert [(r[0], r[1], r[6]) for r in by_name] == [(i, "succeeded", first["id"]) for i in (1, 2, 3, 4)]
    for i, _status, _fp, *answer, _batch in by_name:  # ticket 3 keeps its last answer until the new one lands
        assert tuple(answer) == expected_triage(TRIAGE_SYSTEM, old[i]), i

    (project.root / "models" / "triage_v2.sql").unlink()
    project.write("models/triage.sql", model())
    project.dbt("run", "-s", "triage")  # triage_v2's batch still in flight
    assert shown("triage") == by_name, "the answers harvested under triage_v2, not triage's empty table"
    assert batch_counts(emulator) == [4, 3], "nothing asked again"
    assert "its last merge wrote main.triage_v2, not main.triage" in (project.root / "logs" / "dbt.log").read_text()

    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # the batch sent by triage_v2 lands in triage
    rows = shown("triage")
    assert [(r[0], r[1], r[6]) for r in rows] == [
        (i, "succeeded", second["id"] if i in (3, 5, 6) else first["id"]) for i in range(1, 7)
    ]
    for i, _status, _fp, *answer, _batch in rows:
        assert tuple(answer) == expected_triage(TRIAGE_SYSTEM, new[i]), i
    project.dbt("run", "-s", "triage", "--full-refresh")  # what the ledger says, rebuilt from it alone
    assert shown("triage") == rows
    # Billed once each: the four prompts triage sent and the three triage_v2 sent, nothing again.
    billed = emulator.billed()
    assert collections.Counter(b["prompt"] for b in billed) == collections.Counter(
        [old[i] for i in (1, 2, 3, 4)] + [new[i] for i in (3, 5, 6)]
    )
    assert len({b["request"] for b in billed}) == len(billed) == 7 and batch_counts(emulator) == [4, 3]


def test_a_model_with_variants_renamed_back_rebuilds_every_variant_s_rows(project, emulator):
    """triage with two evaluation variants (terse: another system prompt; claude: Anthropic) answers
    tickets 1-4; renamed triage_v2 keeping its ledger, it selects all six and changes terse's prompt;
    renamed back to triage, whose table dbt left with four rows per variant and terse's old answers.
    The rebuild writes every variant's rows (the first variant creates the table, the others add
    theirs) with the answers the ledger holds, and asks nothing."""
    import collections

    from helpers import TRIAGE_SYSTEM, expected_triage, triage_model

    claude = {"llm_provider": "anthropic", "llm_model": "claude-sonnet-4-5"}

    def model(terse: str, extra: str = "", where: str = "") -> str:
        variants = json.dumps({"terse": {"llm_system": terse}, "claude": claude})
        return triage_model(where=where, extra_config=f"llm_variants = {variants}, {extra}")

    def shown(name: str) -> list[tuple]:
        return project.query(
            f"""select ticket_id, llm_variant, llm_status, llm_fingerprint, llm_model, category, urgent, summary,
                       llm_batch_id from main.{name} order by 1, 2"""
        )

    def assert_answered(rows: list[tuple], terse: str, keys: range) -> None:
        systems = {"default": TRIAGE_SYSTEM, "terse": terse, "claude": TRIAGE_SYSTEM}
        models = {"default": "gpt-4o-mini", "terse": "gpt-4o-mini", "claude": "claude-sonnet-4-5"}
        assert [r[:2] for r in rows] == [(i, v) for i in keys for v in sorted(systems)]
        for i, variant, status, _fp, llm_model, *answer, _batch in rows:
            assert (status, llm_model) == ("succeeded", models[variant]), (i, variant)
            assert tuple(answer) == expected_triage(systems[variant], prompts[i]), (i, variant)

    project.dbt("seed")
    prompts = {
        i: f"Subject: {s}\n\n{b}" for i, s, b in project.query("select * exclude (priority) from main.support_tickets")
    }
    project.write("models/triage.sql", model("Triage tersely.", where="where ticket_id <= 4"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert_answered(shown("triage"), "Triage tersely.", range(1, 5))

    (project.root / "models" / "triage.sql").unlink()
    project.write("models/triage_v2.sql", model("Just the category.", "llm_ledger_identity = 'main.triage',"))
    project.dbt("run", "-s", "triage_v2")
    emulator.complete_all()
    project.dbt("run", "-s", "triage_v2")
    by_name = shown("triage_v2")
    assert_answered(by_name, "Just the category.", range(1, 7))
    # triage's 12, then default and claude for 5 and 6, terse for all six under its new prompt.
    assert emulator.stats()["request_lines"] == 22

    (project.root / "models" / "triage_v2.sql").unlink()
    project.write("models/triage.sql", model("Just the category."))
    project.dbt("run", "-s", "triage")
    rows = shown("triage")
    assert rows == by_name, "every variant's rows, as the ledger holds them"
    assert_answered(rows, "Just the category.", range(1, 7))
    billed = emulator.billed()
    assert emulator.stats()["request_lines"] == len(billed) == 22, "nothing asked again"
    assert all(n == 1 for n in collections.Counter(b["request"] for b in billed).values()), "nothing billed twice"
    assert "its last merge wrote main.triage_v2, not main.triage" in (project.root / "logs" / "dbt.log").read_text()
