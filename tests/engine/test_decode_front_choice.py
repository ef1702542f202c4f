"""EngineConfig.decode_front on the CPU side: which MoE front single-token decode steps get (kernels/moe/
decode_front_cuda.wanted), what is refused with a clear error, and what a build's outcome does to the model
(engine/model_factory.py: the CUDA front's layers flagged on success; a failed build raises for 'cuda' and falls
back to the Triton front, logged, for 'auto'). The kernel itself runs in tests/kernels/test_decode_front_cuda_gpu.py
and, through the engine, tests/engine/test_e2e_gpu.py."""

import concurrent.futures
import logging

import pytest
import torch

from engine.config import EngineConfig, EngineConfigError
from engine.model_factory import ModelFactoryError, _use_decode_front, build_model
from kernels.moe import decode_front_cuda
from kernels.moe.fp8_experts import Fp8Experts
from model.config import GptOssConfig
from serve_app.config import ServeAppConfig
from tests.serve_app.test_serve_config import serve_run_args

CPU = torch.device("cpu")


def small() -> GptOssConfig:
    return GptOssConfig(num_hidden_layers=2, num_local_experts=4, vocab_size=512, hidden_size=64,
                        intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


def fp8_layers(model) -> list[Fp8Experts]:
    layers = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert len(layers) == 2
    return layers


def test_the_choice_per_setting_and_device():
    for experts in (32, 128):
        assert decode_front_cuda.wanted("cuda", experts, CPU, "fp8")
        assert not decode_front_cuda.wanted("triton", experts, CPU, "fp8")
        assert not decode_front_cuda.wanted("auto", experts, CPU, "fp8")  # auto: never off CUDA
    with pytest.raises(ValueError, match="'auto', 'triton' or 'cuda'"):
        decode_front_cuda.wanted("cluster", 128, CPU, "fp8")
    assert "SM90+ CUDA device" in decode_front_cuda.model_outside_range(128, 2880, 4, CPU)


def test_bad_settings_are_refused_before_any_weight_is_made():
    with pytest.raises(EngineConfigError, match="decode_front must be one of"):
        EngineConfig(decode_front="cluster")
    with pytest.raises(EngineConfigError, match="decode_front='cuda'.*needs device 'cuda'"):
        EngineConfig(decode_front="cuda")
    with pytest.raises(EngineConfigError, match="decode_front='cuda'"):
        EngineConfig(device="cuda", moe_backend="torch", decode_front="cuda")
    EngineConfig(device="cuda", decode_front="cuda")  # accepted (whether the build works is the factory's matter)
    with pytest.raises(ModelFactoryError, match="decode_front must be one of"):
        build_model(small(), "cpu", torch.float32, moe_backend="fp8", random_weights=True, decode_front="x")
    with pytest.raises(ModelFactoryError, match="needs a CUDA device"):
        build_model(small(), "cpu", torch.float32, moe_backend="fp8", random_weights=True, decode_front="cuda")


def test_cpu_models_keep_the_triton_front():
    for choice in ("auto", "triton"):
        model = build_model(small(), "cpu", torch.float32, moe_backend="fp8", random_weights=True, decode_front=choice)
        assert not any(m.cuda_front for m in fp8_layers(model))


def test_a_build_outcome_sets_or_keeps_the_front(caplog):
    model = build_model(small(), "cpu", torch.float32, moe_backend="fp8", random_weights=True, seed=2)
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("nvcc not found"))
    with caplog.at_level(logging.WARNING, logger="engine.model_factory"):
        _use_decode_front(model, "auto", failed)
    assert not any(m.cuda_front for m in fp8_layers(model))
    assert "did not build (RuntimeError: nvcc not found)" in caplog.text and "Triton" in caplog.text
    with pytest.raises(ModelFactoryError, match="decode_front='cuda'.*nvcc not found.*decode_front='triton'"):
        _use_decode_front(model, "cuda", failed)
    built = concurrent.futures.Future()
    built.set_result(object())
    _use_decode_front(model, "auto", built)
    assert all(m.cuda_front for m in fp8_layers(model))


def test_serve_key():
    assert ServeAppConfig.from_args(serve_run_args()).engine_config("cpu").decode_front == "auto"
    cfg = ServeAppConfig.from_args(serve_run_args("decode_front=cuda"))
    assert cfg.engine_config("cuda").decode_front == "cuda"
    assert cfg.engine_config("cpu").decode_front == "auto"  # CPU replicas have no CUDA front to run
    with pytest.raises(ValueError, match="decode_front"):
        ServeAppConfig.from_args(serve_run_args("decode_front=cluster"))
