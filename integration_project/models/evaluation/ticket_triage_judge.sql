-- A judge for free text: a second llm_batch model reads the variants' answers and grades each
-- variant's summary. dbt's DAG stages it: a ticket's answers are graded in the run after they are
-- final (the judge selects only succeeded rows), and a changed summary is graded again.
{{ config(
    materialized = 'llm_batch',
    unique_key = ['ticket_id', 'judged_variant'],
    llm_system = 'You grade the one-line summary of a support ticket: is it faithful to the ticket and useful to an agent? Give a score from 1 (useless) to 5 (excellent) and a verdict.',
    llm_output = {'score': 'integer', 'verdict': ['good', 'poor']},
    llm_max_tokens = 100,
) }}

select
    ticket_id,
    llm_variant as judged_variant,
    prompt || chr(10) || chr(10) || 'Summary to grade: ' || summary as prompt
from {{ ref('ticket_triage_eval') }}
where llm_status = 'succeeded'
