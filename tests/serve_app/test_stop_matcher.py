"""StopMatcher (serve_app/openai_api/stop_strings.py) against the plain algorithm it replaced, on random streams."""

from __future__ import annotations

import random

import pytest

from serve_app.openai_api.stop_strings import StopMatcher


class PlainStopMatcher:
    """The reference: every push re-derives the held tail by testing each prefix of each stop string (quadratic in a
    stop string's length; the ingress ran this until 2026-12-06)."""

    def __init__(self, stops: list[str]):
        self._stops, self._held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = max((k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def run(matcher, chunks: list[str]) -> list[tuple[str, bool]]:
    out = []
    for chunk in chunks:
        emitted, hit = matcher.push(chunk)
        out.append((emitted, hit))
        if hit:
            return out
    return out + [(matcher.flush(), False)]


@pytest.mark.parametrize("seed", range(300))
def test_same_output_as_the_plain_matcher(seed):
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "aab", "xyz\u00e9"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 40)))) if len(text) > 1 else []
    chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])] + [""] * rng.randint(0, 2)
    if rng.random() < 0.1:
        rng.shuffle(chunks)  # any order of pieces is a stream too
    assert run(StopMatcher(stops), chunks) == run(PlainStopMatcher(stops), chunks), (stops, chunks)


def test_periodic_stop_strings_keep_their_borders():
    # "abab" after "aba": the held tail must be "aba" (a border of a partial match), and "b" then completes it
    m = StopMatcher(["ababc"])
    assert m.push("xabab") == ("x", False)
    assert m.push("abc") == ("ab", True)  # the match starts at the second "ab": "ab" before it is text


def test_a_long_stop_string_holds_back_and_releases_its_prefix():
    """A 400,000-character stop string: each plain push took 3.2 s on this CPU (the event loop held that long per
    token); these 2,001 pushes take ~10 ms in all (the automaton touches each pushed character a bounded number of
    times), which pytest-timeout would catch going back."""
    m = StopMatcher(["a" * 400_000 + "b", "zz"])
    for _ in range(2000):
        assert m.push("a") == ("", False)
    assert m.push("c") == ("a" * 2000 + "c", False)
    assert m.push("a" * 399_999) == ("", False)
    assert m.push("ab!") == ("", True)
