"""ARCHITECTURE.md is the source of truth for how the code is built: these checks keep it from
drifting away from the code it describes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dbt_llm_batch.ledger import status

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "ARCHITECTURE.md").read_text()


def test_the_module_map_names_every_module_of_the_package():
    map_block = DOC.split("## Module map", 1)[1].split("## ", 1)[0]
    missing = []
    for path in sorted((ROOT / "dbt_llm_batch").rglob("*")):
        if path.suffix not in (".py", ".csv") or "__pycache__" in path.parts:
            continue
        if (
            path.name == "__init__.py"
            and path.parent.name != "dbt_llm_batch"
            and path.parent.name
            not in (
                "providers",
                "sandbox",
            )
        ):
            continue  # a subpackage's __init__ is its folder's line
        if not re.search(rf"^\s+{re.escape(path.name)}\s", map_block, re.M):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules missing from ARCHITECTURE.md's module map: {missing}"


def test_the_state_table_is_the_one_in_status_py():
    """Every row of the transition tables in status.py's docstring appears in ARCHITECTURE.md as is."""
    rows = [line.strip() for line in (status.__doc__ or "").splitlines() if re.match(r"^\s{4}\S", line)]
    assert len(rows) > 20, "status.py's docstring lost its transition tables"
    absent = [row for row in rows if row not in DOC]
    assert not absent, f"ARCHITECTURE.md's state table differs from status.py: {absent[:3]}"


def test_no_file_refers_to_documents_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix not in (
            ".py",
            ".md",
            ".sql",
            ".sh",
            ".yml",
            ".yaml",
            ".toml",
            ".cfg",
            ".txt",
        ):
            continue
        if name == "tests/unit/test_architecture_doc.py":
            continue  # this file spells the patterns it looks for
        text = path.read_text(errors="replace")
        if "../shared" in text or "DESIGN.md" in text:
            offenders.append(name)
    assert not offenders, f"files referring to documents the repository does not contain: {offenders}"
