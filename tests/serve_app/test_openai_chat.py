"""/v1/chat/completions through the official openai client against a live uvicorn server."""

from __future__ import annotations

import json

import httpx
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serve_app.harmony.encoding import load_harmony_encoding
from tests.serve_app.conftest import MODEL

ENC = load_harmony_encoding()
ANSWER = ("<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there! 🦄 How can I help?<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather; call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"location\":\"Paris\"}<|call|>")
CALL_ON_ANALYSIS = ("<|channel|>analysis<|message|>Check the weather.<|end|>"
                    "<|start|>assistant<|channel|>analysis to=functions.get_weather <|constrain|>json"
                    "<|message|>{\"location\":\"Oslo\"}<|call|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                                                          "required": ["location"]}}}]
HI = [{"role": "user", "content": "Hi!"}]


def prompt_text(backend) -> str:
    return ENC.decode(backend.requests[-1].prompt_ids)


def test_non_stream_separates_reasoning_and_content_with_exact_usage(client, backend):
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI)
    msg = r.choices[0].message
    assert msg.content == "Hello there! 🦄 How can I help?"
    assert msg.model_extra["reasoning_content"] == "The user greets. Reply briefly."
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    sent = backend.requests[-1]
    assert r.usage.prompt_tokens == len(sent.prompt_ids)
    assert r.usage.completion_tokens == len(ENC.encode(ANSWER, allowed_special="all"))
    assert r.usage.completion_tokens_details.reasoning_tokens == len(ENC.encode("The user greets. Reply briefly."))
    assert sent.sampling.stop_token_ids == (200002, 200012)
    assert prompt_text(backend).endswith("<|start|>user<|message|>Hi!<|end|><|start|>assistant")
    # the prefix cache's hint: the user message starts where later chats of this system prompt leave it
    assert [ENC.decode(sent.prompt_ids[c:c + 3]) for c in sent.cache_cuts] == ["<|start|>user<|message|>"]


def test_stream_deltas_rebuild_the_non_stream_answer(client, backend):
    backend.push(ANSWER, chunk=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == "The user greets. Reply briefly." and content == "Hello there! 🦄 How can I help?"
    assert not any(d.content and d.model_extra.get("reasoning_content") for d in deltas)  # never glued together
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ENC.encode(ANSWER, allowed_special="all"))
    assert chunks[-1].usage.prompt_tokens == len(backend.requests[-1].prompt_ids) > 0


def test_raw_stream_is_valid_sse_ending_in_done(server, backend):
    backend.push(ANSWER)
    body = {"model": MODEL, "messages": HI, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    for frame in frames[:-1]:
        ChatCompletionChunk.model_validate(json.loads(frame))  # strict check against OpenAI's own types
        assert "usage" not in json.loads(frame)  # no include_usage: no usage field at all


def test_response_validates_against_openai_types(server, backend):
    backend.push(CALL)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200
    parsed = ChatCompletion.model_validate(r.json())
    assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_full_tool_round_trip(client, backend):
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    backend.push(CALL)
    first = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"} and call.id.startswith("call_")
    assert "get_weather = (_: {" in prompt_text(backend)  # the tool is described to the model

    backend.push("<|channel|>analysis<|message|>21 degrees.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is 21 °C in Paris.<|return|>")
    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "{\"temp_c\": 21}"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "It is 21 °C in Paris." and second.choices[0].finish_reason == "stop"
    text = prompt_text(backend)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather; call the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
            "<|message|>{\"location\":\"Paris\"}<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp_c\": 21}<|end|>"
            "<|start|>assistant") in text


def test_tool_call_on_analysis_channel_non_stream_and_stream(client, backend):
    backend.push(CALL_ON_ANALYSIS)
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.arguments == "{\"location\":\"Oslo\"}"
    assert r.choices[0].message.model_extra["reasoning_content"] == "Check the weather."

    backend.push(CALL_ON_ANALYSIS, chunk=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert "".join(tc.function.arguments or "" for tc in calls) == "{\"location\":\"Oslo\"}"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_forced_tool_call_reasons_then_calls_under_a_grammar(client, backend):
    """tool_choice named (or 'required' with one tool): the prompt ends in `<|start|>assistant` as for any turn,
    the engine request carries the forced-call grammar (an analysis message and a preamble of at most the ingress'
    2,048 tokens each, or a quarter of the request's max_tokens; then a call to that tool only), and the answer is
    the reasoning and the call, every token counted as output."""
    from serve_app.harmony.constrain import FORCED_CALL

    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        backend.push(CALL)
        r = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice=choice)
        assert prompt_text(backend).endswith("<|start|>user<|message|>Hi!<|end|><|start|>assistant")
        spec = backend.requests[-1].sampling.constraint
        assert spec.start_in == FORCED_CALL and "thought[max_tokens=2048]" in spec.forced_call
        assert '".get_weather"' in spec.forced_call and "call1" not in spec.forced_call
        msg = r.choices[0].message
        assert (msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments) == \
            ("get_weather", "{\"location\":\"Paris\"}")
        assert msg.model_extra["reasoning_content"] == "Need the weather; call the tool."
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert r.usage.completion_tokens == len(ENC.encode(CALL, allowed_special="all"))
        assert r.usage.prompt_tokens == len(backend.requests[-1].prompt_ids)

    # a request's own limit caps each message before the call at a quarter of it: half is left to the call
    backend.push(CALL)
    client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice="required", max_tokens=203)
    assert "thought[max_tokens=50]" in backend.requests[-1].sampling.constraint.forced_call
    backend.push(CALL)
    client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice="required", max_tokens=3)
    assert "thought" not in backend.requests[-1].sampling.constraint.forced_call  # no room: the call at once

    backend.push(CALL, chunk=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Need the weather; call the tool."
    assert calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == "{\"location\":\"Paris\"}"


def test_required_among_several_tools_leaves_the_model_the_pick(client, backend):
    """tool_choice 'required' with two tools: the engine request's grammar offers both (`.NAME` with its dot, as
    the Harmony tokens spell it), and what the model writes after `to=functions` is that tool's call."""
    from serve_app.harmony.constrain import FORCED_CALL

    tools = TOOLS + [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    written = "<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"q\":\"Rome\"}<|call|>"
    for stream in (False, True):
        backend.push(written, chunk=1)
        r = client.chat.completions.create(model=MODEL, messages=HI, tools=tools, tool_choice="required", stream=stream)
        spec = backend.requests[-1].sampling.constraint
        assert spec.start_in == FORCED_CALL and '".get_weather"' in spec.forced_call and '".search"' in spec.forced_call
        if stream:
            calls = [tc for c in r if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert calls[0].function.name == "search"
            assert "".join(tc.function.arguments or "" for tc in calls) == "{\"q\":\"Rome\"}"
        else:
            call = r.choices[0].message.tool_calls[0]
            assert (call.function.name, call.function.arguments) == ("search", "{\"q\":\"Rome\"}")
            assert r.choices[0].finish_reason == "tool_calls"
            assert r.usage.completion_tokens == len(ENC.encode(written, allowed_special="all"))


def test_allowed_tools_restrict_the_calls_in_both_modes(client, backend):
    """tool_choice allowed_tools (Chat's shape; Responses' in test_openai_responses.py): 'required' keeps every tool
    in the prompt (the same prompt as without it) and holds the output to a call of an allowed one; 'auto' offers
    only the allowed tools and leaves the model free to answer."""
    tools = TOOLS + [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                     for n in ("search", "note")]
    pick = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "note")]
    backend.push(CALL)
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=tools, tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": pick}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    spec, prompt = backend.requests[-1].sampling.constraint, prompt_text(backend)
    assert '".get_weather"' in spec.forced_call and '".note"' in spec.forced_call and '".search"' not in spec.forced_call
    backend.push(ANSWER)
    client.chat.completions.create(model=MODEL, messages=HI, tools=tools)
    assert prompt_text(backend) == prompt
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=tools, tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": pick}})
    assert r.choices[0].message.content == "Hello there! 🦄 How can I help?"
    assert backend.requests[-1].sampling.constraint is None
    prompt = prompt_text(backend)
    assert "type get_weather" in prompt and "type note" in prompt and "type search" not in prompt


def test_sampling_parameters_reach_the_backend(client, backend):
    backend.push(ANSWER)
    client.chat.completions.create(model=MODEL, messages=HI, temperature=0.3, top_p=0.9, seed=7,
                                   max_completion_tokens=100, presence_penalty=0.5, frequency_penalty=-1.25,
                                   extra_body={"top_k": 20, "min_p": 0.05})
    s = backend.requests[-1].sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.top_k, s.min_p) == (0.3, 0.9, 7, 100, 20, 0.05)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.25)
    backend.push(ANSWER)
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=50)
    assert backend.requests[-1].sampling.max_tokens == 50
    backend.push(ANSWER)
    client.chat.completions.create(model=MODEL, messages=HI)  # default: the rest of the context
    sent = backend.requests[-1]
    assert sent.sampling.max_tokens == backend.max_context - len(sent.prompt_ids)
    assert (sent.sampling.temperature, sent.sampling.top_p, sent.sampling.logprobs) == (1.0, 1.0, None)


def test_newer_request_fields_are_accepted(client, backend):
    """`verbosity` and `prompt_cache_retention`, which the openai client sends for OpenAI's own models: accepted,
    the prompt and the answer the same as without them (gpt-oss has no verbosity control; the prefix cache's
    retention is the server's)."""
    backend.push(ANSWER)
    plain = client.chat.completions.create(model=MODEL, messages=HI)
    plain_prompt = backend.requests[-1].prompt_ids
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI, verbosity="high", prompt_cache_retention="in_memory",
                                       prompt_cache_key="k", safety_identifier="s", service_tier="auto")
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert backend.requests[-1].prompt_ids == plain_prompt
    assert (plain.service_tier, r.service_tier) == ("default", "default")  # the one tier it ran in, as asked or not
    backend.push(ANSWER)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, service_tier="flex", stream=True))
    assert len(chunks) > 2 and {c.service_tier for c in chunks} == {"default"}


def test_system_fingerprint_is_the_backends_on_every_completion_object(client, backend):
    """Chat completions, their chunks and text completions carry the app's system_fingerprint (the decode
    deployment's under Serve: test_serve_e2e); an app that was given none reports null."""
    from tests.serve_app.conftest import openai_client, scripted_app
    from tests.serve_app.stub_backend import ScriptedBackend

    backend.push(ANSWER)
    assert client.chat.completions.create(model=MODEL, messages=HI).system_fingerprint is None
    stub = ScriptedBackend(max_context=4096)
    with scripted_app(stub, system_fingerprint="fp_0123456789ab") as server:
        api = openai_client(server.url)
        for _ in range(3):
            stub.push(ANSWER)
        assert api.chat.completions.create(model=MODEL, messages=HI).system_fingerprint == "fp_0123456789ab"
        chunks = list(api.chat.completions.create(model=MODEL, messages=HI, stream=True))
        assert len(chunks) > 2 and {c.system_fingerprint for c in chunks} == {"fp_0123456789ab"}
        assert api.completions.create(model=MODEL, prompt="Hi").system_fingerprint == "fp_0123456789ab"


def test_reasoning_effort_is_rendered(client, backend):
    for effort in ("low", "high"):
        backend.push(ANSWER)
        client.chat.completions.create(model=MODEL, messages=HI, reasoning_effort=effort)
        assert f"\nReasoning: {effort}\n" in prompt_text(backend)
    assert "Current date: 2025-06-28" in prompt_text(backend)


def test_max_tokens_cut_gives_length(client, backend):
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    cut = ENC.encode(ANSWER, allowed_special="all")[:20]
    answer_start = len(cut) - cut[::-1].index(200008)  # after the last <|message|>
    assert 0 < answer_start < 20
    assert r.choices[0].message.content == ENC.decode(cut[answer_start:])
    assert r.choices[0].message.model_extra["reasoning_content"] == "The user greets. Reply briefly."


def test_stop_strings_cut_content_and_abort(client, backend):
    backend.push(ANSWER, chunk=1)
    r = client.chat.completions.create(model=MODEL, messages=HI, stop=["How can", "zzz"])
    assert r.choices[0].message.content == "Hello there! 🦄 " and r.choices[0].finish_reason == "stop"
    assert backend.aborted == [backend.requests[-1].request_id]  # the engine stops generating

    backend.push(ANSWER, chunk=1)  # a stop string split over many tokens, streamed
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stop="there! 🦄", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello "
    assert chunks[-1].choices[0].finish_reason == "stop"

    backend.push(ANSWER)  # stop strings do not apply to reasoning
    r = client.chat.completions.create(model=MODEL, messages=HI, stop=["Reply"])
    assert r.choices[0].message.content == "Hello there! 🦄 How can I help?"


def test_logprobs_cover_answer_tokens(client, backend):
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    answer_ids = ENC.encode("Hello there! 🦄 How can I help?")
    assert len(entries) == len(answer_ids)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "Hello there! 🦄 How can I help?"
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in entries)
    assert all(any(t.logprob == e.logprob and t.bytes == e.bytes for t in e.top_logprobs) for e in entries)
    assert backend.requests[-1].sampling.logprobs == 3

    backend.push(ANSWER, chunk=4)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_invalid_harmony_from_the_model_is_returned_as_content(client, backend):
    backend.push("I forgot the Harmony format entirely.<|return|>")
    r = client.chat.completions.create(model=MODEL, messages=HI)
    assert r.choices[0].message.content == "I forgot the Harmony format entirely."
    backend.push("<|channel|>final<|message|>Fine.<|end|>then junk<|return|>", chunk=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Fine.\n\nthen junk"


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_logprobs_cover_text_recovered_from_a_broken_header(client, backend):
    """Plain text where a Harmony header belongs is returned as content once the parser gives up on it
    (at the end of the output, or after too many header tokens); its tokens keep their logprobs."""
    from serve_app.harmony.parse import MAX_HEADER_TOKENS

    short = "no harmony here"  # cut by max_tokens while still looking like a header
    long = " ".join(["words"] * (MAX_HEADER_TOKENS + 10)) + "<|return|>"  # given up on mid-stream
    for text, max_tokens in ((short, len(ENC.encode(short))), (long, None)):
        for stream in (False, True):
            backend.push(text, chunk=3)
            kwargs = dict(model=MODEL, messages=HI, logprobs=True, top_logprobs=1, max_tokens=max_tokens)
            if stream:
                chunks = list(client.chat.completions.create(**kwargs, stream=True))
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                           for e in c.choices[0].logprobs.content]
            else:
                r = client.chat.completions.create(**kwargs)
                content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
            assert content == text.replace("<|return|>", "")
            assert b"".join(bytes(e.bytes) for e in entries).decode() == content, (text[:20], stream)


def test_structured_output_reaches_the_engine_request_and_the_prompt(client, backend):
    """response_format: the engine request carries the constraint (the final answer's grammar) and the prompt
    ends its developer message with the schema; strict tools add their grammars (a forced strict call's grammar
    holds its arguments to the schema); tool_choice 'none' or a plain text format leave the request unconstrained."""
    from serve_app.harmony.constrain import HarmonySchemaSpec

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "description": "The reply.", "schema": schema}}
    backend.push('<|channel|>final<|message|>{"answer":"hi"}<|return|>')
    r = client.chat.completions.create(model=MODEL, messages=HI, response_format=fmt)
    assert r.choices[0].message.content == '{"answer":"hi"}'
    spec = backend.requests[-1].sampling.constraint
    assert isinstance(spec, HarmonySchemaSpec) and spec.final and spec.tools == () and spec.start_in is None
    assert ('# Response Formats\n\n## reply\n\n// The reply.\n{"type":"object","properties":{"answer":{"type":"string"}},'
            '"required":["answer"]}<|end|><|start|>user') in prompt_text(backend)

    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    backend.push(CALL)
    client.chat.completions.create(model=MODEL, messages=HI, tools=strict + [
        {"type": "function", "function": {"name": "loose", "parameters": {"type": "object", "properties": {}}}}])
    spec = backend.requests[-1].sampling.constraint
    assert spec.final is None and [name for name, _ in spec.tools] == ["get_weather"] and spec.start_in is None
    backend.push(CALL)
    client.chat.completions.create(model=MODEL, messages=HI, tools=strict, tool_choice="required")
    spec = backend.requests[-1].sampling.constraint
    assert spec.start_in == "functions" and '"required": ["location"]' in spec.forced_call  # held to its schema

    for kwargs in (dict(tools=strict, tool_choice="none"), dict(response_format={"type": "text"})):
        backend.push(ANSWER)
        client.chat.completions.create(model=MODEL, messages=HI, **kwargs)
        assert backend.requests[-1].sampling.constraint is None, kwargs
        assert "# Response Formats" not in prompt_text(backend)


def test_prediction_reaches_the_engine_as_draft_tokens_and_usage_counts_them(client, backend):
    # OpenAI's Predicted Outputs: the answer's text becomes draft tokens (engine/speculative.py) behind the final
    # channel's header; the engine's draft totals come back as accepted / rejected prediction tokens.
    expected = tuple(ENC.encode("<|channel|>final<|message|>Hello there! 🦄 How can I help?<|return|>",
                                allowed_special="all"))
    for content in ("Hello there! 🦄 How can I help?",
                    [{"type": "text", "text": "Hello there! 🦄 "}, {"type": "text", "text": "How can I help?"}]):
        backend.push(ANSWER, drafts=(12, 9))
        r = client.chat.completions.create(model=MODEL, messages=HI, prediction={"type": "content", "content": content})
        assert backend.requests[-1].sampling.prediction == expected
        details = r.usage.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (9, 3)
        assert r.choices[0].message.content == "Hello there! 🦄 How can I help?"
    backend.push(ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=HI)
    assert backend.requests[-1].sampling.prediction == ()
    assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_default_max_tokens_caps_requests_that_set_no_limit():
    """ingress.default_max_tokens: chat and responses requests without a limit get it; a request's own limit
    (above it too) stands; /v1/completions keeps OpenAI's 16."""
    import openai

    from serve_app.openai_api.app import create_app
    from tests.serve_app.conftest import LiveServer
    from tests.serve_app.stub_backend import ScriptedBackend

    backend = ScriptedBackend(max_context=4096)
    with LiveServer(create_app(backend, model_name=MODEL, max_context=4096, default_max_tokens=7)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(5):
            backend.push(ANSWER)
        client.chat.completions.create(model=MODEL, messages=HI)
        client.responses.create(model=MODEL, input="Hi")
        client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=300)
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=300)
        client.completions.create(model=MODEL, prompt="Hi")
        assert [r.sampling.max_tokens for r in backend.requests] == [7, 7, 300, 300, 16]


def test_the_reasoning_before_a_forced_call_fits_the_output_limit():
    """Each message before a forced call gets the configured budget, at most a quarter of the request's limit,
    else of the ingress' default_max_tokens; without either, the configured budget."""
    from serve_app.openai_api.generation import IngressConfig

    config = IngressConfig(model_name=MODEL, max_context=4096, forced_call_reasoning_tokens=300)
    assert [config.forced_reasoning_budget(n) for n in (None, 100, 4000)] == [300, 25, 300]
    config = IngressConfig(model_name=MODEL, max_context=4096, default_max_tokens=400, forced_call_reasoning_tokens=300)
    assert [config.forced_reasoning_budget(n) for n in (None, 2000, 3)] == [100, 300, 0]
