"""The one exception type for checkpoint problems, and how messages keep long values readable."""

from __future__ import annotations

import re

ELIDE_LIMIT = 200  # characters a single word (a path, a key) may take in a message before its middle goes
MESSAGE_LIMIT = 2000  # characters a whole message may take


def elide(text: str, limit: int = ELIDE_LIMIT) -> str:
    """``text`` fit to show in a message, the one helper for every value a message repeats: every run of
    non-blank characters longer than ``limit`` cut to its start and end around ``...`` (a path of 6,000
    characters was repeated whole in one error line), the whole cut to :data:`MESSAGE_LIMIT` characters the
    same way, and a lone surrogate (which UTF-8 cannot carry) written as its escape. Idempotent."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    keep = (limit - 3) // 2
    text = re.sub(rf"\S{{{limit + 1},}}", lambda m: f"{m.group()[:keep]}...{m.group()[-keep:]}", text)
    keep = (MESSAGE_LIMIT - 5) // 2
    return text if len(text) <= MESSAGE_LIMIT else f"{text[:keep]} ... {text[-keep:]}"


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read or matched to the model; the message names the cause and fix
    (with any very long path or key shortened by :func:`elide`)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(elide(str(message)))
