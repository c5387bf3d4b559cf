{#-
  A generic test that gates answer quality in CI:

    columns:
      - name: category
        data_tests:
          - dbt_llm_batch.min_accuracy:
              arguments: {reference: expected_category, minimum: 0.9, variant: concise}

  Fails when the accuracy of the output column against the `reference` column (compared as
  variant_report compares them) is below `minimum` for the named variant, or for any variant when
  none is named. One failing row per variant below the minimum (variant, accuracy, judged, minimum),
  and the measured figures are printed in the run log, so the reason is visible without opening the
  stored failures. Rows without a reference value are left out; a variant with no judged row fails
  (there is nothing to vouch for it).
-#}
{% test min_accuracy(model, column_name, reference, minimum, variant=none, tolerance=0.000001) %}
  {%- set node = dbt_llm_batch._llm_node_of(model) -%}
  {%- set types = dbt_llm_batch._llm_column_types(model) -%}
  {%- set variant_expr = 'llm_variant' if (not types or 'llm_variant' in types) else "'default'" -%}
  {%- set measured_sql -%}
    select {{ variant_expr }} as variant,
           {{ dbt_llm_batch._llm_accuracy(column_name, reference, types, node, tolerance) }} as accuracy,
           count(*) filter (where {{ adapter.quote(reference) }} is not null and llm_status in ('succeeded', 'failed')) as judged,
           {{ minimum }} as minimum
    from {{ model }}
    {% if variant is not none %}where {{ variant_expr }} = {{ dbt.string_literal(variant) }}{% endif %}
    group by 1
  {%- endset -%}
  {%- if execute -%}
    {%- set measured = run_query(measured_sql) -%}
    {%- if measured.rows | length == 0 -%}
      {{ log("min_accuracy: " ~ model.identifier ~ "." ~ column_name ~ ": no row" ~ (" of variant '" ~ variant ~ "'" if variant is not none else "") ~ " to measure", info=True) }}
    {%- endif -%}
    {%- for row in measured.rows -%}
      {%- set verdict = 'below' if (row['accuracy'] is none or row['accuracy'] < minimum) else 'meets' -%}
      {{ log("min_accuracy: " ~ model.identifier ~ "." ~ column_name ~ " variant '" ~ row['variant'] ~ "': accuracy "
             ~ ("n/a" if row['accuracy'] is none else "%.4f" | format(row['accuracy'] | float)) ~ " over " ~ row['judged']
             ~ " row(s) with a reference, " ~ verdict ~ " the minimum " ~ minimum, info=True) }}
    {%- endfor -%}
  {%- endif %}
  {%- if variant is not none %}
  select * from (select {{ dbt.string_literal(variant) }} as variant) wanted
  left join ({{ measured_sql }}) measured using (variant)
  where measured.accuracy is null or measured.accuracy < {{ minimum }}
  {%- else %}
  select * from ({{ measured_sql }}) measured
  where accuracy is null or accuracy < {{ minimum }}
  {%- endif %}
{% endtest %}
