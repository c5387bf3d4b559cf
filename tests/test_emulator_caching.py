"""Prompt caching in the sandbox: Anthropic's `cache_control` breakpoints and OpenAI's automatic
prefix caching, with the exact token numbers clients record. Real SDKs, max_retries=0."""

from __future__ import annotations

import json
import time

import openai
from helpers import CLAUDE_MODEL as MODEL
from helpers import SANDBOX_KEY as KEY
from helpers import req, results_of, tokens

# -- prompt caching ----------------------------------------------------------------------


def cached_system(chars, ttl=None):
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": "S" * chars, "cache_control": control}]


def test_one_batch_writes_the_cache_once_and_reads_it_after(emu, claude):
    system = cached_system(20000)  # 5000 tokens
    batch = claude.messages.batches.create(requests=[req(f"r{i}", f"question {i}", system=system) for i in range(10)])
    emu.advance(batch.id, "ended")
    usage = {cid: r.message.usage for cid, r in results_of(claude, batch.id).items()}
    for cid, u in usage.items():
        total = tokens(20000 + len(f"question {cid[1:]}"))
        assert u.input_tokens == total - 5000
        if cid == "r0":  # the first in input order writes
            assert (u.cache_creation_input_tokens, u.cache_read_input_tokens) == (5000, 0)
            assert u.cache_creation.model_dump() == {"ephemeral_5m_input_tokens": 5000, "ephemeral_1h_input_tokens": 0}
        else:
            assert (u.cache_creation_input_tokens, u.cache_read_input_tokens) == (0, 5000)
            assert u.cache_creation.model_dump() == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    ant = emu.stats()["usage_by_face"]["anthropic"]
    assert (ant["cache_creation_input_tokens"], ant["cache_read_input_tokens"]) == (5000, 45000)

    again = claude.messages.batches.create(requests=[req("next", "question 0", system=system)])
    emu.advance(again.id, "ended")
    assert results_of(claude, again.id)["next"].message.usage.cache_read_input_tokens == 5000
    other_model = claude.messages.batches.create(requests=[req("m", "q", system=system, model="claude-y")])
    emu.advance(other_model.id, "ended")  # the cache is per model
    assert results_of(claude, other_model.id)["m"].message.usage.cache_creation_input_tokens == 5000


def test_cache_entries_expire_after_their_ttl_on_the_emulator_clock(emu, claude):
    start = time.time()
    short, long = cached_system(8000), cached_system(8400, ttl="1h")
    first = claude.messages.batches.create(requests=[req("s", "q", system=short), req("l", "q", system=long)])
    emu.advance(first.id, "ended")
    assert results_of(claude, first.id)["l"].message.usage.cache_creation.ephemeral_1h_input_tokens == 2100
    emu.now = lambda: start + 301
    later = claude.messages.batches.create(requests=[req("s", "q", system=short), req("l", "q", system=long)])
    emu.advance(later.id, "ended")
    results = results_of(claude, later.id)
    assert results["s"].message.usage.cache_creation_input_tokens == 2000  # 5 minutes passed: written again
    assert results["l"].message.usage.cache_read_input_tokens == 2100  # the 1 h entry is still there


def test_prefix_below_min_cache_tokens_is_not_cached(emu, claude):
    system = cached_system(4000)  # 1000 tokens < 1024
    batch = claude.messages.batches.create(requests=[req(f"r{i}", "q", system=system) for i in range(3)])
    emu.advance(batch.id, "ended")
    for r in results_of(claude, batch.id).values():
        u = r.message.usage
        assert (u.cache_creation_input_tokens, u.cache_read_input_tokens) == (0, 0)
        assert u.input_tokens == tokens(4001)


def test_breakpoint_on_a_message_block_caches_up_to_that_block(claude, emu):
    shots = [
        {"role": "user", "content": "E" * 5000},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "A" * 3000, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "tail"},
            ],
        },
    ]
    params = {
        "model": MODEL,
        "max_tokens": 100,
        "system": "Sys.",
        "messages": shots + [{"role": "user", "content": "the question"}],
    }
    batch = claude.messages.batches.create(
        requests=[{"custom_id": "a", "params": params}, {"custom_id": "b", "params": params}]
    )
    emu.advance(batch.id, "ended")
    results = results_of(claude, batch.id)
    prefix = tokens(len("Sys.") + 5000 + 3000)
    total = tokens(len("Sys.") + 5000 + len("A" * 3000 + "\ntail") + len("the question"))
    assert results["a"].message.usage.cache_creation_input_tokens == prefix
    assert results["b"].message.usage.cache_read_input_tokens == prefix
    assert results["b"].message.usage.input_tokens == total - prefix


# -- OpenAI automatic prompt caching -----------------------------------------------------


def test_openai_caches_the_prefix_before_the_last_user_message(emu):
    oai = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
    system = "You are a careful assistant. " * 300  # 8700 chars -> 2175 tokens -> 2048 cached

    def run(prompts):
        lines = [
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "gpt-x",
                    "prompt_cache_key": "triage",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": p}],
                },
            }
            for i, p in enumerate(prompts)
        ]
        f = oai.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
        batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        emu.advance(batch.id, "completed")
        done = oai.batches.retrieve(batch.id)
        out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
        return done, [r["response"]["body"]["usage"] for r in out]

    first, usage1 = run([f"question {i}" for i in range(4)])
    cached1 = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usage1)
    assert cached1 == [0, 2048, 2048, 2048]  # the first one processed writes, the others read
    second, usage2 = run([f"other {i}" for i in range(3)])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage2] == [2048] * 3
    assert all(u["prompt_tokens"] == tokens(len(system) + len("other 0")) for u in usage2)
    assert second.usage.input_tokens_details.cached_tokens == 3 * 2048
    assert emu.stats()["usage_by_face"]["openai"]["cached_tokens"] == 6 * 2048
    assert tokens(len(system)) // 128 * 128 == 2048


def test_openai_short_prefix_is_never_cached(emu):
    oai = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-x",
            "messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "q"}],
        },
    }
    for _ in range(2):
        f = oai.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        emu.advance(batch.id, "completed")
        assert oai.batches.retrieve(batch.id).usage.input_tokens_details.cached_tokens == 0
