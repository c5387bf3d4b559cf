{#-
  A generic test that warns while an llm_batch model still has requests without a final outcome
  (in flight at the provider, waiting under an in-flight cap, or backing off): the table does not
  show those rows yet. Severity is `warn` unless the test's config says otherwise:

    models:
      - name: triage
        data_tests:
          - dbt_llm_batch.no_pending_requests

  Its rows are what is still pending. `ledger_identity` is the model's name in the ledger when it is
  not schema.name (llm_ledger_identity); the ledger's schema is the source's (var llm_batch_ledger_schema).
-#}
{% test no_pending_requests(model, ledger_identity=none) %}
  {{ config(severity='warn') }}
  select model, requests_pending, requests_waiting, oldest_pending_age
  from {{ source('llm_batch_ledger', 'llm_batch_progress') }}
  where model = '{{ ledger_identity or (model.schema ~ "." ~ model.identifier) }}'
    and requests_pending + requests_waiting > 0
{% endtest %}
