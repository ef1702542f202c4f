"""Requests and token deltas: the torch-free contract between the HTTP ingress and any engine.

The ingress imports this module only (no torch): token ids go in, token deltas come out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol

if TYPE_CHECKING:
    import numpy as np

# Harmony: <|return|> ends the final answer, <|call|> ends a tool call. <|end|> (200007) closes any
# assistant message, including the analysis that precedes the answer, so it must not stop generation.
HARMONY_STOP_TOKEN_IDS = (200002, 200012)
# o200k_harmony: ids >= 199998 are special (<|startoftext|>, <|channel|>, <|end|>, reserved ...); checked with
# openai_harmony's is_special_token. Penalties leave them alone, or a second <|channel|> would be penalized.
HARMONY_FIRST_SPECIAL_ID = 199998
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_CACHE_SALT = 1024  # characters of GenerateRequest.cache_salt
MAX_CACHE_CUTS = 16  # positions in GenerateRequest.cache_cuts

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BackendOverloaded(RuntimeError):
    """The backend refused a request at once, before its first delta, because its queues are full (a bounded
    Serve queue); nothing of it ran, and the client may retry shortly."""


class EngineUnhealthyError(RuntimeError):
    """The engine cannot serve (engine/health.py: a device or model rank failed, steps keep failing, a step
    hangs, or its loop stopped), so it refused the request before running any of it; the client may retry,
    and another replica or this one's replacement takes it. Serve replicas report the same from check_health."""


class TokenConstraint(Protocol):
    """One request's restriction on its next token (structured output), stateful, engine-side. The engine
    asks for the allowed set once before each sample and reports every token the request gets, in order; it
    asks for the next set before reporting the token in flight only after can_look_ahead() said it may."""

    def allowed_tokens(self) -> "np.ndarray | None":
        """A packed bitmask of the allowed ids (uint32 words, bit i % 32 of word i // 32, ceil(vocab / 32)
        words, never all zero), or None: any token."""
        ...

    def accept(self, token_id: int) -> None:
        ...

    def can_look_ahead(self) -> bool:
        """Whether the engine may draw the token after next before it reads the one in flight (its lookahead):
        the allowed set after that token does not depend on which token it is, or the token is known."""
        ...

    # Optional (jump-forward decoding, EngineConfig.jump_forward_tokens):
    #   def forced_tokens(self, limit: int) -> list[int]
    # up to `limit` tokens that come next after the positions whose sets were asked for, each the only id its
    # set allows ([] where not known). The engine then asks for the sets of those positions and of the one
    # after them before it reports any of their tokens.


class ConstraintSpec(Protocol):
    """What a request carries (picklable: it crosses processes); each engine that samples for the request
    starts its own TokenConstraint from it. It may also have a `prepare()` method: slow one-time work (such
    as compiling grammars) that AsyncEngine runs on a worker thread before the request enters the engine loop."""

    def start(self, vocab_size: int) -> TokenConstraint:
        """Raises InvalidRequestError when the constraint cannot run on this vocabulary."""
        ...


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # [0, 1)
    seed: int | None = None  # per-request generator: same seed, same tokens
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = HARMONY_STOP_TOKEN_IDS
    ignore_eos: bool = False  # keep going past stop tokens (benchmarks)
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's logprob plus the top N
    # OpenAI's penalties, over the tokens this request has generated so far (not the prompt; Harmony's
    # control tokens exempt): logit -= frequency * count + presence * (count > 0). In [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the raw logits every step.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: allowed tokens per step (serve_app/harmony/constrain.py builds Harmony's). The
    # engine reads a constrained token before it samples the next, unless the constraint says the next
    # mask cannot depend on it (TokenConstraint.can_look_ahead).
    constraint: ConstraintSpec | None = None
    # The output the client expects (OpenAI's `prediction`, as token ids): drafts for speculative decoding
    # (engine/speculative.py). It changes how fast the tokens come, never which tokens.
    prediction: tuple[int, ...] = ()

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate(self, vocab_size: int | None = None) -> None:
        """vocab_size: the engine's, to check token ids against (None: not checked). Strict about types: these
        params also come from Python callers (Serve handles, the engine API), and a wrong type that got past
        here would fail the step of every request batched with this one."""
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param)

        ids_below = f"[0, {vocab_size or 'vocab'})"
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise bad("top_k", f"must be a non-negative integer below 2**31, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", f"must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a sequence of non-negative token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and -2 <= value <= 2):
                raise bad(name, f"must be between -2 and 2, got {value!r}")
        if not isinstance(self.logit_bias, (tuple, list)) or not all(
                isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in self.logit_bias):
            raise bad("logit_bias", f"must be a sequence of (token id, bias) pairs, got {self.logit_bias!r}"[:300])
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"takes up to {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise bad("logit_bias", f"keys must be token ids in {ids_below}, got {token!r}")
            if not (_is_real(bias) and -100 <= bias <= 100):
                raise bad("logit_bias", f"values must be between -100 and 100, got {bias!r} for token {token}")
        if self.constraint is not None and not callable(getattr(self.constraint, "start", None)):
            raise bad("constraint", f"must be a ConstraintSpec (with start(vocab_size)), got {self.constraint!r}")
        if not isinstance(self.prediction, (tuple, list)) or (self.prediction and (
                not set(map(type, self.prediction)) <= {int} or min(self.prediction) < 0
                or (vocab_size is not None and max(self.prediction) >= vocab_size))):
            raise bad("prediction", f"must be token ids in {ids_below}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer between 0 and 20, got {self.logprobs!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float that is not a bool (NaN passes here; the range checks refuse it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Scheduling rank: lower runs sooner (vLLM's convention), ties by arrival. A waiting request of a better
    # priority preempts running ones of worse priority when it finds no slot or pages (engine/scheduler.py).
    priority: int = 0
    # Prefix-cache namespace: a request reuses cached prompt blocks only of requests with the same salt ("" is the
    # shared one), so tenants cannot learn from each other's cache hits (time to first token) what others sent.
    cache_salt: str = ""
    # Prompt positions where later prompts are likely to leave this one (the end of a shared system prompt, the
    # start of a user message that may be edited): the prefix cache keeps the sliding layers' windows before them
    # as long as those of the prompt's end, so the first such prompt already hits (engine/block_manager.py).
    # Each in [1, len(prompt_ids)]; a hint only, tokens do not depend on it.
    cache_cuts: tuple[int, ...] = ()

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        """Raise InvalidRequestError unless an engine of this vocabulary and context can run the request."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {self.request_id!r}", "request_id")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}", "sampling")
        self.sampling.validate(vocab_size)
        if type(self.priority) is not int or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise InvalidRequestError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got "
                                      f"{self.priority!r}", "priority")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters",
                                      "cache_salt")
        ids = self.prompt_ids
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"prompt_ids must be a list of token ids, got {type(ids).__name__}", "prompt_ids")
        if not ids:
            raise InvalidRequestError("prompt_ids is empty: send at least one token", "prompt_ids")
        # exact ints (not bool) in the vocabulary, by C-level passes: 32k ids 3.79 -> 1.40 ms (CPU, 2026-11-30)
        if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= vocab_size:
            raise InvalidRequestError(f"prompt_ids must be token ids in [0, {vocab_size})", "prompt_ids")
        if len(ids) + 1 > max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this engine's context (max_model_len) is {max_model_len} "
                "tokens including at least one generated token: shorten the prompt", "prompt_ids")
        cuts = self.cache_cuts
        if not isinstance(cuts, (list, tuple)) or len(cuts) > MAX_CACHE_CUTS \
                or any(type(c) is not int or not 1 <= c <= len(ids) for c in cuts):
            raise InvalidRequestError(f"cache_cuts must be at most {MAX_CACHE_CUTS} prompt positions in [1, "
                                      f"{len(ids)}], got {cuts!r}", "cache_cuts")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class TokenDelta:
    """New tokens of one request since the last delta; the last delta carries `finish_reason`."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, this delta included
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (here or at the prefill)
    # Speculative decoding (engine/speculative.py), totals so far: draft tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class TokenBackend(Protocol):
    """What the ingress needs from an engine (local, Ray Serve handle, or a scripted stub)."""

    max_context: int

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream deltas; raises InvalidRequestError before the first delta for a bad request, BackendOverloaded
        for one refused while the backend's queues are full."""
        ...

    async def abort(self, request_id: str) -> None:
        ...


class UnknownRequestError(KeyError):
    """No unfinished request has this id."""


class RequestStateError(RuntimeError):
    """The request exists but is not in a state that allows the call (e.g. export before prefill ends)."""


@dataclass
class Completion:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_draft_tokens: int = 0  # speculative decoding (engine/speculative.py): drafts verified, and accepted
    num_accepted_draft_tokens: int = 0
