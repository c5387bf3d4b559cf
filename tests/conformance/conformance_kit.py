"""The interface a batch provider's test kit implements to run the conformance suite
(tests/conformance/test_conformance.py; docs/providers/conformance.md says how a third party runs it).

A kit starts the provider's sandbox face (an HTTP emulator the provider's official SDK talks to), points
the provider at it through environment variables, and drives it as the provider would behave: batches
finish, end unfinished, calls fail. The suite runs real dbt against it and checks, with the kit's
record of what the face billed, that nothing is paid twice and every cost is right. The suite never
asks a kit for anything the provider does not do; what differs between providers is said by the kit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

CALLS = ("create", "poll")  # the provider calls a fault can be injected into
FAULT_KINDS = ("overloaded", "disconnect")  # a 5xx the provider sends when overloaded; no answer at all
WHEN = ("before", "after")  # the fault comes before the provider acted, or after (the work is done)


@dataclass(frozen=True)
class Billed:
    """One request the provider billed (a succeeded batch line, also in a batch that ended unfinished,
    or an answered realtime call)."""

    prompt: str  # the row's prompt as asked (the user turn)
    input_tokens: int  # all input tokens, cached ones included
    output_tokens: int
    cached_tokens: int  # input tokens read from (or written to) a prompt cache


class ProviderKit(ABC):
    """What the conformance suite needs of a batch provider. One instance per test."""

    provider: ClassVar[str]  # the llm_provider name, registered in the dbt_llm_batch.providers group
    model: ClassVar[str]  # the llm_model the face serves (priced in the shipped price table)
    config: ClassVar[dict[str, str]] = {}  # more config() keys the provider needs, e.g. {"llm_foo": "bar"}
    # Price rows (the price table's CSV, header included) for a model the shipped table does not price:
    # the suite seeds them as the model's llm_price_table. None: the shipped table prices `model`.
    price_table: ClassVar[str | None] = None
    # Crash points (dbt_llm_batch/pipeline/crashpoints.py) the suite kills a run at: at least after_create.
    crash_points: ClassVar[tuple[str, ...]] = ("after_create",)
    # How the provider ends a batch it did not finish: "expiry" (its window passed) or "cancel" (it never
    # expires a job; one ended early was cancelled outside the plugin). Said in the suite's matrix.
    ends_unfinished_by: ClassVar[str] = "expiry"

    @abstractmethod
    def start(self, monkeypatch) -> None:
        """Start the face and set (with monkeypatch.setenv) the variables that point the provider's SDK
        at it and hold its key; a dbt subprocess inherits them."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the face; raise AssertionError if the face itself failed (a bug in the emulator)."""

    @abstractmethod
    def complete_all(self) -> None:
        """Run every open batch to its successful end."""

    @abstractmethod
    def end_unfinished(self, done_fraction: float) -> None:
        """End every open batch with only `done_fraction` of its requests run, as the provider ends a
        batch it did not finish (`ends_unfinished_by`): the finished requests are returned and billed."""

    @abstractmethod
    def inject_fault(self, call: str, kind: str, when: str, times: int) -> None:
        """Make the next `times` calls of `call` (CALLS) fail as `kind` (FAULT_KINDS), `when` (WHEN)."""

    @abstractmethod
    def faults_pending(self) -> int:
        """Injected failures that have not fired yet."""

    @abstractmethod
    def batches_created(self) -> int:
        """Batches the provider created (whatever happened to them since)."""

    @abstractmethod
    def billed(self) -> list[Billed]:
        """Every request the provider billed so far."""
