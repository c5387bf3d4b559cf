"""`dbt-llm-batch sandbox advance|complete|expire|fault|batches` drive a running sandbox from another
shell, and the control endpoint the README documents works with no body (one stage along). Each
control is run as a user runs it (the CLI in a subprocess) and checked through the official SDKs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
from helpers import control, line, req, submit

REPO = Path(__file__).resolve().parents[1]


def sandbox(emu, *args: str, ok: bool = True) -> str:
    """`dbt-llm-batch sandbox <args>` against `emu`; its output (stderr too, when it fails)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SANDBOX_URL": emu.base_url}
    done = subprocess.run(
        [sys.executable, "-m", "dbt_llm_batch.ops.cli", "sandbox", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def openai_batch(client):
    return submit(client, [line("a", "first"), line("b", "second")])


def claude_batch(claude):
    return claude.messages.batches.create(requests=[req("a", "first"), req("b", "second")])


def test_advance_with_no_body_moves_an_openai_batch_one_stage_at_a_time(emu, client):
    batch = openai_batch(client)
    assert client.batches.retrieve(batch.id).status == "validating"
    # The call as the README shows it: POST, no body.
    assert control(emu, "POST", f"/_emulator/batches/{batch.id}/advance")["status"] == "in_progress"
    assert sandbox(emu, "advance", batch.id).strip() == f"{batch.id}: finalizing"
    assert client.batches.retrieve(batch.id).status == "finalizing"
    assert sandbox(emu, "advance", batch.id).strip() == f"{batch.id}: completed"
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2 and done.output_file_id
    # Nothing after completed: one message, no traceback.
    out = sandbox(emu, "advance", batch.id, ok=False)
    assert "has ended ('completed')" in out and "Traceback" not in out


def test_advance_ends_an_anthropic_batch(emu, claude):
    batch = claude_batch(claude)
    assert claude.messages.batches.retrieve(batch.id).processing_status == "in_progress"
    assert sandbox(emu, "advance", batch.id).strip() == f"{batch.id}: ended"
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.succeeded == 2


def test_advance_to_a_named_status_with_a_share_answered(emu, client):
    batch = openai_batch(client)
    assert (
        sandbox(emu, "advance", batch.id, "--to", "in_progress", "--done-fraction", "0.5")
        .strip()
        .endswith("in_progress")
    )
    assert client.batches.retrieve(batch.id).request_counts.completed == 1


@pytest.mark.parametrize("face", ["openai", "anthropic"])
def test_complete_one_batch_and_every_open_batch(emu, client, claude, face):
    first = openai_batch(client) if face == "openai" else claude_batch(claude)
    second = openai_batch(client) if face == "openai" else claude_batch(claude)
    final = "completed" if face == "openai" else "ended"
    assert sandbox(emu, "complete", first.id).strip() == f"{first.id}: {final}"
    listed = sandbox(emu, "batches")
    assert f"{first.id}: {final}" in listed and f"{second.id}: {final}" not in listed
    assert f"{second.id}: {final}" in sandbox(emu, "complete")  # no id: every open batch
    if face == "openai":
        assert client.batches.retrieve(second.id).request_counts.completed == 2
    else:
        assert claude.messages.batches.retrieve(second.id).request_counts.succeeded == 2
    assert sandbox(emu, "complete").strip() == "no open batch"


@pytest.mark.parametrize("face", ["openai", "anthropic"])
def test_expire_a_batch_and_then_its_results(emu, client, claude, face):
    if face == "openai":
        batch = openai_batch(client)
        assert sandbox(emu, "expire", batch.id).strip() == f"{batch.id}: expired"
        expired = client.batches.retrieve(batch.id)
        assert expired.status == "expired" and expired.request_counts.failed == 2
        assert sandbox(emu, "expire", batch.id, "--results").strip() == f"{batch.id}: results expired"
        with pytest.raises(openai.NotFoundError):
            client.files.content(expired.error_file_id)
    else:
        batch = claude_batch(claude)
        assert sandbox(emu, "expire", batch.id, "--done-fraction", "0.5").strip() == f"{batch.id}: ended"
        expired = claude.messages.batches.retrieve(batch.id)
        assert (expired.request_counts.expired, expired.request_counts.succeeded) == (1, 1)
        sandbox(emu, "expire", batch.id, "--results")
        with pytest.raises(anthropic.NotFoundError):
            list(claude.messages.batches.results(batch.id))


def test_fault_add_list_clear(emu, client, claude):
    out = sandbox(emu, "fault", "--endpoint", "POST /v1/batches", "--status-code", "503", "--times", "1")
    assert '"status_code": 503' in out
    assert "POST /v1/batches" in sandbox(emu, "fault", "--list")
    with pytest.raises(openai.InternalServerError):
        openai_batch(client)
    openai_batch(client)  # the fault fired once
    sandbox(emu, "fault", "--endpoint", "POST /v1/messages/batches", "--status-code", "529", "--times", "1")
    sandbox(emu, "fault", "--clear")
    assert emu.faults() == []
    claude_batch(claude)
    out = sandbox(emu, "fault", "--endpoint", "POST /v1/nowhere", ok=False)
    assert "unknown endpoint" in out and "Traceback" not in out


def test_a_sandbox_that_is_not_running_is_one_message(emu):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "dbt_llm_batch.ops.cli", "sandbox", "--url", "http://127.0.0.1:9", "batches"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode != 0 and "no sandbox answers at http://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_banner_says_how_to_finish_a_batch_and_that_works(tmp_path):
    """Start the sandbox as a user does; follow its banner from another shell to finish a batch."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    out = (tmp_path / "banner.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dbt_llm_batch.ops.cli", "sandbox", "--port", "0", "--quiet"],
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        banner = ""
        for _ in range(600):  # bounded: at most 120 s for an import on two loaded cores
            banner = (tmp_path / "banner.txt").read_text()
            if "Press Ctrl-C" in banner or proc.poll() is not None:
                break
            proc_wait(proc, 0.2)
        assert "Press Ctrl-C" in banner, banner
        base = re.search(r"export SANDBOX_URL=(\S+?)`", banner)[1]
        for command in (
            "dbt-llm-batch sandbox batches",
            "dbt-llm-batch sandbox advance <batch_id>",
            "dbt-llm-batch sandbox complete",
            "dbt-llm-batch sandbox expire <batch_id>",
        ):
            assert command in banner
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-sandbox", max_retries=0)
        batch = openai_batch(client)

        class Running:  # the sandbox the banner names, for sandbox()
            base_url = base

        assert f"{batch.id}: validating" in sandbox(Running, "batches")
        assert sandbox(Running, "complete").strip() == f"{batch.id}: completed"
        assert client.batches.retrieve(batch.id).status == "completed"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        out.close()


def proc_wait(proc, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def test_help_names_the_command_typed_and_lists_the_controls():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command, prog in (
        (["-m", "dbt_llm_batch.ops.cli", "sandbox"], "dbt-llm-batch sandbox"),
        (["-m", "dbt_llm_batch.sandbox"], "python -m dbt_llm_batch.sandbox"),
    ):
        done = subprocess.run(
            [sys.executable, *command, "--help"], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0 and done.stdout.startswith(f"usage: {prog} "), done.stdout
        for control_command in ("batches", "advance <batch_id>", "complete [<batch_id>]", "expire <batch_id>"):
            assert f"{prog} {control_command}" in done.stdout


def test_a_reader_that_stops_reading_ends_the_listing_without_a_traceback(emu, client):
    """`dbt-llm-batch sandbox batches | head`: the pipe's reader is gone before the listing is written."""
    openai_batch(client)
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `head` exits after the lines it wanted
    env = {**os.environ, "PYTHONPATH": str(REPO), "SANDBOX_URL": emu.base_url}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dbt_llm_batch.ops.cli", "sandbox", "batches"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 0, done.stderr
