"""Stop strings over streamed text: what may be sent now, and where the text ends.

Text that could still turn into a stop string is held back, so a streaming client never
receives the start of a stop string that the non-streaming answer would have cut off; both
modes therefore return the same text."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._text = ""
        self._sent = 0
        self.matched = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def feed(self, segment: str) -> tuple[str, bool]:
        """Adds decoded text; returns (text safe to send now, whether a stop string matched).
        After a match the returned text ends just before the stop string; feed no more."""
        self._text += segment
        # Search only where a new match can start: it may straddle the previous feed.
        start = max(0, self._sent - max((len(s) for s in self._stops), default=0))
        found = [(i, s) for s in self._stops if (i := self._text.find(s, start)) >= 0]
        if found:
            cut, self.matched_stop = min(found)
            out = self._text[self._sent : max(cut, self._sent)]
            self._sent = max(cut, self._sent)
            self._text = self._text[: self._sent]
            self.matched = True
            return out, True
        safe = len(self._text) - self._held_back()
        out = self._text[self._sent : safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        return out, False

    def flush(self) -> str:
        """Whatever was held back, once generation ended without a stop string."""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def _held_back(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string. Only the
        # places where a stop string's first character occurs can start one, longest first:
        # per token this costs the stop strings' length, not its square.
        best = 0
        for s in self._stops:
            tail = self._text[len(self._text) - min(len(s) - 1, len(self._text)) :]
            i = tail.find(s[0])
            while i >= 0 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
