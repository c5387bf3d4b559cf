"""Self-hosted batch jobs on a Ray cluster (llm_provider = 'ray'), through real dbt against a local
single-node Ray cluster (the session's `ray_cluster`) whose jobs send to a loopback OpenAI-compatible
engine (the sandbox's /v1/chat/completions): dbt run submits and returns, a later run merges; a run
killed after submit_job adopts its job; a job stopped or failed midway keeps what it finished."""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import pytest
from helpers import SANDBOX_KEY, TRIAGE_SYSTEM, dbt_subprocess, expected_triage, triage_model
from ray_cluster import ENGINE_KEY_ENV

from dbt_llm_batch.sandbox.server import Reply

pytestmark = pytest.mark.xdist_group("ray")  # one worker runs them all, on the session's one cluster


@pytest.fixture
def engine(monkeypatch):
    """A loopback OpenAI-compatible engine the Ray jobs send to (the sandbox answers chat completions)."""
    from dbt_llm_batch.sandbox import Emulator

    monkeypatch.setenv(ENGINE_KEY_ENV, SANDBOX_KEY)  # the run's realtime path would read it; the cluster has it
    emulator = Emulator(api_key=SANDBOX_KEY).start()
    yield emulator
    emulator.stop()
    emulator.raise_internal_errors()


def ray_model(cluster, storage, urls, extra: str = "", select: str = "") -> str:
    model = triage_model(
        extra_config=f"""llm_ray_address = {cluster.address!r}, llm_ray_storage = {str(storage)!r},
    llm_base_url = {urls!r}, llm_api_key_env = {ENGINE_KEY_ENV!r}, llm_concurrency = 8, {extra}"""
    ).replace("llm_provider = 'openai'", "llm_provider = 'ray'")
    if select:
        model = model[: model.index("select ticket_id")] + select
    return model


def generated_rows(n: int, distinct: int) -> str:
    """A model body of `n` tickets whose prompts repeat every `distinct` rows (duplicates share a request)."""
    return f"""select i as ticket_id, 'Ticket ' || (i % {distinct}) as subject, 'normal' as priority,
       'Subject: Ticket ' || (i % {distinct}) || chr(10) || chr(10) || 'The export of project ' || (i % {distinct})
       || ' fails' as prompt
from range({n}) t(i)
"""


def wait_for_end(cluster, batch_id: str, timeout: float = 240) -> str:
    """The job's final status, polled until it ends (bounded: a stuck job fails the test)."""
    client, began = cluster.client(), time.monotonic()
    while True:
        status = str(client.get_job_status(batch_id).value)
        if status in ("STOPPED", "SUCCEEDED", "FAILED"):
            return status
        assert time.monotonic() - began < timeout, f"Ray job {batch_id} still {status} after {timeout} s"
        time.sleep(0.5)


def jobs_of(project) -> list[tuple]:
    return project.query(
        "select batch_id, status from main.llm_batch_jobs where batch_id is not null order by created_at"
    )


def ray_jobs(cluster, batch_ids) -> list:
    return [j for j in cluster.client().list_jobs() if j.submission_id in set(batch_ids)]


def gate(engine, answered_first: int = 0):
    """Hold the engine's chat completions after the first `answered_first` until the returned event is set;
    held requests are then dropped unanswered. Returns (event, restore)."""
    released, answer, count, lock = threading.Event(), engine.handle, [0], threading.Lock()

    def held(method, path, headers, body):
        if path.startswith("/v1/chat/completions"):
            with lock:
                count[0] += 1
                n = count[0]
            if n > answered_first:
                released.wait(timeout=300)  # bounded: a stuck test fails instead of hanging
                return Reply(0, b"", cut="disconnect")
        return answer(method, path, headers, body)

    engine.handle = held

    def restore():
        released.set()
        engine.handle = answer

    return released, restore


def test_dbt_run_returns_while_the_ray_job_runs_and_the_next_run_merges_every_row(
    project, ray_cluster, engine, tmp_path
):
    # 1,000 rows, 900 distinct prompts: one request per prompt (dedup), one Ray job for all of them.
    project.write(
        "models/triage.sql",
        ray_model(ray_cluster, tmp_path / "storage", [engine.openai_base_url], select=generated_rows(1000, 900)),
    )
    released, restore = gate(engine)  # the engine holds every request: the job cannot finish
    try:
        began = time.monotonic()
        project.dbt("run", "-s", "triage")
        returned_in = time.monotonic() - began
        [(batch_id, status)] = jobs_of(project)
        assert str(ray_cluster.client().get_job_status(batch_id).value) in ("PENDING", "RUNNING")
        print(f"\ndbt run returned in {returned_in:.1f} s with Ray job {batch_id} still running")
        assert project.query("select count(*) from main.triage") == [(0,)]
        assert project.query("select count(*), count(distinct custom_id) from main.llm_batch_requests") == [(900, 900)]
    finally:
        restore()
    # Released, the engine answers (the job's retries of the held requests too): the job finishes alone.
    assert wait_for_end(ray_cluster, batch_id) == "SUCCEEDED"
    project.dbt("run", "-s", "triage")
    rows = project.query("select ticket_id, category, urgent, summary, llm_status, llm_cost_usd from main.triage")
    assert len(rows) == 1000
    prompts = dict(project.query("select ticket_id, prompt from main.triage"))
    for ticket_id, category, urgent, summary, status, cost in rows:
        assert status == "succeeded"
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, prompts[ticket_id])
        assert cost == Decimal(0)  # self-hosted and not priced: free
    # Every request answered once by the engine (a held request was dropped unanswered, then retried).
    answered = engine.counters.realtime_prompts
    assert len(answered) == 900 and set(answered.values()) == {1}
    before = len(ray_cluster.client().list_jobs())
    project.dbt("run", "-s", "triage")  # nothing new: no job
    assert len(ray_cluster.client().list_jobs()) == before


PRICES = """provider,model,unit,input_per_mtok,output_per_mtok,cache_write_per_mtok,cache_read_per_mtok,per_hour,batch_discount,as_of,source
ray,gpt-4o-mini,token,2.00,8.00,,,,0,2026-12-05,our GPUs per token
"""


def test_a_run_killed_after_submit_job_adopts_its_job_and_never_runs_it_twice(project, ray_cluster, engine, tmp_path):
    # Two variants (one job holds both) on an engine priced per token by the user.
    project.write("seeds/ray_prices.csv", PRICES)
    extra = "llm_price_table = 'main.ray_prices', llm_variants = {'warm': {'llm_temperature': 0.7}},"
    project.write("models/triage.sql", ray_model(ray_cluster, tmp_path / "storage", [engine.openai_base_url], extra))
    project.dbt("seed")
    project.release_database()
    marker = tmp_path / "marker"
    killed = dbt_subprocess(
        project, {"DBT_LLM_BATCH_CRASH_AT": "after_create", "DBT_LLM_BATCH_CRASH_MARKER": str(marker)}
    )
    assert killed.returncode == -9 and marker.read_text() == "after_create", killed.stdout[-2000:]
    # The ledger never learned the job's id; Ray has the job, named by the ledger's job id.
    [(job_id,)] = project.query("select job_id from main.llm_batch_jobs")
    batch_id = f"dbt_llm_batch-{job_id}"
    assert project.query("select batch_id from main.llm_batch_jobs") == [(None,)]
    assert len(ray_jobs(ray_cluster, [batch_id])) == 1
    assert wait_for_end(ray_cluster, batch_id) == "SUCCEEDED"
    project.dbt("run", "-s", "triage")  # reconciles: adopts the job, harvests it, merges
    assert jobs_of(project) == [(batch_id, "SUCCEEDED")]
    rows = project.query(
        """select llm_status, llm_batch_id, llm_variant, llm_cost_usd, llm_input_tokens, llm_output_tokens,
                  llm_realtime_cost_usd from main.triage"""
    )
    assert sorted({r[2] for r in rows}) == ["default", "warm"] and len(rows) == 12
    for status, batch, _, cost, input_tokens, output_tokens, realtime_cost in rows:
        assert (status, batch) == ("succeeded", batch_id)
        assert input_tokens > 0 and output_tokens > 0
        assert cost == Decimal(input_tokens * 2 + output_tokens * 8) / 1_000_000  # the user's price, no discount
        assert realtime_cost is None  # no realtime counterfactual for a self-hosted engine
    assert project.query("select sum(cost_usd) from main.llm_batch_requests") == [(sum(r[3] for r in rows),)]
    # Each request answered once: 12 requests, 6 prompts asked at two temperatures.
    assert sum(engine.counters.realtime_prompts.values()) == 12 and len(engine.counters.realtime_prompts) == 6
    project.dbt("run", "-s", "triage")
    assert len(ray_jobs(ray_cluster, [b for b, _ in jobs_of(project)])) == 1  # one job, ever


def test_a_job_stopped_midway_merges_what_it_finished_and_resubmits_the_rest(project, ray_cluster, engine, tmp_path):
    # Blocks of 5 lines, one block at a time, 5 in flight: the engine answers 10 requests (two whole
    # blocks are written), then holds the rest until the job is stopped.
    extra = "llm_ray_tasks = 1, llm_ray_rows_per_task = 5,"
    project.write(
        "models/triage.sql",
        ray_model(
            ray_cluster, tmp_path / "storage", [engine.openai_base_url], extra, select=generated_rows(30, 30)
        ).replace("llm_concurrency = 8", "llm_concurrency = 5"),
    )
    released, restore = gate(engine, answered_first=10)
    try:
        project.dbt("run", "-s", "triage")
        [(batch_id, _)] = jobs_of(project)
        output = tmp_path / "storage" / batch_id / "output"
        began = time.monotonic()
        while len(list(output.glob("part-*.jsonl"))) < 2:  # two finished blocks
            assert time.monotonic() - began < 240, "the job wrote no part file"
            time.sleep(0.2)
        ray_cluster.client().stop_job(batch_id)
        assert wait_for_end(ray_cluster, batch_id) == "STOPPED"
    finally:
        restore()
    # A part file holds a whole batch of lines (5, or fewer at the end of one of Ray's blocks): the
    # answers of the batch that was cut off are not written, and are asked again.
    written = sum(int(p.stem.rsplit("-", 1)[1]) for p in output.glob("part-*.jsonl"))
    assert 5 <= written <= 10
    project.dbt("run", "-s", "triage")  # merges what the job wrote, resubmits the rest in a new job
    merged = dict(project.query("select prompt, llm_status from main.triage"))
    assert len(merged) == written and set(merged.values()) == {"succeeded"}
    statuses = dict(project.query("select status, count(*) from main.llm_batch_requests group by all"))
    assert statuses == {"succeeded": written, "voided": 30 - written, "queued": 30 - written}
    [_, (second_id, _)] = jobs_of(project)
    assert wait_for_end(ray_cluster, second_id) == "SUCCEEDED"
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [
        (30, 30)
    ]
    # What the stopped job finished was never asked again; each request succeeded once.
    answered = engine.counters.realtime_prompts
    assert all(answered[("openai", prompt)] == 1 for prompt in merged) and len(answered) == 30
    assert project.query(
        "select count(*), count(distinct custom_id) from main.llm_batch_requests where status = 'succeeded'"
    ) == [(30, 30)]


def test_a_job_whose_engine_is_down_fails_and_its_rows_wait_for_a_later_job(project, ray_cluster, engine, tmp_path):
    from ray_cluster import free_port

    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    project.write("models/triage.sql", ray_model(ray_cluster, tmp_path / "storage", [down]))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    [(batch_id, _)] = jobs_of(project)
    assert wait_for_end(ray_cluster, batch_id) == "FAILED"
    project.dbt("run", "-s", "triage")  # harvests the failed job: nothing answered, nothing merged, no error
    assert project.query("select count(*) from main.triage") == [(0,)]
    [(status, error)] = project.query("select status, error from main.llm_batch_jobs")
    assert status == "FAILED" and "6 of 6 request(s) could not reach an engine" in error, error
    # Resubmitted after a back-off, without using an attempt (a batch that failed naming no request).
    rows = project.query("select status, not_before is not null, error from main.llm_batch_requests")
    assert len(rows) == 6 and {(s, later) for s, later, _ in rows} == {("voided", True)}
    assert all("could not reach an engine" in e and "resubmitted after a 10-minute back-off" in e for *_, e in rows)
    assert len(ray_jobs(ray_cluster, [batch_id])) == 1  # no second job within the back-off


def test_cancel_stops_the_job_merges_what_it_finished_and_holds_the_rest(
    project, ray_cluster, engine, tmp_path, capsys
):
    from helpers import command

    extra = "llm_ray_tasks = 1, llm_ray_rows_per_task = 4,"
    model = ray_model(ray_cluster, tmp_path / "storage", [engine.openai_base_url], extra, select=generated_rows(12, 12))
    project.write("models/triage.sql", model.replace("llm_concurrency = 8", "llm_concurrency = 4"))
    released, restore = gate(engine, answered_first=4)
    try:
        project.dbt("run", "-s", "triage")
        [(batch_id, _)] = jobs_of(project)
        output = tmp_path / "storage" / batch_id / "output"
        began = time.monotonic()
        while not list(output.glob("part-*.jsonl")):
            assert time.monotonic() - began < 240, "the job wrote no part file"
            time.sleep(0.2)
        project.release_database()
        rc, out, _ = command(project, capsys, "cancel")  # the address and storage from the run's snapshot
        assert rc == 0 and f"{batch_id}: cancel requested by " in out, out
        assert wait_for_end(ray_cluster, batch_id) == "STOPPED"
    finally:
        restore()
    written = sum(int(p.stem.rsplit("-", 1)[1]) for p in output.glob("part-*.jsonl"))
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(written,)]
    statuses = dict(project.query("select status, count(*) from main.llm_batch_requests group by all"))
    assert statuses == {"succeeded": written, "held": 12 - written}  # held until `dbt-llm-batch release`
    assert len(ray_jobs(ray_cluster, [b for b, _ in jobs_of(project)])) == 1


def test_a_ray_model_with_several_bad_settings_is_told_them_all_in_one_error(project, monkeypatch, tmp_path):
    """No address (none in the environment either), no storage, no engine URL and a bad task count:
    one error names the four, before anything is planned or submitted (it used to take one run each).
    No cluster is needed: nothing is sent."""
    for variable in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(variable, raising=False)
    project.write(
        "models/triage.sql",
        triage_model(extra_config="llm_ray_tasks = 0,").replace("llm_provider = 'openai'", "llm_provider = 'ray'"),
    )
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = str(result.result.results[0].message)
    for problem in (
        "llm_provider 'ray' needs llm_base_url",
        "llm_provider 'ray' needs the cluster's address: set llm_ray_address",
        "llm_provider 'ray' needs llm_ray_storage",
        "llm_ray_tasks must be an integer from 1 to 1024, got 0",
    ):
        assert problem in message, message
    assert "Traceback" not in message
    assert project.query("select count(*) from information_schema.tables where table_name = 'llm_batch_jobs'") in (
        [(0,)],
        [],
    )


def test_a_job_priced_per_gpu_hour_costs_its_run_time_spread_over_its_rows(project, ray_cluster, engine, tmp_path):
    """llm_gpu_hour_usd x llm_gpus x the job's run time (Ray's start to end), shared evenly by the
    requests it answered, in the table, the ledger and llm_batch_costs (the six tickets, no token price)."""
    project.write(
        "models/triage.sql",
        ray_model(ray_cluster, tmp_path / "storage", [engine.openai_base_url], "llm_gpu_hour_usd = 3.6, llm_gpus = 2,"),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    [(batch_id, _)] = jobs_of(project)
    assert wait_for_end(ray_cluster, batch_id) == "SUCCEEDED"
    project.dbt("run", "-s", "triage")
    info = ray_cluster.client().get_job_info(batch_id)
    job_cost = Decimal(info.end_time - info.start_time) / 3_600_000 * 2 * Decimal("3.6")
    assert job_cost > 0
    share = (job_cost / 6).quantize(Decimal("1e-9"))
    rows = project.query("select llm_status, llm_cost_usd from main.triage")
    assert rows == [("succeeded", share)] * 6
    assert project.query("select sum(cost_usd) from main.llm_batch_requests") == [(share * 6,)]
    assert project.query("select sum(cost_usd) from main.llm_batch_costs") == [(share * 6,)]
