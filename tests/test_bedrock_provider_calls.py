"""The Bedrock provider's own calls against the sandbox (boto3 over HTTP, S3 in moto's server mode),
without dbt: upload and find the upload, create twice with one token (one job), find the submission
by its name and token, poll, download, results gone from S3, stop, and delete what is left."""

from __future__ import annotations

import boto3
import duckdb

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.providers import get_provider


def provider(bucket: str):
    config = parse_config(
        {
            "unique_key": "id",
            "llm_provider": "bedrock",
            "llm_model": "anthropic.claude-haiku-4-5-20251001-v1:0",
            "llm_max_tokens": 20,
            "llm_bedrock_s3_input": f"s3://{bucket}/requests",
            "llm_bedrock_s3_output": f"s3://{bucket}/results/",
            "llm_bedrock_role_arn": "arn:aws:iam::123456789012:role/bedrock-batch",
        }
    )
    return get_provider("bedrock")(config)


def request_file(p, path, rows: int = 100) -> str:
    with duckdb.connect() as con:
        lines = con.execute(
            f"""select {p.request_line_sql()} from (select 'r_' || lpad(i::varchar, 40, '0') as custom_id,
                'row ' || i as prompt from range({rows}) t(i)) order by custom_id"""
        ).fetchall()
    path.write_text("".join(line + "\n" for (line,) in lines))
    return str(path)


def test_the_provider_calls_against_the_sandbox(emulator, bedrock, tmp_path):
    p = provider(bedrock)
    p.check_credentials()
    path = request_file(p, tmp_path / "job.jsonl")
    token = "job_0123456789abcdef0123456789abcdef"
    assert p.find_upload(token, 0) is None
    file_id = p.upload(path, token)
    assert file_id == f"s3://{bedrock}/requests/{token}.jsonl" and p.find_upload(token, 0) == file_id
    assert p.find_submission(token, 0, set()) is None  # no job yet: the submission is voided and resent
    job = p.create(path, file_id, token, "main.m")
    assert p.create(path, file_id, token, "main.m").batch_id == job.batch_id  # one token, one job
    assert p.find_submission(token, 0, set()).batch_id == job.batch_id
    assert p.find_submission(token, 0, set(), frozenset({job.batch_id})) is None  # another job's already

    state = p.poll(job.batch_id)
    assert (state.status, state.ended) == ("Submitted", False)
    emulator.complete(job.batch_id)
    state = p.poll(job.batch_id)
    assert (state.status, state.ended, state.requests_done, state.error) == ("Completed", True, 100, None)
    ((source, results),) = p.download_results(state, job.batch_id, str(tmp_path))
    with open(results) as f:
        assert source == "results" and len(f.readlines()) == 100

    emulator.expire_results(job.batch_id)  # the output deleted from S3 (a lifecycle rule)
    gone = p.poll(job.batch_id)
    assert p.download_results(gone, job.batch_id, str(tmp_path)) == [] and gone.results_gone

    other = p.create(path, p.upload(path, token + "1"), token + "1", "main.m")
    assert p.cancel(other.batch_id) == "Stopping"
    emulator.advance(other.batch_id)
    assert p.poll(other.batch_id).status == "Stopped"
    for batch, uploaded in ((job.batch_id, file_id), (other.batch_id, f"s3://{bedrock}/requests/{token}1.jsonl")):
        p.delete_files(batch, [uploaded])
    assert boto3.session.Session().client("s3").list_objects_v2(Bucket=bedrock).get("Contents", []) == []
