"""A model's submit and harvest never import pandas (pipeline/arrow_tables.py).

pyarrow imports pandas, when installed, the first time it converts Python or NumPy values; that
import cost 0.25-0.35 s inside every `dbt run` that submitted or harvested. Each run here is a real
`dbt run` in a process of its own, which reports at its end whether pandas was imported, and then
shows that the check can see it: one pyarrow conversion in the same process imports it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import assert_triage_rows_answered, triage_model

REPORT = """
import sys
from dbt.cli.main import dbtRunner
ok = dbtRunner().invoke(sys.argv[1:]).success
print("pandas after the run:", "pandas" in sys.modules)
import pyarrow
pyarrow.array([1])  # what the run no longer does
print("pandas after one pyarrow conversion:", "pandas" in sys.modules)
sys.exit(0 if ok else 1)
"""


def dbt_run_reporting_pandas(project) -> str:
    done = subprocess.run(
        [sys.executable, "-c", REPORT, "run", "-s", "triage", "--project-dir", str(project.root),
         "--profiles-dir", str(project.root)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    "provider_name,extra",
    [("openai", ""), ("anthropic", ""), ("openai", 'llm_realtime_when = "ticket_id % 2 = 0",')],
    ids=["openai", "anthropic", "openai-with-realtime-rows"],
)
def test_a_submit_and_a_harvest_leave_pandas_unimported(project, emulator, provider_name, extra):
    assert importlib.util.find_spec("pandas") is not None, (
        "the dev extras install pandas; without it this test shows nothing"
    )
    project.write("models/triage.sql", triage_model(provider=provider_name, extra_config=extra))
    project.dbt("seed")
    project.release_database()
    for step in ("submit", "harvest"):
        out = dbt_run_reporting_pandas(project)
        assert "pandas after the run: False" in out, (step, out[-3000:])
        assert "pandas after one pyarrow conversion: True" in out, (step, out[-3000:])
        emulator.complete_all()
    assert_triage_rows_answered(project)
    if extra:  # the urgent rows went realtime, through the realtime writer's table
        assert (
            project.query(
                "select count(*) from main.llm_batch_requests where route = 'realtime' and status = 'succeeded'"
            )[0][0]
            >= 1
        )
