"""A few requests through a new engine before it takes traffic, so the first user requests do not pay for
compiling kernels and loading them.

Capturing the decode and prefill graphs compiles what runs inside them, but not what runs between them: the
attention of prompt chunks and mixed steps (eager between the prefill graphs' pieces) and the sampler's paths.
On the H200 (20b, random weights, `python -m bench.warm_up_probe`, 2026-12-01) a new engine's first 1k-token
prompt waited 1,189 ms against 23 ms once warm (Triton compiled the sliding-window prefill kernel inside it)
and its first top-p sampled request 261 against 23 ms (no Triton compile: first calls of the sampler's passes).
A first version of this warm-up (A and B below, B with top-k too) took 2.3 s and brought those to 23 and 35 ms;
this one (C, D and B's top-p-only sampling added) brings every request type's first time to its second (first
1k prompt 22.7 ms, first top-p request 23.1; bench/results/warm_up_probe_20b_h200_four_requests.json). With the
kernels precompiled (engine/triton_precompile.py) nothing compiles any more, yet the first requests of an engine
without a warm-up still waited 398 and 170 ms: first launches load each kernel's module (CUDA's lazy loading).

What runs:
- A: a prompt of whole pages, greedy;
- B: A's prompt plus tokens of its own (a prefix-cache hit on A's pages), temperature + top-p + logprobs (the
  sampler's sort path); it joins once A has its first token, so its prompt runs beside A's decode row (a mixed
  step: the split decode kernel eagerly, the sliding prefill kernel on a chunk after cached pages);
- C, after both: a prompt that ends inside a page, top-k + min-p + penalties + logit bias + a constraint that
  allows all tokens but one (the top-k candidate path, penalties, bias and masks); beside it D: A again with A's
  output as its prediction (the draft-verify rows, where speculation is on).
Then the counters go back to zero: the warm-up is not traffic. Every request carries its own seed, so the
engine's seed sequence (the seeds of requests that bring none) is where it was: a run with a warm-up draws what
it would have drawn without. Their K/V pages stay cached (evictable; only a prompt with these tokens would hit).
"""

from __future__ import annotations

import time

import numpy as np

from engine.request import GenerateRequest, SamplingParams

PROMPT_PAGES = 4  # A's prompt: whole pages (a token count divisible by 16, as Triton specializes on)
MORE_TOKENS = 20  # B's own tokens after A's prompt
ODD_PROMPT = 37  # C's prompt: not a multiple of 16
OUTPUT_TOKENS = 6


class AllButOne:
    """A structured-output constraint that forbids one token id and allows every other: the engine's mask path,
    whatever the model (picklable, so it crosses to TP/EP ranks like any ConstraintSpec)."""

    def __init__(self, banned: int = 0):
        self.banned = banned

    def start(self, vocab_size: int) -> "_AllButOneState":
        return _AllButOneState(self.banned % vocab_size, vocab_size)


class _AllButOneState:
    def __init__(self, banned: int, vocab_size: int):
        words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        words[-1] = np.uint32((1 << (vocab_size - 32 * (len(words) - 1))) - 1)  # no bits past the vocabulary
        words[banned // 32] &= np.uint32(~(1 << (banned % 32)) & 0xFFFFFFFF)
        self.mask = words

    def allowed_tokens(self) -> np.ndarray:
        return self.mask

    def accept(self, token_id: int) -> None:
        pass

    def can_look_ahead(self) -> bool:
        return True  # the mask never depends on the tokens


def _ids(n: int, mult: int, add: int, vocab: int) -> list[int]:
    return [(mult * i + add) % vocab for i in range(n)]


def warm_up(engine) -> dict:
    """Run the warm-up requests through `engine` (an LLMEngine with nothing in flight) and reset its counters.
    Returns what ran: seconds, steps, the forward paths taken, the draft tokens verified and the prompt tokens the
    prefix cache served."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine: requests are in flight")
    start = time.perf_counter()
    vocab = engine.vocab_size
    room = engine.max_model_len - OUTPUT_TOKENS - 1  # prompt tokens a request may have
    n = max(1, min(PROMPT_PAGES * engine.block_manager.block_size, room - MORE_TOKENS))
    prompt = _ids(n, 7, 3, vocab)
    more = _ids(max(0, min(MORE_TOKENS, room - n)), 11, 5, vocab)
    first = GenerateRequest("warm-up-greedy", prompt, SamplingParams(temperature=0.0, seed=0, max_tokens=OUTPUT_TOKENS,
                                                                     ignore_eos=True))
    second = GenerateRequest("warm-up-top-p", prompt + more, SamplingParams(
        temperature=0.8, top_p=0.9, logprobs=2, seed=1, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    third = GenerateRequest("warm-up-top-k", _ids(max(1, min(ODD_PROMPT, room)), 5, 2, vocab), SamplingParams(
        temperature=1.0, top_k=50, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3,
        logit_bias=((1 % vocab, 2.0),), constraint=AllButOne(), seed=2, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    steps, output = 0, []
    engine.add_request(first)
    while engine.has_unfinished():
        deltas = engine.step()
        steps += 1
        if not output and any(d.request_id == first.request_id and d.token_ids for d in deltas):
            engine.add_request(second)  # the next step: B's prompt beside A's decode row
        output += [t for d in deltas if d.request_id == first.request_id for t in d.token_ids]
    engine.add_request(third)
    engine.add_request(GenerateRequest("warm-up-predicted", prompt, SamplingParams(
        temperature=0.0, seed=3, max_tokens=OUTPUT_TOKENS, ignore_eos=True, prediction=tuple(output))))
    while engine.has_unfinished():
        engine.step()
        steps += 1
    snapshot = engine.metrics.snapshot()
    report = {"seconds": time.perf_counter() - start, "steps": steps,
              "steps_by_path": snapshot["steps_by_path_total"], "draft_tokens": snapshot["draft_tokens_total"],
              "prefix_hit_tokens": engine.block_manager.prefix_hit_tokens}
    engine.reset_metrics()
    return report
