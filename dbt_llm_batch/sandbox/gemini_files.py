"""The Gemini Files API of the sandbox (the Gemini face mixes this in): resumable uploads, list, get,
delete, and the download of generated files (a batch's responses file).

Follows the google-genai SDK's wire protocol (files.upload): a `start` POST to
`upload/{version}/files` with the file's metadata answers an `x-goog-upload-url`; `upload, finalize`
POSTs to it carry the bytes at `X-Goog-Upload-Offset` and the last answers `{"file": File}` with
`x-goog-upload-status: final`. Files are kept 48 hours (Files API docs), at most `gemini_max_file_bytes`
(2 GB) each. Uploaded files cannot be downloaded; generated ones can (`files/{id}:download?alt=media`).
"""

from __future__ import annotations

import base64
import hashlib
import string
from collections.abc import Callable
from typing import Any

from .server import ApiError, Reply, Request

FILES_KEPT = 48 * 3600
PAGE_MAX = 100


def rfc3339(at: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def require(ok: object, message: str, status: int = 400) -> None:
    if not ok:
        raise ApiError(status, message)


class GeminiFilesMixin:
    """Files over `self.files` (File objects as served, by name `files/<id>`) and `self.contents`."""

    files: dict[str, dict]
    contents: dict[str, bytes]
    deleted_contents: dict[str, bytes]  # what clients deleted: gone from the API, kept for test oracles
    uploads: dict[str, dict]  # upload id -> {"meta", "data"} of a resumable upload not yet finalized
    emu: Any
    _id: Callable[..., str]

    def upload(self, req: Request) -> Reply:
        command = req.headers.get("x-goog-upload-command", "").replace(" ", "")
        if command == "start":
            require(req.headers.get("x-goog-upload-protocol") == "resumable", "Upload protocol must be resumable.")
            body = req.json()
            raw = body.get("file", {}) if isinstance(body, dict) else {}
            require(isinstance(raw, dict), "Invalid value at 'file': expected a File object.")
            # Proto JSON takes both spellings of a field; the SDK sends snake_case (display_name, ...).
            meta = {_camel(k): v for k, v in raw.items()}
            size = int(req.headers.get("x-goog-upload-header-content-length") or meta.get("sizeBytes") or 0)
            require(size <= self.emu.gemini_max_file_bytes, f"File size {size} exceeds the 2 GB limit.")
            upload_id = self._id("", 24, string.ascii_lowercase + string.digits)
            self.uploads[upload_id] = {"meta": meta, "size": size, "data": b""}
            host = req.headers.get("host") or f"{self.emu.host}:{self.emu.port}"
            url = f"http://{host}{req.path}?upload_id={upload_id}&upload_protocol=resumable"
            return Reply(200, b"{}", headers={"x-goog-upload-url": url, "x-goog-upload-status": "active"})
        require(command in ("upload", "upload,finalize"), f"Unknown X-Goog-Upload-Command {command!r}.")
        upload = self.uploads.get(req.query.get("upload_id", ""))
        require(upload is not None, "No such upload session.", 404)
        assert upload is not None
        require(
            req.headers.get("x-goog-upload-offset") == str(len(upload["data"])),
            f"Upload offset must be {len(upload['data'])}.",
        )
        upload["data"] += req.body
        require(len(upload["data"]) <= upload["size"], "More bytes were sent than the upload declared.")
        if command == "upload":
            return Reply(200, b"", headers={"x-goog-upload-status": "active"})
        require(len(upload["data"]) == upload["size"], "Fewer bytes were sent than the upload declared.")
        del self.uploads[req.query["upload_id"]]
        meta = upload["meta"]
        name = meta.get("name") or "files/" + self._id("", 12, string.ascii_lowercase + string.digits)
        require(name not in self.files, f"File {name} already exists.", 409)
        f = self.store_file(name, upload["data"], meta.get("mimeType") or "application/octet-stream", "UPLOADED")
        if meta.get("displayName"):
            f["displayName"] = meta["displayName"]
        return Reply(200, _json({"file": f}), headers={"x-goog-upload-status": "final"})

    def store_file(self, name: str, data: bytes, mime: str, source: str) -> dict:
        now = self.emu.now()
        f = {
            "name": name,
            "mimeType": mime,
            "sizeBytes": str(len(data)),
            "createTime": rfc3339(now),
            "updateTime": rfc3339(now),
            "expirationTime": rfc3339(now + FILES_KEPT),
            "sha256Hash": base64.b64encode(hashlib.sha256(data).hexdigest().encode()).decode(),
            "uri": f"http://{self.emu.host}:{self.emu.port}/gemini/v1beta/{name}",
            "state": "ACTIVE",
            "source": source,
            "_created": now,
        }
        if source == "GENERATED":
            f["downloadUri"] = f["uri"] + ":download?alt=media"
        self.files[name], self.contents[name] = f, data
        return f

    def list_files(self, req: Request) -> dict:
        names = list(reversed(self.files))  # newest first
        return page(names, req, lambda n: _served(self.files[n]), "files")

    def get_file(self, req: Request) -> dict:
        return _served(self._file(req.params["id"]))

    def delete_file(self, req: Request) -> dict:
        f = self._file(req.params["id"])
        self.deleted_contents[f["name"]] = self.contents.pop(f["name"])
        del self.files[f["name"]]
        return {}

    def download_file(self, req: Request) -> Reply:
        f = self._file(req.params["id"])
        require(req.query.get("alt") == "media", "Only alt=media downloads are supported.")
        require(f["source"] == "GENERATED", "Only generated files can be downloaded.")
        return Reply(200, self.contents[f["name"]], "application/octet-stream")

    def expire_files(self, now: float) -> None:
        for name in [n for n, f in self.files.items() if now >= f["_created"] + FILES_KEPT]:
            self.deleted_contents[name] = self.contents.pop(name)
            del self.files[name]

    def _file(self, file_id: str) -> dict:
        name = file_id if file_id.startswith("files/") else f"files/{file_id}"
        require(name in self.files, f"File {name} not found.", 403)  # the Files API answers 403 for a missing file
        return self.files[name]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)


def _served(f: dict) -> dict:
    return {k: v for k, v in f.items() if not k.startswith("_")}


def _json(obj: Any) -> bytes:
    import json

    return json.dumps(obj, ensure_ascii=False).encode()


def page(names: list[str], req: Request, render: Callable[[str], dict], field: str) -> dict:
    """One page of a list: `pageSize` (at most PAGE_MAX) from `pageToken` (the offset, as this sandbox writes it)."""
    try:
        size = int(req.query.get("pageSize", 10))
        start = int(req.query.get("pageToken") or 0)
    except ValueError:
        raise ApiError(400, "Invalid pageSize or pageToken.") from None
    require(size >= 1, "pageSize must be positive.")
    size = min(size, PAGE_MAX)
    page = names[start : start + size]
    out: dict = {field: [render(n) for n in page]}
    if start + size < len(names):
        out["nextPageToken"] = str(start + size)
    return out
