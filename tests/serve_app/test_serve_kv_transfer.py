"""KV transfer pieces without a Ray cluster: packing, the receive arena, the payload size bound.

The object-store transport itself runs in test_serve_e2e.py (it needs Ray); the CUDA IPC transport in
test_serve_cuda_ipc.py (it needs a GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.tiny import make_tiny
from serve_app.kv_transfer import (
    ALIGN,
    _Arena,
    join_payload,
    pack_into,
    payload_upper_bound,
    plan_layout,
    split_payload,
    unpack,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_pack_unpack_roundtrip_awkward_shapes(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 1), (19, 3, 7), (99, 2, 64), (0, 8, 64), (989, 1, 5)]
    tensors = [torch.randn(*s, generator=g).to(dtype) for s in shapes]
    specs, total = plan_layout(tensors)
    assert all(s.offset % ALIGN == 0 for s in specs) and total % ALIGN == 0
    assert total >= sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.full((total,), 0xAB, dtype=torch.uint8)
    pack_into(flat, tensors, specs)
    for original, restored in zip(tensors, unpack(flat, specs)):
        assert restored.dtype == dtype and restored.shape == original.shape
        assert torch.equal(restored.view(torch.uint8), original.view(torch.uint8))  # bit-exact


def test_arena_never_overlaps_and_coalesces():
    arena = _Arena(64 * ALIGN, torch.device("cpu"))
    rng = random.Random(0)
    live: dict[int, int] = {}  # offset -> bytes
    for _ in range(2000):
        if live and (rng.random() < 0.45 or len(live) > 20):
            offset = rng.choice(list(live))
            arena.free(offset, live.pop(offset))
        else:
            size = rng.choice([1, ALIGN - 1, ALIGN, 3 * ALIGN + 5, 10 * ALIGN])
            offset = arena.allocate(size)
            if offset is None:  # full: the caller falls back to the object store
                continue
            rounded = -(-size // ALIGN) * ALIGN
            for other, other_size in live.items():
                other_rounded = -(-other_size // ALIGN) * ALIGN
                assert offset + rounded <= other or other + other_rounded <= offset, "slots overlap"
            assert offset + rounded <= 64 * ALIGN
            live[offset] = size
        used = sum(-(-s // ALIGN) * ALIGN for s in live.values())
        assert arena.free_bytes == 64 * ALIGN - used
    for offset, size in list(live.items()):
        arena.free(offset, size)
    assert arena._free == [(0, 64 * ALIGN)]  # back to one block
    assert arena.allocate(64 * ALIGN + 1) is None


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"])
def small_engine(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("kv_tiny")
    make_tiny(folder, vocab_size=997, num_hidden_layers=3, sliding_window=8, dtype="bfloat16")
    return LLMEngine.from_checkpoint(folder, EngineConfig(block_size=4, max_model_len=512, kv_cache_bytes=2**22,
                                                          kv_cache_dtype=request.param))


@pytest.mark.parametrize("prompt_len", [1, 19, 45])  # window 8: all but the first overflow it
def test_exported_payload_fits_the_bound_and_survives_packing(small_engine, prompt_len):
    engine = small_engine
    prompt = [(7 * i + 3) % 997 for i in range(prompt_len)]
    rid = f"r{prompt_len}"
    engine.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0)), prefill_only=True)
    while not engine.step_prefill():
        pass
    payload = engine.export_kv(rid)
    runner = engine.runner
    skeleton, tensors = split_payload(payload)
    specs, total = plan_layout(tensors)
    bound = payload_upper_bound(prompt_len, len(runner.layer_is_sliding), runner.layer_is_sliding,
                                engine.model.config.sliding_window, runner.payload_kv_heads, runner.head_dim, runner.kv_dtype)
    assert total <= bound
    flat = torch.empty(total, dtype=torch.uint8)
    pack_into(flat, tensors, specs)
    restored = join_payload(skeleton, unpack(flat, specs))
    restored.check_compatible(runner.layer_is_sliding, runner.payload_kv_heads, runner.head_dim)
    assert restored.output_ids == payload.output_ids and restored.seed == payload.seed
    assert payload.k[0].dtype == runner.kv_dtype
    for a, b in zip((*payload.k, *payload.v), (*restored.k, *restored.v)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_packed_flat_finds_the_buffer_an_export_target_laid_out():
    """send() copies nothing (peer slot) or one buffer (local) when the payload's tensors sit at the
    layout's offsets in one allocation, and packs tensor by tensor otherwise."""
    from serve_app.kv_transfer import _packed_flat, plan_layout, plan_shapes, unpack

    shapes = [((5, 8, 64), torch.bfloat16), ((3, 8, 64), torch.bfloat16), ((1, 8, 64), torch.bfloat16)]
    specs, total = plan_shapes(shapes)
    backing = torch.zeros(total + 1024, dtype=torch.uint8)
    flat = backing[512:512 + total]
    views = unpack(flat, specs)
    found = _packed_flat(views, specs, total)
    assert found is not None and found.data_ptr() == flat.data_ptr() and found.numel() == total
    separate = [torch.zeros(s, dtype=d) for s, d in shapes]
    assert _packed_flat(separate, *plan_layout(separate)) is None
    shifted = [views[0], views[2], views[1]]  # the right buffer, the wrong order
    assert _packed_flat(shifted, *plan_layout(shifted)) is None
