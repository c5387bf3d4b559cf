{#-
  A generic test that gates answer quality in CI:

    columns:
      - name: category
        data_tests:
          - dbt_llm_batch.min_accuracy:
              arguments: {reference: expected_category, minimum: 0.9, variant: concise}

  Measures the accuracy of the output column against the `reference` column (compared as
  variant_report compares them) for the named variant, or for every variant when none is named, and
  returns one row per variant that does not meet `minimum` (variant, accuracy, judged, pending,
  minimum, outcome); the figures are printed in the run log too. Rows without a reference value are
  left out. For an llm_batch model only the answers to what each row asks now are measured: a row
  whose table value answers an earlier prompt or config while the ledger waits for the new answer
  (llm_batch_pending_rows) is pending, not judged. Per variant, the outcome is:
    below       measured, under the minimum                                   fails
    unmeasured  nothing measured and nothing pending (nothing vouches for it) fails
    pending     nothing measured yet, rows still waiting for their answers    warns
  so a first build whose rows are all still at the provider warns, never passes, and `dbt build`
  after the batches end measures them. (error_if: the test fails only on a row that is not pending.)
-#}
{% test min_accuracy(model, column_name, reference, minimum, variant=none, tolerance=0.000001) %}
  {{ config(error_if="!= 0 and bool_or(outcome <> 'pending')") }}
  {%- set node = dbt_llm_batch._llm_node_of(model) -%}
  {%- set types = dbt_llm_batch._llm_column_types(model) -%}
  {%- set variant_expr = 't.llm_variant' if (not types or 'llm_variant' in types) else "'default'" -%}
  {%- set pending = dbt_llm_batch._llm_pending_rows(model, node) -%}
  {%- set judged_sql -%}
    count(*) filter (where {{ adapter.quote(reference) }} is not null and llm_status in ('succeeded', 'failed'))
  {%- endset -%}
  {%- set measured_sql -%}
    with answers as (
      select t.*, {{ variant_expr }} as __variant from {{ model }} t
      {%- if pending is not none %}
      -- a row waiting for the answer to another fingerprint shows an earlier prompt's answer
      where not exists (select 1 from {{ pending }} p
                        where p.variant = {{ variant_expr }} and p.key = {{ dbt_llm_batch._llm_key_sql(node, 't.') }}
                          and p.fingerprint <> t.llm_fingerprint)
      {%- endif %}
    ), measured as (
      select __variant as variant,
             {{ dbt_llm_batch._llm_accuracy(column_name, reference, types, node, tolerance) }} as accuracy,
             {{ judged_sql }} as judged
      from answers group by 1
    ), waiting as (
      {%- if pending is not none %}
      select variant, count(distinct key) as pending from {{ pending }} group by 1
      {%- else %}
      select null::varchar as variant, 0 as pending where false
      {%- endif %}
    ), variants as (
      {%- if variant is not none %}
      select {{ dbt.string_literal(variant) }} as variant
      {%- else %}
      select variant from measured union select variant from waiting
      {%- endif %}
    )
    select v.variant, m.accuracy, coalesce(m.judged, 0) as judged, coalesce(w.pending, 0) as pending,
           {{ minimum }} as minimum,
           case when coalesce(m.judged, 0) > 0 and m.accuracy >= {{ minimum }} then 'meets'
                when coalesce(m.judged, 0) > 0 then 'below'
                when coalesce(w.pending, 0) > 0 then 'pending'
                else 'unmeasured' end as outcome
    from variants v left join measured m using (variant) left join waiting w using (variant)
  {%- endset -%}
  {%- if execute -%}
    {%- set measured = run_query(measured_sql ~ " order by 1") -%}
    {%- if measured.rows | length == 0 -%}
      {{ log("min_accuracy: " ~ model.identifier ~ "." ~ column_name ~ ": no row to measure, none pending", info=True) }}
    {%- endif -%}
    {%- for row in measured.rows -%}
      {%- set figure = "n/a" if row['accuracy'] is none else "%.4f" | format(row['accuracy'] | float) -%}
      {%- set verdict = {
            'meets': 'meets the minimum ' ~ minimum,
            'below': 'below the minimum ' ~ minimum,
            'pending': 'nothing measured yet, ' ~ row['pending'] ~ ' row(s) wait for their answers (a warning until they land)',
            'unmeasured': 'nothing measured and nothing pending: fails',
          }[row['outcome']] -%}
      {{ log("min_accuracy: " ~ model.identifier ~ "." ~ column_name ~ " variant '" ~ row['variant'] ~ "': accuracy "
             ~ figure ~ " over " ~ row['judged'] ~ " row(s) with a reference, " ~ verdict
             ~ (" (" ~ row['pending'] ~ " row(s) still pending)" if row['pending'] and row['outcome'] != 'pending' else ""),
             info=True) }}
    {%- endfor -%}
  {%- endif %}
  {#- No variant at all (an empty table that is no llm_batch model): one row, nothing vouches for it. -#}
  select * from ({{ measured_sql }}) measured where outcome <> 'meets'
  {%- if variant is none %}
  union all
  select 'default', null, 0, 0, {{ minimum }}, 'unmeasured'
  where not exists (select 1 from ({{ measured_sql }}) any_variant)
  {%- endif %}
{% endtest %}
