"""POST /v1/completions: raw text in, raw text out, no Harmony rendering or parsing.

What the endpoint is for: clients that write the prompt themselves (a Harmony conversation they rendered,
evaluation harnesses) and the benchmark clients of other engines (`vllm bench serve`, SGLang's
`bench_serving`), which send `/v1/completions` with `ignore_eos` to fix the output length.

Decisions:
- `prompt`: a string (or list of strings) is encoded with the Harmony vocabulary (o200k_harmony); special
  tokens written as text (`<|start|>`, `<|channel|>`, ...) become those tokens, so a rendered Harmony prompt
  works. Token-id lists go through as they are (the engine checks the ids).
- output: tokens decoded as they arrive (UTF-8 characters split over tokens are held until complete),
  special tokens included as their text, so a raw client can parse Harmony itself; the stop token that ended
  the generation is left out. Generation stops at gpt-oss's end tokens, `<|return|>`, `<|call|>` and
  `<|endoftext|>` (its generation config), never with `ignore_eos`.
- `max_tokens` defaults to 16, as on OpenAI's endpoint (capped by the context); `n` completions per prompt,
  choice index = prompt index x n + j; `stop` strings cut the text (the match left out); `echo` puts the
  prompt's text first; `logprobs` N gives the legacy shape (tokens, token_logprobs, top_logprobs with the N
  best, text_offset in characters of the returned text); `echo` with `logprobs` is a 400 (the engine computes
  no prompt logprobs), so are `suffix` and `best_of` other than `n`. Usage counts each prompt once.
"""

from __future__ import annotations

import asyncio
import codecs
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import Response

from engine.request import FINISH_LENGTH, FINISH_STOP, InvalidRequestError, SamplingParams, TokenDelta
from serve_app.harmony.constrain import FINAL
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.text_limits import check_tokenizable
from serve_app.openai_api.auth import in_batch
from serve_app.openai_api.completion_request import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest
from serve_app.openai_api.errors import APIError, BadRequest
from serve_app.openai_api.generation import (
    BackendRequest,
    GenerationGroup,
    IngressContext,
    SamplingRequest,
    respond,
    sampling_params,
)
from serve_app.openai_api.output_options import output_constraint_off_loop
from serve_app.openai_api.stop_strings import StopMatcher
from serve_app.openai_api.streaming import interleave, sse
from serve_app.openai_api.usage import Caller, caller_of

# gpt-oss's generation config: <|return|>, <|endoftext|>, <|call|>
RAW_STOP_TOKEN_IDS = (200002, 199999, 200012)


@dataclass
class TextStep:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def extend(self, other: "TextStep") -> None:
        self.text += other.text
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(other, name))

    def logprobs_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


class TextGeneration(BackendRequest):
    """One completion: token deltas -> text steps, with stop strings and (optionally) logprobs."""

    def __init__(self, ctx: IngressContext, *, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 stop: list[str], echo_text: str = "", priority: int = 0, caller: Caller | None = None,
                 cache_salt: str | None = None):
        super().__init__(ctx, request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, priority=priority,
                         caller=caller, cache_salt=cache_salt)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._matcher = StopMatcher(stop) if stop else None
        self._stop_ids = frozenset() if sampling.ignore_eos else frozenset(sampling.stop_token_ids)
        self._echo_text = echo_text
        self._chars = len(echo_text)  # characters of the returned text before the next token's

    def refusal(self, err: InvalidRequestError) -> BadRequest:
        if err.param != "prompt_ids":
            return super().refusal(err)
        # the engine names its own field; the client sent `prompt`
        return BadRequest(f"prompt: {err}".replace("prompt_ids", "token ids"), param="prompt")

    async def steps(self) -> AsyncIterator[TextStep]:
        """Text per backend delta (the first carries the echoed prompt); the last step flushes held text and
        sets finish_reason."""
        step = TextStep(self._echo_text)
        async for delta in self._deltas():
            self._consume(delta, step)
            if step.text or step.tokens:
                yield step
                step = TextStep()
        yield self._finish(step)

    def _token_text(self, token_id: int) -> tuple[bytes, str]:
        raw = self.ctx.encoding.decode([token_id], errors="surrogateescape").encode("utf-8", "surrogateescape")
        return raw, raw.decode("utf-8", errors="replace")

    def _consume(self, delta: TokenDelta, step: TextStep) -> None:
        logprobs = delta.logprobs or []
        last = len(delta.token_ids) - 1
        for i, token_id in enumerate(delta.token_ids):
            self.completion_tokens += 1
            if i == last and delta.finish_reason == FINISH_STOP and token_id in self._stop_ids:
                break  # the end token: counted, not returned
            raw, token_str = self._token_text(token_id)
            if i < len(logprobs):
                entry = logprobs[i]
                step.tokens.append(token_str)
                step.token_logprobs.append(entry.logprob)
                step.top_logprobs.append({self._token_text(t)[1]: lp for t, lp in entry.top})
                step.text_offset.append(self._chars)
            text = self._decoder.decode(raw)
            self._chars += len(text)
            if self._push(text, step):
                break

    def _push(self, text: str, step: TextStep) -> bool:
        """Add text to the step through the stop strings; True once one matched."""
        if self._matcher is None:
            step.text += text
            return False
        out, hit = self._matcher.push(text)
        step.text += out
        self._stopped_by_string = hit
        return hit

    def _finish(self, step: TextStep) -> TextStep:
        if not self._stopped_by_string:
            self._push(self._decoder.decode(b"", final=True), step)
        if self._matcher is not None and not self._stopped_by_string:
            step.text += self._matcher.flush()
        if self._stopped_by_string:
            self.finish_reason = "stop"
            return step
        self._check_not_aborted()
        self.finish_reason = "length" if self._backend_finish == FINISH_LENGTH else "stop"
        return step


def encode_prompts(texts: list[str]) -> list[list[int]]:
    """String prompts' ids in the Harmony vocabulary (special tokens written as text become those tokens), after
    the check for text the tokenizer would stall on: the tokenizing RenderWorkers runs off the event loop for
    long prompts."""
    check_tokenizable(("prompt", text) for text in texts)
    encoding = load_harmony_encoding()
    return [encoding.encode(text, allowed_special="all") for text in texts]


def prompt_ids_and_text(prompt: str | list[int], encoded: Iterator[list[int]], ctx: IngressContext,
                        echo: bool) -> tuple[list[int], str]:
    """(ids, echoed text) of one prompt; `encoded` yields the string prompts' ids in order (encode_prompts)."""
    if isinstance(prompt, str):
        return next(encoded), prompt
    return list(prompt), ctx.encoding.decode(prompt, errors="replace") if echo else ""


def usage_json(gens: list[TextGeneration], n: int) -> dict[str, Any]:
    firsts = gens[::n]  # one per prompt
    prompt = sum(g.prompt_tokens for g in firsts)
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in firsts)}}


async def create_completion(req: CompletionRequest, http: Request, ctx: IngressContext) -> Response:
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs would need the prompt's logprobs, which this server does not "
                         "compute; drop one of them", param="echo")
    constraint, _ = await output_constraint_off_loop(req.response_format, "response_format", [])
    if constraint is not None:
        constraint = replace(constraint, start_in=FINAL)
    n = req.n or 1
    priority = ctx.config.request_priority(req.priority, in_batch(http))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gens: list[TextGeneration] = []
    texts = [prompt for prompt in req.prompt if isinstance(prompt, str)]
    encoded = iter(await ctx.renderer.run(sum(map(len, texts)), encode_prompts, texts) if texts else [])
    for i, prompt in enumerate(req.prompt):
        ids, text = prompt_ids_and_text(prompt, encoded, ctx, req.echo)
        room = ctx.config.max_context - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else \
            (min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if room > 0 else None)
        sampling = sampling_params(SamplingRequest(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, logprobs=req.logprobs, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias,
        ), len(ids), ctx.config, context_param="prompt")
        sampling = replace(sampling, stop_token_ids=RAW_STOP_TOKEN_IDS, ignore_eos=req.ignore_eos,
                           constraint=constraint)
        for j in range(n):
            # Completion j of a seeded prompt draws from seed + j: reproducible, and the completions differ.
            params = sampling if j == 0 or sampling.seed is None else replace(sampling, seed=(sampling.seed + j) % 2**64)
            rid = request_id if len(req.prompt) * n == 1 else f"{request_id}-{i}-{j}"
            gens.append(TextGeneration(ctx, request_id=rid, prompt_ids=ids, sampling=params, stop=req.stop,
                                       echo_text=text if req.echo else "", priority=priority,
                                       caller=caller_of("completions", http), cache_salt=req.cache_salt))
    group = GenerationGroup(gens)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.config.model_name,
            "system_fingerprint": ctx.config.system_fingerprint}
    with_logprobs = req.logprobs is not None

    async def choice(index: int, gen: TextGeneration) -> dict:
        whole = TextStep()
        async for step in gen.steps():
            whole.extend(step)
        return {"index": index, "text": whole.text, "finish_reason": gen.finish_reason,
                "logprobs": whole.logprobs_json() if with_logprobs else None}

    async def body(group: GenerationGroup) -> dict:
        choices = await asyncio.gather(*(choice(i, g) for i, g in enumerate(group.gens)))
        return {**head, "object": "text_completion", "choices": list(choices), "usage": usage_json(gens, n)}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, step: TextStep, finish: str | None = None) -> bytes:
        out = {"index": index, "text": step.text, "logprobs": step.logprobs_json() if with_logprobs else None,
               "finish_reason": finish}
        return sse({**head, "object": "text_completion", "choices": [out], **extra})

    async def choice_chunks(index: int, gen: TextGeneration) -> AsyncIterator[bytes]:
        async for step in gen.steps():  # the last step (finish_reason set by then) carries the finish reason
            yield chunk(index, step, gen.finish_reason)

    async def stream(group: GenerationGroup) -> AsyncIterator[bytes]:
        try:
            async for data in interleave([choice_chunks(i, g) for i, g in enumerate(group.gens)]):
                yield data
            if include_usage:
                yield sse({**head, "object": "text_completion", "choices": [], "usage": usage_json(gens, n)})
            yield sse("[DONE]")
        except APIError as err:  # mid-stream failure: the openai client raises it as an APIError
            yield sse(err.body())
        finally:
            await group.close()

    return await respond(http, group, response_id=request_id, stream=req.stream, make_stream=stream,
                         make_body=body, keepalive_s=ctx.config.stream_keepalive_s)
