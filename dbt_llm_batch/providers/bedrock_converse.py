"""One realtime request to Amazon Bedrock's Converse API through boto3 (`bedrock-runtime`).

boto3 is synchronous: each call runs in a worker thread, so the realtime executor's event loop keeps
other requests in flight. The client makes one attempt (the executor retries, inside the run's time
budget). Converse takes no idempotency key: a reply lost after sending may have been billed, and is
reported as LostReply like the other SDKs' (realtime.py sends it at most once more).
"""

from __future__ import annotations

import asyncio
import json

from dbt_llm_batch.providers.calls import status_of
from dbt_llm_batch.providers.realtime_transport import LostReply, Reply, TransientError, Transport

# botocore's failures before a request was sent: nothing can have been billed.
NOT_SENT = ("EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError")


class ConverseTransport(Transport):
    def __init__(self, client, model_id: str):
        super().__init__("Amazon Bedrock", "the AWS credential chain (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...)")
        self.client, self.model_id = client, model_id

    async def send(self, body: bytes, timeout: float) -> Reply:
        self.outstanding += 1
        try:
            request = json.loads(body)  # boto3 takes the Converse request as keyword arguments
            response = await asyncio.to_thread(self.client.converse, modelId=self.model_id, **request)
            response.pop("ResponseMetadata", None)
            reply = Reply(200, json.dumps(response, default=str))
        except Exception as exc:
            status = status_of(exc)
            if status is not None:  # botocore's ClientError: the service answered
                error = getattr(exc, "response", {}).get("Error", {})
                text = json.dumps({"message": error.get("Message") or str(exc), "__type": error.get("Code")})
                retry = 1.0 if status == 429 or status >= 500 else None
                reply = Reply(status, text, retry)
            else:
                names = {cls.__name__ for cls in type(exc).__mro__}
                what = f"{type(exc).__name__}: {exc}"
                if names & set(NOT_SENT):
                    self.failures += 1
                    raise TransientError(what) from None
                if "HTTPClientError" in names:  # a read timeout or a dropped connection after sending
                    self.never_connected, self.failures = False, 0
                    raise LostReply(what) from None
                raise
        finally:
            self.outstanding -= 1
        self.never_connected, self.failures = False, 0
        return reply

    async def aclose(self) -> None:
        return None  # botocore's connection pool closes with the client
