"""engine/memory_budget.py: the activation estimate behind the K/V budget, counted by hand for 120b."""

from __future__ import annotations

import pytest

from engine.memory_budget import (FIXED_BYTES, MARGIN, SAMPLER_COPIES, activation_bytes, kv_budget_bytes,
                                  prefill_bytes_per_token)
from model.config import GptOssConfig

GB = 1e9


def test_prefill_bytes_per_token_of_120b_by_hand():
    c = GptOssConfig.preset("gpt-oss-120b")
    # residual: 6 x 2880 x 2; MoE (the larger stage): 4 rows x (2944 FP8 + 5760 x 2 gate_up + 2944 FP8 + 2880 x 2)
    assert prefill_bytes_per_token(c) == 6 * 2880 * 2 + 4 * (2944 + 11520 + 2944 + 5760)
    # attention is the smaller stage even unsplit: (64 + 16) x 64 x 2 twice plus 64 x 64 x 2
    assert 2 * 80 * 64 * 2 + 64 * 64 * 2 < 4 * (2944 + 11520 + 2944 + 5760)


def test_activation_estimate_grows_with_the_engine_limits_and_shrinks_with_ranks():
    c = GptOssConfig.preset("gpt-oss-120b")
    small = activation_bytes(c, 2048, 64)
    assert activation_bytes(c, 8192, 64) > small and activation_bytes(c, 2048, 512) > small
    assert activation_bytes(c, 8192, 512, tp_size=4, num_local_experts=32) < activation_bytes(c, 8192, 512)
    # 8k-token chunks next to 512 sampled rows of the 201k vocabulary: a few GB, counted term by term
    per_token = 6 * 2880 * 2 + 4 * (2944 + 11520 + 2944 + 5760)
    padding = 128 * 128 * (2944 + 11520 + 2944)
    logits = 512 * (201088 * 2 + 201088 * 4 * SAMPLER_COPIES)
    want = int(MARGIN * (8192 * per_token + padding + logits)) + FIXED_BYTES
    assert activation_bytes(c, 8192, 512) == want
    assert 4 * GB < want < 8 * GB


@pytest.mark.parametrize("free_gb,fraction,need_gb,want_gb", [
    (125, 0.9, 5.4, 112.5),  # 20b-like: the fraction leaves more than the activations need
    (17, 0.9, 5.8, 11.2),  # 120b-like: 10% (1.7 GB) would not hold a large step's activations
    (3, 0.9, 5.0, 0.0),  # nothing left: the engine then reports the pools too small for the model length
])
def test_kv_budget_takes_the_smaller_of_the_fraction_and_what_the_activations_leave(free_gb, fraction, need_gb,
                                                                                     want_gb):
    got = kv_budget_bytes(int(free_gb * GB), fraction, int(need_gb * GB))
    assert got == pytest.approx(want_gb * GB, abs=1)
