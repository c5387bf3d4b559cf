{#-
  dbt run-operation dbt_llm_batch.status [--args '{schema: my_schema}']
  Prints in-flight batches (with age and request counts) and, per model, how complete its table is
  and what it cost. Reads the ledger views the materialization creates. Dollar amounts (`*_usd`) are
  printed with six decimals ($0.000000, never 0E-9).
-#}
{% macro status(schema=none) %}
  {%- set schema = schema or target.schema -%}
  {%- set sections = [
      ('In-flight batches', 'select model, variant, provider, batch_id, status, request_count, age from "' ~ schema ~ '".llm_batch_in_flight order by submitted_at'),
      ('Progress per model', 'select * from "' ~ schema ~ '".llm_batch_progress order by model, variant'),
      ('Cost per model, day and route', 'select model, variant, provider, day, route, rows_succeeded, rows_failed, requests_succeeded, requests_failed, cost_usd, realtime_cost_usd, savings_usd, committed_not_billed_usd from "' ~ schema ~ '".llm_batch_costs order by model, variant, day, route'),
  ] -%}
  {%- for title, sql in sections -%}
    {%- set result = run_query(sql) -%}
    {{ log(title ~ ' (' ~ result.rows | length ~ ')', info=True) }}
    {%- for row in result.rows -%}
      {%- set cells = [] -%}
      {%- for name in result.column_names -%}
        {%- set value = row[name] -%}
        {%- if name.endswith('_usd') and value is not none -%}
          {%- set value = '$%.6f' | format(value | float) -%}
        {%- endif -%}
        {#- A model without evaluation variants has none to name. -#}
        {%- if not (name == 'variant' and not value) -%}
          {%- do cells.append(name ~ '=' ~ value) -%}
        {%- endif -%}
      {%- endfor -%}
      {{ log('  ' ~ cells | join(', '), info=True) }}
    {%- endfor -%}
  {%- endfor -%}
{% endmacro %}
