"""The conformance suite's kits: the built-in providers' (kits.py) and any package's registered in the
entry-point group `dbt_llm_batch.conformance_kits` (name: the llm_provider it tests; value: "module:Kit",
a ProviderKit of kit.py). Every test of the suite runs once per kit."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from kits import BUILT_IN

KIT_GROUP = "dbt_llm_batch.conformance_kits"


def all_kits() -> dict[str, type]:
    """Each tested provider's kit class, the built-in ones first; a registered kit replaces a built-in one."""
    kits = {cls.provider: cls for cls in BUILT_IN}
    for ep in entry_points(group=KIT_GROUP):
        cls = ep.load()
        if getattr(cls, "provider", None) != ep.name:
            raise pytest.UsageError(f"conformance kit {ep.value!r} is registered as {ep.name!r} but tests {cls.provider!r}")
        kits[ep.name] = cls
    return kits


KITS = all_kits()


def pytest_generate_tests(metafunc):
    """Each test once per kit; a test taking `crash_point` once per kit and each of its crash points."""
    if "kit" not in metafunc.fixturenames:
        return
    if "crash_point" in metafunc.fixturenames:
        cases = [(name, point) for name in sorted(KITS) for point in KITS[name].crash_points]
        metafunc.parametrize("kit,crash_point", cases, indirect=["kit"], ids=[f"{n}-{p}" for n, p in cases])
    else:
        metafunc.parametrize("kit", sorted(KITS), indirect=True)


@pytest.fixture
def kit(request, monkeypatch):
    """One provider's kit with its face started (and the provider pointed at it), stopped afterwards."""
    instance = KITS[request.param]()
    instance.start(monkeypatch)
    yield instance
    instance.stop()
