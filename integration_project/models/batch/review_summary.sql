{{ config(
    materialized = 'llm_batch',
    unique_key = ['product_id', 'review_no'],
    llm_system = 'Summarise the product review in at most ten words.',
    llm_max_tokens = 60,
    llm_temperature = 0,
) }}

select product_id, review_no, review as prompt
from {{ ref('product_reviews') }}
