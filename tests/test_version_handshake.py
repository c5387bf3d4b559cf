"""The dbt package and the Python package are one release: a model run with macros of another
version fails at once, with one message naming both versions and the commands that align them."""

from __future__ import annotations

import shutil

from conftest import REPO, failure_messages
from helpers import triage_model

from dbt_llm_batch import __version__
from dbt_llm_batch.ledger.store import SCHEMA_VERSION

MACRO = "macros/materializations/llm_batch.sql"


def install_package_copy(project, edit_macro) -> None:
    """Point the project at a copy of this dbt package whose materialization `edit_macro` rewrote
    (the repository's own macros stay untouched: `dbt deps` links a local package)."""
    package = project.root.parent / "dbt_llm_batch_copy"
    shutil.copytree(REPO / "macros", package / "macros")
    shutil.copy(REPO / "dbt_project.yml", package / "dbt_project.yml")
    macro = package / MACRO
    macro.write_text(edit_macro(macro.read_text()))
    project.write("packages.yml", f"packages:\n  - local: {package}\n")
    project.dbt("deps")


def run_fails_with_mismatch(project, emulator, macro_version: str) -> None:
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(result)
    expected = (
        f"dbt-llm-batch versions do not match: the dbt package (the macros in dbt_packages/) is {macro_version}, "
        f"the Python package installed in dbt's environment is {__version__}. Install the same version of both: "
        f"either `pip install dbt-llm-batch=={macro_version}`, or set the dbt package to {__version__} in "
        f"packages.yml and run `dbt deps`. Nothing was sent."
    )
    assert expected in message, message
    assert message.count("versions do not match") == 1, message
    assert emulator.stats()["calls"] == {}  # nothing uploaded, nothing paid for
    assert project.query(
        "select count(*) from information_schema.tables where table_name like 'llm_batch%' or table_name = 'triage'"
    ) == [(0,)]  # not even the ledger was created


def test_macro_of_another_version_fails_with_one_message(project, emulator):
    def older(text: str) -> str:
        assert f"'package_version': '{__version__}'" in text
        return text.replace(f"'package_version': '{__version__}'", "'package_version': '0.1.5'")

    install_package_copy(project, older)
    run_fails_with_mismatch(project, emulator, "0.1.5")


def test_macro_of_0_1_0_through_the_old_entry_point_fails_the_same_way(project, emulator):
    def as_released_in_0_1_0(text: str) -> str:
        # The 0.1.0 materialization: no version in its payload, and the entry point's old name.
        lines = [line for line in text.splitlines(keepends=True) if "'package_version'" not in line]
        text = "".join(lines)
        assert "from dbt_llm_batch.dbt.entry import run_model" in text
        return text.replace(
            "from dbt_llm_batch.dbt.entry import run_model", "from dbt_llm_batch.runner import run_model"
        )

    install_package_copy(project, as_released_in_0_1_0)
    run_fails_with_mismatch(project, emulator, "0.1.0")


def test_a_ledger_a_newer_release_migrated_fails_the_run_with_one_message_and_changes_nothing(project, emulator):
    """A teammate's newer dbt-llm-batch migrated the ledger: this installation refuses to write to it,
    in a dbt error that says what to upgrade (no traceback), and sends nothing."""
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    project.release_database()
    project.query("insert into main.llm_batch_meta values (999, now())")
    calls = dict(emulator.stats()["calls"])
    result = project.dbt("run", "-s", "triage", "--full-refresh", expect_ok=False)
    message = failure_messages(result)
    assert (
        "the ledger in schema main was written by a newer dbt-llm-batch (ledger version 999; this installation "
        f"reads up to {SCHEMA_VERSION}): upgrade dbt-llm-batch" in message
    ), message
    assert "Traceback" not in message and message.count("newer dbt-llm-batch") == 1, message
    assert dict(emulator.stats()["calls"]) == calls
    assert project.query("select count(*) from main.llm_batch_requests") == [(6,)]
