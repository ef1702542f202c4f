"""The rotary embedding's precomputed cos / sin table (RotaryEmbedding(precompute=True), the default on CUDA):
the same bits as computing them from the positions, and what the model does with them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import layers
from model.config import GptOssConfig
from model.gpt_oss import RotaryEmbedding


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_table_rows_are_bitwise_the_computed_values(preset):
    config = dataclasses.replace(GptOssConfig.preset(preset), max_position_embeddings=8192)
    table, computed = RotaryEmbedding(config, precompute=True), RotaryEmbedding(config, precompute=False)
    assert table.cos_sin.shape == (8192, 2, config.head_dim // 2) and computed.cos_sin is None
    positions = torch.cat([torch.tensor([0, 1, 4095, 4096, 8191]), torch.randint(0, 8192, (200,))])
    for got, want in zip(table(positions), computed(positions)):
        assert got.shape == want.shape and torch.equal(got, want)
    assert all(t.shape == (0, config.head_dim // 2) for t in table(positions[:0]))
    assert "cos_sin" not in table.state_dict()  # derived, never saved or loaded


def test_cpu_models_keep_computing_and_the_rotary_takes_table_views():
    config = dataclasses.replace(GptOssConfig.preset("gpt-oss-20b"), max_position_embeddings=1024)
    assert RotaryEmbedding(config).cos_sin is None  # default: the table on CUDA only
    rot = RotaryEmbedding(config, precompute=True)
    positions = torch.randint(0, 1024, (9,))
    cos, sin = rot(positions)
    assert cos.stride(0) == config.head_dim and not cos.is_contiguous()  # row views of the gathered rows
    qkv = torch.randn(9, (4 + 2 * 2) * config.head_dim).bfloat16()
    got = layers.rotary_qkv(qkv, cos, sin, 4, 2, config.head_dim)
    want = layers.rotary_qkv(qkv, *RotaryEmbedding(config, precompute=False)(positions), 4, 2, config.head_dim)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_table_is_bitwise_the_gpu_computation_and_feeds_the_kernel():
    config = GptOssConfig.preset("gpt-oss-20b")
    table = RotaryEmbedding(config, device="cuda")
    computed = RotaryEmbedding(config, device="cuda", precompute=False)
    assert table.cos_sin is not None and table.cos_sin.shape[0] == config.max_position_embeddings
    positions = torch.cat([torch.tensor([0, 131071]), torch.randint(0, 131072, (300,))]).cuda()
    views, values = table(positions), computed(positions)
    assert all(torch.equal(a, b) for a, b in zip(views, values))
    qkv = torch.randn(302, 80 * 64, device="cuda").bfloat16()
    got = layers.rotary_qkv(qkv, *views, 64, 8, 64)
    want = layers.rotary_qkv(qkv, *values, 64, 8, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
