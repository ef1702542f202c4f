"""Piecewise prefill (engine/prefill_graphs.py) on the CPU: the pieces, padded to a token bucket with
attention eager between them, compose into the model's forward (same hidden states, same K/V written,
padding rows write nothing). The CUDA-graph replay of the same pieces is checked on the GPU
(tests/engine/test_e2e_gpu.py)."""

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, EngineConfigError
from engine.cuda_graphs import CudaGraphError
from engine.prefill_graphs import PrefillGraphs, default_token_buckets
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from kernels.attention import AttentionBatch
from tests.engine.engine_testlib import BLOCK, WINDOW, random_prompt


def test_token_buckets():
    assert default_token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    big = default_token_buckets(16384)
    assert big[-1] == 16384 and big == sorted(set(big))
    assert all(b / a <= 2 for a, b in zip(big, big[1:]))
    assert all(b / a <= 1.34 for a, b in zip(big, big[1:]) if a >= 1024)
    assert default_token_buckets(40) == [16, 32, 40]
    with pytest.raises(CudaGraphError):
        default_token_buckets(0)


def test_config_resolves_prefill_graphs():
    assert not EngineConfig().uses_prefill_graphs
    assert EngineConfig(device="cuda", cuda_graphs=True).uses_prefill_graphs
    assert not EngineConfig(device="cuda", cuda_graphs=True, prefill_graphs=False).uses_prefill_graphs
    assert EngineConfig(device="cuda", cuda_graphs=True, tp_size=2).uses_prefill_graphs  # every rank
    assert EngineConfig(device="cuda", prefill_graphs=True).uses_prefill_graphs
    with pytest.raises(EngineConfigError, match="prefill_graphs=True needs device"):
        EngineConfig(prefill_graphs=True)
    assert EngineConfig(device="cuda", prefill_graphs=True, tp_size=2).uses_prefill_graphs  # asked for: every rank
    with pytest.raises(EngineConfigError, match="true, false or null"):
        EngineConfig(prefill_graphs="yes")


def _runner(model, pages: int = 96) -> tuple[ModelRunner, BlockManager]:
    runner = ModelRunner(model, BLOCK)
    runner.allocate_kv_cache(pages, pages)
    for t in (*runner.kv_cache.k, *runner.kv_cache.v):
        t.fill_(float("nan"))  # a stray write or a read of an unwritten slot shows up
    return runner, BlockManager(BLOCK, WINDOW, pages, pages)


def _schedule(bm: BlockManager, work: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
    out = []
    for seq, n in work:
        bm.allocate(seq, seq.num_computed + n)
        out.append(ScheduledSeq(seq, seq.num_computed, n, is_prefill=n > 1))
    return out


def _finish(scheduled: list[ScheduledSeq], bm: BlockManager) -> None:
    for s in scheduled:
        s.seq.num_computed = s.end
        bm.release_out_of_window(s.seq)


def _assert_same_cache(a: ModelRunner, b: ModelRunner) -> None:
    """Written where the other wrote (NaN, the poison, where it did not), values within fp32 GEMM noise (a
    padded step multiplies more rows at once)."""
    for x, y in zip((*a.kv_cache.k, *a.kv_cache.v), (*b.kv_cache.k, *b.kv_cache.v)):
        assert torch.equal(x.isnan(), y.isnan())
        torch.testing.assert_close(x.nan_to_num(nan=7.0), y.nan_to_num(nan=7.0), rtol=1e-5, atol=1e-5)


def test_pieces_compose_into_the_forward(model):
    """Prompt chunks, a mixed step and a decode step through the padded pieces on one cache, the plain
    forward on another: equal hidden states (fp32, CPU) and equal caches, page for page."""
    plain, bm_plain = _runner(model)
    piecewise, bm_pieces = _runner(model)
    pieces = PrefillGraphs(model, [16, 32, 64])
    prompts = [random_prompt(n, 40 + n) for n in (13, 29, 3)]
    seqs = {name: [Sequence(f"s{i}", p, SamplingParams(), 0, i) for i, p in enumerate(prompts)]
            for name in ("plain", "pieces")}
    steps = [[(0, 13)], [(1, 20)], [(0, 1), (1, 9), (2, 3)], [(0, 1), (1, 1), (2, 1)]]  # 13 -> 16, 20 -> 32, ...
    for step in steps:
        sched_a = _schedule(bm_plain, [(seqs["plain"][i], n) for i, n in step])
        sched_b = _schedule(bm_pieces, [(seqs["pieces"][i], n) for i, n in step])
        a, b = plain.prepare(sched_a), piecewise.prepare(sched_b)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
        model.backend.bind_cache(plain.kv_cache)
        want = model(a.input_ids, a.positions, a.attention)
        model.backend.bind_cache(piecewise.kv_cache)
        assert pieces.serves(b.attention)
        got = pieces.run_eager(b.input_ids, b.positions, b.attention)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        _assert_same_cache(plain, piecewise)
        for s in (sched_a, sched_b):
            _finish(s, bm_plain if s is sched_a else bm_pieces)
        for group in seqs.values():  # decoding sequences need a next token
            for i, n in step:
                seq = group[i]
                if seq.num_computed == seq.num_tokens:
                    seq.output_ids.append(11 + i)
    assert model.backend.graph_slots is None  # run_eager hands the backend's slots back


def test_steps_it_does_not_take(model):
    pieces = PrefillGraphs(model, [16, 32])
    assert not pieces.serves(AttentionBatch.without_cache([5], "cpu"))  # no cache: the reference path
    runner, bm = _runner(model)
    seq = Sequence("a", random_prompt(40, 3), SamplingParams(), 0, 0)
    inputs = runner.prepare(_schedule(bm, [(seq, 40)]))
    assert not pieces.serves(inputs.attention)  # 40 tokens exceed the largest bucket
    with pytest.raises(CudaGraphError, match="40 tokens"):
        pieces.run_eager(inputs.input_ids, inputs.positions, inputs.attention)
    with pytest.raises(CudaGraphError, match="CUDA model"):
        pieces.capture()
