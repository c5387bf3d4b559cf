"""`dbt-llm-batch report --serve`: the report on loopback, read again from the ledger at each request,
and the page reloads itself every `refresh` seconds, so it follows batches while they run.

Each request opens the DuckDB file read-only and closes it before answering: the server never holds
the file between requests, so `dbt run` and `dbt-llm-batch poll` write in between. While one of them
holds the file, the page says so (503) and reloads later; it never waits on the lock.
"""

from __future__ import annotations

import html
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dbt_llm_batch.ledger.reads import LedgerNotReadable, LedgerReads, open_ledger
from dbt_llm_batch.ops.report import ReportError, read, render, write_focus

LOOPBACK = "127.0.0.1"  # never another interface: the page shows costs and model names


def make_server(database: str, schema: str, within: float, port: int = 0, refresh: int = 30) -> ThreadingHTTPServer:
    """A server on loopback (`port` 0: any free port; `server.server_address` says which); serve it
    with `serve_forever()`. Paths: `/` the report, `/focus.csv` the FOCUS export."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                con = open_ledger(database, "dbt-llm-batch report --serve")
                try:
                    ledger = LedgerReads(con, schema)
                    if self.path == "/":
                        body, kind = render(read(ledger, within), refresh_seconds=refresh).encode(), "text/html"
                    elif self.path == "/focus.csv":
                        with tempfile.TemporaryDirectory() as tmp:
                            out = Path(tmp) / "focus.csv"
                            write_focus(ledger, out)
                            body, kind = out.read_bytes(), "text/csv"
                    else:
                        self.send_error(404)
                        return
                finally:
                    con.close()
            except (LedgerNotReadable, ReportError) as exc:
                page = f'<!doctype html><meta http-equiv="refresh" content="{refresh}"><p>{html.escape(str(exc))}</p>'
                self._answer(503, page.encode(), "text/html")
                return
            self._answer(200, body, kind)

        def _answer(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # quiet: the terminal shows the URL only
            pass

    return ThreadingHTTPServer((LOOPBACK, port), Handler)
