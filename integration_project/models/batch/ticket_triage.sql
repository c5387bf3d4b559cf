{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_system = 'You triage customer support tickets. Answer with the category, whether it is urgent, and a one-line summary.',
    llm_output = {'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'], 'urgent': 'boolean', 'summary': 'text'},
    llm_max_tokens = 200,
) }}

select
    ticket_id,
    subject,
    priority,
    'Subject: ' || subject || chr(10) || chr(10) || body as prompt
from {{ ref('support_tickets') }}
