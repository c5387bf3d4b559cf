"""OpenAI Files API of the sandbox (the OpenAI batch face mixes this in).

Batch input files must be .jsonl with purpose "batch" and at most
`max_file_bytes` (200 MB, decimal, by default) or the upload gets a 400; result files are
stored with purpose "batch_output". Also holds the small helpers both OpenAI
modules share: parameter checks and list pages.
"""

from __future__ import annotations

import email.parser
import email.policy
from collections.abc import Callable
from typing import Any

from .server import ApiError, Reply, Request

DAY = 86400
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data -> {field name: (filename or None, raw bytes)}."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, "Expected a multipart/form-data request body.")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    fields: dict = {}  # the email package types names and payloads loosely; form fields are str and bytes
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


class FilesMixin:
    """/v1/files routes over `self.files` (FileObjects as served) and `self.contents` (their bytes)."""

    files: dict[str, dict]
    contents: dict[str, bytes]
    deleted_contents: dict[str, bytes]  # what clients deleted: gone from the API, kept for test oracles
    emu: Any  # the Emulator, and the id maker, of the face that mixes this in
    _id: Callable[[str, int], str]

    def upload_file(self, req: Request) -> dict:
        fields = parse_multipart(req.headers.get("content-type", ""), req.body)
        for name in ("purpose", "file"):
            require(name in fields, f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
        purpose = fields["purpose"][1].decode(errors="replace")
        require(purpose in UPLOAD_PURPOSES, f"'{purpose}' is not one of {list(UPLOAD_PURPOSES)} - 'purpose'", "purpose")
        filename, data = fields["file"][0] or "file", fields["file"][1]
        require(len(data) <= (self.emu.max_file_bytes if purpose == "batch" else 512_000_000), "File is too large.")
        require(
            purpose != "batch" or filename.endswith(".jsonl"),
            "Invalid file format for Batch API. Must be .jsonl",
            "file",
        )
        ttl = 30 * DAY if purpose == "batch" else None  # batch inputs expire after 30 days by default
        if "expires_after[seconds]" in fields:
            ttl = ttl_seconds(fields["expires_after[seconds]"][1].decode(), "expires_after.seconds")
        self.emu.counters.files_uploaded += 1
        return dict(self._store(filename, purpose, data, self.emu.now(), ttl))

    def list_files(self, req: Request) -> dict:
        items = [dict(f) for f in self.files.values() if req.query.get("purpose") in (None, "", f["purpose"])]
        if req.query.get("order", "desc") != "asc":
            items.reverse()
        return list_page(items, req.query, default=10000, maximum=10000)

    def get_file(self, req: Request) -> dict:
        return dict(self._file(req.params["id"]))

    def delete_file(self, req: Request) -> dict:
        self._forget_file(self._file(req.params["id"])["id"])
        return {"id": req.params["id"], "object": "file", "deleted": True}

    def _forget_file(self, file_id: str) -> None:
        """Gone from the API (deleted by the client or by retention); kept for Emulator.file_bytes."""
        self.deleted_contents[file_id] = self.contents.pop(file_id)
        del self.files[file_id]

    def file_content(self, req: Request) -> Reply:
        return Reply(200, self.contents[self._file(req.params["id"])["id"]], "application/octet-stream")

    def _file(self, file_id: str, param: str = "id") -> dict:
        require(file_id in self.files, f"No such File object: {file_id}", param, status=404)
        return self.files[file_id]

    def _store(self, filename: str, purpose: str, data: bytes, at: float, ttl: int | None) -> dict:
        f: dict[str, Any] = {
            "id": self._id("file-", 22),
            "object": "file",
            "bytes": len(data),
            "created_at": int(at),
            "expires_at": None if ttl is None else int(at) + ttl,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        self.files[f["id"]], self.contents[f["id"]] = f, data
        return f


def require(ok: object, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
    if not ok:
        raise ApiError(status, message, code=code, param=param)


def list_page(items: list[dict], query: dict[str, str], default: int, maximum: int) -> dict:
    try:
        limit = int(query.get("limit", default))
    except ValueError:
        limit = -1
    require(1 <= limit <= maximum, f"Invalid 'limit': expected an integer between 1 and {maximum}.", "limit")
    if query.get("after"):
        ids = [item["id"] for item in items]
        require(query["after"] in ids, f"Invalid 'after': no object with id '{query['after']}'.", "after")
        items = items[ids.index(query["after"]) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def ttl_seconds(seconds: object, param: str) -> int:
    try:
        value = int(seconds)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        value = 0
    require(3600 <= value <= 30 * DAY, f"Invalid '{param}': expected an integer between 3600 and 2592000.", param)
    return value
