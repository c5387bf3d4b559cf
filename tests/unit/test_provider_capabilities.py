"""Providers declare what they can do; the core asks them, never their names.

Also: providers are found through the entry-point group `dbt_llm_batch.providers`, so a provider in
another package is used without changing this one.
"""

from __future__ import annotations

import ast
import re
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import dbt_llm_batch
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError

PACKAGE = Path(dbt_llm_batch.__file__).parent
BUILT_IN = {"openai", "anthropic", "openai_compatible", "gemini"}
# Not the core: the providers themselves, and the sandbox (the emulator of the providers' HTTP APIs,
# whose faces are named after the provider they emulate).
NOT_CORE = ("providers", "sandbox")
# A provider name in SQL text compared with =, <>, != or in (...), e.g. "provider <> 'openai_compatible'".
SQL_COMPARISON = r"(=|<>|!=|\bin\s*\()\s*'({names})'"


def provider_name_literals() -> set[str]:
    # Read from the installed metadata, not through the package, so the scan also runs on old code.
    return BUILT_IN | {ep.name for ep in entry_points(group="dbt_llm_batch.providers")}


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each place `source` decides by a provider's name: a comparison or `in` test
    with a name literal, a table keyed by a name (a dict key, or a tuple key holding one), and a
    name compared inside SQL text."""

    def literal_names(node) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(literal_names(e) for e in node.elts)) if node.elts else set()
        return set()

    sql = re.compile(SQL_COMPARISON.format(names="|".join(map(re.escape, sorted(names)))), re.IGNORECASE)
    tree = ast.parse(source)
    docstrings = {  # prose, e.g. "llm_provider='openai_compatible' sends every row...", is not SQL
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                for name in literal_names(operand):
                    found.append((node.lineno, f"compares with {name!r}"))
        elif isinstance(node, ast.MatchValue):
            for name in literal_names(node.value):
                found.append((node.value.lineno, f"matches {name!r}"))
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                for name in literal_names(key) if key is not None else ():
                    found.append((key.lineno, f"a table keyed by {name!r}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for match in sql.finditer(node.value):
                found.append((node.lineno, f"SQL compares with {match.group(2)!r}"))
    return found


def test_the_core_never_decides_by_a_provider_name():
    names = provider_name_literals()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in NOT_CORE:
            continue
        for line, what in name_comparisons(path.read_text(encoding="utf-8"), names):
            offenders.append(f"dbt_llm_batch/{relative.as_posix()}:{line}: {what}")
    assert offenders == [], "ask the provider's capabilities instead:\n" + "\n".join(offenders)


def test_the_scan_finds_each_way_of_deciding_by_name():
    # The scan itself, on code in each shape it must catch (and a default value, which it must not).
    source = textwrap.dedent(
        """
        \'\'\'Docstring: rows of llm_provider='openai_compatible' go in realtime.\'\'\'
        a = provider == "openai_compatible"
        b = "anthropic" != config.provider
        c = config.provider in ("openai", "other")
        WINDOWS = {("openai", "gpt-4o"): 128_000, "anthropic": 1}
        q = "select 1 from jobs where provider <> 'openai_compatible' or provider in ('anthropic')"
        match config.provider:
            case "anthropic":
                pass
        DEFAULTS = {"llm_provider": "openai"}
        ok = name == other
        """
    )
    assert [what for _, what in name_comparisons(source, BUILT_IN)] == [
        "compares with 'openai_compatible'",
        "compares with 'anthropic'",
        "compares with 'openai'",
        "a table keyed by 'openai'",
        "a table keyed by 'anthropic'",
        "SQL compares with 'openai_compatible'",
        "SQL compares with 'anthropic'",
        "matches 'anthropic'",
    ]


def test_capabilities_of_the_built_in_providers():
    from dbt_llm_batch.providers import BatchProvider, get_provider

    openai, anthropic, engine = (get_provider(n) for n in ("openai", "anthropic", "openai_compatible"))
    assert [(p.has_batch_api, p.has_realtime, p.self_hosted) for p in (openai, anthropic, engine)] == [
        (True, True, False),
        (True, True, False),
        (False, True, True),
    ]
    assert issubclass(openai, BatchProvider) and issubclass(anthropic, BatchProvider)
    assert not issubclass(engine, BatchProvider)
    # Published batch limits: OpenAI 50,000 requests / 200 MB a file, Anthropic 100,000 / 256 MB a create body.
    assert (openai.max_requests_per_batch, openai.max_bytes_per_batch) == (50_000, 200_000_000)
    assert anthropic.max_requests_per_batch == 100_000 and anthropic.max_bytes_per_batch < 256_000_000
    assert (openai.default_max_tokens_in_flight, anthropic.max_requests_in_flight) == (2_000_000, 100_000)
    assert (engine.default_max_tokens_in_flight, engine.max_requests_in_flight) == (None, None)


def test_a_realtime_only_provider_has_no_batch_methods():
    from dbt_llm_batch.providers import BatchProvider, get_provider

    engine = get_provider("openai_compatible")
    batch_methods = [m for m in vars(BatchProvider) if not m.startswith("_") and m != "has_batch_api"]
    assert {"upload", "create", "submit", "find_upload", "find_submission", "poll", "download_results"} <= set(
        batch_methods
    )
    assert [m for m in batch_methods if hasattr(engine, m)] == []
    # ...while it shares OpenAI's request format and result reading (the chat-completions format).
    openai = get_provider("openai")
    for shared in ("request_body", "realtime_body", "realtime_result_line", "outcomes_sql", "result_structure"):
        assert getattr(engine, shared) is getattr(openai, shared), shared


@pytest.mark.parametrize(
    ("provider", "model", "window", "reserved"),
    [
        ("openai", "gpt-4o-mini", 128_000, None),
        ("openai", "gpt-4o-2024-08-06", 128_000, None),
        ("openai", "gpt-4.1-nano", 1_047_576, None),
        ("openai", "o3-unknown", None, None),
        ("anthropic", "claude-haiku-4-5", 200_000, 1024),
        ("anthropic", "not-claude", None, 1024),
        ("openai_compatible", "gpt-4o-mini", None, None),  # an engine's model: its window is not known
    ],
)
def test_context_windows_and_default_output_tokens_come_from_the_provider(provider, model, window, reserved):
    from dbt_llm_batch.pipeline.validate import context_limit
    from dbt_llm_batch.providers import get_provider

    cls = get_provider(provider)
    assert (cls.context_window(model), cls.default_max_tokens(model)) == (window, reserved)
    extra = {"llm_base_url": "http://127.0.0.1:1/v1"} if provider == "openai_compatible" else {}
    config = parse_config({"unique_key": "id", "llm_provider": provider, "llm_model": model, **extra})
    assert context_limit(config) == window
    assert context_limit(parse_config({**extra, "unique_key": "id", "llm_provider": provider, "llm_model": model,
                                       "llm_max_context_tokens": 7})) == 7  # fmt: skip


def test_a_provider_validates_its_own_keys_with_the_messages_a_user_sees():
    engine = {"unique_key": "id", "llm_model": "m", "llm_provider": "openai_compatible"}
    with pytest.raises(ConfigError) as error:
        parse_config(engine)
    assert "llm_provider 'openai_compatible' needs llm_base_url: the engine's URL" in str(error.value)
    with pytest.raises(ConfigError) as error:
        parse_config({**engine, "llm_base_url": "ftp://x", "llm_api_key_env": "sk-123", "llm_fallback": "realtime"})
    message = str(error.value)
    assert "llm_base_url must be an http(s) URL or a list of them, got 'ftp://x'" in message
    assert "llm_api_key_env must be the NAME of an environment variable (never the key), got a str" in message
    assert "with llm_provider 'openai_compatible' every row is already realtime" in message
    assert "sk-123" not in message  # a key pasted by mistake is never echoed

    config = parse_config({**engine, "llm_base_url": ["http://a:8000/v1/", "http://b:8000/v1"], "llm_api_key_env": "K"})
    assert config.options == {"base_urls": ("http://a:8000/v1", "http://b:8000/v1"), "api_key_env": "K"}


@pytest.mark.parametrize("provider", ["openai", "openai_compatible"])
def test_a_key_shaped_like_a_variable_name_is_refused_without_being_echoed(provider):
    """A Groq key (gsk_ and letters and digits) is a valid identifier: it used to pass as a variable's
    name and was then printed in the run log as "gsk_... is not set"."""
    key = "gsk_4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"
    values = {"unique_key": "id", "llm_model": "m", "llm_provider": provider, "llm_api_key_env": key}
    values["llm_base_url"] = "http://127.0.0.1:9/v1"
    with pytest.raises(ConfigError) as error:
        parse_config(values)
    message = str(error.value)
    assert "llm_api_key_env looks like an API key, not the NAME of an environment variable" in message
    assert "rotate it" in message
    assert key[:8] not in message and key[-4:] not in message
    assert parse_config({**values, "llm_api_key_env": "GROQ_API_KEY"}).options["api_key_env"] == "GROQ_API_KEY"


def test_realtime_routing_needs_a_provider_with_a_realtime_path(monkeypatch):
    from dbt_llm_batch.providers import get_provider

    raw = {"unique_key": "id", "llm_model": "m", "llm_provider": "anthropic", "llm_fallback": "realtime"}
    assert parse_config(raw).fallback == "realtime"
    monkeypatch.setattr(get_provider("anthropic"), "has_realtime", False)  # a batch-only provider
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert "llm_provider 'anthropic' does not have" in str(error.value)


def test_another_providers_key_is_refused_saying_whose_it_is():
    for provider, reads in (("anthropic", "ANTHROPIC_BASE_URL"), ("azure_openai", "AZURE_OPENAI_ENDPOINT")):
        with pytest.raises(ConfigError) as error:
            parse_config({"unique_key": "id", "llm_model": "m", "llm_provider": provider, "llm_base_url": "http://x"})
        message = str(error.value)
        assert "llm_base_url is only for llm_provider 'openai' or 'openai_compatible'" in message and reads in message
    with pytest.raises(ConfigError) as error:  # a typo of a provider's key still gets a did-you-mean
        parse_config({"unique_key": "id", "llm_model": "m", "llm_base_ulr": "http://x"})
    assert "unknown config key 'llm_base_ulr' (did you mean 'llm_base_url'?)" in str(error.value)


def test_an_unknown_provider_name_lists_the_registered_ones():
    from dbt_llm_batch.providers import get_provider, provider_names

    with pytest.raises(ConfigError) as error:
        get_provider("vertex")
    names = provider_names()
    assert str(error.value) == f"llm_provider must be one of {names}, got 'vertex'"
    assert {"anthropic", "azure_openai", "bedrock", "gemini", "openai", "openai_compatible", "ray"} <= set(names)


# --- a third-party provider, registered by its own package's metadata --------------------------------

PLUGIN = '''
from dbt_llm_batch.providers.openai_chat import OpenAIChatProvider


class AcmeProvider(OpenAIChatProvider):
    """A realtime-only provider with a key of its own, in a package of its own."""

    name = "acme"
    config_keys = {"llm_acme_region": "eu"}
    context_windows = {"acme-": 32_000}

    @classmethod
    def parse_options(cls, values, errors):
        if values["llm_acme_region"] not in ("eu", "us"):
            errors.append(f"llm_acme_region must be 'eu' or 'us', got {values['llm_acme_region']!r}")
        return {"region": values["llm_acme_region"]}

    def realtime_transports(self):
        return []
'''


def install_plugin(path: Path, monkeypatch, module: str, class_name: str = "AcmeProvider") -> None:
    """What `pip install acme-llm` leaves on sys.path: the module and its dist-info metadata. (Each
    test names its own module: a module once imported stays in sys.modules for the session.)"""
    (path / f"{module}.py").write_text(PLUGIN)
    dist = path / "acme_llm-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-llm\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[dbt_llm_batch.providers]\nacme = {module}:{class_name}\n")
    monkeypatch.syspath_prepend(str(path))


def test_a_third_party_provider_is_found_through_its_entry_point(tmp_path, monkeypatch):
    from dbt_llm_batch.providers import get_provider, provider_names

    raw = {"unique_key": "id", "llm_provider": "acme", "llm_model": "acme-large"}
    with pytest.raises(ConfigError, match="llm_provider must be one of"):
        parse_config(raw)  # not installed yet

    install_plugin(tmp_path, monkeypatch, "acme_llm_unit")
    acme = get_provider("acme")
    assert acme.__module__ == "acme_llm_unit" and acme.__name__ == "AcmeProvider"
    assert "acme" in provider_names() and BUILT_IN <= set(provider_names())
    assert (acme.has_batch_api, acme.context_window("acme-large")) == (False, 32_000)

    config = parse_config({**raw, "llm_acme_region": "us"})
    assert (config.provider, config.options) == ("acme", {"region": "us"})
    assert parse_config(raw).options == {"region": "eu"}  # its key's default
    with pytest.raises(ConfigError) as error:
        parse_config({**raw, "llm_acme_region": "mars", "llm_fallback": "realtime"})
    assert "llm_acme_region must be 'eu' or 'us', got 'mars'" in str(error.value)
    assert "with llm_provider 'acme' every row is already realtime" in str(error.value)
    with pytest.raises(ConfigError) as error:  # its key is its own: another provider's model may not set it
        parse_config({"unique_key": "id", "llm_model": "m", "llm_acme_region": "eu"})
    assert "llm_acme_region is only for llm_provider 'acme'" in str(error.value)


def test_a_broken_registration_says_which_one(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "acme_llm_broken", class_name="NoSuchClass")
    with pytest.raises(ConfigError) as error:
        parse_config({"unique_key": "id", "llm_provider": "acme", "llm_model": "m"})
    assert "llm_provider 'acme' is registered as 'acme_llm_broken:NoSuchClass'" in str(error.value)
    assert "cannot be loaded: AttributeError" in str(error.value)
    # The built-in providers are unaffected by a broken plugin.
    assert parse_config({"unique_key": "id", "llm_model": "m"}).provider == "openai"
