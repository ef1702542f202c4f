"""Speculative decoding from text the request already holds: no draft model.

Drafts come from two sources, per sequence (`Drafter`):
- a reference: the output the client predicts (OpenAI's `prediction` parameter; an edited file, a
  regenerated document), followed by a pointer that advances while the output agrees with it and re-aligns
  by n-gram search where it stops agreeing (an insertion, a deletion);
- the sequence's own tokens (prompt lookup, `EngineConfig.speculative_ngram`): the tokens that followed the
  most recent earlier occurrence of the output's last n tokens (n from NGRAM_MAX down to NGRAM_MIN).

The engine verifies a draft d1..dk in the same forward as the decode token: the sequence runs k + 1 decode
rows at positions L .. L + k sharing its page tables (row j sees positions up to L + j, whose K/V the rows
before it wrote in this layer), and every row samples. Draft j + 1 is accepted when row j's sample equals it;
the first row whose sample differs gives the step's last token. The sampler's noise is a function of (seed,
step, token) only (engine/sampler.py), so each accepted prefix is exactly what decoding one token at a time
would have sampled: speculation changes how many tokens a step yields, never which tokens (greedy or not).
K/V written for rejected rows lies past the sequence's length and is overwritten before anything reads it.

Drafts are proposed only where the engine can verify them exactly this way: not for requests with penalties
(their history would need the drafts) or token constraints (structured output), and only while at most
`EngineConfig.speculative_max_seqs` sequences run (at larger batches the extra rows cost throughput).

A step that may draft cannot be scheduled before the step ahead of it has returned its tokens, so the engine's
lookahead (which hides the host's work between steps) stops while a sequence of the batch may draft. A drafter
therefore says when it will not (`Drafter.may_propose`): when its reference has no position (the output left the
prediction and no n-gram realigns it yet) or is used up, and while it rests: after a draft none of whose tokens
was accepted, or a prompt lookup that found nothing, it proposes nothing for 1, 2, 4, ... up to MAX_REST resolved
steps (reset by any accepted draft token), so a prediction that stopped matching costs a few synchronous steps
rather than the lookahead for the rest of the request.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import PageList

NGRAM_MAX = 4  # longest tail searched for
NGRAM_MIN = 2  # shortest: a single token matches too often to be worth a verify row
MAX_REST = 16  # the longest rest, in resolved steps, after drafts that keep missing (module docstring)


def ngram_starts(corpus: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Ascending starts i of `pattern` in `corpus` with at least one token after the match (i + n < len)."""
    n = len(pattern)
    if n == 0 or len(corpus) <= n:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(corpus[: len(corpus) - n] == pattern[0])
    for j in range(1, n):
        starts = starts[corpus[starts + j] == pattern[j]]
    return starts


class Drafter:
    """Proposes one sequence's drafts and learns from what was accepted (module docstring).

    The draft length adapts: it starts at max_tokens, doubles (up to max_tokens) after a draft accepted
    whole and drops to accepted + 1 after one cut short, so a source that keeps missing costs one extra
    row per step rather than max_tokens; a draft rejected whole, or a lookup that finds nothing, rests the
    drafter (module docstring)."""

    def __init__(self, prompt_ids: list[int], reference: tuple[int, ...] | None, lookup_context: bool,
                 max_tokens: int):
        self.reference = np.asarray(reference, dtype=np.int64) if reference else None
        self.ref_pos: int | None = 0 if reference else None  # reference index the output follows next
        self.ref_read = 0  # the furthest reference position the output has followed to
        self.context = None  # the prompt and outputs so far (prompt lookup)
        if lookup_context:
            self.context = PageList(np.int64)
            self.context.extend(prompt_ids)
        self.recent: list[int] = []  # the last NGRAM_MAX outputs (reference re-alignment)
        self.max_tokens = max_tokens
        self.cap = max_tokens
        self.num_drafted = 0  # draft tokens verified so far
        self.num_accepted = 0
        self.rest = 0  # resolved steps left before the next proposal
        self.last_rest = 0  # the length of the latest rest (doubles while drafts keep missing)

    def may_propose(self) -> bool:
        """Whether the next step may carry a draft (False: resting, or no source until the output realigns
        with the reference); the engine looks ahead past sequences that will not draft."""
        if self.rest:
            return False
        ref = self.reference
        return (ref is not None and self.ref_pos is not None and self.ref_pos < len(ref)) or self.context is not None

    def propose(self, limit: int) -> list[int]:
        """Up to min(limit, the adaptive cap) draft tokens to follow the sequence's last token ([]: none)."""
        k = min(limit, self.cap)
        if k <= 0 or not self.may_propose():
            return []
        ref = self.reference
        if ref is not None and self.ref_pos is not None and self.ref_pos < len(ref):
            return ref[self.ref_pos: self.ref_pos + k].tolist()
        if self.context is not None:
            tokens = self.context.array()
            for n in range(min(NGRAM_MAX, len(tokens) - 1), NGRAM_MIN - 1, -1):
                starts = ngram_starts(tokens, tokens[len(tokens) - n:])  # (the tail itself has no token after it)
                if len(starts):
                    begin = int(starts[-1]) + n  # the most recent occurrence
                    return tokens[begin: begin + k].tolist()
            self._start_rest()  # nothing to look up
        return []

    def _start_rest(self) -> None:
        self.last_rest = min(MAX_REST, 2 * self.last_rest) or 1
        self.rest = self.last_rest

    def observe(self, new_tokens: list[int], drafted: int = 0, accepted: int = 0) -> None:
        """The sequence's newest outputs (every resolved token, in order, whether or not a draft preceded
        them); drafted / accepted: the draft verified in the step that produced them."""
        self.rest = max(0, self.rest - 1)
        if drafted:
            self.num_drafted += drafted
            self.num_accepted += accepted
            self.cap = min(self.max_tokens, 2 * self.cap) if accepted == drafted else max(1, accepted + 1)
            if accepted:
                self.last_rest = 0
            else:
                self._start_rest()
        if self.context is not None:
            self.context.extend(new_tokens)
        if self.reference is None:
            return
        self.recent = (self.recent + list(new_tokens))[-NGRAM_MAX:]
        ref, pos = self.reference, self.ref_pos
        if pos is not None and ref[pos: pos + len(new_tokens)].tolist() == list(new_tokens):
            self.ref_pos = pos + len(new_tokens)
        else:
            self.ref_pos = self._realign(self.ref_read)
        self.ref_read = max(self.ref_read, self.ref_pos or 0)

    def _realign(self, last_pos: int) -> int | None:
        """Where the reference continues after the output's tail: the first match at or after last_pos
        (text goes on forward after an edit), else the first anywhere; None without a match."""
        recent = np.asarray(self.recent, dtype=np.int64)
        for n in range(min(NGRAM_MAX, len(recent)), NGRAM_MIN - 1, -1):
            starts = ngram_starts(self.reference, recent[len(recent) - n:])
            if len(starts):
                ahead = starts[starts + n >= last_pos]
                return int((ahead if len(ahead) else starts)[0]) + n
        return None
