"""The docs' examples run: the README's quickstart, then every guide that continues it, read from the
Markdown as a reader sees it (tests/docs_blocks.py; the convention: docs/contributing-docs.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_blocks import Session, blocks, chain, free_port, opt_in, pages_in_order

REPO = Path(__file__).resolve().parent.parent
GUIDES = [f"docs/guides/{name}.md" for name in ("classify", "extract", "generate", "evaluate", "pipeline", "realtime")]
RUN_AFTER_THE_QUICKSTART = [*GUIDES, "docs/operations.md"]


def test_every_example_of_an_opted_in_page_runs_or_says_why_not():
    opted = [page for page in pages_in_order(REPO) if opt_in((REPO / page).read_text())]
    assert {"README.md", *RUN_AFTER_THE_QUICKSTART} <= set(opted)
    unmarked = [b.where for page in opted for b in blocks(page, (REPO / page).read_text()) if b.kind == "unmarked"]
    assert unmarked == []
    # Every guide is reached from the quickstart, so the test below runs it.
    assert set(RUN_AFTER_THE_QUICKSTART) <= set(chain(REPO, "README.md"))


def test_the_convention_reads_a_page_as_documented():
    page = "\n".join(
        [
            "<!-- docs-test: continues ../README.md -->",
            "```sql",
            "-- file: models/a.sql",
            "select 1",
            "```",
            "  ```bash",
            "  dbt run -s a   # run it",
            "  ```",
            "```yaml",
            "# not run by the docs tests: needs Airflow",
            "```",
            "```yaml",
            "models: []",
            "```",
        ]
    )
    assert opt_in(page) == "../README.md"
    assert [(b.line, b.kind) for b in blocks("p.md", page)] == [
        (2, "file"),
        (6, "run"),
        (9, "not run"),
        (12, "unmarked"),
    ]


@pytest.mark.dbt
def test_the_quickstart_and_every_guide_run_on_the_sandbox(tmp_path, monkeypatch):
    (tmp_path / "dbt-llm-batch").symlink_to(REPO)  # the checkout the quickstart installs, next to the project
    session = Session(tmp_path, free_port(), monkeypatch)
    try:
        for page in chain(REPO, "README.md"):
            for block in blocks(page, (REPO / page).read_text()):
                session.follow(block)
    finally:
        session.close()
    # The quickstart ends by querying its table; each guide by querying its own (checked by their output blocks).
    assert any(command.startswith("dbt show") for command in session.ran)


def test_an_output_block_fails_when_the_command_printed_otherwise(tmp_path, monkeypatch):
    session = Session(tmp_path, free_port(), monkeypatch)
    session.last_output = "| ticket_id | category |\n|         1 | billing  |\n"
    shown = "```text\n# the output includes:\n| 1 | billing |\n```\n"
    session.follow(blocks("p.md", shown)[0])  # spaces collapsed: the same row
    with pytest.raises(AssertionError, match=r"p.md:1: the output lacks \['\| 2 \| bug \|'\]"):
        session.follow(blocks("p.md", shown.replace("| 1 | billing |", "| 2 | bug |"))[0])
