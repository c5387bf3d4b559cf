{#-
  dbt_llm_batch.is_incremental(): true when an llm_batch model's table already exists and this is
  not a full refresh. dbt's own is_incremental() is always false in a custom materialization.
  Use it to select only new source rows:

    {% if dbt_llm_batch.is_incremental() %}
      where updated_at > (select coalesce(max(updated_at), '1900-01-01') from {{ this }})
    {% endif %}
-#}
{% macro is_incremental() %}
  {%- if not execute -%}
    {{ return(false) }}
  {%- endif -%}
  {%- set existing = adapter.get_relation(database=this.database, schema=this.schema, identifier=this.identifier) -%}
  {{ return(existing is not none and existing.type == 'table' and not should_full_refresh()) }}
{% endmacro %}
