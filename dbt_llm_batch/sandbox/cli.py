"""`python -m dbt_llm_batch.sandbox`: run the sandbox emulator until Ctrl-C.

One key serves both faces: --api-key, else $OPENAI_API_KEY, else
$ANTHROPIC_API_KEY, else "sk-sandbox". A key the user supplied is never printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from .server import Emulator

DEFAULT_KEY = "sk-sandbox"
BANNER = """\
=====================================================================
 SANDBOX emulator of the OpenAI Batch API (Files + Batches) and the
 Anthropic Message Batches API.
 Its answers are deterministic placeholders computed from the prompt,
 NOT a model's answers. Nothing is sent to OpenAI or Anthropic;
 nothing is billed.
=====================================================================
 Base URL: {base}
   OpenAI base URL:    {base}/v1
   Anthropic base URL: {base}
 Batches advance {mode}.
 Use it from another shell with:
   export OPENAI_BASE_URL={base}/v1
   export OPENAI_API_KEY={key}
   export ANTHROPIC_BASE_URL={base}
   export ANTHROPIC_API_KEY={key}
 Control endpoints: {base}/_emulator/ (stats, batches, faults, reset, ...)
 Press Ctrl-C to stop.
"""


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dbt_llm_batch.sandbox",
        description="Local SANDBOX emulator of the OpenAI Batch API and the Anthropic Message Batches API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8787)
    parser.add_argument(
        "--api-key",
        default=None,
        help="key clients must send, to either face (default: $OPENAI_API_KEY, "
        f"else $ANTHROPIC_API_KEY, else {DEFAULT_KEY!r})",
    )
    parser.add_argument(
        "--auto-advance",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds each batch stage lasts (default: wait for /_emulator/ advance calls)",
    )
    parser.add_argument(
        "--min-cache-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="shortest prompt prefix the prompt cache stores (default: each provider's "
        "per-model minimum, 1024 tokens, 2048 for Anthropic Haiku models)",
    )
    parser.add_argument(
        "--enqueued-token-limit",
        type=int,
        default=None,
        metavar="TOKENS",
        help="OpenAI: prompt tokens enqueued per model over the batches in progress; a batch "
        "over it fails with token_limit_exceeded (default: no limit)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="Anthropic: requests of unended batches; a create over it gets a 429 (default: no cap)",
    )
    parser.add_argument(
        "--null-usage-details",
        action="store_true",
        help="usage details and cache_* fields are null, as a vLLM server sends them by default",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--quiet", action="store_true", help="do not log requests")
    args = parser.parse_args(argv)
    env_name = next((name for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY") if os.environ.get(name)), None)
    api_key = args.api_key or (os.environ[env_name] if env_name else None)
    if not api_key:
        api_key = DEFAULT_KEY
        print(f"No --api-key, OPENAI_API_KEY or ANTHROPIC_API_KEY given; the sandbox accepts the key '{DEFAULT_KEY}'.")
    emu = Emulator(
        api_key,
        auto_advance_seconds=args.auto_advance,
        host=args.host,
        port=args.port,
        seed=args.seed,
        min_cache_tokens=args.min_cache_tokens,
        openai_enqueued_token_limit=args.enqueued_token_limit,
        anthropic_max_queued_requests=args.max_queued_requests,
        null_usage_details=args.null_usage_details,
    )
    emu.log_requests = not args.quiet
    emu.start()
    mode = (
        f"automatically, {args.auto_advance:g}s per stage"
        if args.auto_advance is not None
        else "only when told to (POST /_emulator/batches/{id}/advance or /_emulator/complete_all)"
    )
    # Never print a key the user supplied; only the sandbox's own default.
    shown_key = (
        "<the --api-key value>" if args.api_key else f'"${env_name}"  # as in this shell' if env_name else DEFAULT_KEY
    )
    print(BANNER.format(base=emu.base_url, mode=mode, key=shown_key), flush=True)
    # Stop cleanly on Ctrl-C and on kill, also when started as a background job (which inherits
    # SIGINT ignored, so Python would install no KeyboardInterrupt handler of its own).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nStopping sandbox emulator.")
    finally:
        emu.stop()
    return 0
