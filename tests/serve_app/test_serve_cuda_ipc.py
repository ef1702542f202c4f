"""The CUDA IPC KV transport between two real processes (skipped without a GPU).

The receiving process plays the decode replica (it owns the arena and makes the offer), a spawned
process plays the prefill replica (it maps the arena and writes the K/V into the offered slot). No Ray:
the transport's GPU path does not need it, and GPU hosts may not have it.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import replace

import pytest
import torch

from engine.kv_payload import PrefilledKV
from serve_app.kv_transfer import CudaIpcTransport, payload_upper_bound

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs an NVIDIA GPU")]

LAYERS = [True, False, True, False, True]  # sliding, full, ...
KV_HEADS, HEAD_DIM, WINDOW = 8, 64, 128


def make_payload(request_id: str, prompt_len: int, seed: int, device: str) -> PrefilledKV:
    g = torch.Generator(device=device).manual_seed(seed)
    start = max(0, prompt_len - (WINDOW - 1))
    ks, vs = [], []
    for sliding in LAYERS:
        rows = prompt_len - start if sliding else prompt_len
        ks.append(torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device=device).to(torch.bfloat16))
        vs.append(torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device=device).to(torch.bfloat16))
    return PrefilledKV(request_id, list(range(prompt_len)), [42], [], seed, prompt_len, start, list(LAYERS), ks, vs)


def _prefill_process(offers, answers) -> None:
    transport = CudaIpcTransport("cuda:0", arena_bytes=1)  # the sending side never allocates its arena
    while True:
        job = offers.get()
        if job is None:
            return
        request_id, prompt_len, seed, offer, send_mode = job
        payload = make_payload(request_id, prompt_len, seed, "cuda:0")
        if send_mode.startswith("export_"):  # as the engine exports: rows written into export_target's views
            transport.export_via = send_mode.removeprefix("export_")  # peer: the slot itself; local: a buffer
            tensors = [*payload.k, *payload.v]
            outs = transport.export_target(offer)([tuple(t.shape) for t in tensors], tensors[0].dtype)
            for out, t in zip(outs, tensors):
                out.copy_(t)
            payload = replace(payload, k=outs[:len(payload.k)], v=outs[len(payload.k):])
        handle = transport.send(payload, offer)
        answers.put(handle)


@pytest.fixture(scope="module")
def prefill_process():
    ctx = torch.multiprocessing.get_context("spawn")
    offers, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_process, args=(offers, answers), daemon=True)
    proc.start()
    yield offers, answers
    offers.put(None)
    proc.join(30)


def _decode_devices() -> list:
    two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a second GPU")
    return ["cuda:0", pytest.param("cuda:1", marks=two)]


@pytest.mark.parametrize("decode_device", _decode_devices())
@pytest.mark.parametrize("send_mode", ["per_tensor", "export_peer", "export_local"])
@pytest.mark.parametrize("prompt_len", [1, 127, 989, 4099])
def test_cuda_ipc_moves_kv_into_the_decode_arena(prefill_process, prompt_len, send_mode, decode_device):
    """Prefill on cuda:0; decode on the same GPU, or on a second one (the arena then maps into the
    sender's context as a peer mapping: serve_app/kv_transfer.py, CudaIpcTransport._map_peer)."""
    offers, answers = prefill_process
    decode = CudaIpcTransport(decode_device, arena_bytes=256 * 2**20)
    bound = payload_upper_bound(prompt_len, len(LAYERS), LAYERS, WINDOW, KV_HEADS, HEAD_DIM, torch.bfloat16)
    offer = decode.offer(bound)
    assert offer.kind == "cuda_ipc"
    offers.put((f"r{prompt_len}", prompt_len, prompt_len, offer, send_mode))
    try:
        handle = answers.get(timeout=120)
    except queue.Empty:
        pytest.fail("the prefill process did not answer")
    assert handle.kind == "cuda_ipc" and handle.ref is None  # nothing went through the object store
    payload = asyncio.run(decode.receive(handle, offer, timeout_s=10))
    decode.release(offer)
    assert decode.arena_free_bytes == 256 * 2**20
    expected = make_payload(f"r{prompt_len}", prompt_len, prompt_len, "cuda:0")
    payload.check_compatible(LAYERS, KV_HEADS, HEAD_DIM)
    assert payload.output_ids == [42] and payload.sliding_start == expected.sliding_start
    for got, want in zip((*payload.k, *payload.v), (*expected.k, *expected.v)):
        assert got.device == torch.device(decode_device) and torch.equal(got, want.to(got.device))
    stats = decode.last_stats
    print(f"\ncuda_ipc prompt={prompt_len} ({send_mode}, to {decode_device}): {handle.nbytes} bytes, pack (prefill side) {handle.pack_ms:.3f} ms, "
          f"receive {stats.receive_ms:.3f} ms")


def test_offer_falls_back_when_the_arena_is_full():
    decode = CudaIpcTransport("cuda:0", arena_bytes=4096)
    assert decode.offer(1024).kind == "cuda_ipc"
    assert decode.offer(8192).kind == "object_store"
