-- One row per variant: rows, outcomes, cost, tokens, category accuracy against the labels, and the
-- pairwise agreement of the variants' categories; with the judge's mean score per variant.
{{ config(materialized = 'table') }}

with report as (
    {{ dbt_llm_batch.variant_report(ref('ticket_triage_eval'), reference={'category': 'expected_category'}) }}
),

judged as (
    select judged_variant as variant, avg(score) as judge_score,
           count(*) filter (where verdict = 'good') as judged_good
    from {{ ref('ticket_triage_judge') }}
    where llm_status = 'succeeded'
    group by 1
)

select report.*, judged.judge_score, judged.judged_good
from report left join judged using (variant)
