"""`python -m dbt_llm_batch.sandbox`: the banner names both faces, one key serves both, a user's key is
never printed, and Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import anthropic
import openai

STARTUP_TIMEOUT = 120  # generous: an import on two loaded cores can take long; it only bounds a hang


def start_cli(env, command=("-m", "dbt_llm_batch.sandbox")):
    """Start the CLI; return (process, banner text, base URL)."""
    proc = subprocess.Popen(
        [sys.executable, *command, "--port", "0", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue = queue.Queue()  # read on a thread, so a CLI that hangs silently cannot hang the test
    threading.Thread(
        target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] + [lines.put("")], daemon=True
    ).start()
    banner, deadline = "", time.monotonic() + STARTUP_TIMEOUT
    while "Press Ctrl-C" not in banner:
        try:
            out = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            out = None
        if not out:
            proc.kill()
            problem = "exited" if out == "" else f"printed no banner within {STARTUP_TIMEOUT} s"
            raise AssertionError(f"the sandbox CLI {problem}:\n{banner}{proc.communicate(timeout=30)[1]}")
        banner += out
    base = next(x.split()[-1] for x in banner.splitlines() if x.strip().startswith("Base URL:"))
    return proc, banner, base


def stop_cli(proc):
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0  # generous: CI machines have two loaded cores


def test_cli_prints_sandbox_banner_and_stops_on_ctrl_c():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
    proc, banner, base = start_cli(env)
    try:
        assert "SANDBOX" in banner and "NOT a model's answers" in banner and "sk-sandbox" in banner
        assert f"export OPENAI_BASE_URL={base}/v1" in banner and f"export ANTHROPIC_BASE_URL={base}\n" in banner
        assert "export OPENAI_API_KEY=sk-sandbox" in banner and "export ANTHROPIC_API_KEY=sk-sandbox" in banner
        sandbox = openai.OpenAI(base_url=base + "/v1", api_key="sk-sandbox", max_retries=0)
        assert list(sandbox.batches.list()) == []
        claude = anthropic.Anthropic(base_url=base, api_key="sk-sandbox", max_retries=0)
        assert list(claude.messages.batches.list()) == []
    finally:
        stop_cli(proc)


def test_cli_takes_the_anthropic_key_from_the_environment_without_printing_it():
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["ANTHROPIC_API_KEY"] = "sk-ant-from-env-123"
    proc, banner, base = start_cli(env)
    try:
        assert "sk-ant-from-env-123" not in banner and 'export ANTHROPIC_API_KEY="$ANTHROPIC_API_KEY"' in banner
        claude = anthropic.Anthropic(base_url=base, api_key="sk-ant-from-env-123", max_retries=0)
        assert list(claude.messages.batches.list()) == []
        with_openai = openai.OpenAI(base_url=base + "/v1", api_key="sk-ant-from-env-123", max_retries=0)
        assert list(with_openai.batches.list()) == []  # one key serves both faces
    finally:
        stop_cli(proc)


def test_the_package_command_starts_the_same_sandbox():
    """`dbt-llm-batch sandbox --port ... --api-key ...`, as the README writes it."""
    proc, banner, base = start_cli(
        {**os.environ, "OPENAI_API_KEY": "sk-from-env"},
        command=("-m", "dbt_llm_batch.ops.cli", "sandbox", "--api-key", "sk-given"),
    )
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-given", max_retries=0)
        assert client.batches.list().data == []
        assert "sk-given" not in banner
    finally:
        stop_cli(proc)
