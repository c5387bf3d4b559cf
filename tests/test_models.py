"""More of the user's surface: composite keys, two models under threads with dbt tests, Python
models, is_incremental(), waiting, bad input and bad config (nothing sent), and secrets."""

from __future__ import annotations

import json

from conftest import failure_messages
from helpers import batch_counts, batch_input_lines, triage_model

from dbt_llm_batch.sandbox import expected_answer

REVIEW_SYSTEM = "Summarise the product review in at most ten words."


def write_reviews(project, n_products: int, per_product: int) -> dict:
    """A seed with a composite key (product_id, review_no); returns {key: review text}."""
    rows = {
        (f"P {p} ü", r): f"Review {r} of product {p}: {'good ' * (p % 4)}and {'bad ' * (r % 3)}."
        for p in range(n_products)
        for r in range(1, per_product + 1)
    }
    lines = ["product_id,review_no,review"] + [f'"{p}",{r},"{t}"' for (p, r), t in rows.items()]
    project.write("seeds/product_reviews.csv", "\n".join(lines) + "\n")
    return rows


def test_shuffled_results_land_on_their_composite_keys(project, emulator):
    reviews = write_reviews(project, n_products=10, per_product=6)
    project.dbt("seed")
    project.dbt("run", "-s", "review_summary")
    emulator.complete_all()
    project.dbt("run", "-s", "review_summary")

    rows = project.query("select product_id, review_no, llm_output, llm_status from main.review_summary")
    assert len(rows) == len(reviews) == 60
    for product_id, review_no, output, status in rows:
        assert status == "succeeded"
        assert output == expected_answer(REVIEW_SYSTEM, reviews[(product_id, review_no)], None), (product_id, review_no)
    # The emulator really did return them out of order.
    out_ids = [json.loads(line)["custom_id"] for line in emulator_output_lines(emulator)]
    in_ids = [line["custom_id"] for line in batch_input_lines(emulator, emulator.batches()[0])]
    assert sorted(out_ids) == sorted(in_ids) and out_ids != in_ids


def emulator_output_lines(emu) -> list[str]:
    # From the emulator's record: the run deleted the file at the provider once its results were stored.
    return emu.file_bytes(emu.batches()[0]["output_file_id"]).decode().splitlines()


def test_two_models_with_threads_wait_and_dbt_tests(project, emulator):
    """`dbt build --threads 4`: both models submit, wait for the sandbox, merge, then dbt tests run."""
    emulator.auto_advance_seconds = 0.2
    config = (project.root / "dbt_project.yml").read_text()
    assert "    +llm_model: gpt-4o-mini\n" in config
    project.write(
        "dbt_project.yml",
        config.replace("    +llm_model: gpt-4o-mini\n", "    +llm_model: gpt-4o-mini\n    +llm_wait_seconds: 60\n"),
    )
    result = project.dbt("build", "--threads", "4", "--select", "+tag:batch")
    tests = [r for r in result.result.results if r.node.resource_type == "test"]
    assert len(tests) == 5 and all(r.status == "pass" for r in tests)
    assert project.query(
        "select count(*), count(*) filter (where llm_status = 'succeeded') from main.ticket_triage"
    ) == [(6, 6)]
    assert project.query("select count(*) from main.review_summary where llm_output like '[sandbox]%'") == [(3,)]
    assert sorted(batch_counts(emulator)) == [3, 6]
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "main.ticket_triage: waiting for 1 batch(es), 6 request(s) pending" in log  # a long wait shows progress


def test_python_model(project, emulator):
    project.write(
        "models/triage_py.py",
        """
def model(dbt, session):
    dbt.config(materialized="llm_batch", unique_key="ticket_id", llm_system="Be brief.",
               llm_output={"category": ["billing", "other"]})
    tickets = dbt.ref("support_tickets")
    return tickets.filter("priority = 'urgent'").project("ticket_id, subject as prompt")
""",
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage_py")
    assert batch_counts(emulator) == [2]
    emulator.complete_all()
    project.dbt("run", "-s", "triage_py")
    rows = project.query("select prompt, category from main.triage_py order by ticket_id")
    schema = {
        "type": "object",
        "properties": {"category": {"type": "string", "enum": ["billing", "other"]}},
        "required": ["category"],
        "additionalProperties": False,
    }
    assert rows == [(p, json.loads(expected_answer("Be brief.", p, schema))["category"]) for p, _ in rows]
    assert len(rows) == 2


def test_is_incremental_filters_selection_and_harvest_still_merges(project, emulator):
    # On later runs the model selects nothing new; results of earlier batches must still be merged.
    project.write(
        "models/triage.sql",
        triage_model(
            where="{% if dbt_llm_batch.is_incremental() %} where ticket_id > (select max(ticket_id) from {{ this }}) "
            "or (select count(*) from {{ this }}) = 0 and false {% endif %}"
        ),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert (
        "where ticket_id >" not in (project.root / "target/compiled/integration_project/models/triage.sql").read_text()
    )
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert "where ticket_id >" in (project.root / "target/compiled/integration_project/models/triage.sql").read_text()
    assert project.query("select count(*) from main.triage") == [(6,)]
    assert batch_counts(emulator) == [6]


def test_null_and_duplicate_keys_fail_before_sending(project, emulator):
    project.write(
        "seeds/support_tickets.csv", "ticket_id,subject,body,priority\n1,a,b,low\n1,c,d,low\n2,e,f,low\n,g,h,low\n"
    )
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(where="where ticket_id is not null"))
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(result)
    assert "unique_key value(s) are duplicated" in message and "1 (2 rows)" in message
    project.write("models/triage.sql", triage_model())
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "have a NULL in unique_key (ticket_id)" in message
    assert "for example the row whose prompt starts 'Subject: g" in message and "None" not in message
    assert emulator.stats()["calls"] == {}


def test_config_errors_reported_together_before_any_call(project, emulator):
    project.write(
        "models/triage.sql",
        triage_model(extra_config="llm_max_atempts = 2, llm_temperature = 5, llm_params = {'messages': []},"),
    )
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "unknown config key 'llm_max_atempts' (did you mean 'llm_max_attempts'?)" in message
    assert "llm_temperature must be >= 0 and <= 2, got 5" in message
    assert "llm_params may not set 'messages'" in message
    assert emulator.stats()["calls"] == {}


def test_output_column_clash_is_a_config_error(project, emulator):
    project.write("models/triage.sql", triage_model().replace("priority,", "priority as category,"))
    project.dbt("seed")
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "selected column 'category' clashes" in message
    assert emulator.stats()["calls"] == {}


def test_missing_api_key_names_the_variable(project, emulator, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY")
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "OPENAI_API_KEY is not set" in message
    assert emulator.stats()["calls"] == {}


def test_api_key_never_lands_on_disk(project, emulator, api_key):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("build", "-s", "triage", "--debug")  # debug logs are the most verbose
    project.dbt("docs", "generate")
    scanned = 0
    for path in [p for p in project.root.rglob("*") if p.is_file() and "dbt_packages" not in p.parts]:
        assert api_key.encode() not in path.read_bytes(), f"API key found in {path}"
        scanned += 1
    assert (project.root / "warehouse.duckdb").exists() and scanned > 10


def test_python_model_with_hooks(project, emulator):
    """Hooks open a transaction on dbt's connection; the ledger still commits on its own."""
    project.write(
        "models/triage_py.py",
        """
def model(dbt, session):
    dbt.config(materialized="llm_batch", unique_key="ticket_id", pre_hook="select 1",
               post_hook="create or replace table main.hook_ran as select 1 as ok")
    return dbt.ref("support_tickets").project("ticket_id, subject as prompt")
""",
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage_py")
    assert batch_counts(emulator) == [6]
    emulator.complete_all()
    project.dbt("run", "-s", "triage_py")
    assert project.query("select count(*) from main.triage_py where llm_status = 'succeeded'") == [(6,)]
    assert project.query("select ok from main.hook_ran") == [(1,)]


def test_config_from_yaml_overrides_the_folder(project, emulator):
    """Flat keys set in a model's YAML `config:` (over the folder's +llm_model in dbt_project.yml)."""
    project.write(
        "models/triage.sql",
        """
select ticket_id, 'Subject: ' || subject as prompt from {{ ref('support_tickets') }}""",
    )
    project.write(
        "models/triage.yml",
        """
version: 2
models:
  - name: triage
    config:
      materialized: llm_batch
      unique_key: ticket_id
      llm_model: gpt-4.1-mini
      llm_system: From YAML.
      llm_output: {kind: [a, b]}
""",
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    body = batch_input_lines(emulator, emulator.batches()[0])[0]["body"]
    assert body["model"] == "gpt-4.1-mini" and body["messages"][0] == {"role": "system", "content": "From YAML."}
    assert body["response_format"]["json_schema"]["schema"]["properties"] == {
        "kind": {"type": "string", "enum": ["a", "b"]}
    }


def test_a_failed_batch_uses_no_attempt(project, emulator):
    """The provider fails the whole batch (enqueued-token limit): its rows go again after a back-off
    (tests/test_faults.py has the schedule), attempts intact."""
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 1,"))
    project.dbt("seed")
    emulator.add_fault(kind="token_limit", times=1)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    assert emulator.batches()[0]["status"] == "failed"
    project.dbt("run", "-s", "triage")  # harvests the failure; the six wait for the back-off
    assert batch_counts(emulator) == [6]
    assert project.query(
        "select count(*) from main.llm_batch_requests where status = 'voided' and error like 'token_limit_exceeded%'"
    ) == [(6,)]
    project.release_database()
    project.query("update main.llm_batch_requests set not_before = now() - interval 1 second")
    project.dbt("run", "-s", "triage")  # the back-off is over: all six again
    assert batch_counts(emulator) == [6, 6]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]


def test_an_empty_prompt_fails_alone_without_a_request(project, emulator):
    project.write("seeds/support_tickets.csv", "ticket_id,subject,body,priority\n1,a,b,low\n2,c,d,low\n")
    project.dbt("seed")
    project.write(
        "models/triage.sql",
        triage_model().replace(
            "'Subject: ' || subject || chr(10) || chr(10) || body as prompt",
            "case when ticket_id = 2 then '' else 'Subject: ' || subject end as prompt",
        ),
    )
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [1]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select ticket_id, llm_status, llm_error from main.triage order by 1") == [
        (1, "succeeded", None),
        (2, "failed", "prompt is NULL or empty: nothing was sent"),
    ]


def test_unusable_answers_fail_with_the_reason(project, emulator):
    """An answer that is not the requested JSON is a failed attempt; one cut off at llm_max_tokens is final."""
    project.dbt("seed")
    emulator.add_fault(prompt_contains="Dark mode", kind="content", content="not json", times=None)
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 1,"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select llm_status, llm_error from main.triage where ticket_id = 5") == [
        ("failed", "answer is not valid JSON")
    ]
    project.write(
        "models/short.sql",
        """
{{ config(materialized='llm_batch', unique_key='ticket_id', llm_max_tokens=2, llm_max_attempts=1) }}
select ticket_id, subject as prompt from {{ ref('support_tickets') }} where ticket_id = 1""",
    )
    project.dbt("run", "-s", "short")
    emulator.complete_all()
    project.dbt("run", "-s", "short")
    assert project.query("select llm_status, llm_error, llm_finish_reason from main.short") == [
        (
            "failed",
            "answer was cut off at llm_max_tokens=2 (finish reason length); not retried: the same request "
            "would be cut off again. Raise llm_max_tokens (that asks again)",
            "length",
        )
    ]
    # The raw, cut-off answer is kept in the ledger (2 tokens: the emulator's 8 characters).
    assert project.query("select answer from main.llm_batch_requests where model = 'main.short'") == [
        (expected_answer(None, "Refund not received", None)[:8],)
    ]
