"""/v1/responses through the official openai client against a live uvicorn server."""

from __future__ import annotations

import json

import httpx
from openai.types.responses import Response

from serve_app.harmony.encoding import load_harmony_encoding
from tests.serve_app.conftest import MODEL

ENC = load_harmony_encoding()
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"location\":\"Rome\"}<|call|>")
ANSWER = ("<|channel|>analysis<|message|>Tool says sunny.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Sunny in Rome.<|return|>")


def test_forced_function_call(client, backend):
    """tool_choice {'type': 'function', 'name': ...}: the prompt ends as any turn's, the engine request carries the
    forced-call grammar (that function only), the output is the reasoning, the preamble and the call; the input
    token count (POST /v1/responses/input_tokens) is the prompt's."""
    backend.push(CALL)
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert ENC.decode(backend.requests[-1].prompt_ids).endswith("<|start|>assistant")
    spec = backend.requests[-1].sampling.constraint
    assert spec.start_in == "functions" and '".get_weather"' in spec.forced_call
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[2].name == "get_weather" and json.loads(r.output[2].arguments) == {"location": "Rome"}
    assert r.usage.output_tokens == len(ENC.encode(CALL, allowed_special="all"))
    assert r.usage.input_tokens == len(backend.requests[-1].prompt_ids) == client.responses.input_tokens.count(
        model=MODEL, input="Weather in Rome?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}
    ).input_tokens


def test_allowed_tools_in_the_responses_shape(client, backend):
    """{'type': 'allowed_tools', 'mode', 'tools': [{'type': 'function', 'name'}]}: 'required' forces a call of an
    allowed function (the prompt offers every tool), 'auto' offers only the allowed ones."""
    tools = TOOLS + [{"type": "function", "name": "search", "parameters": {"type": "object"}}]
    backend.push(CALL)
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=tools, tool_choice={
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]})
    spec = backend.requests[-1].sampling.constraint
    assert '".get_weather"' in spec.forced_call and '".search"' not in spec.forced_call
    assert "type search" in ENC.decode(backend.requests[-1].prompt_ids)
    assert r.output[-1].name == "get_weather" and r.tool_choice.type == "allowed_tools"
    backend.push(ANSWER)
    client.responses.create(model=MODEL, input="Hi", tools=tools, tool_choice={
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "search"}]})
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "type search" in prompt and "type get_weather" not in prompt


def test_non_stream_function_call_then_answer(client, backend):
    backend.push(CALL)
    first = client.responses.create(model=MODEL, input="Weather in Rome?", instructions="Be brief.", tools=TOOLS)
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    reasoning, preamble, call = first.output
    assert reasoning.content[0].text == "Need the weather."
    assert preamble.content[0].text == "Checking the forecast." and preamble.phase == "commentary"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"location": "Rome"}
    assert first.status == "completed" and first.usage.input_tokens == len(backend.requests[-1].prompt_ids)
    assert first.usage.output_tokens == len(ENC.encode(CALL, allowed_special="all"))
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "# Instructions\n\nBe brief." in prompt and "type get_weather" in prompt

    backend.push(ANSWER)
    follow_up = [{"role": "user", "content": "Weather in Rome?"}] + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "{\"sky\": \"sunny\"}"}]
    second = client.responses.create(model=MODEL, input=follow_up, tools=TOOLS)
    assert second.output_text == "Sunny in Rome." and second.output[-1].phase == "final_answer"
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert ("<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
            "{\"location\":\"Rome\"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary"
            "<|message|>{\"sky\": \"sunny\"}<|end|><|start|>assistant") in prompt


def test_reasoning_round_trips_through_encrypted_content_alone(client, backend):
    """include=["reasoning.encrypted_content"] (OpenAI's stateless pattern, store=false): a client that sends the
    reasoning item back with only its encrypted_content gets the same prompt as one that sends the text."""
    backend.push(CALL)
    first = client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS, store=False,
                                    include=["reasoning.encrypted_content"])
    reasoning, preamble, call = first.output
    assert reasoning.encrypted_content and "Need the weather." not in reasoning.encrypted_content
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    prompts = []
    for sent in (reasoning.model_dump(exclude_none=True),  # the text
                 {"type": "reasoning", "id": reasoning.id, "summary": [],
                  "encrypted_content": reasoning.encrypted_content}):  # the envelope alone
        backend.push(ANSWER)
        client.responses.create(model=MODEL, tools=TOOLS, store=False, input=[
            {"role": "user", "content": "Weather in Rome?"}, sent, preamble.model_dump(exclude_none=True),
            call.model_dump(exclude_none=True), result])
        prompts.append(backend.requests[-1].prompt_ids)
    assert prompts[0] == prompts[1] and "Need the weather." in ENC.decode(prompts[1])

    # another server's encrypted_content cannot be read: the item adds nothing, and is no error
    backend.push(ANSWER)
    client.responses.create(model=MODEL, tools=TOOLS, store=False, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-not-ours=="},
        call.model_dump(exclude_none=True), result])
    assert "Need the weather." not in ENC.decode(backend.requests[-1].prompt_ids)

    backend.push(CALL)  # not asked for: no envelope; streamed: in the reasoning item's output_item.done
    plain = client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS)
    assert plain.output[0].encrypted_content is None
    backend.push(CALL)
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS, stream=True,
                                          include=["reasoning.encrypted_content"]))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert [d.encrypted_content for d in done] == [reasoning.encrypted_content]


TWO_MESSAGES = ("<|channel|>analysis<|message|>Plan it.<|end|>"
                "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is sunny in Rome.<|return|>")


def expected_logprobs(backend, request) -> list[list[tuple[str, float]]]:
    """(token text, logprob) of each message's text tokens, as the scripted backend made them for `request`."""
    from tests.serve_app.stub_backend import ScriptedBackend

    ids = backend.tokens(TWO_MESSAGES)
    entries = ScriptedBackend._logprobs(ids, request)
    message = backend.tokens("<|message|>")[0]
    ends = {backend.tokens(t)[0] for t in ("<|end|>", "<|return|>")}
    starts = [i + 1 for i, t in enumerate(ids) if t == message][1:]  # the two messages after the analysis
    out = []
    for start in starts:
        end = next(i for i in range(start, len(ids)) if ids[i] in ends)
        out.append([(ENC.decode([e.token_id]), e.logprob) for e in entries[start:end]])
    return out


def test_output_text_logprobs_per_message(client, backend):
    """include ["message.output_text.logprobs"] with top_logprobs: each message item's output_text carries the
    logprobs of its own tokens (a preamble and the final answer, deltas spanning both), streamed or not."""
    backend.push(TWO_MESSAGES, chunk=5)
    r = client.responses.create(model=MODEL, input="Weather?", include=["message.output_text.logprobs"],
                                top_logprobs=2)
    assert backend.requests[-1].sampling.logprobs == 2
    messages = [item for item in r.output if item.type == "message"]
    got = [[(lp.token, lp.logprob) for lp in m.content[0].logprobs] for m in messages]
    assert got == expected_logprobs(backend, backend.requests[-1])
    assert "".join(t for t, _ in got[1]) == "It is sunny in Rome."
    assert all(len(lp.top_logprobs) == 2 for m in messages for lp in m.content[0].logprobs)

    backend.push(TWO_MESSAGES, chunk=5)
    events = list(client.responses.create(model=MODEL, input="Weather?", include=["message.output_text.logprobs"],
                                          top_logprobs=1, stream=True))
    want = expected_logprobs(backend, backend.requests[-1])
    done = events[-1].response
    for n, message in enumerate(item for item in done.output if item.type == "message"):
        deltas = [(lp.token, lp.logprob) for e in events if e.type == "response.output_text.delta"
                  and e.item_id == message.id for lp in e.logprobs]
        final = [e for e in events if e.type == "response.output_text.done" and e.item_id == message.id][0]
        assert deltas == [(lp.token, lp.logprob) for lp in final.logprobs] == want[n]
        assert [(lp.token, lp.logprob) for lp in message.content[0].logprobs] == want[n]

    backend.push(TWO_MESSAGES)  # not asked for: none computed, none returned
    plain = client.responses.create(model=MODEL, input="Weather?", top_logprobs=3)
    assert backend.requests[-1].sampling.logprobs is None
    assert all(item.content[0].logprobs == [] for item in plain.output if item.type == "message")


def test_stream_events_in_order(client, backend):
    backend.push(CALL, chunk=2)
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS, stream=True,
                                          reasoning={"effort": "low"}))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 3
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (reasoning, text, args) == ("Need the weather.", "Checking the forecast.", "{\"location\":\"Rome\"}")
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "message", "function_call"]
    assert done.output[2].arguments == args and done.usage.output_tokens == len(ENC.encode(CALL, allowed_special="all"))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[2].item.type == "function_call" and added[2].item.name == "get_weather"
    assert "\nReasoning: low\n" in ENC.decode(backend.requests[-1].prompt_ids)


def test_max_output_tokens_makes_an_incomplete_response(client, backend):
    backend.push(ANSWER)
    r = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.output[-1].status == "incomplete"
    backend.push(ANSWER)
    events = list(client.responses.create(model=MODEL, input="Weather?", max_output_tokens=6, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_body_validates_against_openai_types(server, backend):
    backend.push(CALL)
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "tools": TOOLS}, timeout=30)
    parsed = Response.model_validate(r.json())
    assert parsed.output[2].type == "function_call"
    backend.push(TWO_MESSAGES)  # with logprobs and encrypted reasoning
    r = httpx.post(f"{server.url}/v1/responses", json={
        "model": MODEL, "input": "hi", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "top_logprobs": 2}, timeout=30)
    parsed = Response.model_validate(r.json())
    assert parsed.output[0].encrypted_content and parsed.output[2].content[0].logprobs[0].top_logprobs


def test_newer_request_fields_are_accepted_and_echoed(client, backend):
    """Fields the openai client sends for OpenAI's own models: accepted (no effect on the output here) and echoed
    in the response object, as OpenAI does; the tier echoed is the one it ran in."""
    kwargs = dict(model=MODEL, input="Weather?", max_tool_calls=3, prompt_cache_key="user-42",
                  prompt_cache_retention="24h", safety_identifier="hash-9", service_tier="flex",
                  text={"verbosity": "low"}, top_logprobs=2)
    backend.push(ANSWER)
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and r.output_text == "Sunny in Rome."
    assert (r.max_tool_calls, r.prompt_cache_key, r.prompt_cache_retention, r.safety_identifier, r.service_tier,
            r.text.verbosity, r.top_logprobs) == (3, "user-42", "24h", "hash-9", "default", "low", 2)
    assert r.created_at <= r.completed_at <= r.created_at + 60
    backend.push(ANSWER)
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[0].response.completed_at is None and events[0].response.max_tool_calls == 3
    assert events[-1].type == "response.completed" and events[-1].response.completed_at is not None
    backend.push(ANSWER)
    cut = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=6)
    assert cut.status == "incomplete" and cut.completed_at is None
    assert (cut.text.verbosity, cut.service_tier, cut.max_tool_calls) == ("medium", "default", None)


def test_raw_stream_frames_name_their_events(server, backend):
    backend.push(ANSWER)
    with httpx.stream("POST", f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True},
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [p["type"] for p in payloads] and names[-1] == "response.completed"


def test_text_format_json_schema_constrains_the_final_answer(client, backend):
    from serve_app.harmony.constrain import HarmonySchemaSpec

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    backend.push('<|channel|>final<|message|>{"n":3}<|return|>')
    r = client.responses.create(model=MODEL, input="Count.", text={"format": {"type": "json_schema", "name": "count",
                                                                              "schema": schema, "strict": True}})
    assert r.output_text == '{"n":3}' and r.text.format.type == "json_schema"
    spec = backend.requests[-1].sampling.constraint
    assert isinstance(spec, HarmonySchemaSpec) and spec.final and not spec.tools
    prompt = load_harmony_encoding().decode(backend.requests[-1].prompt_ids)
    assert '<|start|>developer<|message|># Response Formats\n\n## count\n\n{"type":"object"' in prompt


def test_function_tools_are_strict_unless_they_say_otherwise(client, backend):
    """Responses' default is strict (Chat's is not): a tool that leaves `strict` out gets its schema's grammar."""
    params = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    for strict, constrained in ((None, True), (True, True), (False, False)):
        tool = {"type": "function", "name": "search", "parameters": params}
        if strict is not None:
            tool["strict"] = strict
        backend.push("<|channel|>final<|message|>ok<|return|>")
        httpx.post(f"{backend_url(client)}/responses", json={"model": MODEL, "input": "Hi", "tools": [tool]},
                   timeout=30).raise_for_status()
        spec = backend.requests[-1].sampling.constraint
        assert (spec is not None and [n for n, _ in spec.tools] == ["search"]) == constrained, strict


def backend_url(client) -> str:
    return str(client.base_url).rstrip("/")
