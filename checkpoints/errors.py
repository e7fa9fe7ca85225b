"""The one exception type for checkpoint problems, and how messages keep long values readable."""

from __future__ import annotations

import re

ELIDE_LIMIT = 200  # characters a single word (a path, a key) may take in a message before its middle goes


def elide(text: str, limit: int = ELIDE_LIMIT) -> str:
    """``text`` with every run of non-blank characters longer than ``limit`` cut to its start and end around
    ``...``: a path of 6,000 characters was repeated whole in one error line. Idempotent."""
    keep = (limit - 3) // 2
    return re.sub(rf"\S{{{limit + 1},}}", lambda m: f"{m.group()[:keep]}...{m.group()[-keep:]}", text)


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read or matched to the model; the message names the cause and fix
    (with any very long path or key shortened by :func:`elide`)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(elide(str(message)))
