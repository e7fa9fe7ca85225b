"""Token bytes to text: incremental UTF-8 decoding, stop strings, and the hold-back for exact streaming."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextTracker:
    """The text of one row, built token by token.

    Bytes are decoded incrementally, so a multi-byte character split across tokens appears only once all
    its bytes have arrived (invalid bytes become U+FFFD, as ``tiktoken``'s ``decode`` does). Stop strings
    are searched for in the text; the text is cut where the first one begins. :meth:`take` returns only
    text that can no longer change: a tail that could still grow into a stop string is held back, so the
    concatenated stream equals the final text exactly.

    Args:
        token_bytes: maps a token id to its bytes (``encoding.decode_single_token_bytes``).
        stop: stop strings; each must be non-empty.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.stopped = False
        self._sent = 0

    def add(self, token: int) -> bool:
        """Append a token's bytes; return True if a stop string is now complete (the text is then cut)."""
        if self.stopped:
            return True
        before = len(self.text)
        self.text += self._decoder.decode(self._token_bytes(token))
        return self._check_stop(before)

    def close(self) -> None:
        """No more tokens: flush an incomplete trailing character (as U+FFFD)."""
        if not self.stopped:
            before = len(self.text)
            self.text += self._decoder.decode(b"", final=True)
            self._check_stop(before)

    def _check_stop(self, before: int) -> bool:
        if not self._stop or len(self.text) == before:
            return self.stopped
        start = max(0, before - self._longest + 1)  # a stop string may begin in earlier text
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def _held_back(self) -> int:
        # Length of the longest tail of the text that is a proper prefix of a stop string.
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def take(self, final: bool = False) -> str:
        """Return the text not yet taken that is settled; with ``final``, everything that is left."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        piece = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece
