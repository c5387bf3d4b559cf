"""docs/configuration.md, generated from the config table (config_keys.py) and the own keys of this
package's providers, so the reference cannot drift from what parsing, variants, the fingerprint and
the poller's snapshot do.

`python -m dbt_llm_batch.ops.config_reference` writes the page; `--check` exits 1 when the file differs
from what the code generates (tests/unit/test_config_keys.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dbt_llm_batch import registry
from dbt_llm_batch.config_keys import SECTIONS, Key

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m dbt_llm_batch.ops.config_reference"

INTRO = """\
Every key a model can set, generated from the one table that declares them
(`dbt_llm_batch/config_keys.py`): do not edit this page, edit the table and run `{command}`.

Keys are set in `config()`, in a model's YAML `config:`, or for a folder with `+llm_...` in
`dbt_project.yml`. An unknown `llm_*` key is an error (with a did-you-mean); `dbt-llm-batch check` finds
every problem after `dbt parse`, before any run.

- **changes the answer**: the key is in the request's fingerprint; changing it asks every row again.
- **per variant**: a variant in `llm_variants` may set it (every other key is the model's).
- **kept for poll**: the copy of the config a run stores for `dbt-llm-batch poll` keeps it (a system
  prompt, examples and request parameters are prompts, which are never stored outside a run).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def default_text(key: Key) -> str:
    """How the page says a key's default."""
    if key.default_doc is not None:
        return key.default_doc
    value: Any = key.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render() -> str:
    """The whole page, as the repository keeps it."""
    lines = ["# Configuration reference", "", INTRO.format(command=COMMAND)]
    for title, keys in SECTIONS.items():
        lines += [f"## {title}", ""]
        lines += [
            "| key | type | default | changes the answer | per variant | kept for poll | meaning |",
            "|---|---|---|---|---|---|---|",
        ]
        for key in keys:
            cells = [
                f"`{key.name}`",
                key.type,
                default_text(key),
                _yes(key.changes_answer),
                _yes(key.variant),
                _yes(key.snapshot),
                key.doc,
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    lines += [
        "## Keys a provider adds",
        "",
        "A provider reads keys of its own (declared by the provider, validated by its `parse_options`); "
        "another provider's key on a model is an error. The poller's stored config keeps them.",
        "",
        "| key | provider | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name in registry.provider_names():
        provider = registry.load_provider(name)
        if not provider.__module__.startswith("dbt_llm_batch."):
            continue  # a plugin documents its own keys
        for key_name, declared in provider.config_keys.items():
            if isinstance(declared, Key):
                cells = [f"`{key_name}`", f"`{name}`", declared.type, default_text(declared), declared.doc]
                lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the generated one")
    parser.add_argument("--path", default=str(PAGE), help=f"the page (default: {PAGE})")
    args = parser.parse_args(argv)
    page, wanted = Path(args.path), render()
    if args.check:
        if not page.exists() or page.read_text() != wanted:
            print(f"{page} is not what the config table generates: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(wanted)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
