"""Shared fixtures: a local provider emulator, and a throwaway copy of integration_project that runs
real dbt (in-process, through dbtRunner) on a real DuckDB file."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from helpers import (
    KILL,
    KILLS_A_PROCESS,
    PROVIDER_MODELS,
    SANDBOX_KEY,
    STARTS_A_PROCESS,
    STARTS_A_SANDBOX,
    gemini_triage_model,
    uses_any,
)

os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parent.parent
INTEGRATION = REPO / "integration_project"


# --- test tiers (pyproject's markers; README "Testing and contributing") ---------------------------
# Each test gets exactly one tier, from what it needs, the most demanding first: `engine` (the local
# engine), `crash` (it kills a process: a dbt subprocess at a crash point, a lock holder, a server),
# `dbt` (real dbt on a DuckDB file: the `project` fixture), `sandbox` (the provider emulator, in
# process or as a server), and `unit` (what starts none of these: tests/unit and the plain function
# tests beside the stories; seconds). `slow` is named by a test itself (a fresh virtual environment:
# tests/test_readme_quickstart.py). `pytest -m unit` is the fast loop; tests/unit/test_tiers.py
# checks that every test has one tier and that the rules hold.
TIERS = ("unit", "sandbox", "dbt", "crash", "engine", "slow")


def tier_of(item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    function = getattr(item, "function", None)
    if Path(str(item.path)).name == "test_local_engine.py":
        return "engine"
    if uses_any(function, KILLS_A_PROCESS) or (uses_any(function, KILL) and uses_any(function, STARTS_A_PROCESS)):
        return "crash"
    if "project" in fixtures:
        return "dbt"
    if fixtures & {"emulator", "emu"} or uses_any(function, STARTS_A_SANDBOX):
        return "sandbox"
    return "unit"


def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):  # a test may name its tier itself
            item.add_marker(getattr(pytest.mark, tier_of(item)))


@pytest.fixture(autouse=True)
def package_logger_as_python_leaves_it():
    """An in-process dbt run hands the package's logger to dbt (dbt_llm_batch/dbt/log.py): give each
    test the logger as plain Python has it, so `caplog` sees its records again."""
    yield
    from dbt_llm_batch.log import log

    # By name: importing the dbt glue would import dbt, which a unit test does not need.
    log.handlers = [h for h in log.handlers if type(h).__name__ != "DbtLogHandler"]
    log.propagate = True
    log.setLevel(logging.NOTSET)


@pytest.fixture
def memory_con():
    """An in-memory DuckDB connection: what the unit tests (tests/unit) run the package's SQL on."""
    con = duckdb.connect(":memory:")
    yield con
    con.close()


@pytest.fixture
def api_key() -> str:
    # Distinctive, so a test can search every file for it.
    return "sk-test-" + uuid.uuid4().hex


@pytest.fixture
def emulator(monkeypatch, api_key):
    from dbt_llm_batch.sandbox import Emulator

    emu = Emulator(api_key=api_key).start()
    monkeypatch.setenv("OPENAI_BASE_URL", emu.openai_base_url)
    monkeypatch.setenv("OPENAI_API_KEY", api_key)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", emu.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", api_key)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", emu.gemini_base_url)
    monkeypatch.setenv("GEMINI_API_KEY", api_key)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)  # the SDK would prefer it to GEMINI_API_KEY
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", emu.base_url)
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", api_key)
    yield emu
    emu.stop()
    emu.raise_internal_errors()  # a sandbox bug looks like a provider 500 the plugin survives: fail here


@pytest.fixture(scope="session")
def s3_server() -> str:
    """moto's S3 in server mode (a real S3 emulator, over HTTP), shared by the session: each test
    that uses it makes buckets of its own (the `bedrock` fixture)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bedrock(emulator, s3_server, monkeypatch, api_key):
    """The emulator's Bedrock face on moto's S3, with the environment boto3's standard chain reads:
    credentials (the access key id is the sandbox key), region and each service's endpoint. Nothing
    from this machine's own AWS setup is read. Returns the test's bucket."""
    import boto3

    emulator.s3_endpoint_url = s3_server
    env = {
        "AWS_ACCESS_KEY_ID": api_key,
        "AWS_SECRET_ACCESS_KEY": "sandbox-secret",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_BEDROCK": emulator.base_url,
        "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": emulator.base_url,
        "AWS_ENDPOINT_URL_S3": s3_server,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    bucket = "llm-" + uuid.uuid4().hex[:16]
    boto3.session.Session().client("s3").create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(params=sorted(PROVIDER_MODELS))
def provider(request) -> str:
    """Run a test once per batch provider: the same story must hold for each."""
    return request.param


@pytest.fixture
def emu():
    """A seeded emulator on its own, for tests that drive it directly with the SDKs."""
    from dbt_llm_batch.sandbox import Emulator

    with Emulator(SANDBOX_KEY, seed=7) as emulator:
        yield emulator
    emulator.raise_internal_errors()


@pytest.fixture
def client(emu):
    """The official OpenAI SDK on the `emu` sandbox (max_retries=0: call counts and errors are exact)."""
    import openai

    return openai.OpenAI(base_url=emu.openai_base_url, api_key=SANDBOX_KEY, max_retries=0)


@pytest.fixture
def claude(emu):
    """The official Anthropic SDK on the `emu` sandbox (max_retries=0)."""
    import anthropic

    return anthropic.Anthropic(base_url=emu.anthropic_base_url, api_key=SANDBOX_KEY, max_retries=0)


class Project:
    """A copy of integration_project in a temp dir, with its own DuckDB file, target/ and logs/
    (the profile's DuckDB file: DBT_LLM_BATCH_DUCKDB)."""

    def __init__(self, root: Path, monkeypatch):
        self.root = root
        self.db_path = root / "warehouse.duckdb"
        monkeypatch.setenv("DBT_LLM_BATCH_DUCKDB", str(self.db_path))

    @classmethod
    def run_from_its_directory(cls, root: Path, monkeypatch) -> Project:
        """The project as a user runs it, from its directory, the profile naming its DuckDB file by a
        path relative to it: the profile reads the same in every test's copy, which dbt's partial
        parsing requires (a profile's values are part of its saved manifest's check)."""
        project = cls(root, monkeypatch)
        monkeypatch.chdir(root)
        monkeypatch.setenv("DBT_LLM_BATCH_DUCKDB", project.db_path.name)
        return project

    def write(self, relpath: str, text: str) -> None:
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def dbt(self, *args: str, expect_ok: bool = True):
        from dbt.cli.main import dbtRunner

        argv = [*args, "--project-dir", str(self.root), "--profiles-dir", str(self.root)]
        result = dbtRunner().invoke(argv)
        if expect_ok and not result.success:
            raise AssertionError(f"dbt {' '.join(args)} failed: {result.exception or _failures(result)}")
        return result

    def release_database(self) -> None:
        """dbt-duckdb keeps the database open in this process after an in-process run; close it, so
        that another process (a dbt subprocess) can take the file's lock."""
        from dbt.adapters.duckdb.connections import DuckDBConnectionManager

        if DuckDBConnectionManager._ENV is not None:
            DuckDBConnectionManager._ENV.close()
            DuckDBConnectionManager._ENV = None

    def query(self, sql: str, params=None) -> list[tuple]:
        with duckdb.connect(str(self.db_path)) as con:
            return con.execute(sql, params or []).fetchall()


def _failures(result) -> str:
    res = getattr(result, "result", None)
    try:
        return "\n".join(
            f"{r.node.name}: {r.status}: {r.message}" for r in res.results if r.status not in ("success", "pass")
        )
    except Exception:
        return repr(res)


def failure_messages(result) -> str:
    """All messages of failed nodes of a dbt invocation, joined (for asserting on error text)."""
    return "\n".join(str(r.message) for r in result.result.results if r.status in ("error", "fail"))


@pytest.fixture(scope="session")
def parsed_integration_project(tmp_path_factory) -> Path:
    """integration_project with this package installed (`dbt deps`: a link to this checkout) and its
    files parsed (`dbt parse`), once per test session and xdist worker. Each test's project is a copy,
    so its first dbt command parses only the files the test wrote (dbt's partial parsing: the saved
    manifest in target/ holds the template's directory only as a fallback for a seed whose file is
    missing), not all of them again: about 2 s a test (tests/test_project_fixture.py). A test of a
    parse from scratch says so (`--no-partial-parse`), as a CI checkout does."""
    root = tmp_path_factory.mktemp("integration") / "project"
    shutil.copytree(INTEGRATION, root, ignore=shutil.ignore_patterns("target", "logs", "dbt_packages", "*.duckdb*"))
    (root / "packages.yml").write_text(f"packages:\n  - local: {REPO}\n")
    with pytest.MonkeyPatch.context() as patch:
        parsing = Project.run_from_its_directory(root, patch)
        for command in ("deps", "parse"):
            parsing.dbt(command)
    shutil.rmtree(root / "logs", ignore_errors=True)
    assert (root / "target" / "partial_parse.msgpack").exists() and not list(root.glob("*.duckdb*"))
    return root


@pytest.fixture
def project(parsed_integration_project, tmp_path, monkeypatch) -> Iterator[Project]:
    """A copy of the parsed integration project (its package link copied as a link). dbt-duckdb keeps
    the database of an in-process run open for the next run with the same profile, and every copy's
    profile reads the same (a relative path): each test's project starts and ends with it closed."""
    root = tmp_path / "project"
    shutil.copytree(parsed_integration_project, root, symlinks=True)
    project = Project.run_from_its_directory(root, monkeypatch)
    project.release_database()
    yield project
    project.release_database()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (tests/ray_cluster.py) for the test session: `ray start --head` on loopback,
    2 CPUs; its start-up time is printed. The Ray tests share an xdist group, so one worker starts it."""
    from helpers import SANDBOX_KEY
    from ray_cluster import RayCluster

    cluster = RayCluster(engine_key=SANDBOX_KEY).start()
    print(f"\nray_cluster: a local Ray head started in {cluster.started_in_seconds:.1f} s")
    yield cluster
    cluster.stop()


@pytest.fixture
def gemini_project(project, emulator) -> Project:
    """A project on the sandbox's Gemini face: the model `triage` (6 tickets, seeded) asks Gemini
    (tests/test_gemini.py; a provider conformance suite takes "a project on this provider's face")."""
    project.write("models/triage.sql", gemini_triage_model())
    project.dbt("seed")
    return project
