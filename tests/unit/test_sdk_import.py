"""A provider's SDK imported ahead of its first call (dbt_llm_batch/providers/sdk_import.py): on a thread
of its own, joined before a client is made, and a module that cannot be imported fails where the client
imports it, not on the thread."""

from __future__ import annotations

import importlib
import sys
import threading

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.pipeline.pool import Pool
from dbt_llm_batch.providers import sdk_import
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

SLOW_MODULE = """
import threading, time
time.sleep(0.3)
IMPORTED_ON = threading.current_thread().name
"""


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    """A module whose import takes 0.3 s and records the thread that imported it."""
    name = f"slow_sdk_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_start_returns_at_once_and_the_module_is_imported_on_its_own_thread(slow_module):
    sdk_import.start([slow_module])
    assert slow_module not in sys.modules or not hasattr(sys.modules[slow_module], "IMPORTED_ON")
    sdk_import.wait([slow_module])
    assert sys.modules[slow_module].IMPORTED_ON == f"import {slow_module}"
    assert sys.modules[slow_module].IMPORTED_ON != threading.current_thread().name


def test_a_module_that_cannot_be_imported_fails_where_the_client_imports_it():
    sdk_import.start(["no_such_provider_sdk"])
    sdk_import.wait(["no_such_provider_sdk"])  # the thread ended quietly
    with pytest.raises(ModuleNotFoundError, match="no_such_provider_sdk"):
        importlib.import_module("no_such_provider_sdk")


def test_the_pool_joins_the_import_of_a_provider_s_sdk_before_it_makes_its_client(slow_module, monkeypatch):
    monkeypatch.setattr(OpenAIBatchProvider, "sdk_modules", (slow_module,))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    config = parse_config({"unique_key": "id", "llm_model": "gpt-4o-mini", "llm_provider": "openai"})
    pool = Pool(None, config)
    pool.import_ahead([config])
    assert pool.client(config) is not None
    assert sys.modules[slow_module].IMPORTED_ON == f"import {slow_module}"  # whole before the client was made
