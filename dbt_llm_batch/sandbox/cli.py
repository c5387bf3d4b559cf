"""`python -m dbt_llm_batch.sandbox`: run the sandbox emulator until Ctrl-C.

One key serves both faces: --api-key, else $OPENAI_API_KEY, else
$ANTHROPIC_API_KEY, else "sk-sandbox". A key the user supplied is never printed.

`dbt-llm-batch sandbox advance|complete|expire|fault|batches ...` drive a running sandbox from
another shell: each is one call of a control endpoint (/_emulator/...), so nobody needs curl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from .server import Emulator

DEFAULT_KEY = "sk-sandbox"
BEDROCK_BANNER = """\
 Amazon Bedrock (batch inference and Converse, S3 at {s3}): the key is the
 access key id boto3 signs with:
   export AWS_ACCESS_KEY_ID=<the key above> AWS_SECRET_ACCESS_KEY=sandbox AWS_DEFAULT_REGION=us-east-1
   export AWS_ENDPOINT_URL_BEDROCK={base} AWS_ENDPOINT_URL_BEDROCK_RUNTIME={base}
   export AWS_ENDPOINT_URL_S3={s3}
====================================================================="""
BANNER = """\
=====================================================================
 SANDBOX emulator of the OpenAI Batch API (Files + Batches), the
 Anthropic Message Batches API and the Gemini API Batch Mode.
 Its answers are deterministic placeholders computed from the prompt,
 NOT a model's answers. Nothing is sent to OpenAI, Anthropic or Google;
 nothing is billed.
=====================================================================
 Base URL: {base}
   OpenAI base URL:    {base}/v1
   Anthropic base URL: {base}
   Gemini base URL:    {base}/gemini
   Azure endpoint:     {base}
 Batches advance {mode}.
 Use it from another shell with:
   export OPENAI_BASE_URL={base}/v1
   export OPENAI_API_KEY={key}
   export ANTHROPIC_BASE_URL={base}
   export ANTHROPIC_API_KEY={key}
   export GOOGLE_GEMINI_BASE_URL={base}/gemini
   export GEMINI_API_KEY={key}
   export AZURE_OPENAI_ENDPOINT={base}
   export AZURE_OPENAI_API_KEY={key}
 Finish a batch from another shell (after `export SANDBOX_URL={base}`):
   dbt-llm-batch sandbox batches             list batches with their status
   dbt-llm-batch sandbox advance <batch_id>  move it one stage along
   dbt-llm-batch sandbox complete            finish every open batch (or: complete <batch_id>)
   dbt-llm-batch sandbox expire <batch_id>   end it as expired
 Control endpoints: {base}/_emulator/ (stats, batches, faults, reset, ...)
 Press Ctrl-C to stop.
"""

URL_ENV = "SANDBOX_URL"
DEFAULT_URL = "http://127.0.0.1:8787"
CONTROL_COMMANDS = ("advance", "complete", "expire", "fault", "batches")
# Faults.add's parameters (answers.py), as --options of `sandbox fault`: name -> type.
FAULT_OPTIONS = {
    "kind": str,
    "endpoint": str,
    "path_contains": str,
    "prompt_contains": str,
    "times": int,
    "status_code": int,
    "type": str,
    "message": str,
    "code": str,
    "param": str,
    "content": str,
    "retry_after": float,
    "when": str,
}


def _call(url: str, method: str, path: str, body: dict | None = None) -> Any:
    """One control call; the sandbox's error message (4xx) becomes a SystemExit with it."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise SystemExit(f"sandbox: {message}") from None
    except urllib.error.URLError as exc:
        raise SystemExit(
            f"sandbox: no sandbox answers at {url} ({exc.reason}); start one with `dbt-llm-batch sandbox`, "
            f"or pass its address with --url or ${URL_ENV}"
        ) from None


def _status(batch: dict) -> str:
    """A batch's status word, for either face (OpenAI `status`, Anthropic `processing_status`)."""
    return str(batch.get("status") or batch.get("processing_status"))


# What `sandbox --help` lists after its flags: the controls that drive a running sandbox.
CONTROLS_HELP = """\
drive a running sandbox from another shell (after `export SANDBOX_URL=<its base URL>`, or --url):
  {prog} batches                 list every batch of both faces, newest first
  {prog} advance <batch_id>      move a batch one stage along (--to STATUS, --done-fraction F)
  {prog} complete [<batch_id>]   answer and end a batch (no id: every open batch)
  {prog} expire <batch_id>       end a batch as expired (--results: end its result retention)
  {prog} fault ...               add a fault, or --list / --clear them (`{prog} fault --help`)
"""


def control(argv: list[str], prog: str = "dbt-llm-batch sandbox") -> int:
    """`dbt-llm-batch sandbox <control> ...`: one control call to a running sandbox; prints the result."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Drive a running sandbox: move its batches along, add faults.",
    )
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"the sandbox's base URL (default: ${URL_ENV} or {DEFAULT_URL})",
    )
    sub = parser.add_subparsers(dest="control", required=True)
    adv = sub.add_parser("advance", help="move a batch one stage along (or to --to)")
    adv.add_argument("batch_id")
    adv.add_argument("--to", default=None, help="the status to move to (default: the next stage)")
    adv.add_argument("--done-fraction", type=float, default=0.0, help="share of requests answered on the way (0-1)")
    done = sub.add_parser("complete", help="answer every request of a batch and end it (no id: every open batch)")
    done.add_argument("batch_id", nargs="?")
    exp = sub.add_parser("expire", help="end a batch as expired (its unanswered requests expire)")
    exp.add_argument("batch_id")
    exp.add_argument("--done-fraction", type=float, default=0.0, help="share of requests answered before it expired")
    exp.add_argument(
        "--results", action="store_true", help="instead: end an ended batch's result retention (404 from then on)"
    )
    fault = sub.add_parser("fault", help="add a fault (see docs/sandbox.md), or --list / --clear them")
    for name, typ in FAULT_OPTIONS.items():
        fault.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None)
    fault.add_argument("--list", action="store_true", help="list the faults")
    fault.add_argument("--clear", action="store_true", help="remove every fault")
    sub.add_parser("batches", help="list every batch of both faces, newest first")
    args = parser.parse_args(argv)
    url = args.url
    if args.control == "advance":
        body: dict = {"done_fraction": args.done_fraction} | ({"to": args.to} if args.to else {})
        batch = _call(url, "POST", f"/_emulator/batches/{quote(args.batch_id, safe='')}/advance", body)
        print(f"{args.batch_id}: {_status(batch)}")
    elif args.control == "complete":
        if args.batch_id:
            batches = [_call(url, "POST", f"/_emulator/batches/{quote(args.batch_id, safe='')}/complete")]
        else:
            batches = _call(url, "POST", "/_emulator/complete_all")["batches"]
        for batch in batches:
            print(f"{batch['id']}: {_status(batch)}")
        if not batches:
            print("no open batch")
    elif args.control == "expire":
        if args.results:
            batch = _call(url, "POST", f"/_emulator/batches/{quote(args.batch_id, safe='')}/expire_results")
            print(f"{args.batch_id}: results expired")
        else:
            body = {"to": "expired", "done_fraction": args.done_fraction}
            batch = _call(url, "POST", f"/_emulator/batches/{quote(args.batch_id, safe='')}/advance", body)
            print(f"{args.batch_id}: {_status(batch)}")
    elif args.control == "fault":
        if args.clear:
            _call(url, "DELETE", "/_emulator/faults")
            print("no faults")
        elif args.list:
            print(json.dumps(_call(url, "GET", "/_emulator/faults"), indent=2))
        else:
            spec = {name: getattr(args, name) for name in FAULT_OPTIONS if getattr(args, name) is not None}
            print(json.dumps(_call(url, "POST", "/_emulator/faults", spec)))
    else:
        for batch in _call(url, "GET", "/_emulator/batches")["batches"]:
            print(f"{batch['id']}: {_status(batch)}")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str = "python -m dbt_llm_batch.sandbox") -> int:
    """The sandbox server, or (a control command first) one control call; `prog`: the command as the
    user typed it, for the usage lines (`dbt-llm-batch sandbox` from the package's command)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and (argv[0] in CONTROL_COMMANDS or argv[0] == "--url"):
        return control(argv, prog)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Local SANDBOX emulator of the OpenAI Batch API and the Anthropic Message Batches API.",
        epilog=CONTROLS_HELP.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "--s3-endpoint-url",
        default=None,
        metavar="URL",
        help="Bedrock: the S3 emulator its jobs read and write (moto's server: `moto_server -p 5000`, "
        "then http://127.0.0.1:5000); without it the Bedrock face refuses to create jobs",
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
        s3_endpoint_url=args.s3_endpoint_url,
    )
    emu.log_requests = not args.quiet
    emu.start()
    mode = (
        f"automatically, {args.auto_advance:g}s per stage"
        if args.auto_advance is not None
        else "only when told to (see below)"
    )
    # Never print a key the user supplied; only the sandbox's own default.
    shown_key = (
        "<the --api-key value>" if args.api_key else f'"${env_name}"  # as in this shell' if env_name else DEFAULT_KEY
    )
    print(BANNER.format(base=emu.base_url, mode=mode, key=shown_key), flush=True)
    if args.s3_endpoint_url:
        print(BEDROCK_BANNER.format(base=emu.base_url, s3=args.s3_endpoint_url), flush=True)
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
