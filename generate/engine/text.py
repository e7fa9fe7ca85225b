"""Token bytes to text: incremental UTF-8 decoding, stop strings, and the hold-back for exact streaming."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextTracker:
    """The text of one row, built from ``token_bytes`` (token id -> bytes) token by token.

    A character split across tokens appears once all its bytes have arrived (invalid bytes become U+FFFD, as
    in ``tiktoken``'s ``decode``); the text is cut where the first ``stop`` string (non-empty) begins, and
    :meth:`take` holds back a tail that could still grow into one, so the stream adds up to the final text."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes, self._stop = token_bytes, tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text, self.stopped, self._sent = "", False, 0

    def add(self, token: int) -> bool:
        """Append a token's bytes; return True if a stop string is now complete (the text is then cut)."""
        return self.stopped or self._extend(self._decoder.decode(self._token_bytes(token)))

    def close(self) -> None:
        """No more tokens: flush an incomplete trailing character (as U+FFFD)."""
        if not self.stopped:
            self._extend(self._decoder.decode(b"", final=True))

    def _extend(self, piece: str) -> bool:
        self.text += piece
        if not self._stop or not piece:
            return self.stopped
        start = max(0, len(self.text) - len(piece) - self._longest + 1)  # (it may begin in earlier text)
        if hits := [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]:
            self.text, self.stopped = self.text[: min(hits)], True
        return self.stopped

    def take(self, final: bool = False) -> str:
        """Return the text not yet taken that is settled; with ``final``, everything that is left."""
        end = len(self.text)
        if not (final or self.stopped):  # less the longest tail that is a proper prefix of a stop string
            tails = range(min(self._longest - 1, len(self.text)), 0, -1)
            end -= next((k for k in tails if any(s.startswith(self.text[-k:]) for s in self._stop)), 0)
        piece, self._sent = self.text[self._sent : end], max(self._sent, end)
        return piece
