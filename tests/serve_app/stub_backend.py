"""A scripted TokenBackend: replays Harmony text, encoded by the real Harmony encoding, as token deltas.

It behaves like an engine at the contract level (engine/request.py): validates sampling parameters
and prompt length (InvalidRequestError before the first delta), stops after a stop token or at
max_tokens, reports logprobs when asked, honours abort. What the "model" says is the script.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import deque
from dataclasses import dataclass

from engine.request import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    InvalidRequestError,
    TokenDelta,
    TokenLogprob,
)
from serve_app.harmony.encoding import load_harmony_encoding


@dataclass
class Script:
    text: str  # Harmony completion text, e.g. "<|channel|>final<|message|>Hi<|return|>"
    chunk: int = 3  # tokens per delta
    delay_s: float = 0.0  # pause before each delta
    fail_after: int | None = None  # raise after this many deltas (an engine crash)
    error: Exception | None = None  # raise before the first delta
    first_delay_s: float = 0.0  # pause before the first delta or the error (a request waiting in a queue)
    drafts: tuple[int, int] = (0, 0)  # (draft tokens verified, accepted) each delta reports, as an engine's totals


class ScriptedBackend:
    def __init__(self, max_context: int = 8192):
        self.max_context = max_context
        self.encoding = load_harmony_encoding()
        self._scripts: deque[Script] = deque()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()
        self._lock = threading.Lock()

    def push(self, text: str, **options) -> None:
        self._scripts.append(Script(text, **options))

    def reset(self) -> None:
        with self._lock:
            self._scripts.clear()
            self.requests.clear()
            self.aborted.clear()
            self.abort_seen.clear()

    def tokens(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
        self.abort_seen.set()

    async def generate(self, request: GenerateRequest):
        request.sampling.validate()
        if len(request.prompt_ids) >= self.max_context:
            raise InvalidRequestError(f"prompt of {len(request.prompt_ids)} tokens exceeds {self.max_context}",
                                      "messages")
        with self._lock:
            self.requests.append(request)
            if not self._scripts:
                raise RuntimeError("the test scripted no output for this request")
            script = self._scripts.popleft()
        if script.first_delay_s:
            await asyncio.sleep(script.first_delay_s)
        if script.error is not None:
            raise script.error
        ids, finish = self._generated(self.tokens(script.text), request)
        logprobs = self._logprobs(ids, request) if request.sampling.logprobs is not None else None
        for n, start in enumerate(range(0, len(ids), script.chunk)):
            if script.delay_s:
                await asyncio.sleep(script.delay_s)
            if script.fail_after is not None and n >= script.fail_after:
                raise RuntimeError("scripted engine failure")
            if request.request_id in self.aborted:
                return
            end = min(start + script.chunk, len(ids))
            yield TokenDelta(
                request.request_id, ids[start:end],
                logprobs=logprobs[start:end] if logprobs is not None else None,
                finish_reason=finish if end == len(ids) else None,
                num_prompt_tokens=len(request.prompt_ids), num_output_tokens=end,
                num_draft_tokens=script.drafts[0], num_accepted_draft_tokens=script.drafts[1],
            )

    @staticmethod
    def _generated(script_ids: list[int], request: GenerateRequest) -> tuple[list[int], str]:
        sampling = request.sampling
        out: list[int] = []
        for token_id in script_ids:
            out.append(token_id)
            if token_id in sampling.stop_token_ids and not sampling.ignore_eos:
                return out, FINISH_STOP
            if len(out) == sampling.max_tokens:
                return out, FINISH_LENGTH
        return out, FINISH_STOP

    @staticmethod
    def _logprobs(ids: list[int], request: GenerateRequest) -> list[TokenLogprob]:
        # Made-up but distinct values: tests check that each reaches the right token in the API.
        rng = random.Random(request.request_id)
        out = []
        for token_id in ids:
            chosen = -rng.uniform(0.01, 3.0)
            others = [(rng.randrange(1000, 100000), chosen - rng.uniform(0.1, 5.0)) for _ in range(request.sampling.logprobs)]
            top = sorted([(token_id, chosen)] + others, key=lambda t: -t[1])[: request.sampling.logprobs]
            out.append(TokenLogprob(token_id, chosen, top))
        return out
