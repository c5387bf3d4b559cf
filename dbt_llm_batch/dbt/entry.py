"""The entry point the llm_batch materialization calls (macros/materializations/llm_batch.sql)."""

from __future__ import annotations

import json
import os
import traceback

from dbt_common.exceptions import CompilationError

from dbt_llm_batch import __version__
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.dbt.log import debug_to_dbt, forward_to_dbt
from dbt_llm_batch.errors import ConfigError, ContractError, LlmBatchError, VersionMismatchError
from dbt_llm_batch.pipeline import runner
from dbt_llm_batch.providers import calls, get_provider
from dbt_llm_batch.sql import literal

# The version of the dbt package whose macro calls dbt_llm_batch.runner without saying its version.
UNVERSIONED_MACRO = "0.1.0"


# The DuckDB variable that carries a failure's message from the Python job back to the
# materialization (macros/materializations/llm_batch.sql), which raises it as dbt's own error.
FAILURE_VARIABLE = "dbt_llm_batch_failure"


def run_model(con, *, package_version: str | None = None, session=None, **payload):
    """Run one llm_batch model; everything the package logs reaches dbt's log.

    dbt-duckdb reports any exception out of a Python job as "Python model failed:" and a full
    traceback, which buries the one useful line. So a failure the package anticipated (an
    LlmBatchError: config, contract, input, provider, budget, lock), a provider SDK's error no retry
    fixes (a 4xx such as a rejected key: provider_refusal), or a dbt error a warning became under
    --warn-error, is not raised here: its message is left in a DuckDB variable on
    `session` (dbt's own connection, which the materialization queries next) and the materialization
    raises it as a dbt compilation, contract or runtime error. Its traceback goes to dbt's debug log
    (logs/dbt.log; the console with --debug). Anything else is a bug: it propagates with its
    traceback, which is what a bug report needs.
    """
    forward_to_dbt()
    if session is not None:
        report_failure(session, None)  # a previous model's failure on this connection is not ours
    try:
        check_package_version(package_version)  # before anything is read, locked or sent
        return runner.run_model(con, **payload)
    except (LlmBatchError, CompilationError) as exc:
        if session is None:  # called without a way to report: dbt-duckdb shows the traceback
            raise
        debug_to_dbt(f"dbt-llm-batch: the traceback of the failure below:\n{traceback.format_exc()}")
        report_failure(session, failure_of(exc))
        return None
    except Exception as exc:
        message = provider_refusal(exc, payload)
        if session is None or message is None:  # a bug: its traceback is what a report needs
            raise
        debug_to_dbt(f"dbt-llm-batch: the traceback of the failure below:\n{traceback.format_exc()}")
        report_failure(session, {"kind": "runtime", "message": message})
        return None


def provider_refusal(exc: Exception, payload: dict) -> str | None:
    """The message for a provider SDK's error that no retry fixes (a 4xx: a rejected key, a missing
    permission, an unknown model; calls.refusal), naming the model, its provider and the variable
    that holds its key; None for any other exception."""
    try:
        # The client whose call was refused: an older job's is the provider it was sent to, which
        # may not be the model's provider now.
        provider = calls.raised_by(exc)
        if provider is None:
            config = parse_config(payload["raw_config"])
            provider = get_provider(config.provider)(config)
        config = provider.config
        hint, var = calls.key_hint(provider), calls.key_variable(provider)
    except Exception:  # noqa: BLE001 - the config parsed before the provider was called: not expected
        return None
    model = payload.get("name") or payload.get("identifier")
    who = f"model {model}: llm_provider '{config.provider}' (llm_model '{config.model}')"
    return calls.refusal(exc, who, hint, secret=os.environ.get(var) if var else None)


def failure_of(exc: Exception) -> dict:
    """What the materialization needs to raise `exc` as dbt would: its kind and message."""
    if isinstance(exc, ContractError):
        return {"kind": "contract", "message": str(exc), "declared": exc.declared, "produced": exc.produced}
    if isinstance(exc, CompilationError):  # a warning that --warn-error turned into an error
        return {"kind": "compiler", "message": exc.msg}
    kind = "compiler" if isinstance(exc, (ConfigError, VersionMismatchError)) else "runtime"
    return {"kind": kind, "message": str(exc)}


def report_failure(session, failure: dict | None) -> None:
    value = "NULL" if failure is None else literal(json.dumps(failure))
    session.execute(f"set variable {FAILURE_VARIABLE} = {value}")


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
