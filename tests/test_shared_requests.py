"""Rows answered by another model's request (llm_dedup = 'ledger'): they are pending in their own model
(the run log, `llm_batch_progress`), their own model's run harvests that request once its batch ended
(even when the other model is gone from the project), and their urgent rows follow their own model's
llm_realtime_when instead of waiting for the other model's batch."""

from __future__ import annotations

from decimal import Decimal

import pytest
from helpers import PRICES, billed_cost, command, dup_model, log_text, prompt_of, write_rows

from dbt_llm_batch.sandbox import expected_answer

N = 10


@pytest.fixture
def models(project, emulator, provider):
    """`dup` and `twin` ask the same 10 prompts, sharing the ledger's requests; batches end when told."""
    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", dup_model(provider, extra="llm_dedup='ledger'"))
    write_rows(project, {i: i for i in range(N)})
    return project


def table(project, name: str) -> dict[int, tuple]:
    rows = project.query(f"select id, prompt, llm_output, llm_status, llm_cost_usd, llm_route from main.{name}")
    return {r[0]: r[1:] for r in rows}


PROGRESS = "select model, requests_pending, rows_pending from main.llm_batch_progress order by model"


def test_rows_waiting_on_another_model_s_request_are_pending_in_their_own_model(models, emulator, capsys):
    models.dbt("run", "-s", "dup")  # sends the 10 requests
    models.dbt("run", "-s", "twin")  # its rows wait on dup's batch: nothing of its own to send

    assert len(emulator.billed()) == 0 and table(models, "twin") == {}
    assert "main.twin: submitted 0 request(s)" in log_text(models)
    assert "pending 0; 10 row(s) wait for requests of main.dup in flight" in log_text(models)
    assert models.query(PROGRESS) == [("main.dup", N, N), ("main.twin", 0, N)]
    code, out, _ = command(models, capsys, "status")
    assert code == 0 and "rows_pending" in out


def test_rows_waiting_on_another_model_land_in_their_own_run_when_it_is_gone(models, emulator, provider):
    models.dbt("run", "-s", "dup")
    models.dbt("run", "-s", "twin")
    # dup leaves the project; its batch ends. twin's own run harvests it and its rows land.
    (models.root / "models" / "dup.sql").unlink()
    emulator.complete_all()
    models.dbt("run", "-s", "twin")
    twin = table(models, "twin")
    assert sorted(twin) == list(range(N))
    for key, (prompt, answer, status, _cost, route) in twin.items():
        assert (prompt, answer, status, route) == (
            prompt_of(key),
            expected_answer(None, prompt, None),
            "succeeded",
            "batch",
        )
    # Each request billed once; its cost is split between the two rows it answers, dup's and twin's.
    assert len(emulator.billed()) == N
    # (dup's row, first by model, takes the odd billionth of a dollar of a request's cost)
    half = billed_cost(emulator, provider) / 2
    assert half - N * Decimal("0.000000001") <= sum(r[3] for r in twin.values()) <= half
    assert models.query(PROGRESS) == [("main.dup", 0, 0), ("main.twin", 0, 0)]


def test_a_model_that_waits_gets_the_rows_another_model_s_batch_answers_within_its_run(models, emulator, provider):
    models.dbt("run", "-s", "dup")
    emulator.auto_advance_seconds = 2  # dup's batch ends a few seconds from now, on its own
    models.write("models/twin.sql", dup_model(provider, extra="llm_dedup='ledger', llm_wait_seconds=120"))
    models.dbt("run", "-s", "twin")  # waits for dup's batch, harvests it and merges
    twin = table(models, "twin")
    assert sorted(twin) == list(range(N)) and {r[2] for r in twin.values()} == {"succeeded"}
    assert len(emulator.billed()) == N


def test_urgent_rows_go_realtime_instead_of_waiting_for_another_model_s_batch(models, emulator, provider):
    models.dbt("run", "-s", "dup")  # all 10 in a batch
    models.write("models/twin.sql", dup_model(provider, extra="llm_dedup='ledger', llm_realtime_when='id < 3'"))
    models.dbt("run", "-s", "twin")

    twin = table(models, "twin")
    assert sorted(twin) == [0, 1, 2]  # answered in this run, through the realtime path
    assert {r[4] for r in twin.values()} == {"realtime"} and {r[2] for r in twin.values()} == {"succeeded"}
    assert all(r[3] > Decimal(0) for r in twin.values())  # their own requests, at list prices
    assert "pending 0; 7 row(s) wait for requests of main.dup in flight" in log_text(models)


def test_the_views_count_each_row_once_with_variants_sharing_requests_after_a_prompt_edit(models, emulator, provider):
    """`dup` has a variant and shares its default variant's requests with `twin` (llm_dedup = 'ledger');
    then dup's prompt is edited, so its default variant's rows are asked again while twin keeps the old
    answers. At every step the cost view's rows, summed over the ledger, are the progress view's keys:
    each (model, variant, key) once, whichever model's request answers it. Both models run at once
    (dbt's threads): the one that claims the shared requests second waits for the other to record them."""
    variants = "llm_dedup='ledger', llm_variants={'terse': {'llm_system': 'Answer tersely.'}},"
    models.write("models/dup.sql", dup_model(provider, extra=variants))
    costs = "select sum(rows_succeeded), sum(rows_pending) from main.llm_batch_costs"
    progress = "select sum(keys_succeeded), sum(rows_pending) from main.llm_batch_progress"

    models.dbt("run", "-s", "dup", "twin")
    assert models.query(costs) == models.query(progress) == [(0, 3 * N)]  # dup's two variants, and twin
    emulator.complete_all()
    models.dbt("run", "-s", "dup", "twin")
    # Under the threads dup's harvest may land after twin merged: twin's next run merges those rows
    # (counted pending until then, which llm_batch_costs does not count: test_shared_requests' race tests).
    models.dbt("run", "-s", "twin")
    assert models.query(costs) == models.query(progress) == [(3 * N, 0)]
    assert len(emulator.billed()) == 2 * N, "twin's rows were answered by dup's default variant's requests"

    models.write("models/dup.sql", dup_model(provider, extra=f"llm_system='Answer briefly.', {variants}"))
    models.dbt("run", "-s", "dup", "twin")
    # dup's default rows asked again (they show their first answers meanwhile); its terse rows and twin's keep theirs
    assert models.query(costs) == models.query(progress) == [(3 * N, N)]
    emulator.complete_all()
    models.dbt("run", "-s", "dup", "twin")
    # Under the threads dup's harvest may land after twin merged: twin's next run merges those rows
    # (counted pending until then, which llm_batch_costs does not count: test_shared_requests' race tests).
    models.dbt("run", "-s", "twin")
    assert models.query(costs) == models.query(progress) == [(3 * N, 0)]
    assert len(emulator.billed()) == 3 * N
    assert models.query("select count(*) from main.dup") == [(2 * N,)]
    assert models.query("select count(*) from main.twin") == [(N,)]


def settle_dups_batch_meanwhile(models, emulator, monkeypatch, after: str) -> None:
    """Make dup's batch end and be harvested in the middle of twin's next run, as dup's own run does
    under dbt's threads: right after twin's merge (`after` = 'merge'), or after twin's run looked for
    rows that landed during its merge ('recheck'). Harvested as shared.harvest_shared does it, under
    dup's lock."""
    from dbt_llm_batch.pipeline import runner, shared

    fired = []
    original = {"merge": runner.ModelRun.merge, "recheck": shared.landed_unmerged}[after]

    def settle(ledger, config):
        if ledger.model == "main.twin" and not fired:
            fired.append(True)
            emulator.complete_all()
            assert shared.harvest_shared(ledger, config) == 1

    if after == "merge":

        def merge(run, target, rebuild):
            done = original(run, target, rebuild)
            settle(run.ledger, run.config)
            return done

        patches = [(runner.ModelRun, "merge", merge)]
    else:
        config_of = {}
        original_merge = runner.ModelRun.merge

        def merge(run, target, rebuild):
            config_of[run.ledger.model] = run.config
            return original_merge(run, target, rebuild)

        def recheck(ledger, variants):
            found = original(ledger, variants)
            settle(ledger, config_of[ledger.model])
            return found

        patches = [(runner.ModelRun, "merge", merge), (shared, "landed_unmerged", recheck)]
    with monkeypatch.context() as patched:  # this run only
        for owner, name, replacement in patches:
            patched.setattr(owner, name, replacement)
        models.dbt("run", "-s", "twin")
    assert fired


def test_rows_another_model_s_run_answers_while_this_model_merges_are_merged_in_the_same_run(
    models, emulator, monkeypatch
):
    """dbt's threads: dup's run harvests the shared batch just after twin's run merged (nothing yet):
    twin's run sees its rows landed and merges them, instead of leaving them out of its table (and out
    of every pending count) until its next run."""
    models.dbt("run", "-s", "dup")
    models.dbt("run", "-s", "twin")  # its rows wait on dup's batch
    settle_dups_batch_meanwhile(models, emulator, monkeypatch, after="merge")
    twin = table(models, "twin")
    assert sorted(twin) == list(range(N)) and {r[2] for r in twin.values()} == {"succeeded"}
    assert "main.twin: submitted 0 request(s) in 0 batch(es) (estimated $0); harvested 0 batch(es)" in log_text(models)
    assert "merged 10 row(s) (0 failed); pending 0" in log_text(models)
    assert len(emulator.billed()) == N


def test_rows_another_model_s_run_answers_after_this_model_merged_are_pending_and_said_so(
    models, emulator, monkeypatch, capsys
):
    """The same, with dup's harvest landing after twin's run last looked: the run line says the rows
    wait for the next run, llm_batch_progress counts them pending (llm_batch_pending_rows lists them
    with their outcome), and twin's next run merges them without asking anything."""
    models.dbt("run", "-s", "dup")
    models.dbt("run", "-s", "twin")
    settle_dups_batch_meanwhile(models, emulator, monkeypatch, after="recheck")
    assert table(models, "twin") == {}
    assert (
        "merged 0 row(s) (0 failed); pending 0; 10 row(s) answered by main.dup's run after this run merged: "
        "the next run merges them" in log_text(models)
    )
    assert models.query(PROGRESS) == [("main.dup", 0, 0), ("main.twin", 0, N)]
    assert models.query(
        "select asked_by, status, count(*) from main.llm_batch_pending_rows where model = 'main.twin' group by all"
    ) == [("main.dup", "succeeded", N)]
    models.dbt("run", "-s", "twin")
    assert sorted(table(models, "twin")) == list(range(N))
    assert models.query(PROGRESS) == [("main.dup", 0, 0), ("main.twin", 0, 0)]
    assert len(emulator.billed()) == N


def test_rows_another_model_s_run_answers_as_this_model_s_merge_begins_are_merged_in_that_run(
    models, emulator, monkeypatch
):
    """dbt's threads: dup's run (its own connection) harvests the shared batch just as twin's merge opens
    its transaction. The merge chooses the rows it writes and marks the row answers it wrote from one
    snapshot: the rows either land in this run or stay pending. (The rows were chosen before the
    transaction: twin's rows were marked 'superseded' by requests final to the marking but not
    chosen, so they were in no table and counted nowhere: "merged 0 row(s); pending 0".)"""
    from dbt_llm_batch.ledger import Ledger
    from dbt_llm_batch.pipeline import costs, merge, runner, shared

    models.dbt("run", "-s", "dup")
    models.dbt("run", "-s", "twin")  # its rows wait on dup's batch
    fired, runs = [], {}
    original_merge, original_transaction = runner.ModelRun.merge, merge.transaction

    def run_merge(run, target, rebuild):
        runs[run.ledger.model] = run
        return original_merge(run, target, rebuild)

    def transaction(con):
        run = runs.get("main.twin")
        if run is not None and not fired:
            fired.append(True)
            emulator.complete_all()
            other = run.con.cursor()  # another connection, as another dbt thread's
            costs.load_prices(other, run.config.price_table)  # a temp table of the run's connection
            assert shared.harvest_shared(Ledger(other, run.ledger.schema, run.ledger.model), run.config) == 1
        return original_transaction(con)

    with monkeypatch.context() as patched:
        patched.setattr(runner.ModelRun, "merge", run_merge)
        patched.setattr(merge, "transaction", transaction)
        models.dbt("run", "-s", "twin")
    assert fired
    twin = table(models, "twin")
    assert sorted(twin) == list(range(N)) and {r[2] for r in twin.values()} == {"succeeded"}
    assert "merged 10 row(s) (0 failed); pending 0" in log_text(models)
    assert models.query(PROGRESS) == [("main.dup", 0, 0), ("main.twin", 0, 0)]
    assert len(emulator.billed()) == N
