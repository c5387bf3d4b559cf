"""Every test has one tier (pyproject's markers, applied by tests/conftest.py), so `pytest -m unit` is a
fast loop that starts no server, dbt or process, and `pytest -m "not engine"` runs all but the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
TIERS = ("unit", "sandbox", "dbt", "crash", "engine", "slow")

# Collects the suite in a process of its own and prints {node id: the tiers it is marked with}.
COLLECT = f"""
import json, sys, pytest
class Recorder:
    def pytest_collection_finish(self, session):
        self.tiers = {{i.nodeid: [m.name for m in i.iter_markers() if m.name in {TIERS!r}] for i in session.items}}
recorder = Recorder()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[recorder])
print("TIERS=" + json.dumps(recorder.tiers))
sys.exit(int(code))
"""


def test_every_collected_test_has_exactly_one_tier():
    done = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marked = json.loads(done.stdout.split("TIERS=", 1)[1])
    assert len(marked) > 100
    assert {node: tiers for node, tiers in marked.items() if len(tiers) != 1} == {}

    def tier(prefix: str) -> set[str]:
        return {tiers[0] for node, tiers in marked.items() if node.startswith(prefix)}

    # The rules, on tests whose needs are known.
    assert tier("tests/unit/") == {"unit"}
    assert tier("tests/test_local_engine.py::") == {"engine"}
    assert tier("tests/test_crash_recovery.py::") == {"crash"}  # kill_then_run_on: a crash point
    assert tier("tests/test_reconcile.py::test_a_run_killed_before_its_create") == {"crash"}  # a module helper
    assert tier("tests/test_variant_report.py::test_min_accuracy") == {"dbt"}  # the project fixture
    assert tier("tests/test_emulator.py::test_429_fault") == {"sandbox"}  # the emu fixture
    assert tier("tests/test_emulator.py::test_file_too_large") == {"sandbox"}  # an Emulator of its own
    assert tier("tests/test_finish_reasons.py::test_the_mapping_table") == {"unit"}  # starts nothing
    assert tier("tests/test_readme_quickstart.py::") == {"slow"}  # a fresh venv: named by the test itself
