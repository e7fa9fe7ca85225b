"""generate: the runtime (sampling, the decode loop), the Python API and the ``generate`` command.

Public names are imported on first use (PEP 562): ``import generate`` and the command's startup do not pay
for torch until something needs it, so Ctrl-C in that window exits cleanly (see ``generate.tools.cli``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from generate.api import Completion, Generator, load
    from generate.engine.engine import GenerationError
    from generate.engine.sampling import SamplingParams
    from generate.ids import TokenCompletion, generate_ids
    from generate.score import Score

__all__ = ["Completion", "GenerationError", "Generator", "SamplingParams", "Score", "TokenCompletion",
           "generate_ids", "load"]  # fmt: skip

_HOMES = {
    "generate.api": ("Completion", "Generator", "load"),
    "generate.engine.engine": ("GenerationError",),
    "generate.engine.sampling": ("SamplingParams",),
    "generate.ids": ("TokenCompletion", "generate_ids"),
    "generate.score": ("Score",),
}


def __getattr__(name: str) -> object:
    """Import an exported name from its module on first access, then keep it here."""
    home = next((module for module, names in _HOMES.items() if name in names), None)
    if home is None:
        raise AttributeError(f"module 'generate' has no attribute {name!r}")
    globals()[name] = value = getattr(importlib.import_module(home), name)  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
