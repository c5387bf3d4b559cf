"""Packing: several requests in one batch request line, where the provider's API takes an array of
inputs (OpenAI embeddings: `input` is a list), and each request's outcome read back out of its line.

Sending: a sender's rows are grouped into lines of at most the provider's inputs and estimated tokens per
line (Provider.max_inputs_per_line, max_tokens_per_line), never mixing two passes; a line's inputs are
its requests in custom_id order and the line carries the first one's custom_id. Every request of a line
is recorded with the same `file_line` (request_files.SENT), so the ledger still maps each row to its
request, and its request to the line that answers it.

Settling: a result line answers the requests of its job recorded at its line (the requests whose
`file_line` is that of the request named by the line's custom_id), in custom_id order: the i-th vector
of the line's answer (a list of vectors, FLOAT[][]) is the i-th request's, split off by one set-based
unnest and joined to it by position, and kept typed (the outcome's `vector`, FLOAT[]; `answer` NULL); an error, or an expiry, is every one of them's (so a failed
line retries only its own rows); the line's input tokens are split among them (exactly: the parts add
up to the line's). A line with no recorded line number (a realtime reply) answers its own request.
"""

from __future__ import annotations


def packed_rows_sql(rows: str, max_inputs: int, max_tokens: int | None) -> str:
    """One row per request line over `rows` (a sender's plan rows with `plan_row`, `custom_id`,
    `estimated_input_tokens`, `estimated_cost_usd`, `pack_group` (the pass), `input_json` (the prompt as
    JSON) and the line's literal parts `line_head`, `line_middle`, `line_tail`): `plan_rows` (its
    requests, in input order), `tokens`, `cost`, `line`. Ordered as the plan, line after line."""
    token_group = f"cum // {int(max_tokens)}" if max_tokens else "0"
    return f"""
        with numbered as (
            select *, row_number() over (partition by pack_group order by plan_row) - 1 as n,
                   sum(coalesce(estimated_input_tokens, 0)) over (
                       partition by pack_group order by plan_row rows between unbounded preceding and current row) as cum
            from {rows}),
        grouped as (
            select *, dense_rank() over (order by pack_group, n // {int(max_inputs)}, {token_group}) as grp
            from numbered)
        select list(plan_row order by custom_id) as plan_rows,
               sum(estimated_input_tokens) as tokens, sum(estimated_cost_usd) as cost,
               any_value(line_head) || to_json(min(custom_id)) || any_value(line_middle)
                   || '[' || string_agg(input_json, ',' order by custom_id) || ']' || any_value(line_tail)
                   || chr(10) as line
        from grouped group by grp order by grp"""


def members_sql(lines: str, requests: str) -> str:
    """The outcome rows (providers.base.OUTCOME_COLUMNS, source, job_id, vector) of each request
    answered by the result lines of `lines` (one row per result line, its `answer` a list of one vector
    per input), one row per request: see the module's docstring."""
    return f"""
        with heads as (
            select l.custom_id as line_id, l.job_id, r.file_line
            from {lines} l join {requests} r on r.custom_id = l.custom_id and r.job_id = l.job_id
            where r.file_line is not null),
        members as (
            select h.line_id, h.job_id, m.custom_id,
                   row_number() over (partition by h.job_id, h.line_id order by m.custom_id) as pos,
                   count(*) over (partition by h.job_id, h.line_id) as n
            from heads h join {requests} m on m.job_id = h.job_id and m.file_line = h.file_line),
        -- Each line's vectors split off once (never a line's whole list per request: a line is megabytes).
        vectors as (
            select custom_id as line_id, job_id, unnest(range(1, len(answer) + 1)) as pos, unnest(answer) as vector
            from {lines} where outcome = 'ok')
        select coalesce(m.custom_id, l.custom_id) as custom_id, l.outcome, null::varchar as answer,
               l.finish_reason, l.truncated, l.error,
               {_split("l.input_tokens")} as input_tokens,
               {_split("l.output_tokens")} as output_tokens,
               {_split("l.cached_tokens")} as cached_tokens,
               {_split("l.cache_write_tokens")} as cache_write_tokens,
               l.not_retried,
               {_split("l.cache_write_1h_tokens")} as cache_write_1h_tokens,
               l.source, l.job_id, v.vector
        from (select * exclude (answer) from {lines}) l left join members m on m.line_id = l.custom_id and m.job_id = l.job_id
             left join vectors v on v.line_id = l.custom_id and v.job_id = l.job_id and v.pos = coalesce(m.pos, 1)"""


def _split(tokens: str) -> str:
    """A line's `tokens` shared among its n requests: the first (tokens mod n) take one more."""
    n, pos = "coalesce(m.n, 1)", "coalesce(m.pos, 1)"
    return f"({tokens} // {n} + case when {pos} <= {tokens} % {n} then 1 else 0 end)::bigint"
