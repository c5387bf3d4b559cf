"""A provider from another package, registered in the entry-point group `dbt_llm_batch.providers`,
runs a model through real dbt and DuckDB without any change to dbt-llm-batch: the run asks the
provider's capabilities (no batch API: every row in realtime), never its name."""

from __future__ import annotations

from pathlib import Path

from helpers import TRIAGE_SYSTEM, expected_triage, triage_model

PLUGIN = '''
"""acme-llm: a realtime-only provider whose service speaks OpenAI's chat-completions API."""
from dbt_llm_batch.providers.engine_http import engine_transports
from dbt_llm_batch.providers.openai_chat import OpenAIChatProvider


class AcmeProvider(OpenAIChatProvider):
    name = "acme"
    key_env_var = "ACME_API_KEY"
    config_keys = {"llm_acme_endpoint": None}

    @classmethod
    def parse_options(cls, values, errors):
        if not isinstance(values["llm_acme_endpoint"], str):
            errors.append("llm_provider 'acme' needs llm_acme_endpoint: the service's URL")
        return {"endpoint": values["llm_acme_endpoint"]}

    def realtime_transports(self):
        return engine_transports((self.config.options["endpoint"],), self.key_env_var)
'''


def install_plugin(path: Path, monkeypatch) -> None:
    """What `pip install acme-llm` leaves on sys.path: the module and its dist-info metadata."""
    (path / "acme_llm_service.py").write_text(PLUGIN)  # a module name no other test imports
    dist = path / "acme_llm-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-llm\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dbt_llm_batch.providers]\nacme = acme_llm_service:AcmeProvider\n")
    monkeypatch.syspath_prepend(str(path))


def test_a_third_party_provider_runs_a_model_in_realtime(project, emulator, api_key, tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    install_plugin(tmp_path / "site", monkeypatch)
    monkeypatch.setenv("ACME_API_KEY", api_key)
    project.write(
        "models/triage.sql",
        triage_model(extra_config=f"llm_acme_endpoint = '{emulator.openai_base_url}',").replace(
            "llm_provider = 'openai'", "llm_provider = 'acme'"
        ),
    )
    project.dbt("seed")
    project.dbt("run", "-s", "triage")

    rows = project.query("""select ticket_id, category, urgent, summary, llm_status, llm_route, llm_batch_id
                            from main.triage order by ticket_id""")
    texts = dict(
        project.query(
            "select ticket_id, 'Subject: ' || subject || chr(10) || chr(10) || body from main.support_tickets"
        )
    )
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
    for ticket_id, category, urgent, summary, status, route, batch_id in rows:
        assert (status, route, batch_id) == ("succeeded", "realtime", None)
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, texts[ticket_id])
    assert project.query("select distinct provider, status from main.llm_batch_jobs") == [("acme", "completed")]
    stats = emulator.stats()
    assert (stats["realtime_requests"]["openai"], stats["batches_created"]) == (6, 0)

    project.dbt("run", "-s", "triage")  # nothing new: nothing asked again
    assert emulator.stats()["realtime_requests"]["openai"] == 6

    # Its own key is validated by the provider, with its message, before anything runs.
    project.write("models/triage.sql", triage_model().replace("llm_provider = 'openai'", "llm_provider = 'acme'"))
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = "\n".join(str(r.message) for r in result.result.results)
    assert "llm_provider 'acme' needs llm_acme_endpoint: the service's URL" in message
    assert emulator.stats()["realtime_requests"]["openai"] == 6
