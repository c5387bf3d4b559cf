{#-
  dbt run-operation dbt_llm_batch.status [--args '{schema: my_schema}']
  Prints in-flight batches (with age and request counts) and, per model, how complete its table is
  and what it cost. Reads the ledger views the materialization creates.
-#}
{% macro status(schema=none) %}
  {%- set schema = schema or target.schema -%}
  {%- set sections = [
      ('In-flight batches', 'select model, provider, batch_id, status, request_count, age from "' ~ schema ~ '".llm_batch_in_flight order by submitted_at'),
      ('Progress per model', 'select * from "' ~ schema ~ '".llm_batch_progress order by model'),
  ] -%}
  {%- for title, sql in sections -%}
    {%- set result = run_query(sql) -%}
    {{ log(title ~ ' (' ~ result.rows | length ~ ')', info=True) }}
    {%- for row in result.rows -%}
      {%- set cells = [] -%}
      {%- for name in result.column_names -%}
        {%- do cells.append(name ~ '=' ~ row[name]) -%}
      {%- endfor -%}
      {{ log('  ' ~ cells | join(', '), info=True) }}
    {%- endfor -%}
  {%- endfor -%}
{% endmacro %}
