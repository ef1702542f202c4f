"""Fixtures for the engine tests: one tiny fp32 checkpoint per session and a from-scratch greedy reference."""

from __future__ import annotations

import pytest

from engine.llm_engine import LLMEngine
from tests.engine.engine_testlib import VOCAB, WINDOW, engine_config
from model.loader import load_model
from model.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-engine")
    # 4 layers: sliding, full, sliding, full.
    make_tiny(folder, vocab_size=VOCAB, sliding_window=WINDOW, dtype="float32", hidden_size=32, head_dim=8,
              intermediate_size=32, seed=7)
    return folder


@pytest.fixture(scope="session")
def model(tiny_dir):
    return load_model(tiny_dir, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def other_model(tiny_dir):
    """A second copy of the tiny model, for tests that run two engines at once: an engine binds its K/V
    cache into its model's attention backend, so two engines stepping in two threads must not share one."""
    return load_model(tiny_dir, dtype="float32", progress=False)


@pytest.fixture
def make_engine(model):
    def make(**overrides) -> LLMEngine:
        return LLMEngine(model, engine_config(**overrides))
    return make


_REFERENCE: dict[tuple, list[int]] = {}


@pytest.fixture
def reference_greedy(model):
    """Greedy continuation where every token comes from a full recompute (model.full_logits, no cache)."""
    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in _REFERENCE:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model.full_logits(ids)[-1].argmax()))
            _REFERENCE[key] = ids[len(prompt):]
        return _REFERENCE[key]
    return run
