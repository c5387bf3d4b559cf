"""The version handshake: the three places a release writes its version agree, and the check refuses
any other pair (the dbt story is tests/test_version_handshake.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dbt_llm_batch import __version__
from dbt_llm_batch.dbt.entry import check_package_version
from dbt_llm_batch.errors import VersionMismatchError

REPO = Path(__file__).resolve().parents[2]


def test_macro_dbt_project_and_python_package_carry_one_version():
    macro = (REPO / "macros/materializations/llm_batch.sql").read_text()
    assert re.findall(r"'package_version': '([^']+)'", macro) == [__version__]
    assert re.findall(r'^version: "([^"]+)"$', (REPO / "dbt_project.yml").read_text(), re.M) == [__version__]
    pyproject = (REPO / "pyproject.toml").read_text()  # no tomllib: the package supports Python 3.10
    assert re.findall(r"^version\b.*$", pyproject, re.M) == ['version = { attr = "dbt_llm_batch.__version__" }']
    assert 'dynamic = ["version"]' in pyproject


def test_same_version_passes():
    check_package_version("1.2.3", installed="1.2.3")


@pytest.mark.parametrize(
    ("macro", "said"),
    [("1.2.2", "1.2.2"), ("1.3.0", "1.3.0"), (None, "0.1.0")],  # None: the 0.1.0 macro, which says nothing
)
def test_other_version_names_both_and_how_to_align(macro, said):
    with pytest.raises(VersionMismatchError) as error:
        check_package_version(macro, installed="1.2.3")
    message = str(error.value)
    assert f"the dbt package (the macros in dbt_packages/) is {said}" in message
    assert "the Python package installed in dbt's environment is 1.2.3" in message
    assert f"`pip install dbt-llm-batch=={said}`" in message
    assert "set the dbt package to 1.2.3 in packages.yml and run `dbt deps`" in message
