{#-
  The llm_batch materialization. All the work happens in Python (dbt_llm_batch.dbt.entry), inside
  dbt-duckdb's Python job, because it talks to a provider API and writes the ledger with its own
  autocommit connection: ledger rows must survive a model that fails later in the run.
  For a SQL model the compiled SELECT is handed to Python as a string; for a Python model, the
  relation its `model()` returns is.
  `package_version` is the version of this dbt package, the same string as dbt_project.yml's
  `version` and the Python package's `dbt_llm_batch.__version__`: the Python side refuses to run
  macros written for another version of it, with a message saying which versions to align.
-#}
{% materialization llm_batch, adapter='duckdb', supported_languages=['sql', 'python'] %}
  {%- set target_relation = this.incorporate(type='table') -%}
  {%- set contract_config = config.get('contract') -%}
  {%- set contract = {'enforced': contract_config.enforced if contract_config else false, 'columns': []} -%}
  {%- if contract['enforced'] -%}
    {%- for name, column in model['columns'].items() -%}
      {%- do contract['columns'].append({'name': column.get('name') or name, 'data_type': column.get('data_type')}) -%}
    {%- endfor -%}
  {%- endif -%}
  {%- set payload = {
      'package_version': '0.2.0',
      'schema': this.schema,
      'identifier': this.identifier,
      'name': model.name,
      'target': target_relation.render(),
      'raw_config': dbt_llm_batch._llm_config(),
      'sql': compiled_code if model.language == 'sql' else none,
      'full_refresh': should_full_refresh(),
      'contract': contract,
      'project': {'max_cost_usd': var('llm_batch_max_cost_usd', none),
                  'dry_run': var('llm_batch_dry_run', false)},
  } -%}

  {{ run_hooks(pre_hooks, inside_transaction=False) }}
  {{ run_hooks(pre_hooks, inside_transaction=True) }}
  {% call statement('main', language='python') -%}
{% if model.language == 'python' %}
{{ compiled_code }}

# dbt's own is_incremental() is always False inside a custom materialization: use ours.
_dbt_llm_batch_base_dbtObj = dbtObj
class dbtObj(_dbt_llm_batch_base_dbtObj):
    def __init__(self, load_df_function):
        super().__init__(load_df_function)
        self.is_incremental = {{ 'True' if dbt_llm_batch.is_incremental() else 'False' }}

_dbt_llm_batch_user_model = model

def model(dbt, session):
    global _dbt_llm_batch_session
    _dbt_llm_batch_session = session
    return _dbt_llm_batch_user_model(dbt, session)
{% else %}
class dbtObj:
    def __init__(self, load_df_function):
        pass

def model(dbt, session):
    global _dbt_llm_batch_session
    _dbt_llm_batch_session = session
    return None
{% endif %}

# `session` is dbt's own connection (materialize may get another cursor): a failure is reported on
# it, and raised below as dbt's own error, without a Python traceback.
def materialize(df, con):
    import json
    from dbt_llm_batch.dbt.entry import run_model
    payload = json.loads({{ tojson(tojson(payload)) }})
    run_model(con, df=df, session=_dbt_llm_batch_session, **payload)
  {%- endcall %}
  {{ dbt_llm_batch._raise_llm_failure() }}
  {#- A dry run sends nothing and leaves the table as it is: its result line says so instead of OK. -#}
  {%- if config.get('llm_dry_run') or var('llm_batch_dry_run', false) -%}
    {% do store_raw_result(name='main', message='DRY RUN', code='DRY RUN', rows_affected='-1') %}
  {%- endif %}
  {{ run_hooks(post_hooks, inside_transaction=True) }}
  {% do adapter.commit() %}
  {{ run_hooks(post_hooks, inside_transaction=False) }}

  {% do persist_docs(target_relation, model) %}
  {{ return({'relations': [target_relation]}) }}
{% endmaterialization %}


{#- Every llm_* key set on the model (in SQL, YAML or dbt_project.yml), plus unique_key. Unknown
    llm_* keys are passed on too, so that Python can report them all at once. -#}
{% macro _llm_config() %}
  {%- set picked = {'unique_key': config.get('unique_key'), 'on_schema_change': config.get('on_schema_change')} -%}
  {%- for key, value in model.config.items() if key.startswith('llm_') -%}
    {%- do picked.update({key: value}) -%}
  {%- endfor -%}
  {#- llm_output_from_columns: the model's YAML columns are its output columns (name, data_type, description). -#}
  {%- if picked.get('llm_output_from_columns') -%}
    {%- set columns = [] -%}
    {%- for name, column in (model.columns or {}).items() -%}
      {%- do columns.append({'name': name, 'data_type': column.get('data_type'),
                             'description': column.get('description')}) -%}
    {%- endfor -%}
    {%- do picked.update({'columns': columns}) -%}
  {%- endif -%}
  {{ return(picked) }}
{% endmacro %}


{#- A failure the Python job reported (dbt_llm_batch.dbt.entry.run_model), raised as dbt raises its
    own: a config problem as a compilation error, a contract mismatch as dbt's contract error (its
    table of mismatches), anything else (input, provider, budget, lock) as a runtime error. -#}
{% macro _raise_llm_failure() %}
  {%- set result = run_query("select getvariable('dbt_llm_batch_failure')") -%}
  {%- set value = result.columns[0].values()[0] -%}
  {%- if value is not none -%}
    {%- set failure = fromjson(value) -%}
    {%- if failure['kind'] == 'contract' -%}
      {%- do exceptions.raise_contract_error(failure['declared'], failure['produced']) -%}
    {%- elif failure['kind'] == 'compiler' -%}
      {%- do exceptions.raise_compiler_error(failure['message']) -%}
    {%- else -%}
      {%- do exceptions.raise_database_error(failure['message']) -%}
    {%- endif -%}
  {%- endif -%}
{% endmacro %}
