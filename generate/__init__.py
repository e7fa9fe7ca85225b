"""generate: the runtime (sampling, the decode loop), the Python API and the ``generate`` command.

The public names are imported on first use (PEP 562), so ``import generate`` and the command's startup do
not pay for torch until something needs it: Ctrl-C in that window then exits cleanly (see
``generate.tools.cli``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from generate.api import Completion, Generator, load
    from generate.engine.engine import GenerationError
    from generate.engine.sampling import SamplingParams
    from generate.ids import TokenCompletion, generate_ids
    from generate.score import Score

__all__ = [
    "Completion",
    "GenerationError",
    "Generator",
    "SamplingParams",
    "Score",
    "TokenCompletion",
    "generate_ids",
    "load",
]

_HOMES = {
    "Completion": "generate.api",
    "Generator": "generate.api",
    "load": "generate.api",
    "GenerationError": "generate.engine.engine",
    "TokenCompletion": "generate.ids",
    "generate_ids": "generate.ids",
    "SamplingParams": "generate.engine.sampling",
    "Score": "generate.score",
}


def __getattr__(name: str) -> object:
    """Import an exported name from its module on first access, then keep it here."""
    if name not in _HOMES:
        raise AttributeError(f"module 'generate' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
