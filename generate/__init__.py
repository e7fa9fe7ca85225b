"""generate: the runtime (sampling, the decode loop), the Python API and the ``generate`` command."""

from generate.api import Completion, Generator, load
from generate.engine import GenerationError, TokenCompletion, generate_ids
from generate.sampling import SamplingParams

__all__ = [
    "Completion",
    "GenerationError",
    "Generator",
    "SamplingParams",
    "TokenCompletion",
    "generate_ids",
    "load",
]
