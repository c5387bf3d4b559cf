-- Structured extraction: each resume becomes typed, nested columns. `candidate` is a STRUCT,
-- `jobs` a list of STRUCTs, `skills` a list of strings, `available_from` a DATE; `email` is
-- optional (left out of `required`: NULL when the resume gives none). The descriptions are sent
-- to the provider with the schema: they steer what the model extracts.
{{ config(
    materialized = 'llm_batch',
    unique_key = 'resume_id',
    llm_system = 'Extract the candidate, their jobs, their skills and the date they can start from the resume.',
    llm_output = {
        'candidate': {
            'type': 'object',
            'properties': {
                'name': {'type': 'string', 'description': 'full name'},
                'email': {'type': 'string', 'description': 'email address, if the resume gives one'},
            },
            'required': ['name'],
        },
        'jobs': {
            'type': 'array',
            'description': 'every job held, most recent first',
            'items': {
                'type': 'object',
                'properties': {'title': 'text', 'company': 'text', 'years': 'integer'},
                'required': ['title', 'company', 'years'],
            },
        },
        'skills': {'type': 'array', 'items': {'type': 'string'}, 'description': 'tools and skills named'},
        'available_from': {'type': 'string', 'format': 'date', 'description': 'the first day the candidate can start'},
    },
    llm_max_tokens = 600,
) }}

select resume_id, resume as prompt
from {{ ref('resumes') }}
