"""The engine on a CUDA device: the sampler never synchronises with the host, draws the same tokens as
on the CPU (integer-hashed noise), and a whole engine run on the GPU reproduces the CPU engine.
Skips without an NVIDIA GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.sampler import Sampler, SamplingBatch  # noqa: E402
from model.loader import load_model  # noqa: E402
from tests.engine.engine_testlib import engine_config, random_prompt, request, run_to_end  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 201088

PARAMS = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
          SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.2, min_p=0.05, logprobs=0),
          SamplingParams(temperature=0.6)] * 13  # 65 rows: a decode batch of 64 and one more


def _sample(device: str, params, logits: torch.Tensor):
    batch = SamplingBatch.build(params, list(range(len(params))), [7] * len(params), device)
    return Sampler(VOCAB, device)(logits.to(device), batch)


def test_sampler_makes_no_host_sync():
    for params in (PARAMS, [p for p in PARAMS if p.top_k]):  # mixed paths; the top-k candidate path alone
        logits = torch.randn(len(params), VOCAB, device="cuda")
        _sample("cuda", params, logits)  # warm up allocations
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _sample("cuda", params, logits)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("rows", [slice(None), slice(1, 2)])  # mixed paths; the top-k candidate path alone
def test_gpu_and_cpu_sampler_agree(rows):
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    params = PARAMS[rows]
    logits = logits[rows]
    cpu, gpu = _sample("cpu", params, logits), _sample("cuda", params, logits)
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()


def test_engine_on_gpu_reproduces_the_cpu_engine(tiny_dir):
    reqs = [request(f"g{i}", random_prompt(n, i), SamplingParams(temperature=0.0, max_tokens=m))
            for i, (n, m) in enumerate([(1, 9), (8, 6), (13, 8), (30, 12)])]
    reqs.append(request("s", random_prompt(6, 9), SamplingParams(temperature=0.9, top_k=40, seed=1, max_tokens=9)))
    outputs = []
    for device in ("cpu", "cuda"):
        engine = LLMEngine(load_model(tiny_dir, dtype="float32", device=device, progress=False),
                           engine_config(device=device, max_num_batched_tokens=16))
        for r in reqs:
            engine.add_request(r)
        outputs.append({rid: r["ids"] for rid, r in run_to_end(engine).items()})
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a thread's default device is cuda:0: needs a second GPU")
def test_async_engine_thread_runs_on_the_engine_device(tiny_dir):
    """The engine thread of an engine on cuda:1 has cuda:1 current (Triton launches on the current device)
    and generates what the same engine stepped from this thread generates."""
    import asyncio
    import threading

    from engine.async_engine import AsyncEngine

    device = f"cuda:{torch.cuda.device_count() - 1}"
    torch.cuda.set_device(0)
    r = request("d", random_prompt(12, 4), SamplingParams(temperature=0.0, max_tokens=6))

    def make():
        return LLMEngine(load_model(tiny_dir, dtype="float32", device=device, progress=False),
                         engine_config(device=device, max_num_batched_tokens=16))

    sync = make()
    sync.add_request(r)
    expected = run_to_end(sync)["d"]["ids"]
    engine = AsyncEngine(make())
    seen = []
    done = threading.Event()
    engine._submit(lambda: (seen.append(torch.cuda.current_device()), done.set()))

    async def collect():
        return [t async for d in engine.generate(r) for t in d.token_ids]

    try:
        assert done.wait(10)
        ids = asyncio.run(collect())
    finally:
        engine.shutdown()
    assert seen == [torch.device(device).index]
    assert ids == expected


def test_one_copy_upload_on_the_gpu_gives_back_every_array():
    """engine/step_arrays.upload on CUDA: one pinned buffer, one copy, views with each array's dtype, shape, values."""
    import numpy as np

    from engine.step_arrays import upload

    rng = np.random.default_rng()
    arrays = [rng.integers(-2**40, 2**40, 9), np.zeros(0, dtype=np.int64), rng.integers(0, 2**31 - 1, (5, 3), dtype=np.int32),
              rng.integers(0, 7, 1, dtype=np.int32)]
    got = upload("cuda", arrays)
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # one device buffer
    for a, t in zip(arrays, got):
        assert t.is_cuda and tuple(t.shape) == a.shape and t.data_ptr() % 16 == 0
        assert np.array_equal(t.cpu().numpy(), a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_on_the_gpu_is_torch_argmax(dtype):
    """The sampler's greedy pick (kernels/sampling/argmax_triton.py) against torch.argmax on CUDA: gpt-oss's
    vocabulary and an awkward one, ties across chunks, NaNs, an all -inf row, +inf; replayed in a CUDA graph."""
    from kernels.sampling.argmax_triton import RowArgmax
    from tests.kernels.sampling_common import awkward_rows

    argmax = RowArgmax("cuda")
    for vocab in (VOCAB, 5001):
        for rows in (1, 7, 64):
            x = awkward_rows(rows, vocab, dtype).cuda()
            assert torch.equal(argmax(x), x.argmax(dim=-1))
    x = awkward_rows(5, VOCAB, dtype).cuda()
    graph = torch.cuda.CUDAGraph()
    argmax(x)
    with torch.cuda.graph(graph):
        out = argmax(x)
    for _ in range(3):
        x.copy_(awkward_rows(5, VOCAB, dtype))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1))


def test_a_closed_engine_leaves_nothing_on_the_gpu():
    """A closed engine (FP8 experts, decode graphs captured, a host tier, a request run) is collected and its memory freed, so a
    second engine fits in the same process. Before, DeepGEMM's failed import was cached with its traceback, whose
    frames (the first forward, under graph capture) held the whole engine: 120b's second engine in one process ran
    out of memory (2026-12-05)."""
    import dataclasses
    import gc
    import weakref

    from engine.config import EngineConfig
    from engine.request import GenerateRequest
    from model.config import GptOssConfig

    shapes = GptOssConfig.preset("gpt-oss-20b")
    shapes = dataclasses.replace(shapes, num_hidden_layers=2, layer_types=shapes.layer_types[:2])
    gc.collect()
    before = torch.cuda.memory_allocated()
    config = EngineConfig(device="cuda", max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512,
                          kv_cache_bytes=64 * 2**20, cuda_graphs=True, enable_prefix_caching=True,
                          host_kv_cache_bytes=64 * 2**20)
    engine = LLMEngine.with_random_weights(shapes, config)
    assert torch.cuda.memory_allocated() - before > 2**30  # (2 layers of FP8 experts, embedding, unembedding)
    engine.generate([GenerateRequest("r", list(range(1, 40)), SamplingParams(temperature=0.0, max_tokens=4))])
    ref = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    assert torch.cuda.memory_allocated() - before < 64 * 2**20
