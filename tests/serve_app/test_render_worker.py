"""RenderWorkers: long prompts are tokenized in worker processes, token for token what the ingress would render in
place, while the event loop goes on; errors come back typed, a dead worker is replaced, short prompts stay in
place. Then through the app: chat, responses and completions with a long prompt reach the engine as rendered in
place."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from engine.request import InvalidRequestError
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.render import Prompt, UserMessage, prompt_chars, render_prompt
from serve_app.harmony.render_worker import RenderWorkerDied, RenderWorkers
from serve_app.openai_api.chat import chat_tokens
from serve_app.openai_api.completions import encode_prompts
from serve_app.openai_api.generation import IngressConfig
from serve_app.openai_api.protocol import ResponsesRequest
from serve_app.openai_api.responses_input import fitted_prompt
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ENC = load_harmony_encoding()
ANSWER = "<|channel|>final<|message|>Noted.<|return|>"


def prose(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "model", "streams", "tokens", "über", "naïve", "42", "3.14", "(x)", "—", "日本語", "\n\n", "def"]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def raise_unpicklable() -> None:
    """An exception of a class the parent cannot unpickle (a local one): its text must still come back."""

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    raise Odd(1, 2)


@pytest.fixture(scope="module")
def workers():
    pool = RenderWorkers(workers=1, min_chars=1_000)
    yield pool
    pool.close()
    assert pool.started == 0


def test_long_prompts_render_in_a_worker_token_for_token(workers):
    prompt = Prompt(history=[UserMessage(prose(20_000, seed=1))], instructions=prose(300, seed=2))
    chars = prompt_chars(prompt)
    assert chars > workers.min_chars
    assert asyncio.run(workers.run(chars, render_prompt, prompt)) == render_prompt(prompt)
    assert workers.started == 1
    prediction = prose(5_000, seed=3)
    assert asyncio.run(workers.run(10**6, chat_tokens, prompt, prediction)) == chat_tokens(prompt, prediction)
    texts = [prose(3_000, seed=4), "<|start|>user<|message|>" + prose(50, seed=5)]
    assert asyncio.run(workers.run(10**6, encode_prompts, texts)) == encode_prompts(texts)
    config = IngressConfig(model_name=MODEL, max_context=2_000, default_max_tokens=100)
    req = ResponsesRequest(model=MODEL, truncation="auto", input=[
        {"role": "user", "content": prose(400, seed=10 + i)} for i in range(12)])
    fitted = asyncio.run(workers.run(10**6, fitted_prompt, req, config, None, None))
    assert fitted == fitted_prompt(req, config, None, None)
    assert len(fitted) <= 1_900 < len(fitted_prompt(req.model_copy(update={"truncation": "disabled"}), config,
                                                    None, None))
    assert workers.started == 1  # the same process served every call


@pytest.mark.parametrize("worker_count", [1, 0])
def test_the_event_loop_runs_while_a_worker_renders(worker_count):
    """Deterministic, no clock: a coroutine started after the render counts the loop's turns until the render
    is done. In a worker it gets many; rendered in place (0 workers) none, as the render never yields."""
    pool = RenderWorkers(workers=worker_count, min_chars=1_000)
    prompt = Prompt(history=[UserMessage(prose(60_000, seed=6))])

    async def main() -> int:
        render = asyncio.create_task(pool.run(prompt_chars(prompt), render_prompt, prompt))
        turns = 0

        async def count() -> None:
            nonlocal turns
            while not render.done():
                turns += 1
                await asyncio.sleep(0)

        await asyncio.gather(render, count())
        assert render.result() == render_prompt(prompt)
        return turns

    try:
        turns = asyncio.run(main())
    finally:
        pool.close()
    assert turns > 10 if worker_count else turns == 0


def test_errors_come_back_typed(workers):
    with pytest.raises(InvalidRequestError) as err:  # text_limits' 400, raised in the worker
        asyncio.run(workers.run(10**6, render_prompt, Prompt(history=[UserMessage("x" * 40_000)]), "input"))
    assert err.value.param == "input" and "unbroken run" in str(err.value)
    with pytest.raises(RuntimeError, match=r"Odd: 1/2"):
        asyncio.run(workers.run(10**6, raise_unpicklable))
    assert asyncio.run(workers.run(10**6, len, "still serving")) == 13


def test_a_dead_worker_is_replaced(workers):
    assert asyncio.run(workers.run(10**6, len, "abc")) == 3
    (proc,) = [p for p in workers._procs if p.poll() is None]
    proc.send_signal(signal.SIGINT)  # Ctrl-C on `serve run` reaches the process group: the worker stays
    assert asyncio.run(workers.run(10**6, len, "ab")) == 2 and proc.poll() is None
    proc.kill()  # between calls: the next call starts a new one
    proc.wait()
    assert asyncio.run(workers.run(10**6, len, "abcd")) == 4

    async def killed_mid_call() -> None:
        call = asyncio.create_task(workers.run(10**6, time.sleep, 30))
        await asyncio.sleep(0.3)
        (live,) = [p for p in workers._procs if p.poll() is None]
        os.kill(live.pid, signal.SIGKILL)
        await call

    with pytest.raises(RenderWorkerDied):
        asyncio.run(killed_mid_call())
    assert asyncio.run(workers.run(10**6, len, "abcde")) == 5
    assert workers.started == 1


def test_a_call_past_the_timeout_stops_its_worker():
    pool = RenderWorkers(workers=1, min_chars=0, timeout_s=1.0)
    try:
        assert asyncio.run(pool.run(0, len, "first call: starts the worker")) > 0
        with pytest.raises(RenderWorkerDied, match="longer than 1 s"):
            asyncio.run(pool.run(0, time.sleep, 30))
        assert pool.started == 0
        assert asyncio.run(pool.run(0, len, "a new one")) == 9
    finally:
        pool.close()


def test_a_cancelled_caller_leaves_the_pool_usable(workers):
    prompt = Prompt(history=[UserMessage(prose(40_000, seed=7))])

    async def main() -> list[int]:
        call = asyncio.create_task(workers.run(10**6, render_prompt, prompt))
        await asyncio.sleep(0.02)
        call.cancel()  # a client that left: the worker finishes that render, then serves the next
        with pytest.raises(asyncio.CancelledError):
            await call
        return await workers.run(10**6, render_prompt, prompt)

    assert asyncio.run(main()) == render_prompt(prompt)


def test_short_prompts_and_zero_workers_stay_in_place():
    pool = RenderWorkers(workers=1)
    prompt = Prompt(history=[UserMessage("short")])
    assert asyncio.run(pool.run(prompt_chars(prompt), render_prompt, prompt)) == render_prompt(prompt)
    assert pool.started == 0
    off = RenderWorkers(workers=0)
    assert asyncio.run(off.run(10**9, len, "in place")) == 8 and off.started == 0
    with pytest.raises(ValueError):
        RenderWorkers(workers=-1)


def test_long_requests_through_the_app_reach_the_engine_as_rendered_in_place():
    backend = ScriptedBackend(max_context=60_000)
    renderer = RenderWorkers(workers=1, min_chars=1_000)
    text = prose(8_000, seed=8)
    try:
        with scripted_app(backend, renderer=renderer) as server:
            api = openai_client(server.url)
            backend.push(ANSWER)
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
            chat_ids = backend.requests[-1].prompt_ids
            assert renderer.started == 1
            backend.push(ANSWER)
            api.responses.create(model=MODEL, input=text, store=False)
            assert backend.requests[-1].prompt_ids == chat_ids  # the same conversation through both APIs
            backend.push("more")
            backend.push("more")
            api.completions.create(model=MODEL, prompt=[text, "a short one"], max_tokens=2)
            assert [r.prompt_ids for r in backend.requests[-2:]] == [ENC.encode(text, allowed_special="all"),
                                                                     ENC.encode("a short one")]
            with pytest.raises(Exception) as err:  # the worker's 400 is the client's 400
                api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 40_000}])
            assert getattr(err.value, "status_code", None) == 400
    finally:
        renderer.close()
    in_place = Prompt(history=[UserMessage(text)], conversation_start_date="2025-06-28")
    assert chat_ids == render_prompt(in_place)
