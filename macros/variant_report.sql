{#-
  Comparing answers: variant_report() and the min_accuracy test read an llm_batch table (or any
  relation with the same llm_* columns) and compare output columns with expected values, per variant.

  How two values are compared depends on the output column's type in the table:
    - numbers (DOUBLE, FLOAT, REAL, DECIMAL): equal within `tolerance` (absolute);
    - text (VARCHAR) that is not an enum of the model's llm_output: equal after normalising both
      sides with _llm_normalise_text (lower case, surrounding whitespace and trailing . ! ? removed,
      runs of whitespace made one space);
    - everything else (enums, booleans, integers, dates, nested values): exactly equal, the expected
      value cast to the column's type.
  A table without an llm_variant column (a model without variants) is one variant, 'default'.
-#}

{% macro _llm_normalise_text(expr) -%}
  lower(regexp_replace(regexp_replace(trim(cast({{ expr }} as varchar)), '\s+', ' ', 'g'), '[.!?]+$', ''))
{%- endmacro %}

{#- The llm_batch model node that builds `relation`, or none (a relation that is not one). -#}
{% macro _llm_node_of(relation) -%}
  {%- set found = [] -%}
  {%- if execute -%}
    {%- for node in graph.nodes.values() -%}
      {%- if node.resource_type == 'model' and (node.alias or node.name) | lower == relation.identifier | lower
            and node.schema | lower == relation.schema | lower -%}
        {%- do found.append(node) -%}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{ return(found[0] if found else none) }}
{%- endmacro %}

{#- The ledger key of a row of llm_batch model `node` (its unique_key as the JSON list of the key
    columns' text, as plan.key_sql writes it), over the columns of `alias`. -#}
{% macro _llm_key_sql(node, alias='') -%}
  {%- set key = node.config.get('unique_key') -%}
  {%- set key = [key] if key is string else key -%}
  cast(to_json([{% for k in key %}cast({{ alias }}{{ adapter.quote(k) }} as varchar){% if not loop.last %}, {% endif %}{% endfor %}]) as varchar)
{%- endmacro %}

{#- SQL, a relation of the rows of llm_batch model `node` (built into `relation`) still waiting for their
    answers (variant as the table names it, key, fingerprint: the ledger's llm_batch_pending_rows), or
    none when `relation` is no llm_batch model or its ledger has no such view yet. -#}
{% macro _llm_pending_rows(relation, node) -%}
  {%- set found = none -%}
  {%- if execute and node and node.config.get('materialized') == 'llm_batch' and node.config.get('unique_key') -%}
    {%- set schema = node.config.get('llm_ledger_schema') or relation.schema -%}
    {#- Asked of the database, not dbt's relation cache: the plugin, not dbt, creates the ledger. -#}
    {%- set exists = run_query("select count(*) from information_schema.tables where table_catalog = "
          ~ dbt.string_literal(relation.database) ~ " and table_schema = " ~ dbt.string_literal(schema)
          ~ " and table_name = 'llm_batch_pending_rows'") -%}
    {%- set view = api.Relation.create(database=relation.database, schema=schema, identifier='llm_batch_pending_rows') -%}
    {%- if exists.rows[0][0] > 0 -%}
      {%- set identity = node.config.get('llm_ledger_identity') or (relation.schema ~ '.' ~ relation.identifier) -%}
      {%- set default_name = (node.config.get('llm_default_variant') or 'default') if node.config.get('llm_variants') else 'default' -%}
      {%- set found -%}
        (select case when variant = '' then {{ dbt.string_literal(default_name) }} else variant end as variant, key, fingerprint
         from {{ view }} where model = {{ dbt.string_literal(identity) }})
      {%- endset -%}
    {%- endif -%}
  {%- endif -%}
  {{ return(found) }}
{%- endmacro %}

{#- {column name (lower case): upper-case DuckDB type} of `relation`, once it exists. -#}
{% macro _llm_column_types(relation) -%}
  {%- set types = {} -%}
  {%- if execute -%}
    {%- for column in adapter.get_columns_in_relation(relation) -%}
      {%- do types.update({column.name | lower: column.dtype | upper}) -%}
    {%- endfor -%}
  {%- endif -%}
  {{ return(types) }}
{%- endmacro %}

{#- A SQL boolean: does `actual` (a value of output column `column`) match `expected`? NULL when
    either side is NULL. -#}
{% macro _llm_match(actual, expected, column, types, node, tolerance) -%}
  {%- set dtype = types.get(column | lower, '') -%}
  {%- set output = (node.config.get('llm_output') or {}) if node else {} -%}
  {%- set is_enum = output.get(column) is sequence and output.get(column) is not string and output.get(column) is not mapping -%}
  {%- if dtype in ('DOUBLE', 'FLOAT', 'REAL') or dtype.startswith('DECIMAL') or dtype.startswith('NUMERIC') -%}
    (abs(cast({{ actual }} as double) - try_cast({{ expected }} as double)) <= {{ tolerance }})
  {%- elif dtype == 'VARCHAR' and not is_enum -%}
    ({{ dbt_llm_batch._llm_normalise_text(actual) }} = {{ dbt_llm_batch._llm_normalise_text(expected) }})
  {%- elif dtype -%}
    ({{ actual }} = try_cast({{ expected }} as {{ dtype }}))
  {%- else -%}
    ({{ actual }} = {{ expected }})
  {%- endif -%}
{%- endmacro %}

{#- Accuracy of output column `column` against `expected`, over the rows of a group that have an
    expected value and a final outcome; a failed row counts as wrong. NULL when no row qualifies. -#}
{% macro _llm_accuracy(column, expected, types, node, tolerance) -%}
  avg(case when {{ adapter.quote(expected) }} is not null and llm_status in ('succeeded', 'failed')
           then case when coalesce({{ dbt_llm_batch._llm_match(adapter.quote(column), adapter.quote(expected), column, types, node, tolerance) }}, false)
                     then 1.0 else 0.0 end end)
{%- endmacro %}

{#-
  dbt_llm_batch.variant_report(relation, reference={'category': 'expected_category'}, compare=none,
                               unique_key=none, tolerance=0.000001)
  SQL with one row per variant: variant, rows, succeeded, failed, cost_usd, realtime_cost_usd,
  input_tokens, output_tokens; for each output column in `reference` (output column -> column
  holding the expected value) <column>_accuracy and <column>_judged (the rows it was computed over);
  and for each output column in `compare` (default: the keys of `reference`) <column>_agreement, a
  MAP from every other variant to the fraction of keys both answered on which the two agree.
-#}
{% macro variant_report(relation, reference={}, compare=none, unique_key=none, tolerance=0.000001) -%}
  {%- set node = dbt_llm_batch._llm_node_of(relation) -%}
  {%- set types = dbt_llm_batch._llm_column_types(relation) -%}
  {%- set compare = compare if compare is not none else (reference.keys() | list) -%}
  {%- set key = unique_key or (node.config.get('unique_key') if node else none) -%}
  {%- set key = [key] if key is string else (key or []) -%}
  {%- if compare and not key and execute -%}
    {{ exceptions.raise_compiler_error("variant_report: pass unique_key=... to compare variants of " ~ relation ~ " (it is not an llm_batch model of this project)") }}
  {%- endif -%}
  {%- set variant = 'llm_variant' if (not types or 'llm_variant' in types) else "'default'" -%}
with answers as (
  select *, {{ variant }} as __variant from {{ relation }}
), per_variant as (
  select
    __variant as variant,
    count(*) as rows,
    count(*) filter (where llm_status = 'succeeded') as succeeded,
    count(*) filter (where llm_status = 'failed') as failed,
    coalesce(sum(llm_cost_usd), 0) as cost_usd,
    coalesce(sum(llm_realtime_cost_usd), 0) as realtime_cost_usd,
    coalesce(sum(llm_input_tokens), 0) as input_tokens,
    coalesce(sum(llm_output_tokens), 0) as output_tokens
    {%- for column, expected in reference.items() %},
    {{ dbt_llm_batch._llm_accuracy(column, expected, types, node, tolerance) }} as {{ adapter.quote(column ~ '_accuracy') }},
    count(*) filter (where {{ adapter.quote(expected) }} is not null and llm_status in ('succeeded', 'failed')) as {{ adapter.quote(column ~ '_judged') }}
    {%- endfor %}
  from answers
  group by 1
)
{%- if compare %}, pairs as (
  select
    a.__variant as variant,
    b.__variant as other
    {%- for column in compare %},
    avg(case when coalesce({{ dbt_llm_batch._llm_match('a.' ~ adapter.quote(column), 'b.' ~ adapter.quote(column), column, types, node, tolerance) }}, false) then 1.0 else 0.0 end) as {{ adapter.quote(column) }}
    {%- endfor %}
  from answers a
  join answers b
    on {% for k in key %}a.{{ adapter.quote(k) }} = b.{{ adapter.quote(k) }}{% if not loop.last %} and {% endif %}{% endfor %}
   and a.__variant <> b.__variant
  where a.llm_status = 'succeeded' and b.llm_status = 'succeeded'
  group by 1, 2
), agreement as (
  select
    variant
    {%- for column in compare %},
    map_from_entries(list({'k': other, 'v': {{ adapter.quote(column) }}} order by other)) as {{ adapter.quote(column ~ '_agreement') }}
    {%- endfor %}
  from pairs
  group by 1
)
select per_variant.*{% for column in compare %}, agreement.{{ adapter.quote(column ~ '_agreement') }}{% endfor %}
from per_variant left join agreement using (variant)
{%- else %}
select * from per_variant
{%- endif %}
order by variant
{%- endmacro %}
