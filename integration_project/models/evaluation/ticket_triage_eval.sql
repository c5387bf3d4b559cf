-- An evaluation run: the same tickets asked of three variants in one run (README "Evaluation runs").
-- The model's own keys are the variant 'baseline'; 'concise' changes the system prompt and 'claude'
-- the provider and model. The table has one row per (ticket_id, llm_variant), next to the label.
{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_system = 'You triage customer support tickets. Answer with the category and a one-line summary.',
    llm_output = {'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'], 'summary': 'text'},
    llm_max_tokens = 200,
    llm_default_variant = 'baseline',
    llm_variants = {
        'concise': {'llm_system': 'Classify the support ticket. Keep the summary under ten words.'},
        'claude': {'llm_provider': 'anthropic', 'llm_model': 'claude-sonnet-4-5'},
    },
) }}

select
    t.ticket_id,
    'Subject: ' || t.subject || chr(10) || chr(10) || t.body as prompt,
    l.expected_category
from {{ ref('support_tickets') }} t
left join {{ ref('ticket_labels') }} l using (ticket_id)
