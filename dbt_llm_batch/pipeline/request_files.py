"""Request files: the plan's batch requests written as provider-sized JSONL files in one streamed pass.

Each request line is built once, in SQL (the provider's request_line_sql), and streamed as Arrow
batches whose value buffer is already the file's bytes: no Python object per line, and memory
bounded by a few Arrow batches whatever the plan's size. Files are written on a background thread,
so building lines and writing them overlap.

Lines are split into files greedily, in the order DuckDB streams them: a file ends before the line
that would take it over the provider's per-batch request count or bytes. The in-flight caps are
applied in the same pass (`Room`): writing stops at the first line no file may take, and that line
and the rest of the plan wait in the ledger (deferred). A capped run builds only the lines it sends.

Which plan rows went into which file, at which line, is recorded in the temp table SENT
(plan_row, chunk, line): the ledger's intents are written from it, and `line` (1-based) is what an
OpenAI validation error names (batch_failures.py).
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from decimal import Decimal
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbt_llm_batch.errors import InputError
from dbt_llm_batch.pipeline import arrow_tables, packing
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import joins_as_written

SENT = Scratch.sent
STREAM_BATCH_ROWS = 10_000
# The Arrow text types whose value buffer is the lines' bytes, end to end: the dtype of their offsets.
_OFFSET_TYPES = {pa.string(): np.int32, pa.large_string(): np.int64}


@dataclass
class Room:
    """What the in-flight caps leave for this run (None: no cap)."""

    batches: int | None = None
    requests: int | None = None
    tokens: int | None = None
    # With nothing in flight, a single request estimated over the token cap may go alone in a file;
    # otherwise it could never be sent.
    nothing_in_flight: bool = True


@dataclass
class RequestFile:
    chunk: int
    path: str | None  # None when nothing is written (a dry run only counts)
    requests: int = 0
    lines: int = 0  # request lines: fewer than requests when several are packed into one (packing.py)
    bytes: int = 0
    tokens: int = 0
    cost: Decimal | None = None


class _BackgroundWrites(threading.Thread):
    """Writes and closes files in order on a thread of its own, so DuckDB builds the next batch of
    lines while this one is written (the GIL is released by both). At most QUEUED batches wait."""

    QUEUED = 4

    def __init__(self):
        super().__init__(name="dbt-llm-batch-request-files", daemon=True)
        self.jobs: queue.Queue = queue.Queue(maxsize=self.QUEUED)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            handle, data = job
            try:
                if data is None:
                    handle.close()  # always, even after an error: no handle is left open
                elif self.error is None:
                    handle.write(data)
            except BaseException as exc:  # raised in the caller's thread by check()
                self.error = exc

    def write(self, handle, data) -> None:
        self.check()
        self.jobs.put((handle, data))

    def close(self, handle) -> None:
        self.jobs.put((handle, None))

    def finish(self) -> None:
        self.jobs.put(None)
        self.join()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Writer:
    """The greedy split, batch by batch; holds the file being filled and what was sent so far."""

    def __init__(self, con, directory, max_requests, max_bytes, room: Room):
        self.con, self.directory = con, directory
        self.max_requests, self.max_bytes, self.room = max_requests, max_bytes, room
        self.files: list[RequestFile] = []
        self.current: RequestFile | None = None
        self.handle: BinaryIO | None = None  # the current file, opened at its first line
        self.writes = _BackgroundWrites() if directory else None
        self.requests = self.tokens = 0  # over all files
        self.sent_rows: list[np.ndarray] = []
        self.sent_chunks: list[np.ndarray] = []
        self.sent_lines: list[np.ndarray] = []

    @property
    def file(self) -> RequestFile:
        """The file being filled: take() opens one before anything else is asked of it."""
        assert self.current is not None
        return self.current

    def take(self, batch: pa.RecordBatch) -> bool:
        """Write as much of `batch` as the limits allow; False once writing must stop."""
        lines = batch.column("line")
        # DuckDB hands text over as `string` (32-bit offsets): read as it is, not cast (a copy of every line).
        if lines.type not in _OFFSET_TYPES:
            lines = lines.cast(pa.large_string())
        offsets = np.frombuffer(lines.buffers()[1], dtype=_OFFSET_TYPES[lines.type])
        offsets = offsets[lines.offset : lines.offset + len(lines) + 1].astype(np.int64)
        sizes = np.diff(offsets)
        if lines.null_count:  # planner.build_plan fails requests without a prompt before they get here
            raise ValueError("dbt-llm-batch bug: a planned request has no request line")
        tokens = arrow_tables.to_numpy(batch.column("tokens"), np.int64, null=0)
        rows, inputs = _members(batch)
        starts = np.concatenate(([0], np.cumsum(inputs)))
        pos = 0
        while pos < len(sizes):
            if self.current is None and not self._open():
                return False
            n = self._fitting(sizes[pos:], tokens[pos:], inputs[pos:])
            if n == 0:
                if self.file.requests:  # full: the next line starts a new file
                    self._close()
                    continue
                if sizes[pos] > self.max_bytes:
                    raise InputError(
                        f"a request is {int(sizes[pos])} bytes, larger than the provider's batch limit "
                        f"({self.max_bytes} bytes) on its own; nothing was sent. Shorten that prompt."
                    )
                if not (self.room.nothing_in_flight and self.requests == 0 and self.room.requests != 0):
                    return False  # the in-flight caps are reached: the rest waits
                n = 1  # over the token cap alone, with nothing in flight: it goes by itself
            self._write(
                batch,
                lines,
                offsets,
                pos,
                n,
                int(sizes[pos : pos + n].sum()),
                int(tokens[pos : pos + n].sum()),
                rows[starts[pos] : starts[pos + n]],
                inputs[pos : pos + n],
            )
            pos += n
        return True

    def _fitting(self, sizes, tokens, inputs) -> int:
        """How many of the next lines the current file takes (the request limits count the requests
        the lines carry: `inputs` each)."""
        f = self.file
        carried = np.cumsum(inputs)
        n = int(np.searchsorted(carried, self.max_requests - f.requests, side="right"))
        if self.room.requests is not None:
            n = min(n, int(np.searchsorted(carried, self.room.requests - self.requests, side="right")))
        n = min(n, int(np.searchsorted(np.cumsum(sizes), self.max_bytes - f.bytes, side="right")))
        if self.room.tokens is not None:
            n = min(n, int(np.searchsorted(np.cumsum(tokens), self.room.tokens - self.tokens, side="right")))
        return max(n, 0)

    def _open(self) -> bool:
        if self.room.batches is not None and len(self.files) >= self.room.batches:
            return False
        chunk = len(self.files)
        path = os.path.join(self.directory, f"requests-{chunk}.jsonl") if self.directory else None
        self.current = RequestFile(chunk=chunk, path=path)
        return True

    def _write(self, batch, lines, offsets, pos, n, size, tokens, rows, inputs) -> None:
        f = self.file
        if f.path:
            assert self.writes is not None  # a file has a path only when there is a directory to write to
            if self.handle is None:
                self.handle = open(f.path, "wb")
            # The view keeps this batch's buffer alive until written (at most QUEUED batches).
            self.writes.write(self.handle, memoryview(lines.buffers()[2])[offsets[pos] : offsets[pos + n]])
        # A copy: a view would keep the whole Arrow batch (its lines included) alive until the end.
        self.sent_rows.append(rows.copy())
        self.sent_chunks.append(np.full(len(rows), f.chunk, dtype=np.int32))
        # Every request of a line has the line's number (1-based, in its file): what validation names.
        self.sent_lines.append(np.repeat(np.arange(f.lines + 1, f.lines + n + 1, dtype=np.int32), inputs))
        cost = pc.sum(batch.column("cost").slice(pos, n)).as_py()
        if cost is not None:
            f.cost = (f.cost or Decimal(0)) + cost
        carried = len(rows)
        f.requests, f.lines, f.bytes, f.tokens = f.requests + carried, f.lines + n, f.bytes + size, f.tokens + tokens
        self.requests, self.tokens = self.requests + carried, self.tokens + tokens

    def _close(self) -> None:
        if self.handle:
            assert self.writes is not None
            self.writes.close(self.handle)
            self.handle = None
        if self.file.requests:
            self.files.append(self.file)
        self.current = None

    def finish(self) -> None:
        """Close the file being filled and wait until every file is written."""
        if self.current is not None:
            self._close()
        if self.writes:
            self.writes.finish()

    def record_sent(self) -> None:
        sent = arrow_tables.from_numpy(
            {
                "plan_row": np.concatenate(self.sent_rows) if self.sent_rows else np.array([], np.int64),
                "chunk": np.concatenate(self.sent_chunks) if self.sent_chunks else np.array([], np.int32),
                "line": np.concatenate(self.sent_lines) if self.sent_lines else np.array([], np.int32),
            }
        )
        self.con.register(Scratch.sent_arrow, sent)
        try:
            self.con.execute(f"create or replace temp table {SENT} as select * from {Scratch.sent_arrow}")
        finally:
            self.con.unregister(Scratch.sent_arrow)


def nothing_to_write(con) -> list[RequestFile]:
    """No request file at all (a provider without a batch API: every row goes in realtime): SENT is
    recorded empty, as write_request_files would for an empty plan."""
    con.execute(f"create or replace temp table {SENT} (plan_row bigint, chunk integer, line integer)")
    return []


def unsent_rows(rows: str, first_unsent_chunk: int) -> str:
    """`rows` not written, or written to a file from `first_unsent_chunk` on (never submitted)."""
    return f"""(select p.* from {rows} p
               where p.plan_row not in (select plan_row from {SENT} where chunk < {int(first_unsent_chunk)}))"""


def _members(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """The plan rows the batch's lines carry, in line order, and how many each line carries (one, unless
    the lines are packed: a `plan_rows` list per line)."""
    if "plan_rows" not in batch.schema.names:
        rows = arrow_tables.to_numpy(batch.column("plan_row"), np.int64)
        return rows, np.ones(len(rows), dtype=np.int64)
    lists = batch.column("plan_rows")
    counts = arrow_tables.to_numpy(pc.list_value_length(lists), np.int64)
    return arrow_tables.to_numpy(lists.flatten(), np.int64), counts


def write_request_files(
    con,
    line_sql: str,
    rows: str,
    directory: str | None,
    max_requests: int,
    max_bytes: int,
    room: Room,
    packed: tuple[int, int | None] | None = None,
) -> list[RequestFile]:
    """Write the batch requests of `rows` (planner.plan_rows) into files under `directory` (None: only
    count), within the provider's per-batch limits and the in-flight `room`; returns the files, and
    records the rows written in SENT. Rows not written wait for a later run. `packed`: (inputs, estimated
    tokens) a line may carry at most; the rows then carry their lines' parts (packing.py), not `line_sql`."""
    writer = _Writer(con, directory, max_requests, max_bytes, room)
    if packed is not None:
        query = packing.packed_rows_sql(rows, *packed)
    else:
        query = f"""select plan_row, estimated_input_tokens as tokens, estimated_cost_usd as cost,
                           {line_sql} || chr(10) as line
                    from {rows}"""
    # The lines read each row's prompt from the input by its rowid (plan.plan_rows): with the join's
    # sides as written, the prompts stream through it instead of filling its hash table (5 GB at ten
    # million 512-character prompts, spilled under a memory limit). The statement is planned when the
    # reader is made; the setting (the database's, not the connection's) is set and restored through a
    # cursor, as `con` cannot run a statement while the reader holds its result open.
    setter = con.cursor()
    try:
        with joins_as_written(setter):
            reader = con.sql(query).to_arrow_reader(STREAM_BATCH_ROWS)
    finally:
        setter.close()
    try:
        for batch in reader:
            if not writer.take(batch):
                break
    finally:
        reader.close()
        writer.finish()
    writer.record_sent()
    return writer.files
