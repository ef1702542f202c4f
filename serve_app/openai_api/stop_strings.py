"""Stop strings over streamed text (`stop` of Chat and Completions): what may be emitted as tokens arrive."""

from __future__ import annotations


class StopMatcher:
    """Stop strings over streamed text: holds back a tail that could still grow into a match.

    The tail is the longest suffix of the text so far that is a prefix of a stop string, tracked per string by
    its Knuth-Morris-Pratt automaton: each push costs its own length (times the strings), not the square of a
    stop string's (a 400,000-character stop string had held the event loop 3.2 s per token, 2026-12-06)."""

    def __init__(self, stops: list[str]):
        self._stops = stops
        self._borders = [_borders(s) for s in stops]
        self._matched = [0] * len(stops)  # per string: how many of its first characters end the text so far
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched); after a match the rest is dropped."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        # no string is whole in buf, and buf holds every partial match's start, so none is whole in the text
        self._matched = [_advance(s, b, m, text) for s, b, m in zip(self._stops, self._borders, self._matched)]
        keep = max(self._matched, default=0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _borders(s: str) -> list[int]:
    """KMP's failure function: borders[i] is the length of the longest proper prefix of s[:i + 1] that is also
    its suffix."""
    borders, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = borders[k - 1]
        if s[i] == s[k]:
            k += 1
        borders[i] = k
    return borders


def _advance(s: str, borders: list[int], matched: int, text: str) -> int:
    """The automaton's state after `text`, from `matched`. Only called on text that completes no match (push()
    looks for whole matches in buf first), so the state stays below len(s)."""
    for c in text:
        while matched and c != s[matched]:
            matched = borders[matched - 1]
        if c == s[matched]:
            matched += 1
    return matched
