"""`dbt-llm-batch poll --then COMMAND`: the shell command a poll runs for the models it completed.

The command is shell text, run as cron runs a crontab line: `/bin/sh -c COMMAND`, so `&&`, `;`,
`>`, `|`, `$HOME` and quotes mean what they mean in a shell. Only `{models}` is the poller's: it
becomes the models' dbt names, each shell-quoted (shlex.quote) so that no name can be read as shell
syntax, one word per model. dbt's graph operators written around the placeholder go with every name:
`-s {models}+` becomes `-s a+ b+`, `-s +{models}` becomes `-s +a +b`, `2+{models}+1` and `@{models}`
likewise (a dbt selector unions space-separated words). The placeholder must therefore be a word of
its own: inside quotes, or glued to anything other than those operators (`--select={models}`,
`"{models}"`), several names could not be substituted as words, and the poll refuses the command
before it polls.

A command that exits non-zero is recorded in each model's ledger (ledger/then_commands.py); the next
poll with --then runs its own command again for those models, with any new ones, until it succeeds.
"""

from __future__ import annotations

import re
import shlex
import subprocess

from dbt_llm_batch.errors import PollError

PLACEHOLDER = "{models}"
SHELL = "/bin/sh"  # what cron runs a crontab line with
# Characters that end an unquoted shell word.
_WORD_END = frozenset(" \t\n;&|<>()")
# dbt's graph operators that may stand before and after a selector word (`+x`, `2+x`, `@x`, `x+`, `x+1`).
_BEFORE = re.compile(r"(@|\d*\+)?")
_AFTER = re.compile(r"(\+\d*)?")


def check(template: str) -> None:
    """Raise PollError if `template` cannot have its `{models}` substituted as shell words."""
    expand(template, ["model"])


def expand(template: str, models: list[str]) -> str:
    """`template` with each `{models}` (and the graph operators around it) replaced by one shell-quoted
    word per model in `models`; everything else is left exactly as written. Raises PollError when a
    placeholder is quoted or glued to other text (see the module's docstring)."""
    words = []
    for at in reversed(_placeholders(template)):
        start, end = at, at + len(PLACEHOLDER)
        while start > 0 and template[start - 1] not in _WORD_END:
            start -= 1
        while end < len(template) and template[end] not in _WORD_END:
            end += 1
        before, after = template[start:at], template[at + len(PLACEHOLDER) : end]
        if not (_BEFORE.fullmatch(before) and _AFTER.fullmatch(after)):
            raise PollError(
                f"--then: {PLACEHOLDER} must be a shell word of its own, optionally with dbt's graph operators "
                f"(-s {PLACEHOLDER}+, -s +{PLACEHOLDER}, -s @{PLACEHOLDER}); it is in {template[start:end]!r}, "
                f"where several model names cannot be put. Write e.g. --then 'dbt build -s {PLACEHOLDER}+'"
            )
        words.append((start, end, " ".join(shlex.quote(before + name + after) for name in models)))
    for start, end, text in words:  # right to left, so earlier offsets stay valid
        template = template[:start] + text + template[end:]
    return template


def _placeholders(template: str) -> list[int]:
    """Offsets of the unquoted `{models}` in `template`, read as /bin/sh reads quotes and backslashes;
    a quoted one raises PollError."""
    found, quote, i = [], "", 0
    while i < len(template):
        if template.startswith(PLACEHOLDER, i):
            if quote:
                raise PollError(
                    f"--then: {PLACEHOLDER} is inside {quote}...{quote} quotes, where several model names "
                    f"would become one word; leave it unquoted (each name is shell-quoted for you): "
                    f"e.g. --then 'dbt build -s {PLACEHOLDER}+'"
                )
            found.append(i)
            i += len(PLACEHOLDER)
            continue
        c = template[i]
        if quote == "'":  # nothing is special inside single quotes but the closing one
            quote = "" if c == "'" else quote
        elif c == "\\":
            i += 1  # the next character is escaped
        elif quote == '"':
            quote = "" if c == '"' else quote
        elif c in "'\"":
            quote = c
        i += 1
    return found


def run(command: str) -> int:
    """Run `command` through the shell as cron would; its output goes where the poller's goes.
    Returns its exit status (a shell that cannot be started counts as 127, as sh says)."""
    try:
        return subprocess.run([SHELL, "-c", command]).returncode
    except OSError:
        return 127
