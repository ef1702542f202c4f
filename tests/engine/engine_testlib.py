"""Helpers for the engine tests (fixtures live in conftest.py): a tiny fp32 model with a sliding window
of 8 and pages of 4 tokens, so window edges and page freeing happen within a few tokens."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams

VOCAB = 1000
WINDOW = 8
BLOCK = 4


def engine_config(**overrides) -> EngineConfig:
    settings = dict(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                    num_full_pages=256, num_sliding_pages=256)
    settings.update(overrides)
    return EngineConfig(**settings)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def request(rid: str, prompt: list[int], sampling: SamplingParams) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), sampling)


def with_requests(engine: LLMEngine, reqs) -> LLMEngine:
    """The engine with `reqs` added (in order)."""
    for r in reqs:
        engine.add_request(r)
    return engine


def assert_same(got: dict, want: dict) -> None:
    """run_to_end results: the same requests, tokens, and logprobs within 1e-4."""
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        for a, b in zip(got[rid]["logprobs"], want[rid]["logprobs"]):
            assert abs(a.logprob - b.logprob) < 1e-4, rid


def run_to_end(engine: LLMEngine, step=None, limit: int = 10_000) -> dict[str, dict]:
    """Step until idle; per request: tokens, logprobs, finish reason, number of deltas."""
    step = step or engine.step
    out: dict[str, dict] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return out
        for d in step():
            r = out.setdefault(d.request_id, {"ids": [], "logprobs": [], "finish": None, "deltas": 0})
            r["ids"] += d.token_ids
            r["logprobs"] += d.logprobs or []
            r["finish"] = d.finish_reason
            r["deltas"] += 1
    raise AssertionError(f"engine still busy after {limit} steps")


def assert_pool_full(engine: LLMEngine) -> None:
    usage = engine.block_manager.usage()
    assert usage["full_pages_used"] == 0 and usage["sliding_pages_used"] == 0, usage
