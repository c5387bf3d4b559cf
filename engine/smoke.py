"""Smoke check of a running local engine (scripts/engine.sh start): structured chat completions through the
official openai SDK must come back as JSON holding one of the allowed categories, every time.

    .venv/bin/python engine/smoke.py [--requests 8] [--concurrency 1]
Exits non-zero, saying which answer was wrong, otherwise prints the rate. Needs only the openai package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import openai

CATEGORIES = ["billing", "bug", "how_to", "other"]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "llm_output",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"category": {"type": "string", "enum": CATEGORIES}},
            "required": ["category"],
            "additionalProperties": False,
        },
    },
}
TICKETS = [
    "I was charged twice this month.",
    "The app crashes when I export a report.",
    "How do I change my password?",
    "Do you have an office in Berlin?",
]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1)
    port = os.environ.get("DBT_LLM_BATCH_ENGINE_PORT", "8791")
    parser.add_argument("--base-url", default=f"http://127.0.0.1:{port}/v1")
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="EMPTY", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> str:
        async with gate:
            r = await client.chat.completions.create(
                model="gemma-3-270m",
                max_tokens=24,
                temperature=0,
                response_format=RESPONSE_FORMAT,
                messages=[
                    {"role": "system", "content": "Classify the support ticket."},
                    {"role": "user", "content": TICKETS[i % len(TICKETS)]},
                ],
            )
        content = r.choices[0].message.content
        category = json.loads(content).get("category")
        if category not in CATEGORIES or r.choices[0].finish_reason != "stop":
            raise SystemExit(f"request {i}: not an allowed category: {content!r} ({r.choices[0].finish_reason})")
        return category

    start = time.perf_counter()
    async with client:
        answers = await asyncio.gather(*(one(i) for i in range(args.requests)))
    elapsed = time.perf_counter() - start
    print(
        f"{len(answers)} valid answers ({', '.join(sorted(set(answers)))}) in {elapsed:.1f}s: "
        f"{len(answers) / elapsed:.2f} req/s at {args.concurrency} in flight"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
