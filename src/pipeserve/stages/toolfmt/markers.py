"""Incremental marker search over streamed text with a bounded holdback.

Every text stage (thinking, tool calls, stop sequences) needs the same thing: find the
earliest of a few fixed strings in text that arrives in pieces, and hold back only the
tail that could still grow into one of them. Each call looks at the held tail plus the
new piece, so the cost per piece is bounded by the longest marker, never by the length
of the output so far.
"""

from __future__ import annotations

from collections.abc import Iterable


class MarkerSet:
    """A fixed set of markers: earliest-match search and partial-tail detection."""

    __slots__ = ("markers", "_prefixes", "_first", "_maxhold")

    def __init__(self, markers: Iterable[str]) -> None:
        unique = sorted({m for m in markers if m}, key=len, reverse=True)
        self.markers: tuple[str, ...] = tuple(unique)
        self._prefixes = frozenset(m[:k] for m in unique for k in range(1, len(m)))
        self._first = "".join(sorted({m[0] for m in unique}))
        self._maxhold = max((len(m) - 1 for m in unique), default=0)

    def __bool__(self) -> bool:
        return bool(self.markers)

    def absent(self, text: str) -> bool:
        """True when no marker can start anywhere in text (the common, fast case)."""
        for ch in self._first:
            if ch in text:
                return False
        return True

    def find(self, text: str, start: int = 0) -> tuple[int, str | None]:
        """Position and text of the earliest marker at or after `start` (longest on ties)."""
        best, found = -1, None
        for marker in self.markers:
            i = text.find(marker, start)
            if i != -1 and (best == -1 or i < best):
                best, found = i, marker
        return best, found

    def partial_start(self, text: str, start: int = 0) -> int:
        """Index where a suffix of text that is a proper marker prefix begins, else len(text)."""
        end = len(text)
        lo = max(start, end - self._maxhold)
        if lo >= end:
            return end
        best = end
        for ch in self._first:
            i = text.find(ch, lo)
            while i != -1:
                if i < best and text[i:] in self._prefixes:
                    best = i
                    break
                i = text.find(ch, i + 1)
        return best


class Splitter:
    """Splits streamed text at markers; the caller may switch marker sets between parts.

    Loop: `buf = take(piece)`, then `split(buf, markers)` until no marker is left, and
    keep the returned tail in `held` for the next piece.
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def split(self, text: str, markers: MarkerSet) -> tuple[str, str | None, str]:
        """(before, marker, after) for the earliest marker; else (safe, None, held tail).

        The caller stores the held tail in `self.held`; `split` itself is pure.
        """
        if markers.absent(text):
            return text, None, ""
        i, marker = markers.find(text)
        if marker is not None:
            return text[:i], marker, text[i + len(marker) :]
        cut = markers.partial_start(text)
        return text[:cut], None, text[cut:]

    def take(self, piece: str) -> str:
        """The held tail followed by the new piece; clears the held tail."""
        if self.held:
            piece, self.held = self.held + piece, ""
        return piece

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
