"""Every client error is a 4xx in OpenAI's shape, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from engine.request import BackendOverloaded, InvalidRequestError
from serve_app.harmony.encoding import load_harmony_encoding
from tests.serve_app.conftest import MAX_CONTEXT, MODEL

ENC = load_harmony_encoding()
OK = "<|channel|>final<|message|>ok<|return|>"
HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL, "messages": HI}
RESP = {"model": MODEL, "input": "Hi"}


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                      timeout=30, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = "__any__", code: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "__any__":
        assert error["param"] == param, error
    if code != "__any__":
        assert error["code"] == code, error
    return error


def assert_still_serving(client, backend) -> None:
    backend.push(OK)
    assert client.chat.completions.create(model=MODEL, messages=HI).choices[0].message.content == "ok"


def nested_arrays_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def nested_objects_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


CHAT_400 = [
    ("malformed JSON", b'{"model": "gpt-oss-test", "messages": [', None),
    ("not an object", b'[1, 2]', None),
    ("metadata with 17 pairs", {**CHAT, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("NaN is not JSON", b'{"model": "gpt-oss-test", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     None),
    ("Infinity is not JSON", b'{"model": "gpt-oss-test", "messages": [{"role": "user", "content": "x"}], '
                             b'"response_format": {"a": [-Infinity]}}', None),
    ("lone surrogate", b'{"model": "gpt-oss-test", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content"),
    ("lone surrogate in a key", b'{"model": "gpt-oss-test", "messages": [{"role": "user", "content": "x"}], '
                                b'"metadata": {"\\uDC00": "v"}}', "metadata"),
    ("nested deeper than the parser goes", b'{"model": "gpt-oss-test", "metadata": ' + b'[' * 100_000 + b']' * 100_000
     + b'}', None),
    ("nested deeper than the limit", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_arrays_schema(70)}}}, "response_format"),
    ("tool schema deeper than Harmony renders", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nested_objects_schema(64)}}]}, "tools"),
    ("an integer of 5,000 digits", b'{"model": "gpt-oss-test", "messages": [], "seed": ' + b'9' * 5000 + b'}', None),
    ("messages wrong type", {**CHAT, "messages": "hello"}, "messages"),
    ("empty messages", {**CHAT, "messages": []}, "messages"),
    ("bad role", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("temperature wrong type", {**CHAT, "temperature": "hot"}, "temperature"),
    ("temperature out of range", {**CHAT, "temperature": 3.5}, "temperature"),
    ("temperature as a string", {**CHAT, "temperature": "0.5"}, "temperature"),
    ("max_tokens as a boolean", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("max_tokens as a string", {**CHAT, "max_tokens": "5"}, "max_tokens"),
    ("max_tokens as a decimal", {**CHAT, "max_tokens": 5.0}, "max_tokens"),
    ("stream as a string", {**CHAT, "stream": "true"}, "stream"),
    ("stream as a number", {**CHAT, "stream": 1}, "stream"),
    ("seed as a string", {**CHAT, "seed": "7"}, "seed"),
    ("logprobs as a number", {**CHAT, "logprobs": 1}, "logprobs"),
    ("top_p out of range", {**CHAT, "top_p": 0}, "top_p"),
    ("max_tokens zero", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("top_logprobs out of range", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("n above the cap", {**CHAT, "n": 17}, "n"),
    ("n zero", {**CHAT, "n": 0}, "n"),
    ("unknown argument", {**CHAT, "frobnicate": True}, "frobnicate"),
    ("penalty out of range", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("penalty wrong type", {**CHAT, "frequency_penalty": "high"}, "frequency_penalty"),
    ("logit_bias key", {**CHAT, "logit_bias": {"hello": 3}}, "logit_bias"),
    ("logit_bias value", {**CHAT, "logit_bias": {"42": 300}}, "logit_bias"),
    ("response_format type", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("json_schema without an object", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("json_schema name", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
     "response_format"),
    ("json_schema unusable", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}}},
     "response_format.json_schema.schema"),
    ("strict tool schema unusable", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]},
     "tools.0.function.parameters"),
    ("required without tools", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("forced unknown tool", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}},
                             "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("tool_choice shape", {**CHAT, "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ("allowed_tools mode", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": [{"type": "function", "function": {
            "name": "f"}}]}}}, "tool_choice"),
    ("allowed_tools unknown tool", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {
            "name": "g"}}]}}}, "tool_choice"),
    ("too many stops", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("prediction type", {**CHAT, "prediction": {"type": "diff", "content": "x"}}, "prediction.type"),
    ("prediction content", {**CHAT, "prediction": {"type": "content", "content": 42}}, "prediction.content"),
    ("image content", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ("tool schema not object", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ("tool schema properties", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}]},
     "tools.0.function.parameters"),
    ("tool name", {**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ("tool type", {**CHAT, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    ("duplicate tools", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ("unmatched tool result", {**CHAT, "messages": HI + [{"role": "tool", "tool_call_id": "x", "content": "1"}]},
     "messages.1.tool_call_id"),
    ("verbosity", {**CHAT, "verbosity": "loud"}, "verbosity"),
    ("prompt_cache_retention", {**CHAT, "prompt_cache_retention": "1h"}, "prompt_cache_retention"),
]


@pytest.mark.parametrize("case,body,param", CHAT_400, ids=[c[0] for c in CHAT_400])
def test_chat_bad_requests_are_400(server, client, backend, case, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)
    assert not backend.requests  # nothing reached the engine
    assert_still_serving(client, backend)


RESPONSES_400 = [
    ("metadata with 17 pairs", {**RESP, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("metadata value over 512 characters", {**RESP, "metadata": {"k": "v" * 513}}, "metadata"),
    ("metadata key over 64 characters", {**RESP, "metadata": {"k" * 65: "v"}}, "metadata"),
    ("previous_response_id", {**RESP, "previous_response_id": "resp_1"}, "previous_response_id"),
    ("input wrong type", {**RESP, "input": 42}, "input"),
    ("lone surrogate", b'{"model": "gpt-oss-test", "input": "\\udfff"}', "input"),
    ("hosted tool", {**RESP, "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("unknown item", {**RESP, "input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ("bad tool schema", {**RESP, "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools.0.parameters"),
    ("unmatched call output", {**RESP, "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input.0.call_id"),
    ("effort", {**RESP, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("max_output_tokens as a string", {**RESP, "max_output_tokens": "5"}, "max_output_tokens"),
    ("top_p as a string", {**RESP, "top_p": "1"}, "top_p"),
    ("background", {**RESP, "background": True}, "background"),
    ("top_logprobs out of range", {**RESP, "top_logprobs": 21}, "top_logprobs"),
    ("text.format type", {**RESP, "text": {"format": {"type": "xml"}}}, "text.format"),
    ("text.format schema unusable", {**RESP, "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": {"type": "foo"}}}}, "text.format.schema"),
    ("strict tool schema unusable", {**RESP, "tools": [{"type": "function", "name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}]}, "tools.0.parameters"),
    ("allowed_tools hosted tool", {**RESP, "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "mcp", "server_label": "deepwiki"}]}},
     "tool_choice"),
    ("allowed_tools empty", {**RESP, "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": []}}, "tool_choice"),
    ("max_tool_calls negative", {**RESP, "max_tool_calls": -1}, "max_tool_calls"),
    ("max_tool_calls as a string", {**RESP, "max_tool_calls": "3"}, "max_tool_calls"),
    ("text.verbosity", {**RESP, "text": {"verbosity": "terse"}}, "text.verbosity"),
    ("prompt_cache_retention", {**RESP, "prompt_cache_retention": 24}, "prompt_cache_retention"),
]


@pytest.mark.parametrize("case,body,param", RESPONSES_400, ids=[c[0] for c in RESPONSES_400])
def test_responses_bad_requests_are_400(server, client, backend, case, body, param):
    assert_error(post(server, "/v1/responses", body), 400, param)
    assert_still_serving(client, backend)


def test_whole_numbers_pass_for_number_fields(server, backend):
    """Strict JSON types refuse what OpenAI refuses, not what it takes: an integer where a number goes."""
    backend.push(OK)
    r = post(server, "/v1/chat/completions", {**CHAT, "temperature": 1, "top_p": 1, "presence_penalty": 0,
                                              "logit_bias": {"42": 1}})
    assert r.status_code == 200, r.text
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.logit_bias) == (1.0, 1.0, ((42, 1.0),))


def test_schemas_nested_up_to_the_depth_limit_are_served(server, backend):
    """The body's depth limit (errors.MAX_JSON_DEPTH) leaves room for schemas ~30 objects deep, and the schema
    checks, the grammar compiler and the prompt renderer take them without overflowing Python's stack."""
    schema = nested_objects_schema(28)
    for body in ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}]}):
        backend.push(OK)
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text


def test_surrogate_pairs_pass(server, backend):
    """Escaped UTF-16 pairs (how `json.dumps` writes an emoji) are text; only a lone half is refused."""
    backend.push(OK)
    r = post(server, "/v1/chat/completions", b'{"model": "gpt-oss-test", "messages": [{"role": "user", '
                                            b'"content": "hi \\ud83d\\udc4b \\\\ud800"}]}')
    assert r.status_code == 200, r.text
    assert "hi \N{WAVING HAND SIGN} \\ud800" in ENC.decode(backend.requests[-1].prompt_ids)


def test_openai_client_raises_bad_request_with_fields(client, backend):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, n=40)
    assert info.value.status_code == 400 and info.value.param == "n" and "between 1 and 16" in info.value.message
    assert_still_serving(client, backend)


def test_prompt_over_the_context_is_400(server, client, backend):
    long = [{"role": "user", "content": "word " * (MAX_CONTEXT + 10)}]
    for path, body in (("/v1/chat/completions", {**CHAT, "messages": long}),
                       ("/v1/responses", {**RESP, "input": "word " * (MAX_CONTEXT + 10)})):
        err = assert_error(post(server, path, body), 400, code="context_length_exceeded")
        assert str(MAX_CONTEXT) in err["message"]
    err = assert_error(post(server, "/v1/chat/completions", {**CHAT, "max_tokens": MAX_CONTEXT}), 400,
                       param="max_tokens", code="context_length_exceeded")
    assert "at most" in err["message"]
    assert_still_serving(client, backend)


def test_text_the_tokenizer_would_stall_on_is_400(server, client, backend):
    """A run of 1,000,000 letters made openai-harmony's tokenizer panic (HTTP 500) and 200,000 held the ingress'
    event loop for 14 s on this CPU (serve_app/harmony/text_limits.py; this server takes bodies of 256 KiB): each
    field that is tokenized is checked."""
    run = "x" * 200_000
    cases = [("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": run}]}, "messages"),
             ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": "\n" * 40_000}] + HI},
              "messages"),
             ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f",
                                                                                          "description": run}}]}, "tools"),
             ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "-" * 40_000}},
              "prediction"),
             ("/v1/responses", {**RESP, "input": run}, "input"),
             ("/v1/responses", {**RESP, "instructions": "é" * 20_000}, "input"),
             ("/v1/completions", {"model": MODEL, "prompt": ["ok", run]}, "prompt")]
    for path, body, param in cases:
        err = assert_error(post(server, path, body), 400, param)
        assert "unbroken run" in err["message"]
    assert not backend.requests
    assert_still_serving(client, backend)


def test_unknown_model_is_404(server, client, backend):
    for path, body in (("/v1/chat/completions", {**CHAT, "model": "gpt-5"}), ("/v1/responses", {**RESP, "model": "gpt-5"})):
        assert_error(post(server, path, body), 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert_still_serving(client, backend)


def test_oversized_body_is_413(server, client, backend):
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_error(post(server, "/v1/chat/completions", huge), 413)

    def chunked():  # no Content-Length: the limit applies while reading
        yield json.dumps(huge).encode()

    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunked(), timeout=30)
    assert_error(r, 413)
    assert_still_serving(client, backend)


def test_engine_refusal_is_400(server, client, backend):
    backend.push(OK, error=InvalidRequestError("top_k is too large for this engine", "top_k"))
    assert_error(post(server, "/v1/chat/completions", {**CHAT, "stream": True}), 400, param="top_k")
    assert_still_serving(client, backend)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True}),
                                       ("/v1/responses", {**RESP, "stream": True}),
                                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})])
def test_a_full_backend_queue_is_503_with_retry_after_before_any_stream(server, client, backend, path, body):
    backend.push(OK, error=BackendOverloaded("decode queue full: 9 waiting"))
    r = post(server, path, body)
    error = assert_error(r, 503, code="server_overloaded")
    assert r.headers["retry-after"] == "1" and "decode queue full: 9 waiting" in error["message"]
    assert_still_serving(client, backend)


def test_the_openai_client_retries_an_overloaded_answer(server, client, backend):
    backend.push(OK, error=BackendOverloaded("decode queue full"))
    backend.push(OK)
    retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=1, timeout=30)
    assert retrying.chat.completions.create(model=MODEL, messages=HI).choices[0].message.content == "ok"
    assert len(backend.requests) == 2


def test_engine_failure_is_503_or_a_stream_error_event(server, client, backend):
    backend.push(OK, fail_after=0)
    assert_error(post(server, "/v1/chat/completions", CHAT), 503)
    backend.push("<|channel|>final<|message|>partial answer then crash<|return|>", chunk=2, fail_after=2)
    with pytest.raises(openai.APIError, match="engine failed"):
        for _ in client.chat.completions.create(model=MODEL, messages=HI, stream=True):
            pass
    backend.push("<|channel|>final<|message|>partial answer then crash<|return|>", chunk=2, fail_after=2)
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    assert events[-1].type == "error" and "engine failed" in events[-1].message
    assert_still_serving(client, backend)


def test_unknown_path_and_method_are_shaped(server, client, backend):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.put(f"{server.url}/v1/chat/completions"), 405)  # (GET lists stored chat completions)
    assert_still_serving(client, backend)


def test_answers_carry_their_id_as_x_request_id(server, client, backend):
    """The body's id in the `x-request-id` header (OpenAI's answers carry one; the openai client exposes it
    as `_request_id`), streamed or not; the engine request id is the same (or `<id>-<choice>` for n > 1).
    Under Serve the proxy's id is the header instead (test_serve_e2e)."""
    backend.push(OK)
    completion = client.chat.completions.create(model=MODEL, messages=HI)
    assert completion._request_id == completion.id == backend.requests[-1].request_id
    backend.push(OK)
    backend.push(OK)
    two = client.chat.completions.create(model=MODEL, messages=HI, n=2)
    assert two._request_id == two.id and {r.request_id for r in backend.requests[-2:]} == {f"{two.id}-0", f"{two.id}-1"}
    for path, body in (("/v1/chat/completions", {**CHAT, "stream": True}), ("/v1/responses", {**RESP, "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True}),
                       ("/v1/responses", RESP), ("/v1/completions", {"model": MODEL, "prompt": "Hi"})):
        backend.push(OK)
        r = post(server, path, body)
        assert r.status_code == 200 and r.headers["x-request-id"] == backend.requests[-1].request_id, path
        first = json.loads(next(line for line in r.text.splitlines() if line.startswith("data: "))[6:]) \
            if body.get("stream") else r.json()
        assert (first.get("response") or first)["id"] == r.headers["x-request-id"], path
    # a request that brings its own (a proxy's, Serve's) is not given a second one
    backend.push(OK)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-7"}, timeout=30)
    assert r.status_code == 200 and "x-request-id" not in r.headers
    # answers the app does not generate (refusals, lists, /health) get a fresh one each, unless the request had one
    answers = [post(server, "/v1/chat/completions", {**CHAT, "temperature": 9}), httpx.get(f"{server.url}/v1/nothing"),
               httpx.get(f"{server.url}/v1/models"), httpx.get(f"{server.url}/health")]
    assert [r.status_code for r in answers] == [400, 404, 200, 200]
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids), ids
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HI, temperature=9)
    assert refused.value.request_id.startswith("req_")
    r = httpx.get(f"{server.url}/v1/models", headers={"x-request-id": "trace-8"})
    assert r.status_code == 200 and "x-request-id" not in r.headers
