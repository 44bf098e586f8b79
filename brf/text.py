"""Streaming text: emit only what is final, stop at stop strings.

The decoder knows the full generated text after every step (decoded from token
ids, or concatenated bytes). :class:`TextStream` turns that into pieces that
are safe to print: it holds back an incomplete UTF-8 character (decoders show
it as U+FFFD until its last byte arrives) and any tail that could still grow
into a stop string, and it cuts the text at the first stop string.
"""

from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"


def utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that decodes as UTF-8, decoded.

    An incomplete multi-byte character at the end is held back; invalid bytes
    elsewhere decode to U+FFFD (they can never become valid).
    """
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < cut - 3 or e.reason != "unexpected end of data":
                continue
    return data.decode("utf-8", errors="replace")


class TextStream:
    """Incremental, stop-string-aware text of one sequence.

    Call :meth:`update` with the full text so far after every step; it returns
    the new piece to show. ``stopped`` becomes True at the first stop string,
    after which the text is frozen (the stop string itself is not included).
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = tuple(s for s in stop if s)
        self.text = ""       # emitted so far
        self.stopped = False

    def _held(self, full: str) -> int:
        """How many trailing characters of ``full`` to hold back."""
        hold = len(full) - len(full.rstrip(_REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def update(self, full: str, final: bool = False) -> str:
        """The next piece given the full text so far; ``final`` flushes held text."""
        if self.stopped:
            return ""
        # Search for a stop string from just before the already-emitted text.
        longest = max((len(s) for s in self.stop), default=0)
        lo = max(len(self.text) - longest, 0)
        cut = min((i for i in (full.find(s, lo) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            target = full[:cut]
        elif final:
            target = full
        else:
            target = full[:len(full) - self._held(full)]
        if not target.startswith(self.text):  # a decoder revised its past; keep going
            common = 0
            while common < min(len(target), len(self.text)) and \
                    target[common] == self.text[common]:
                common += 1
            target = self.text + target[common:]
        piece = target[len(self.text):]
        self.text = target
        return piece
