"""Refusing text that openai-harmony's tokenizer would spend seconds on, or crash on, before it runs.

The tokenizer (tiktoken's byte-pair merge, in Rust) first splits text into pieces by o200k's pattern: runs of
letters (with their marks), runs of whitespace, runs of other symbols; digits by threes. It then merges each
piece's bytes in time that grows with the square of the piece, and holds the GIL all the while, so the ingress'
event loop and every stream on the replica wait with it. Measured on this project's 2-core CPU machine
(2026-12-06, `encoding.encode`): 'x' * 100,000 took 3.4 s, * 500,000 86 s, and * 1,000,000 panicked inside the
pattern match (a regex stack overflow, an HTTP 500 then); 2 MB of text made of runs of 1,024 / 4,096 / 16,384
characters took 0.7-2.6 / 2.6-10 / 10-41 s, against 0.33 s for 2 MB of English (bench/RESULTS.md, "The ingress'
worst inputs"). The time of the long runs fits
a * sum(bytes of each run ** 2) with a = 3-3.6e-10 s.

So a request may hold unbroken runs of at most RUN_BUDGET in that sum, counted over the runs of at least
RUN_MIN_BYTES (shorter runs cost at most ~2x ordinary text per byte): one run of 32 KiB, or 1,024 runs of 1 KiB,
~0.35 s of merging here. Ordinary prose, code, base64 and hex never come near it (their runs break at spaces,
digits, case or punctuation). The runs are found by class of character (letters and marks, whitespace, digits,
the rest), which never splits one of the tokenizer's pieces (a letter run can hold several pieces, where case
changes): the count errs toward refusing. Linear and vectorized: 8 MB of English ~60 ms.
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from typing import Iterable

import numpy as np

from engine.request import InvalidRequestError

RUN_MIN_BYTES = 1024
RUN_BUDGET = 1 << 30
_RUN_MIN_CHARS = RUN_MIN_BYTES // 4  # a run of RUN_MIN_BYTES bytes has at least this many characters (UTF-8)
_LETTER, _SPACE, _DIGIT, _OTHER = 0, 1, 2, 3


@functools.cache
def _classes() -> np.ndarray:
    """The class of every code point (~0.25 s once per process, at the first text long enough to need it)."""
    def cls(c: str) -> int:
        cat = unicodedata.category(c)
        if cat[0] in "LM":
            return _LETTER
        if cat[0] == "N":
            return _DIGIT
        return _SPACE if c.isspace() else _OTHER

    return np.fromiter((cls(chr(i)) for i in range(sys.maxunicode + 1)), dtype=np.uint8, count=sys.maxunicode + 1)


def long_runs(text: str) -> list[int]:
    """UTF-8 byte lengths of the runs of one class (not digits) of at least _RUN_MIN_CHARS characters, in order."""
    if len(text) < _RUN_MIN_CHARS:
        return []
    classes = _classes()[np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)]
    ends = np.flatnonzero(classes[1:] != classes[:-1])  # each run's last index, but the last run's
    bounds = np.concatenate(([-1], ends, [len(classes) - 1]))  # run k holds (bounds[k], bounds[k + 1]]
    runs = []
    for k in np.flatnonzero(np.diff(bounds) >= _RUN_MIN_CHARS).tolist():
        start, stop = int(bounds[k]) + 1, int(bounds[k + 1]) + 1
        if classes[start] != _DIGIT:
            runs.append(len(text[start:stop].encode("utf-8", "surrogatepass")))
    return runs


def check_tokenizable(texts: Iterable[tuple[str | None, str]]) -> None:
    """Raise InvalidRequestError (HTTP 400) when the texts of one request, together, hold unbroken runs over the
    budget. texts: (param, text) for everything of the request that will be tokenized; the error names the param
    of the text that holds the longest run."""
    cost, longest, count, where = 0, 0, 0, None
    for param, text in texts:
        for nbytes in long_runs(text):
            if nbytes >= RUN_MIN_BYTES:
                cost, count = cost + nbytes * nbytes, count + 1
                if nbytes > longest:
                    longest, where = nbytes, param
    if cost > RUN_BUDGET:
        raise InvalidRequestError(
            f"the text holds {count} unbroken run(s) of {RUN_MIN_BYTES:,} bytes or more (letters only, whitespace "
            f"only, or symbols only; the longest {longest:,} bytes), which the tokenizer takes time quadratic in: "
            f"this server accepts runs whose squared byte lengths sum to at most {RUN_BUDGET:,} (one run of "
            f"{int(RUN_BUDGET ** 0.5):,} bytes); break them up", where)
