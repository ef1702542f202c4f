"""/v1/completions (raw text) through the official openai client against a live uvicorn server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion

from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.openai_api.completions import RAW_STOP_TOKEN_IDS
from tests.serve_app.conftest import MAX_CONTEXT, MODEL

ENC = load_harmony_encoding()
RENDERED = "<|start|>user<|message|>Hi!<|end|><|start|>assistant"
OUT = "<|channel|>final<|message|>Grüße, 🦄 world!<|return|>"


def ids(text: str) -> list[int]:
    return ENC.encode(text, allowed_special="all")


def test_text_prompt_is_encoded_with_special_tokens_and_output_keeps_them_but_not_the_end(client, backend):
    backend.push(OUT)
    r = client.completions.create(model=MODEL, prompt=RENDERED, max_tokens=100)
    sent = backend.requests[-1]
    assert sent.prompt_ids == ids(RENDERED)  # <|start|> etc. became the special tokens
    assert sent.sampling.stop_token_ids == RAW_STOP_TOKEN_IDS and not sent.sampling.ignore_eos
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "<|channel|>final<|message|>Grüße, 🦄 world!"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].logprobs is None
    assert r.usage.prompt_tokens == len(ids(RENDERED))
    assert r.usage.completion_tokens == len(ids(OUT))  # the end token counts, as the engine generated it


def test_default_max_tokens_is_16_and_length_finish(client, backend):
    backend.push("word " * 40)
    r = client.completions.create(model=MODEL, prompt="Count:")
    assert backend.requests[-1].sampling.max_tokens == 16
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert r.choices[0].text == ENC.decode(ids("word " * 40)[:16])


def test_token_id_prompts_several_prompts_n_and_echo(client, backend):
    first, second = ids("One two"), ids("Three")
    for k in range(4):
        backend.push(f" out{k}<|endoftext|>", chunk=1)
    r = client.completions.create(model=MODEL, prompt=[first, second], n=2, echo=True, seed=5, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    sent = backend.requests[-4:]
    assert [q.prompt_ids for q in sent] == [first, first, second, second]
    assert [q.sampling.seed for q in sent] == [5, 6, 5, 6]  # completion j of a prompt draws from seed + j
    texts = sorted(c.text for c in r.choices)
    assert [t.split(" out")[0] for t in texts] == ["One two", "One two", "Three", "Three"]
    assert all(c.finish_reason == "stop" and "<|endoftext|>" not in c.text for c in r.choices)
    assert r.usage.prompt_tokens == len(first) + len(second)  # each prompt once, not once per completion
    assert r.usage.completion_tokens == sum(len(ids(f" out{k}<|endoftext|>")) for k in range(4))


def test_stream_rebuilds_the_text_and_ends_with_usage_and_done(server, backend):
    assert any("\ufffd" in ENC.decode([t], errors="replace") for t in ids(OUT))  # a character split over tokens
    backend.push(OUT, chunk=1)  # one token per delta
    body = {"model": MODEL, "prompt": RENDERED, "max_tokens": 100, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(ch.keys() == {"index", "text", "logprobs", "finish_reason"} for ch in choices)
    text = "".join(ch["text"] for ch in choices)
    assert text == "<|channel|>final<|message|>Grüße, 🦄 world!"
    assert all("\ufffd" not in ch["text"] for ch in choices)  # no character split between chunks
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["stop"]
    assert choices[-1]["finish_reason"] == "stop"
    # OpenAI's type wants a finish_reason, which a stream sends in a choice's last chunk only: check that one
    # and the usage chunk against it strictly
    Completion.model_validate(chunks[-2])
    usage = Completion.model_validate(chunks[-1])
    assert usage.choices == [] and usage.usage.completion_tokens == len(ids(OUT))


def test_stop_strings_cut_the_text_stream_and_not(client, backend):
    for _ in range(2):
        backend.push("alpha beta STOP gamma", chunk=1)
    r = client.completions.create(model=MODEL, prompt="x", stop=["STOP"], max_tokens=50)
    assert r.choices[0].text == "alpha beta " and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="x", stop="STOP", max_tokens=50, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "alpha beta "


def test_logprobs_in_the_legacy_shape(client, backend):
    backend.push("Hello world<|return|>", chunk=2)
    r = client.completions.create(model=MODEL, prompt="x", logprobs=2, max_tokens=10)
    lp = r.choices[0].logprobs
    generated = ids("Hello world")
    assert lp.tokens == [ENC.decode([t]) for t in generated]
    assert len(lp.token_logprobs) == len(generated) and all(v < 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [len(ENC.decode(generated[:i])) for i in range(len(generated))]
    assert backend.requests[-1].sampling.logprobs == 2


def test_ignore_eos_goes_to_the_engine_and_keeps_generating(client, backend):
    backend.push("a<|return|>b<|return|>c", chunk=1)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"ignore_eos": True})
    assert backend.requests[-1].sampling.ignore_eos
    assert r.choices[0].text == "a<|return|>b<|return|>c" and r.choices[0].finish_reason == "length"


def stream_frames(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_the_requests_of_vllm_and_sglang_benchmark_clients(server, backend):
    """The bodies `vllm bench serve` (completions and chat backends) and SGLang's `bench_serving` send, field
    for field, with --ignore-eos: streamed with usage, exactly max_tokens generated past the end tokens."""
    script = "Hi<|return|>" * 20
    vllm_completions = {"model": MODEL, "prompt": "The quick brown fox", "repetition_penalty": 1.0, "max_tokens": 12,
                        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sglang_completions = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0.0, "best_of": 1,
                          "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True},
                          "ignore_eos": True}
    vllm_chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                 "max_completion_tokens": 12, "stream": True, "stream_options": {"include_usage": True},
                 "ignore_eos": True}
    for path, body in (("/v1/completions", vllm_completions), ("/v1/completions", sglang_completions),
                       ("/v1/chat/completions", vllm_chat)):
        backend.push(script, chunk=2)
        chunks = stream_frames(server, path, body)
        assert backend.requests[-1].sampling.ignore_eos and backend.requests[-1].sampling.max_tokens == 12
        assert chunks[-1]["usage"]["completion_tokens"] == 12, path
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finishes == ["length"], path
        if path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ENC.decode(ids(script)[:12])


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "max_tokens": MAX_CONTEXT}, "max_tokens"),
    ({"prompt": list(range(MAX_CONTEXT))}, "prompt"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
])
def test_bad_requests_are_400_with_the_field_named(server, backend, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert not backend.requests  # refused before the engine saw it


def test_unknown_model_is_404(client, backend):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
