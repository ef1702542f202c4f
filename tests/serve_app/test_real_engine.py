"""The app over the real engine (AsyncEngine + LLMEngine) on a tiny random GPT-OSS with Harmony's vocab.

A random model writes random tokens, mostly not Harmony: this checks that the whole path (render ->
engine -> parse -> HTTP) returns exactly what the engine generated, never a 500, and that a client
that leaves frees the engine.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.request import GenerateRequest, SamplingParams
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.parse import HarmonyOutputParser, ItemKind
from serve_app.harmony.render import render_prompt
from serve_app.openai_api.chat import chat_prompt
from serve_app.openai_api.generation import IngressConfig
from serve_app.openai_api.protocol import ChatCompletionRequest
from tests.serve_app.conftest import LiveServer

MODEL = "tiny"
MAX_CONTEXT = 256
DATE = "2025-06-28"
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from serve_app.openai_api.app import create_app

    folder = tmp_path_factory.mktemp("tiny-harmony")
    make_tiny(folder, dtype="float32", seed=3)
    model = load_model(folder, dtype="float32", progress=False)
    config = EngineConfig(max_model_len=MAX_CONTEXT, num_full_pages=64, num_sliding_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=256)
    reference = LLMEngine(model, config)
    engine = AsyncEngine(LLMEngine(model, config))
    app = create_app(engine, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=DATE,
                     forced_call_reasoning_tokens=4)  # a random model reasons until the budget: keep it short
    with LiveServer(app) as server:
        yield reference, engine, server
    engine.shutdown()


def expected_message(token_ids: list[int]) -> tuple[str, str]:
    """(reasoning, content) our parser makes of these tokens, as the chat API joins them."""
    parser = HarmonyOutputParser(load_harmony_encoding())
    events = [e for t in token_ids for e in parser.feed(t)] + parser.finish()
    done = [e for e in events if type(e).__name__ == "ItemDone"]
    join = lambda kind: "\n\n".join(e.text for e in done if e.kind is kind)  # noqa: E731
    return join(ItemKind.REASONING), join(ItemKind.CONTENT)


def test_greedy_chat_returns_exactly_what_the_engine_generated(real):
    reference, engine, server = real
    req = ChatCompletionRequest(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    prompt = render_prompt(chat_prompt(req, IngressConfig(model_name=MODEL, max_context=MAX_CONTEXT,
                                                          conversation_start_date=DATE)))
    (direct,) = reference.generate([GenerateRequest("ref", prompt, SamplingParams(temperature=0.0, max_tokens=6))])

    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(direct.output_ids)
    reasoning, content = expected_message(direct.output_ids)
    assert (r.choices[0].message.content or "") == content
    assert (r.choices[0].message.model_extra.get("reasoning_content") or "") == reasoning
    expected_finish = "length" if direct.finish_reason == "length" else "stop"
    assert r.choices[0].finish_reason == expected_finish


def test_greedy_completion_is_the_engine_tokens_as_text(real):
    """/v1/completions: the raw text of exactly the tokens the engine generates, the end token left out;
    streamed and not, with one logprob entry per returned token."""
    from serve_app.openai_api.completions import RAW_STOP_TOKEN_IDS

    reference, engine, server = real
    enc = load_harmony_encoding()
    text = "<|start|>user<|message|>Hi!<|end|><|start|>assistant"
    prompt = enc.encode(text, allowed_special="all")
    (direct,) = reference.generate([GenerateRequest("ref", prompt, SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=RAW_STOP_TOKEN_IDS))])
    returned = direct.output_ids[:-1] if direct.finish_reason == "stop" else direct.output_ids

    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=1)
    assert r.choices[0].text == enc.decode(returned, errors="replace")
    assert r.choices[0].finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(direct.output_ids)
    assert len(r.choices[0].logprobs.token_logprobs) == len(returned)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_penalized_greedy_chat_returns_what_the_engine_generated(real):
    """Penalties travel from the API to the sampler: the same tokens as the engine called directly."""
    reference, engine, server = real
    penalties = dict(presence_penalty=-2.0, frequency_penalty=-1.5)  # pull toward repeats: they bite here
    req = ChatCompletionRequest(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    prompt = render_prompt(chat_prompt(req, IngressConfig(model_name=MODEL, max_context=MAX_CONTEXT,
                                                          conversation_start_date=DATE)))
    (direct,) = reference.generate([GenerateRequest("pen", prompt, SamplingParams(
        temperature=0.0, max_tokens=8, **penalties))])
    (plain,) = reference.generate([GenerateRequest("plain", prompt, SamplingParams(temperature=0.0, max_tokens=8))])
    assert direct.output_ids != plain.output_ids

    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, **penalties)
    reasoning, content = expected_message(direct.output_ids)
    assert (r.choices[0].message.content or "") == content
    assert (r.choices[0].message.model_extra.get("reasoning_content") or "") == reasoning
    assert r.usage.completion_tokens == len(direct.output_ids)


def _prompt() -> list[int]:
    req = ChatCompletionRequest(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    return render_prompt(chat_prompt(req, IngressConfig(model_name=MODEL, max_context=MAX_CONTEXT,
                                                        conversation_start_date=DATE)))


def test_n_choices_are_the_engine_generations_of_seed_plus_index(real):
    """n=3 with seed 5: choice i is what the engine generates with seed 5 + i; usage counts the prompt
    once; streamed, the chunks of each index rebuild the same choices; greedy choices are all alike."""
    reference, engine, server = real
    directs = reference.generate([GenerateRequest(f"n{i}", _prompt(), SamplingParams(
        temperature=1.0, seed=5 + i, max_tokens=7)) for i in range(3)])
    assert len({tuple(d.output_ids) for d in directs}) > 1  # the seeds give different completions

    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=7, temperature=1.0, seed=5, n=3)
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, d in zip(r.choices, directs):
        reasoning, content = expected_message(d.output_ids)
        assert (c.message.content or "") == content
        assert (c.message.model_extra.get("reasoning_content") or "") == reasoning
    assert r.usage.prompt_tokens == len(_prompt())
    assert r.usage.completion_tokens == sum(len(d.output_ids) for d in directs)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for i, c in enumerate(r.choices):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == c.finish_reason
        assert "".join(m.delta.content or "" for m in mine) == (c.message.content or "")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, n=2)
    assert greedy.choices[0].message == greedy.choices[1].message
    assert not engine.engine.has_unfinished()
    usage = engine.engine.block_manager.usage()
    assert usage["full_pages_used"] == 0 and usage["sliding_pages_used"] == 0


def leave_stream(engine, server, body: dict) -> int:
    """Read one event of a streamed chat, hang up, wait until the engine is idle; returns the aborts."""
    before = engine.engine.metrics.snapshot()["requests_finished_total"].get("abort", 0)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine still runs what the client abandoned"
        time.sleep(0.05)
    return engine.engine.metrics.snapshot()["requests_finished_total"].get("abort", 0) - before


def test_leaving_an_n_stream_aborts_every_choice(real):
    _, engine, server = real
    aborted = leave_stream(engine, server, {"model": MODEL, "messages": MESSAGES, "max_tokens": 150, "stream": True,
                                            "n": 3})
    assert aborted == 3, aborted
    usage = engine.engine.block_manager.usage()
    assert usage["full_pages_used"] == 0 and usage["sliding_pages_used"] == 0


def test_logit_bias_forces_a_token_and_unknown_ids_are_400(real):
    reference, engine, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.7, seed=3,
                                       logit_bias={"1001": 100})
    assert r.usage.completion_tokens == 4
    assert (r.choices[0].message.content or "") == load_harmony_encoding().decode([1001] * 4)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logit_bias={"999999": 5})
    assert info.value.param == "logit_bias"


def test_forced_tool_call_is_what_the_engine_writes_under_its_grammar(real):
    """tool_choice naming a function: the engine gets the rendered prompt (ending in `<|start|>assistant`) and the
    forced-call grammar with the ingress' reasoning budget (4 tokens here); at temperature 0 the answer is exactly
    what the engine writes under that grammar: a message of at most 4 tokens, then the call (this random model
    writes one endless JSON key: the arguments are what our parser makes of the tokens up to max_tokens), every
    token counted as output."""
    from serve_app.harmony.constrain import CALL, FORCED_CALL, RETURN, HarmonySchemaSpec, forced_call_grammar

    reference, engine, server = real
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    req = ChatCompletionRequest(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=tools)
    prompt = render_prompt(chat_prompt(req, IngressConfig(model_name=MODEL, max_context=MAX_CONTEXT,
                                                          conversation_start_date=DATE)))
    spec = HarmonySchemaSpec(start_in=FORCED_CALL, forced_call=forced_call_grammar([("lookup", None)], 4))
    (direct,) = reference.generate([GenerateRequest("f", prompt, SamplingParams(
        temperature=0.0, max_tokens=60, stop_token_ids=(RETURN, CALL), constraint=spec))])
    enc = load_harmony_encoding()
    before, _ = enc.decode(direct.output_ids).split("<|start|>assistant<|channel|>commentary to=functions.lookup "
                                                    "<|constrain|>json<|message|>{")
    assert len(before) > 0 and before.count("<|end|>") == 1  # a message before the call (a preamble, this seed)

    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "lookup"}})
    (call,) = r.choices[0].message.tool_calls
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (len(direct.output_ids), len(prompt))
    parser = HarmonyOutputParser(enc)
    events = [e for t in direct.output_ids for e in parser.feed(t)] + parser.finish()
    (expected,) = [e for e in events if type(e).__name__ == "ItemDone" and e.kind is ItemKind.TOOL_CALL]
    assert (call.function.name, call.function.arguments) == ("lookup", expected.text)
    out = direct.output_ids
    assert out.index(200007) - out.index(200008) - 1 <= 4  # the message's text: <|message|> ... <|end|>


def test_usage_reports_prompt_tokens_from_the_prefix_cache(tmp_path):
    """A server whose engine caches prefixes: the same conversation twice, the second reports the cached
    prompt tokens (whole pages of 16, at least one prompt token computed) in both APIs' usage."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from serve_app.openai_api.app import create_app

    make_tiny(tmp_path, dtype="float32", seed=3)
    config = EngineConfig(max_model_len=MAX_CONTEXT, num_full_pages=64, num_sliding_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=256, enable_prefix_caching=True)
    engine = AsyncEngine(LLMEngine(load_model(tmp_path, dtype="float32", progress=False), config))
    import openai
    try:
        with LiveServer(create_app(engine, model_name=MODEL, max_context=MAX_CONTEXT,
                                   conversation_start_date=DATE)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
            first, second = (client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                            temperature=0) for _ in range(2))
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
            assert second.choices[0].message == first.choices[0].message
            resp = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=3, temperature=0)
            again = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=3, temperature=0)
            assert again.usage.input_tokens_details.cached_tokens == (again.usage.input_tokens - 1) // 16 * 16
            assert resp.usage.input_tokens_details.cached_tokens <= again.usage.input_tokens_details.cached_tokens
    finally:
        engine.shutdown()


def test_isolated_prefix_caches_per_api_key_and_cache_salt(tmp_path):
    """ingress.isolate_prefix_cache: the same conversation from a second API key finds nothing of the first key's
    in the prefix cache (cached_tokens 0), from the same key it finds its prefix; a request's own cache_salt
    separates it further. The answers stay the same (greedy)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from serve_app.openai_api.app import create_app

    make_tiny(tmp_path, dtype="float32", seed=3)
    config = EngineConfig(max_model_len=MAX_CONTEXT, num_full_pages=64, num_sliding_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=256, enable_prefix_caching=True)
    engine = AsyncEngine(LLMEngine(load_model(tmp_path, dtype="float32", progress=False), config))
    import openai
    try:
        with LiveServer(create_app(engine, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=DATE,
                                   api_keys=["sk-a", "sk-b"], isolate_prefix_cache=True)) as server:
            a, b = (openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
                    for key in ("sk-a", "sk-b"))

            def chat(client, **extra):
                return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                                      **extra)

            first, other_key, same_key = chat(a), chat(b), chat(a)
            salted, salted_again = chat(a, extra_body={"cache_salt": "s1"}), chat(a, extra_body={"cache_salt": "s1"})
            whole = (first.usage.prompt_tokens - 1) // 16 * 16
            assert [r.usage.prompt_tokens_details.cached_tokens for r in
                    (first, other_key, same_key, salted, salted_again)] == [0, 0, whole, 0, whole]
            assert whole > 0 and len({r.choices[0].message.content for r in (first, other_key, salted)}) == 1
            with pytest.raises(openai.BadRequestError) as err:
                chat(a, extra_body={"cache_salt": ""})
            assert err.value.param == "cache_salt"
    finally:
        engine.shutdown()


def test_seeded_stream_equals_seeded_non_stream(real):
    _, _, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=11, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (whole.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 5


def test_disconnect_frees_the_engine(real):
    _, engine, server = real
    aborted = leave_stream(engine, server, {"model": MODEL, "messages": MESSAGES, "max_tokens": 150, "stream": True})
    assert aborted == 1, aborted  # ended by our abort, not by running to max_tokens
    usage = engine.engine.block_manager.usage()
    assert usage["full_pages_used"] == 0 and usage["sliding_pages_used"] == 0


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit", "days"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_strict_forced_tool_call_arguments_match_the_schema(real, seed):
    """A random model, sampled at temperature 1: held to the strict tool's schema from the forced header on,
    its arguments are JSON that satisfies it and the call ends with <|call|> (finish_reason tool_calls), in
    Chat and Responses; the engine is idle after."""
    from tests.serve_app.test_harmony_constrain import valid

    _, engine, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "weather", "description": "Forecast.", "parameters": WEATHER, "strict": True}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
                                       tools=[{"type": "function", "function": tool}], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    assert valid(json.loads(call.function.arguments), WEATHER), call.function.arguments
    resp = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=60, temperature=1.0,
                                   tools=[{"type": "function", **tool}],
                                   tool_choice={"type": "function", "name": "weather"})
    (item,) = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and valid(json.loads(item.arguments), WEATHER), item.arguments
    assert not engine.engine.has_unfinished()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_among_several_tools_calls_one_of_them(real, seed):
    """tool_choice 'required' with two tools (one strict): a random model sampled at temperature 1 calls one of
    them (the prompt ends in `to=functions`, the grammar holds the name and the arguments), in Chat and Responses;
    the strict one's arguments satisfy its schema, the other's are a JSON object. (This random model picks
    `weather` at seeds 1-12; the masks' random walks in test_harmony_constrain.py take both names.)"""
    from tests.serve_app.test_harmony_constrain import valid

    _, engine, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    weather = {"name": "weather", "description": "Forecast.", "parameters": WEATHER, "strict": True}
    note = {"name": "note", "description": "Write a note.", "parameters": {"type": "object"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed,
                                       tools=[{"type": "function", "function": t} for t in (weather, note)],
                                       tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("weather", "note")
    args = json.loads(call.function.arguments)
    assert valid(args, WEATHER) if call.function.name == "weather" else isinstance(args, dict)
    resp = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=80, temperature=1.0,
                                   extra_body={"seed": seed},
                                   tools=[{"type": "function", **t} for t in (weather, note)], tool_choice="required")
    (item,) = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and item.name in ("weather", "note")
    args = json.loads(item.arguments)
    assert valid(args, WEATHER) if item.name == "weather" else isinstance(args, dict)
    assert not engine.engine.has_unfinished()


def test_completion_response_format_holds_the_text_from_the_first_token(real):
    """/v1/completions with response_format (vLLM's extension): the prompt ends in the final channel's header,
    the random model's text is JSON that satisfies the schema, and the request stops at <|return|>."""
    from tests.serve_app.test_harmony_constrain import valid

    _, engine, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>final<|message|>"
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, temperature=1.0, seed=4, n=2,
                                  extra_body={"response_format": fmt})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and valid(json.loads(choice.text), WEATHER), choice.text
    # json_object: any object. Left alone the random model writes one endless key; a logit_bias toward
    # '"', '}', ':' and '0' (combined with the mask, as a client may) makes it close its objects.
    enc = load_harmony_encoding()
    bias = {str(enc.encode(ch, allowed_special=set())[0]): 30 for ch in ['"', "}", ":", "0"]}
    for seed in range(3):
        obj = client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, temperature=1.0, seed=seed,
                                        logit_bias=bias, extra_body={"response_format": {"type": "json_object"}})
        assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
    assert not engine.engine.has_unfinished()


def test_the_engine_looks_ahead_past_forced_tokens_with_the_same_tokens(tmp_path):
    """A strict forced call through LLMEngine with its lookahead on (the GPU default) and off, and with
    jump-forward (forced tokens as drafts, the default) and without: the same tokens, valid arguments; the
    lookahead ran inside the grammar, and forced runs (the keys, punctuation) took fewer steps."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from serve_app.harmony.constrain import HarmonySchemaSpec, check_json_schema
    from tests.serve_app.test_harmony_constrain import valid

    make_tiny(tmp_path, dtype="float32", seed=3)
    model = load_model(tmp_path, dtype="float32", progress=False)
    enc = load_harmony_encoding()
    prompt = enc.encode("<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>commentary "
                        "to=functions.weather <|constrain|>json<|message|>", allowed_special="all")
    spec = HarmonySchemaSpec(tools=(("weather", check_json_schema(WEATHER, "t")),), start_in="weather")
    outs, ahead, jumped, steps = {}, {}, {}, {}
    for on, jump in ((True, 8), (False, 8), (True, 0)):
        engine = LLMEngine(model, EngineConfig(max_model_len=MAX_CONTEXT, num_full_pages=64, num_sliding_pages=64,
                                               max_num_seqs=4, max_num_batched_tokens=256, async_decode=on,
                                               jump_forward_tokens=jump))
        outs[on, jump] = engine.generate([GenerateRequest(f"w{s}", prompt, SamplingParams(
            temperature=1.0, seed=s, max_tokens=60, constraint=spec)) for s in range(3)])
        ahead[on, jump] = engine.lookahead_steps
        snap = engine.metrics.snapshot()
        jumped[on, jump], steps[on, jump] = snap["jump_forward_tokens_total"], snap["steps_total"]
        engine.close()
    ids = {key: [o.output_ids for o in out] for key, out in outs.items()}
    assert ids[True, 8] == ids[False, 8] == ids[True, 0]
    assert ahead[True, 8] > 0 and ahead[False, 8] == 0, ahead
    assert jumped[True, 8] > 5 and jumped[True, 0] == 0, jumped
    assert steps[True, 8] < steps[True, 0], steps
    for o in outs[True, 8]:
        assert o.finish_reason == "stop" and o.output_ids[-1] == 200012  # <|call|>
        assert valid(json.loads(enc.decode(o.output_ids[:-1])), WEATHER)


def test_a_prediction_is_verified_by_the_engine_and_changes_no_token(real):
    """Chat `prediction` through HTTP into the real engine's speculative decoding: the answer the random model
    writes is sent back as the prediction of the same request, so most drafts are accepted (the engine re-aligns
    on its first two tokens, the prediction opening with the final-channel header the random model does not
    write); the message equals the one without a prediction, and usage counts the accepted and rejected drafts."""
    import openai

    reference, engine, server = real
    enc = load_harmony_encoding()
    cfg = IngressConfig(model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=DATE)
    picked = None
    for word in ("hello world", "Hi!", "Rename x to count", "Spell it", "Go on"):
        messages = [{"role": "user", "content": word}]
        prompt = render_prompt(chat_prompt(ChatCompletionRequest(model=MODEL, messages=messages, max_tokens=40,
                                                                 temperature=0), cfg))
        (direct,) = reference.generate([GenerateRequest("ref", prompt, SamplingParams(temperature=0.0, max_tokens=40))])
        text = enc.decode(direct.output_ids)
        if enc.encode(text, allowed_special="all") == direct.output_ids:  # the text tokenizes back to them
            picked = messages, direct, text
            break
    assert picked is not None, "no candidate answer tokenizes back to its own tokens"
    messages, direct, text = picked
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    predicted = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                               prediction={"type": "content", "content": text})
    assert predicted.choices[0].message == plain.choices[0].message
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens == len(direct.output_ids)
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= len(direct.output_ids) // 2, details
    assert details.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_responses_logprobs_are_the_chat_logprobs_of_the_same_conversation(real):
    """The real engine and parser (random output, mostly recovered as text): the logprobs of a Responses request's
    message items, in order, are those Chat returns for the same greedy conversation (the same tokens; the values
    to fp32 rounding, as the second request takes its prompt from the prefix cache)."""
    _, _, server = real
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True,
                                          top_logprobs=2)
    resp = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=24, temperature=0,
                                   include=["message.output_text.logprobs"], top_logprobs=2)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    want = [lp for lp in chat.choices[0].logprobs.content]
    got = [lp for item in resp.output if item.type == "message" for lp in item.content[0].logprobs]
    tokens = lambda lps: [(lp.token, [t.token for t in lp.top_logprobs]) for lp in lps]  # noqa: E731
    values = lambda lps: [v for lp in lps for v in (lp.logprob, *(t.logprob for t in lp.top_logprobs))]  # noqa: E731
    assert want and tokens(got) == tokens(want)
    assert values(got) == pytest.approx(values(want), abs=1e-4)
