"""Azure OpenAI Global Batch face of the sandbox: the OpenAI Files + Batches behaviour (openai_batch.py)
behind Azure's URL shapes and authentication, with what Azure does differently.

Driven by the `openai` SDK's AzureOpenAI client (`azure_endpoint=<sandbox base URL>`), which sends:
- every call under `<endpoint>/openai/...` with `?api-version=<version>`; a call without an api-version,
  or with one Azure does not serve, is refused before anything else (as Azure's front door does);
- the key in an `api-key` header (or an Entra ID token as `Authorization: Bearer`, accepted when it is
  the sandbox's key), never OpenAI's Bearer API key;
- realtime calls to `/openai/deployments/{deployment}/chat/completions` (the deployment names the model);
- batch files whose lines have `"url": "/chat/completions"` and `"model": <a global batch deployment>`,
  and batches created with `endpoint="/chat/completions"`.
Differences from OpenAI (learn.microsoft.com, azure ai-foundry openai how-to batch): jobs do not expire
("we do not expire the jobs that take longer"; a cancel returns the completed work, which is billed),
and the enqueued-token quota is per deployment: a batch past it fails with `token_limit_exceeded`.
"""

from __future__ import annotations

import json

from . import openai_batch
from .realtime import openai_chat_completion
from .server import ApiError, Request

# API versions that serve Global Batch (GA 2024-10-21 and later previews used in Azure's docs).
API_VERSIONS = ("2024-10-21", "2025-03-01-preview", "2025-04-01-preview", "2025-01-01-preview", "2024-07-01-preview")
ENDPOINTS = ("/chat/completions", "/embeddings", "/responses")
TOKEN_LIMIT = (
    "Enqueued token limit reached for deployment {model}. Limit: {limit:,} enqueued tokens. Please try again "
    "once some in_progress batches have been completed, or raise the deployment's enqueued token quota."
)
ACCESS_DENIED = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key "
    "for an active subscription and use a correct regional API endpoint for your resource."
)


class Face(openai_batch.Face):
    """Azure OpenAI: OpenAI's batch lifecycle under /openai, with api-version and api-key."""

    name = "azure_openai"
    prefixes = ("/openai",)
    request_id_header = "apim-request-id"
    batch_endpoints = ENDPOINTS
    emulated_endpoints = ("/chat/completions",)
    window_expires = False
    token_limit_message = TOKEN_LIMIT

    def __init__(self, emu) -> None:
        super().__init__(emu)
        self.routes = [
            ("POST", "/openai/files", self.upload_file),
            ("GET", "/openai/files", self.list_files),
            ("GET", "/openai/files/{id}", self.get_file),
            ("DELETE", "/openai/files/{id}", self.delete_file),
            ("GET", "/openai/files/{id}/content", self.file_content),
            ("POST", "/openai/batches", self.create_batch),
            ("GET", "/openai/batches", self.list_batches),
            ("GET", "/openai/batches/{id}", self.get_batch),
            ("POST", "/openai/batches/{id}/cancel", self.cancel_batch),
            ("POST", "/openai/deployments/{deployment}/chat/completions", self.chat_completion),
        ]

    def edge_check(self, req: Request) -> ApiError | None:
        version = req.query.get("api-version")
        if not version:
            return ApiError(404, "Resource not found", code="404")
        if version not in API_VERSIONS:
            return ApiError(
                400,
                f"The API version '{version}' is not supported for batch. Supported: {', '.join(API_VERSIONS)}.",
                code="BadRequest",
            )
        return None

    def api_key_from(self, headers: dict[str, str]) -> str | None:
        if headers.get("api-key"):
            return headers["api-key"].strip()
        scheme, _, token = headers.get("authorization", "").partition(" ")  # an Entra ID token
        return token.strip() if scheme.lower() == "bearer" else None

    def auth_error(self, presented: str | None) -> ApiError:
        return ApiError(401, ACCESS_DENIED, code="401")

    def route_not_found(self, method: str, path: str) -> ApiError:
        return ApiError(404, "Resource not found", code="404")

    def chat_completion(self, req: Request):
        body = req.json()
        if isinstance(body, dict):  # the deployment in the path is the model; a body's `model` is ignored
            body["model"] = req.params["deployment"]
            req.body = json.dumps(body).encode()
        return openai_chat_completion(self, req)
