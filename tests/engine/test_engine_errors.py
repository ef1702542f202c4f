"""Typed errors for bad requests, settings and payloads; the engine keeps serving afterwards."""

import pytest

from engine.config import EngineConfig, EngineConfigError
from engine.kv_payload import KVPayloadError
from engine.llm_engine import LLMEngine
from engine.request import (GenerateRequest, InvalidRequestError, RequestStateError, SamplingParams,
                            UnknownRequestError)
from tests.engine.engine_testlib import VOCAB, greedy, random_prompt, request, run_to_end

BAD_REQUESTS = [
    ("max_tokens", random_prompt(4, 0), SamplingParams(max_tokens=0)),
    ("max_tokens", random_prompt(4, 0), SamplingParams(max_tokens=-3)),
    ("top_p", random_prompt(4, 0), SamplingParams(top_p=0.0)),
    ("top_p", random_prompt(4, 0), SamplingParams(top_p=1.5)),
    ("min_p", random_prompt(4, 0), SamplingParams(min_p=1.0)),
    ("temperature", random_prompt(4, 0), SamplingParams(temperature=-0.1)),
    ("prompt_ids", [], SamplingParams()),
    ("prompt_ids", random_prompt(96, 0), SamplingParams()),  # max_model_len is 96: no room for a token
    ("prompt_ids", [1, VOCAB], SamplingParams()),
    ("prompt_ids", [1, -2], SamplingParams()),
    ("prompt_ids", [1, True], SamplingParams()),  # a bool is not a token id
    ("prompt_ids", [1, 2.0], SamplingParams()),
    ("prompt_ids", "abc", SamplingParams()),
    ("prompt_ids", None, SamplingParams()),
    ("sampling", random_prompt(4, 0), None),
    ("sampling", random_prompt(4, 0), {"max_tokens": 3}),
    # wrong types from Python callers: before typed checks these raised TypeError here, or were accepted and then
    # failed the whole step (StepFailedError) of every request batched with them
    *[(field, random_prompt(4, 0), SamplingParams(**{field: value})) for field, value in [
        ("seed", "x"), ("seed", 1.5), ("seed", True), ("top_k", True), ("top_k", 2**64), ("top_k", 2.0),
        ("stop_token_ids", 5), ("stop_token_ids", ("a",)), ("stop_token_ids", (-1,)), ("logprobs", True),
        ("logprobs", 1.5), ("logprobs", "3"), ("temperature", "x"), ("temperature", None), ("temperature", float("inf")),
        ("temperature", float("nan")), ("top_p", None), ("min_p", "x"), ("max_tokens", True), ("ignore_eos", "yes"),
        ("presence_penalty", True), ("logit_bias", None), ("logit_bias", ((1, 2, 3),)), ("logit_bias", "x"),
        ("logit_bias", ((1, "a"),)), ("prediction", 5), ("prediction", (1, "a"))]],
]


def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving(make_engine, reference_greedy):
    engine = make_engine()
    good = request("good", random_prompt(9, 1), greedy(6))
    engine.add_request(good)
    engine.step()
    for i, (param, prompt, sampling) in enumerate(BAD_REQUESTS):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(GenerateRequest(f"bad{i}", prompt, sampling))
        assert err.value.param == param, (i, str(err.value))
        assert f"bad{i}" not in engine.seqs
    for not_a_request in (None, {"request_id": "d", "prompt_ids": [1]}):
        with pytest.raises(InvalidRequestError, match="expected a GenerateRequest"):
            engine.add_request(not_a_request)
    with pytest.raises(InvalidRequestError, match="already running") as err:
        engine.add_request(request("good", random_prompt(3, 2), greedy(2)))
    assert err.value.param == "request_id"
    after = request("after", random_prompt(5, 3), greedy(4))
    engine.add_request(after)
    out = run_to_end(engine)
    assert out["after"]["ids"] == reference_greedy(after.prompt_ids, 4)
    assert len(out["good"]["ids"]) == 5  # its first token came from the step before the errors


def test_engine_config_errors():
    for kwargs, field in [({"block_size": 0}, "block_size"), ({"max_num_seqs": -1}, "max_num_seqs"),
                          ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
                          ({"num_full_pages": 10}, "num_full_pages"), ({"dtype": "fp8"}, "dtype"),
                          ({"device": "tpu"}, "device"), ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
                          ({"max_model_len": 0}, "max_model_len")]:
        with pytest.raises(EngineConfigError, match=field):
            EngineConfig(**kwargs)


def test_pools_too_small_for_one_sequence(model):
    # max_model_len 96 with pages of 4 needs 24 full pages; a window of 8 needs 3 sliding pages.
    with pytest.raises(EngineConfigError, match="max_model_len"):
        LLMEngine(model, EngineConfig(block_size=4, max_model_len=96, num_full_pages=23, num_sliding_pages=64))
    with pytest.raises(EngineConfigError, match="num_sliding_pages"):
        LLMEngine(model, EngineConfig(block_size=4, max_model_len=96, num_full_pages=24, num_sliding_pages=2))
    with pytest.raises(EngineConfigError, match="max_position_embeddings"):
        LLMEngine(model, EngineConfig(max_model_len=model.config.max_position_embeddings + 1, num_full_pages=1,
                                      num_sliding_pages=1))
    with pytest.raises(EngineConfigError, match="kv_cache_bytes"):
        LLMEngine(model, EngineConfig(max_model_len=4096, kv_cache_bytes=2**16))
    engine = LLMEngine(model, EngineConfig(block_size=4, max_model_len=96, num_full_pages=24, num_sliding_pages=3))
    engine.add_request(request("fits", random_prompt(90, 4), greedy(6)))
    assert len(run_to_end(engine)["fits"]["ids"]) == 6  # the minimum pools do run a max_model_len request


def test_export_and_import_errors(make_engine):
    prefill, decode = make_engine(max_num_batched_tokens=8), make_engine()
    r = request("x", random_prompt(20, 5), greedy(4))
    with pytest.raises(UnknownRequestError):
        prefill.export_kv("x")
    prefill.add_request(r, prefill_only=True)
    prefill.step_prefill()  # 8 of 20 prompt tokens
    with pytest.raises(RequestStateError, match="export after its prefill"):
        prefill.export_kv("x")
    run_to_end(prefill, prefill.step_prefill)
    payload = prefill.export_kv("x")
    with pytest.raises(KVPayloadError, match="does not match"):
        decode.import_prefilled(request("x", random_prompt(20, 6), greedy(4)), payload)
    broken = type(payload)(**{**payload.__dict__, "k": payload.k[:-1]})
    with pytest.raises(KVPayloadError, match="layers"):
        decode.import_prefilled(r, broken)
    short = type(payload)(**{**payload.__dict__, "k": [k[1:] for k in payload.k]})
    with pytest.raises(KVPayloadError, match="shapes"):
        decode.import_prefilled(r, short)
    assert not decode.seqs
    (delta,) = decode.import_prefilled(r, payload)  # the intact payload still works
    assert len(delta.token_ids) == 1
    assert len(run_to_end(decode)["x"]["ids"]) == 3
