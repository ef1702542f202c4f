"""One request inside the engine: its tokens, how much of them is cached, and its KV pages."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.request import FINISH_LENGTH, FINISH_STOP, SamplingParams, TokenConstraint, TokenLogprob

if TYPE_CHECKING:
    from engine.kv_payload import PrefilledKV
    from engine.speculative import Drafter


# An output token whose step is launched but not read back yet (the engine's lookahead):
# lengths count it, nothing reads its value; never a valid token id.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages (new, preempted, or imported KV not yet written)
    RUNNING = "running"  # holds pages; scheduled for prefill chunks or decode steps
    PREFILLED = "prefilled"  # prefill-only request whose first token is sampled; waits for export_kv
    FINISHED = "finished"


class PageList:
    """A growable integer array (int32 by default): a sequence's page ids, which step metadata copies with one
    memcpy, or its tokens (engine/speculative.py searches them)."""

    def __init__(self, dtype=np.int32) -> None:
        self._data = np.zeros(16, dtype=dtype)
        self._len = 0

    def extend(self, pages: list[int]) -> None:
        need = self._len + len(pages)
        if need > len(self._data):
            grown = np.zeros(max(need, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len: need] = pages
        self._len = need

    def clear(self) -> list[int]:
        pages = self._data[: self._len].tolist()
        self._len = 0
        return pages

    def array(self) -> np.ndarray:
        return self._data[: self._len]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        return int(self._data[: self._len][i])


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved per-request seed: the sampler's noise is a function of (seed, step, token)
    arrival: int  # FCFS rank: lower arrived earlier
    prefill_only: bool = False  # a prefill replica's request: stop after the first token, then export
    priority: int = 0  # lower runs sooner; the scheduler orders by (priority, arrival)
    cache_salt: str = ""  # its prefix-cache namespace (GenerateRequest.cache_salt)
    cache_cuts: tuple[int, ...] = ()  # where later prompts are likely to leave this one (GenerateRequest.cache_cuts)
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache (a prefix of prompt + output)
    # Full layers: every page. Sliding layers: only live pages; sliding_first is the logical index
    # (position // block_size) of sliding_pages[0].
    full_pages: PageList = field(default_factory=PageList)
    sliding_pages: deque = field(default_factory=deque)
    sliding_first: int = 0
    pending_kv: "PrefilledKV | None" = None  # imported K/V waiting for pages
    constraint: TokenConstraint | None = None  # started from sampling.constraint; has seen every resolved output
    drafter: "Drafter | None" = None  # speculative decoding: proposes drafts, has seen every resolved output
    # Prefix caching (engine/block_manager.py): chain hashes of the prompt's whole blocks (computed once),
    # and how many of this sequence's blocks are registered in the pools.
    block_hashes: list[bytes] | None = None
    num_registered: int = 0
    sliding_named_from: int = 0  # first block whose sliding K/V is whole (imported K/V starts mid-page)
    num_cached_prefix: int = 0  # prompt tokens its first admission took from the cache (usage reports)
    finish_reason: str | None = None
    num_emitted: int = 0  # output tokens already sent in deltas
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:
        """Known tokens whose K/V is not cached yet; the last of them yields the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        # Decode = exactly the last sampled token is uncached. A 1-token prompt before its first sample,
        # and a preempted sequence being recomputed, are prefills.
        return self.num_remaining > 1 or not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p: end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def append_token(self, token: int, logprob: TokenLogprob | None, now: float) -> None:
        self.output_ids.append(token)
        self.resolve_token(len(self.output_ids) - 1, token, logprob, now)

    def resolve_token(self, index: int, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """Output `index` (a placeholder appended when its step was launched) becomes `token`."""
        self.output_ids[index] = token
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def drop_placeholders(self) -> None:
        """Forget outputs of steps still in flight (the sequence finished or was aborted before them)."""
        while self.output_ids and self.output_ids[-1] == PLACEHOLDER:
            self.output_ids.pop()

    def check_finished(self, max_model_len: int, num_outputs: int | None = None) -> str | None:
        """The finish reason the last sampled token implies, or None to keep going. num_outputs: judge
        the first that many outputs (the engine's next step may already hold a placeholder after them)."""
        s = self.sampling
        n = len(self.output_ids) if num_outputs is None else num_outputs
        if not s.ignore_eos and n and self.output_ids[n - 1] in s.stop_token_ids:
            return FINISH_STOP
        if self._at_length_limit(n, max_model_len):
            return FINISH_LENGTH
        return None

    def finishes_by_length(self, max_model_len: int) -> bool:
        """The token sampled last (perhaps still a placeholder) is the last this sequence may get."""
        return self._at_length_limit(len(self.output_ids), max_model_len)

    def _at_length_limit(self, num_outputs: int, max_model_len: int) -> bool:
        return num_outputs >= self.sampling.max_tokens or len(self.prompt_ids) + num_outputs >= max_model_len
