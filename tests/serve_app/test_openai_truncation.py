"""/v1/responses `truncation: "auto"`: a conversation that outgrows the context drops its oldest items (the
fewest that make room for the output), keeps system and developer messages, and drops a dropped call's output
with it; `disabled` (the default) stays a 400. A live uvicorn server with a small context and a store."""

from __future__ import annotations

import math
import random

import openai
import pytest

from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.openai_api.responses_input import fewest_drops
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ENC = load_harmony_encoding()
CONTEXT = 400
ANSWER = "<|channel|>final<|message|>Noted.<|return|>"


def words(tag: str, n: int = 60) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture(scope="module")
def live():
    backend = ScriptedBackend(max_context=CONTEXT)
    with scripted_app(backend, response_store=MemoryResponseStore()) as server:
        yield backend, openai_client(server.url)


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


@pytest.fixture
def api(live) -> openai.OpenAI:
    return live[1]


def test_a_long_chain_drops_its_oldest_turns_only_when_asked(api, backend):
    previous = None
    for turn in "abc":  # each turn ~150 tokens: the third does not fit 400 with 30 to spare
        backend.push(ANSWER)
        previous = api.responses.create(model=MODEL, input=words(turn), previous_response_id=previous,
                                        truncation="auto", max_output_tokens=30).id
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "c59" in prompt and "b0" in prompt and "a0" not in prompt  # turn a went, turn b stayed: the fewest
    assert len(backend.requests[-1].prompt_ids) + 30 <= CONTEXT
    assert api.responses.retrieve(previous).truncation == "auto"

    backend.push(ANSWER)
    with pytest.raises(openai.BadRequestError) as err:  # the default: no truncation
        api.responses.create(model=MODEL, input=words("d"), previous_response_id=previous, max_output_tokens=30)
    assert err.value.code == "context_length_exceeded"


def test_instructions_stay_and_a_dropped_call_takes_its_output_along(api, backend):
    items = [{"role": "developer", "content": "Always answer in French."},
             {"role": "user", "content": words("old")},
             {"type": "function_call", "call_id": "call_1", "name": "lookup",
              "arguments": "{\"q\": \"" + words("arg", 100) + "\"}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "result-text"},
             {"role": "user", "content": words("new", 50)}]
    backend.push(ANSWER)
    api.responses.create(model=MODEL, input=items, truncation="auto", max_output_tokens=30, store=False)
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "Always answer in French." in prompt and "new49" in prompt
    assert "old0" not in prompt and "arg0" not in prompt and "result-text" not in prompt


def test_what_cannot_fit_even_alone_is_still_a_400(api, backend):
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"},
                                                 {"role": "user", "content": words("x", 300)}],
                             truncation="auto", store=False)
    assert err.value.code == "context_length_exceeded"
    assert not backend.requests


@pytest.mark.parametrize("seed", range(200))
def test_fewest_drops_finds_the_first_fit_from_any_guess(seed):
    rng = random.Random(seed)
    lo, hi = 1, rng.randint(0, 300)
    first = rng.randint(lo, hi + 1)  # hi + 1: nothing fits
    calls = []

    def fits(d: int) -> bool:
        assert lo <= d <= hi
        calls.append(d)
        return d >= first

    guess = rng.choice([first, first - 1, first + 1, rng.randint(-5, hi + 5)])
    assert fewest_drops(fits, guess, lo, hi) == (first if first <= hi else None)
    distance = abs(min(max(guess, lo), hi) - first) + 1
    assert len(calls) <= 2 * math.log2(distance) + 4, (guess, first, calls)


def test_a_long_conversation_renders_a_few_times_not_once_per_halving(api, backend, monkeypatch):
    """60 stored turns over a 400-token context: the cut is found in a handful of renders (the bisection over all
    items took 1 + log2(items))."""
    from serve_app.openai_api import responses_input

    calls = []
    real = responses_input.render_prompt
    monkeypatch.setattr(responses_input, "render_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    items = []
    for i in range(60):
        items += [{"role": "user", "content": words(f"q{i}x", 6)}, {"role": "assistant", "content": words(f"a{i}y", 6)}]
    backend.push(ANSWER)
    r = api.responses.create(model=MODEL, input=items + [{"role": "user", "content": "last"}], truncation="auto",
                             max_output_tokens=20)
    assert r.output_text == "Noted."
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "last" in prompt and "q0x0" not in prompt
    kept = [i for i in range(60) if f"q{i}x0 " in prompt]
    assert kept and kept == list(range(kept[0], 60))  # a suffix of the turns: the oldest went
    assert len(calls) <= 6, len(calls)
