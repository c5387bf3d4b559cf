-- One row per job of each extracted resume: the list of STRUCTs unnested with plain SQL.
select
    r.resume_id,
    r.candidate.name as candidate,
    job.title,
    job.company,
    job.years
from {{ ref('resume_extraction') }} r, unnest(r.jobs) as t(job)
where r.llm_status = 'succeeded'
