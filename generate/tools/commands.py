"""The ``gptgen score``, ``gptgen attention`` and ``gptgen batch`` commands, named in one place for
:mod:`generate.tools.gptgen` and the tests.

Each command lives in its own module (:mod:`generate.tools.score_command`,
:mod:`generate.tools.attention_command`, :mod:`generate.tools.batch_command`), with what they share in
:mod:`generate.tools.command_base`. Like those, this module imports only the standard library at module
level.
"""

from __future__ import annotations

from generate.tools.attention_command import (
    ATTENTION_EXAMPLES,
    MAX_MASK_TOKENS,
    PICTURE_FORMATS,
    attention_main,
    build_attention_parser,
)
from generate.tools.batch_command import BATCH_EXAMPLES, batch_main, build_batch_parser
from generate.tools.command_base import DTYPE_HELP
from generate.tools.score_command import SCORE_BATCH_SIZE, SCORE_EXAMPLES, build_score_parser, score_main

__all__ = [
    "ATTENTION_EXAMPLES",
    "BATCH_EXAMPLES",
    "DTYPE_HELP",
    "MAX_MASK_TOKENS",
    "PICTURE_FORMATS",
    "SCORE_BATCH_SIZE",
    "SCORE_EXAMPLES",
    "attention_main",
    "batch_main",
    "build_attention_parser",
    "build_batch_parser",
    "build_score_parser",
    "score_main",
]
