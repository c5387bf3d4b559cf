"""`dbt-llm-batch` command line: the local sandbox, a config check, the ledger's status and report, the poller, and operator actions."""

from __future__ import annotations

import argparse
import os
import sys


def status_command(args) -> int:
    """`dbt-llm-batch status`: in flight, progress and cost of the ledger (ops/status.py)."""
    from dbt_llm_batch.ops import status

    shape = "json" if args.json else "wide" if args.wide else "brief"
    return status.status(args.database, args.schema, shape)


def report_command(args) -> int:
    """`dbt-llm-batch report`: the HTML report and/or the FOCUS CSV (ops/report.py)."""
    from pathlib import Path

    from dbt_llm_batch.ledger.reads import LedgerNotReadable, LedgerReads, open_ledger
    from dbt_llm_batch.ops.report import ReportError, write_focus, write_report
    from dbt_llm_batch.pipeline.costs import fmt_usd

    if args.serve:
        from dbt_llm_batch.ops.report_server import make_server

        server = make_server(args.database, args.schema, args.within, args.port, args.refresh)
        port = server.server_address[1]
        print(f"serving the report of {args.database} on http://127.0.0.1:{port}/ (FOCUS: /focus.csv); Ctrl-C stops")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0
    try:
        ledger = LedgerReads(open_ledger(args.database, "dbt-llm-batch report"), args.schema)
        if args.focus:
            rows = write_focus(ledger, Path(args.focus))
            print(f"wrote {args.focus}: {rows} FOCUS row(s)")
        if args.out or not args.focus:
            out = Path(args.out or "llm_batch_report.html")
            data = write_report(ledger, out, args.within)
            spent = fmt_usd(data.totals["cost_usd"])
            print(f"wrote {out} (spent {spent}; {len(data.open_batches)} batch(es) open)")
    except (LedgerNotReadable, ReportError) as exc:
        print(f"dbt-llm-batch report: {exc}", file=sys.stderr)
        return 2
    return 0


# What no --schema means for a command that reads one ledger (every command but `poll` and `check`).
IN_ONE_SCHEMA = "the dbt profile target's when --database is not given, else main"

# Operator actions (dbt_llm_batch/operator.py), each on one model of one ledger.
OPERATOR_COMMANDS = {
    "cancel": "cancel the model's in-flight batches at the provider; their unanswered requests are held",
    "release": "let the next run send the model's held requests (cancelled, or of interrupted submissions)",
    "requeue": "give the model's failed requests a fresh set of attempts, without changing config",
    "unlock": "remove the model's run lock left by a dead process",
}


def poll_command(args) -> int:
    """`dbt-llm-batch poll`: harvest ended batches into the ledger (ops/poller.py); exit codes there."""
    import logging

    from dbt_llm_batch.errors import LlmBatchError
    from dbt_llm_batch.log import log
    from dbt_llm_batch.ops import poller
    from dbt_llm_batch.pipeline import progress
    from dbt_llm_batch.providers import calls

    bar = None
    handler: logging.Handler
    if sys.stderr.isatty():  # a progress bar, with the log lines printed above it
        from rich.logging import RichHandler
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        handler = RichHandler(console=bar.console, show_time=False, show_path=False, show_level=False)
        tasks: dict[str, object] = {}

        def on_progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)  # type: ignore[arg-type]

        progress.add_listener(on_progress)
        bar.start()
    else:  # plain lines (a log file, cron's mail, an orchestrator's task log)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        result = poller.poll(
            args.database, schema=args.schema, model=args.model, wait=args.wait, then=args.then, on_line=print
        )
    except LlmBatchError as exc:  # cannot poll at all: no such file, an unknown model, a --then it cannot expand
        print(f"dbt-llm-batch poll: {exc}", file=sys.stderr)
        return poller.EXIT_CANNOT_POLL
    except Exception as exc:  # a provider refused a call (a rejected key, ...): say so, no traceback
        message = calls.refusal(exc, "the provider", calls.sdk_key_hint(exc), again="poll")
        if message is None:  # a bug: its traceback is what a report needs
            raise
        print(f"dbt-llm-batch poll: {message}", file=sys.stderr)
        return poller.EXIT_CANNOT_POLL
    finally:
        log.removeHandler(handler)
        if bar is not None:
            progress.remove_listener(on_progress)
            bar.stop()
    if not result.models:
        print("no batch open")
    if result.models_with_new_results and result.then_command is not None and result.then_returncode == 0:
        print(f"new results for: {result.selector}; --then ran: {result.then_command}")
    elif result.models_with_new_results:
        print(f"new results for: {result.selector} (the next `dbt run` of each merges them without a provider call)")
    for line in result.cannot_poll:  # each says how to fix it
        print(f"dbt-llm-batch poll: {line}", file=sys.stderr)
    if result.unavailable:
        print(f"dbt-llm-batch poll: the provider stayed unavailable: {result.unavailable}", file=sys.stderr)
    if result.then_returncode:
        print(
            f"dbt-llm-batch poll: --then exited with status {result.then_returncode} ({result.then_command}); "
            f"recorded: the next poll with --then runs it again for {' '.join(result.then_models)}",
            file=sys.stderr,
        )
    elif args.then is None and any(m.then_owed for m in result.models):
        owed = [m for m in result.models if m.then_owed]
        how = "failed" if all((m.then_owed or {}).get("attempts") for m in owed) else "failed or did not finish"
        print(
            f"dbt-llm-batch poll: an earlier --then {how} for {' '.join(sorted({m.selector_name for m in owed}))}; "
            "the next poll with --then runs it again",
            file=sys.stderr,
        )
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """The command line; a reader that stops reading (`dbt-llm-batch sandbox batches | head`) ends it
    quietly, as `head` expects, instead of with a BrokenPipeError traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is caught below, not printed by Python
        return code
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull, so the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sandbox"]:  # the sandbox has its own options (see `dbt-llm-batch sandbox --help`)
        from dbt_llm_batch.sandbox.cli import main as sandbox_main

        return sandbox_main(argv[1:], prog="dbt-llm-batch sandbox")
    from dbt_llm_batch.errors import ConfigError
    from dbt_llm_batch.ops.profile import add_ledger_options, ledger_location

    parser = argparse.ArgumentParser(prog="dbt-llm-batch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sandbox", help="run the local provider emulator (answers are not a model's); see sandbox --help")
    ck = sub.add_parser(
        "check", help="validate every llm_batch model's config from the manifest (after `dbt parse`); no calls"
    )
    ck.add_argument("--project-dir", default=".", help="the dbt project (default: the current directory)")
    ck.add_argument("--manifest", help="the manifest.json to read (default: <project-dir>/target/manifest.json)")
    st = sub.add_parser("status", help="show in-flight batches, per-model progress and cost from the ledger")
    add_ledger_options(st, IN_ONE_SCHEMA)
    shape = st.add_mutually_exclusive_group()
    shape.add_argument("--wide", action="store_true", help="every column (the default fits 100 characters)")
    shape.add_argument("--json", action="store_true", help="every column, as one JSON object")
    rp = sub.add_parser(
        "report",
        help="write the ledger's cost, progress and evaluation report as one HTML file (no network needed to view)",
    )
    add_ledger_options(rp, IN_ONE_SCHEMA)
    rp.add_argument("--out", default=None, help="the HTML file to write (default: llm_batch_report.html)")
    rp.add_argument(
        "--focus", default=None, metavar="FILE.csv", help="also (or, without --out, only) write costs as FOCUS CSV"
    )
    rp.add_argument(
        "--within",
        type=float,
        default=0.02,
        help="evaluation runs: name the cheapest variant whose accuracy is within this of the best (default 0.02)",
    )
    rp.add_argument(
        "--serve", action="store_true", help="serve the report on 127.0.0.1 instead, read again at each reload"
    )
    rp.add_argument("--port", type=int, default=8765, help="--serve: the port (default 8765; 0: any free port)")
    rp.add_argument("--refresh", type=int, default=30, help="--serve: reload the page every this many seconds")
    for name, text in OPERATOR_COMMANDS.items():
        op = sub.add_parser(name, help=text)
        add_ledger_options(op, IN_ONE_SCHEMA)
        op.add_argument("--model", required=True, help="the model, as its name or schema.name")
    po = sub.add_parser(
        "poll",
        help="harvest the batches that ended into the ledger, without a dbt run (the next run merges them)",
        description="Exit codes: 0 nothing open; 3 still open (batches not ended, or --wait ran out; "
        "submissions the model's next dbt run reconciles); 2 cannot poll (no such or unreadable file, unknown "
        "model, a key not set, a config it cannot read: the message says how to fix it); 1 --then failed "
        "(recorded; the next poll with --then runs it again); 4 the provider stayed unavailable.",
    )
    add_ledger_options(po, "every schema of the file: poll reads each ledger in it")
    po.add_argument("--model", default=None, help="only this model, as its name or schema.name")
    po.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="poll with back-off until no batch is open"
    )
    po.add_argument(
        "--then",
        default=None,
        metavar="COMMAND",
        help="run COMMAND with /bin/sh once if new results were stored (or an earlier --then failed); "
        "{models} becomes their dbt names, one shell-quoted word each, dbt's graph operators around it "
        "kept: --then 'dbt build -s {models}+ && notify' runs `dbt build -s a+ b+ && notify`",
    )
    args = parser.parse_args(argv)
    if "database" in vars(args):  # a command that reads a ledger (add_ledger_options): --database's, or the profile's
        try:
            args.database, args.schema = ledger_location(args, schema_from_profile=args.command != "poll")
        except ConfigError as exc:
            print(f"dbt-llm-batch {args.command}: {exc}", file=sys.stderr)
            return 2
        if args.command != "poll":
            args.schema = args.schema or "main"
    if args.command == "poll":
        return poll_command(args)
    if args.command == "report":
        return report_command(args)
    if args.command == "check":
        from dbt_llm_batch.ops.check import check

        return check(args.project_dir, args.manifest)
    if args.command in OPERATOR_COMMANDS:
        from dbt_llm_batch.ops.operator import command

        return command(args)
    return status_command(args)


if __name__ == "__main__":
    sys.exit(main())
