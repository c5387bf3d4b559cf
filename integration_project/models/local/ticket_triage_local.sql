-- The main job on a real model: Gemma 3 270M served by a local vLLM engine (scripts/engine.sh).
-- Every row goes to the engine in this run (no batch API, no key, nothing leaves the machine);
-- structured output constrains each answer to the enum and the boolean. The engine's address follows
-- DBT_LLM_BATCH_ENGINE_PORT, the variable scripts/engine.sh starts it on (or a whole DBT_LLM_BATCH_ENGINE_URL).
{{ config(
    materialized = 'llm_batch',
    unique_key = 'ticket_id',
    llm_provider = 'openai_compatible',
    llm_model = 'gemma-3-270m',
    llm_base_url = env_var('DBT_LLM_BATCH_ENGINE_URL', 'http://127.0.0.1:' ~ env_var('DBT_LLM_BATCH_ENGINE_PORT', '8791') ~ '/v1'),
    llm_concurrency = 32,
    llm_system = 'You triage customer support tickets. Answer with the category and whether it is urgent.',
    llm_output = {'category': ['billing', 'bug', 'how_to', 'feature_request', 'other'], 'urgent': 'boolean'},
    llm_max_tokens = 40,
    llm_temperature = 0,
) }}

select
    ticket_id,
    subject,
    priority,
    'Subject: ' || subject || chr(10) || chr(10) || body as prompt
from {{ ref('support_tickets') }}
