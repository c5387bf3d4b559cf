"""The entry point the llm_batch materialization calls (macros/materializations/llm_batch.sql)."""

from __future__ import annotations

from dbt_llm_batch import __version__
from dbt_llm_batch.dbt.log import forward_to_dbt
from dbt_llm_batch.errors import VersionMismatchError
from dbt_llm_batch.pipeline import runner

# The version of the dbt package whose macro calls dbt_llm_batch.runner without saying its version.
UNVERSIONED_MACRO = "0.1.0"


def run_model(con, *, package_version: str | None = None, **payload):
    """Run one llm_batch model; everything the package logs reaches dbt's log."""
    forward_to_dbt()
    check_package_version(package_version)  # before anything is read, locked or sent
    return runner.run_model(con, **payload)


def check_package_version(macro_version: str | None, installed: str = __version__) -> None:
    """The macros and the Python package are two halves of one release: refuse any other pair.

    The payload the macro passes, the ledger it expects and the config keys it forwards change
    between versions, so a pair released apart could misread a model rather than fail cleanly.
    """
    if macro_version == installed:
        return
    raise VersionMismatchError(version_mismatch_message(macro_version or UNVERSIONED_MACRO, installed))


def version_mismatch_message(macro_version: str, installed: str) -> str:
    return (
        f"dbt-llm-batch versions do not match: the dbt package (the macros in dbt_packages/) is "
        f"{macro_version}, the Python package installed in dbt's environment is {installed}. "
        f"Install the same version of both: either `pip install dbt-llm-batch=={macro_version}`, or set "
        f"the dbt package to {installed} in packages.yml and run `dbt deps`. Nothing was sent."
    )
