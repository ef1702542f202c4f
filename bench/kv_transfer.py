"""Benchmark: K/V hand-off prefill -> decode over CUDA IPC vs. staging through host memory (one GPU node).

    python -m bench.kv_transfer [--prompts 1024,8192,32768] [--json out.json]
    python -m bench.kv_transfer --prefill-device cuda:0 --decode-device cuda:1 [--send-modes per_tensor,sm_copy]
    (across GPUs, 2x H200 NV18, 2026-11-30: sends of 292.5 / 1,156.5 MiB in 1.15 / 3.74 ms with the arena
    mapped in the sender's context, 10-35 GB/s before; bench/results/kv_transfer_h200x2*.json)

Payloads have gpt-oss-120b's K/V shapes (36 layers alternating sliding/full, 8 KV heads x 64, bf16; the
sliding layers carry only their last 127 tokens). A spawned process plays the prefill replica: it packs
the payload into the decode process's CUDA IPC arena (`send`, timed there); this process plays the
decode replica (`receive`: copy out of the arena). The host-staging column is what the object-store
transport needs at least on GPUs: pinned device-to-host plus host-to-device copies of the same bytes
(without Ray's own copy into the object store); the peer column is one in-process copy of the same bytes
between the two devices (the ceiling of the send; with peer access off the driver stages it through
the host). Needs an NVIDIA GPU; no Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl

from engine.kv_payload import PrefilledKV
from serve_app.kv_transfer import CudaIpcTransport, KVHandle, payload_upper_bound

LAYERS = [i % 2 == 0 for i in range(36)]
KV_HEADS, HEAD_DIM, WINDOW = 8, 64, 128


def make_payload(prompt_len: int, device: str) -> PrefilledKV:
    """The same values on any CUDA device (Philox draws from a fixed seed), so the receiver can check them."""
    g = torch.Generator(device=device).manual_seed(prompt_len)
    start = max(0, prompt_len - (WINDOW - 1))
    ks, vs = [], []
    for sliding in LAYERS:
        rows = prompt_len - start if sliding else prompt_len
        ks.append(torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16))
        vs.append(torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16))
    return PrefilledKV("bench", list(range(prompt_len)), [1], [], 0, prompt_len, start, list(LAYERS), ks, vs)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    """dst[:n_words] = src[:n_words] (int64 words), grid-strided: for sm_copy only (a peer GPU's memory
    mapped into this process as dst, written by this GPU's SMs over NVLink)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    for base in range(start, n_words, tl.num_programs(0).to(tl.int64) * BLOCK):
        idx = base + tl.arange(0, BLOCK)
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=idx < n_words), mask=idx < n_words)


def copy_bytes(src: torch.Tensor, dst: torch.Tensor, block: int = 2048) -> None:
    """Copy equal-length, 8-byte aligned uint8 tensors with 4 programs per SM of src's GPU."""
    n = src.numel() // 8
    programs = 4 * torch.cuda.get_device_properties(src.device).multi_processor_count
    with torch.cuda.device(src.device):
        _copy_kernel[(max(1, min(programs, triton.cdiv(n, block))),)](
            src.view(torch.int64), dst.view(torch.int64), n, BLOCK=block, num_warps=8)


def sm_copy_send(transport: CudaIpcTransport, payload: PrefilledKV, offer) -> KVHandle:
    """Packed into one buffer on this GPU, then a copy kernel on this GPU stores it into the peer's slot
    (SM stores over NVLink) instead of the copy engine (bench only: measured slower, 2026-11-30)."""
    from serve_app.kv_transfer import ALIGN, pack_into, plan_layout, split_payload

    t0 = time.perf_counter()
    skeleton, tensors = split_payload(payload)
    specs, total = plan_layout(tensors)
    slot = transport._map_peer(offer)[offer.slot_offset: offer.slot_offset + total]
    staging = torch.empty(total, dtype=torch.uint8, device=transport.device)
    pack_into(staging, tensors, specs)
    slot[:ALIGN].copy_(staging[:ALIGN])  # a copy_ across the two GPUs enables peer access in this process
    copy_bytes(staging, slot)
    torch.cuda.synchronize(transport.device)
    torch.cuda.synchronize(slot.device)
    return KVHandle("cuda_ipc", skeleton, specs, total, (time.perf_counter() - t0) * 1e3)


def paged_copy(payload: PrefilledKV, block: int = 16) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The payload's rows scattered into fresh paged caches (one per K/V tensor, slots shuffled per layer
    kind), so that an export gathers them back: (caches, slots per tensor)."""
    from kernels.attention.kv_rows import scatter_rows

    tensors = [*payload.k, *payload.v]
    device = tensors[0].device
    rows = max(t.shape[0] for t in tensors)
    blocks = -(-rows // block) + 4
    by_rows = {n: torch.randperm(blocks * block, device=device)[:n] for n in {t.shape[0] for t in tensors}}
    caches = [torch.zeros(blocks, block, *t.shape[1:], dtype=t.dtype, device=device) for t in tensors]
    slots = [by_rows[t.shape[0]] for t in tensors]
    scatter_rows(caches, slots, tensors, [0] * len(tensors))
    return caches, slots


def export_send(transport: CudaIpcTransport, payload: PrefilledKV, offer, paged) -> KVHandle:
    """As the prefill engine and server do it: gather the rows out of the pages into export_target's
    tensors (kernels/attention/kv_rows.py), then send."""
    from kernels.attention.kv_rows import gather_rows

    caches, slots = paged
    t0 = time.perf_counter()
    tensors = [*payload.k, *payload.v]
    outs = transport.export_target(offer)([tuple(t.shape) for t in tensors], tensors[0].dtype)
    gather_rows(caches, slots, outs)
    torch.cuda.synchronize(transport.device)
    n = len(payload.k)
    handle = transport.send(replace(payload, k=outs[:n], v=outs[n:]), offer)
    return replace(handle, pack_ms=(time.perf_counter() - t0) * 1e3)


def _prefill_side(device: str, jobs, results) -> None:
    transport = CudaIpcTransport(device, arena_bytes=1)
    while (job := jobs.get()) is not None:
        prompt_len, offer, repeats, mode = job
        payload = make_payload(prompt_len, device)
        times, handle, error = [], None, None
        paged = None
        if mode.startswith("export_"):
            transport.export_via = mode.removeprefix("export_")
            paged = paged_copy(payload)
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                if paged is not None:
                    handle = export_send(transport, payload, offer, paged)
                else:
                    send = sm_copy_send if mode == "sm_copy" else CudaIpcTransport.send
                    handle = send(transport, payload, offer)  # pack into the peer's slot + synchronize
                times.append((time.perf_counter() - t0) * 1e3)
        except Exception as err:  # noqa: BLE001 - a mode the platform cannot do is reported, not fatal
            error = f"{type(err).__name__}: {err}"
        peer = torch.cuda.can_device_access_peer(torch.device(device).index or 0, offer_device_index(offer))
        results.put((handle, times, error, peer))


def offer_device_index(offer) -> int:
    from serve_app.kv_transfer import _local_index_of

    return _local_index_of(offer.gpu_uuid) or 0


def host_staging_ms(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def peer_copy(src_device: str, dst_device: str, nbytes: int, repeats: int) -> dict:
    """The plain in-process copy of one buffer between the two GPUs (the ceiling of the IPC send) and
    whether the driver reports peer access: without it copies are staged through the host."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        times.append((time.perf_counter() - t0) * 1e3)
    a, b = torch.device(src_device), torch.device(dst_device)
    same = (a.index or 0) == (b.index or 0)
    return {"peer_access": True if same else torch.cuda.can_device_access_peer(a.index or 0, b.index or 0),
            "peer_copy_ms": min(times), "peer_copy_GBps": nbytes / min(times) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="1024,8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--send-modes", default="per_tensor",
                        help="comma list of per_tensor (each layer's K and V copied into the slot: what send "
                             "does), sm_copy (packed on the prefill GPU, crossing by a copy kernel's stores), "
                             "export_peer / export_local (rows gathered out of paged caches as the engine exports: "
                             "into the slot itself, or into a local buffer sent in one copy; CudaIpcTransport.export_via)")
    parser.add_argument("--prefill-device", default="cuda:0", help="where the prefill side's K/V lives")
    parser.add_argument("--decode-device", default="cuda:0",
                        help="where the decode side's arena lives (another GPU: the hand-off crosses NVLink)")
    args = parser.parse_args()
    ctx = torch.multiprocessing.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_side, args=(args.prefill_device, jobs, results), daemon=True)
    proc.start()
    prompts = [int(p) for p in args.prompts.split(",")]
    bounds = [payload_upper_bound(p, len(LAYERS), LAYERS, WINDOW, KV_HEADS, HEAD_DIM, torch.bfloat16) for p in prompts]
    decode = CudaIpcTransport(args.decode_device, arena_bytes=max(bounds) + 2**20)
    rows = []
    modes = args.send_modes.split(",")
    for prompt_len, bound in zip(prompts, bounds):
        for mode in modes:
            offer = decode.offer(bound)
            jobs.put((prompt_len, offer, args.repeats, mode))
            handle, send_ms, error, sender_peer = results.get(timeout=300)
            if handle is None:
                decode.release(offer)
                rows.append({"prompt_tokens": prompt_len, "send_mode": mode, "error": error})
                print(f"{prompt_len} {mode}: {error}")
                continue
            receive_ms = []
            for _ in range(args.repeats):
                got = asyncio.run(decode.receive(handle, offer, timeout_s=30))
                torch.cuda.synchronize()
                receive_ms.append(decode.last_stats.receive_ms)
            decode.release(offer)
            want = make_payload(prompt_len, args.decode_device)
            exact = all(torch.equal(a, b) for a, b in zip((*got.k, *got.v), (*want.k, *want.v)))
            ipc_ms = min(send_ms) + min(receive_ms)
            rows.append({"prompt_tokens": prompt_len, "send_mode": mode, "bytes": handle.nbytes,
                         "cuda_ipc_send_ms": min(send_ms), "cuda_ipc_receive_ms": min(receive_ms),
                         "cuda_ipc_total_ms": ipc_ms, "cuda_ipc_GBps": handle.nbytes / ipc_ms / 1e6,
                         "sender_peer_access": sender_peer, "error": error, "exact": exact,
                         "host_staging_ms": host_staging_ms(handle.nbytes, args.repeats),
                         **peer_copy(args.prefill_device, args.decode_device, handle.nbytes, args.repeats)})
    jobs.put(None)
    proc.join(30)
    done = [r for r in rows if "bytes" in r]
    print(f"peer access {args.prefill_device} -> {args.decode_device}: {done[0]['peer_access'] if done else '?'}")
    print(f"{'prompt':>7} {'mode':>10} {'MiB':>8} {'ipc send':>9} {'ipc recv':>9} {'ipc GB/s':>9} {'host stage':>10} "
          f"{'peer GB/s':>9} {'exact':>5}  (ms, best of {args.repeats})")
    for r in done:
        print(f"{r['prompt_tokens']:>7} {r['send_mode']:>10} {r['bytes'] / 2**20:>8.1f} {r['cuda_ipc_send_ms']:>9.2f} "
              f"{r['cuda_ipc_receive_ms']:>9.2f} {r['cuda_ipc_GBps']:>9.1f} {r['host_staging_ms']:>10.2f} "
              f"{r['peer_copy_GBps']:>9.1f} {str(r['exact']):>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "prefill_device": args.prefill_device,
                       "decode_device": args.decode_device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
