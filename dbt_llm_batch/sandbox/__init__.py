"""Local SANDBOX emulator of provider batch APIs: OpenAI Files + Batches and
Anthropic Message Batches.

For tests and dry runs without a provider account. Its answers are
deterministic placeholders computed from the prompt (`expected_answer`),
never a model's output.
"""

from .answers import expected_answer
from .server import Emulator

__all__ = ["Emulator", "expected_answer"]
