"""Benchmark: K/V hand-off prefill -> decode over CUDA IPC vs. staging through host memory (one GPU node).

    python -m bench.kv_transfer [--prompts 1024,8192,32768] [--json out.json]
    python -m bench.kv_transfer --prefill-device cuda:0 --decode-device cuda:1   (across GPUs: 28-34 GB/s on
    2x H200 NV18 at 8k-32k tokens, 2026-11-30, bench/results/kv_transfer_h200x2.json)

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

import torch

from engine.kv_payload import PrefilledKV
from serve_app.kv_transfer import CudaIpcTransport, payload_upper_bound

LAYERS = [i % 2 == 0 for i in range(36)]
KV_HEADS, HEAD_DIM, WINDOW = 8, 64, 128


def make_payload(prompt_len: int, device: str) -> PrefilledKV:
    start = max(0, prompt_len - (WINDOW - 1))
    ks, vs = [], []
    for sliding in LAYERS:
        rows = prompt_len - start if sliding else prompt_len
        ks.append(torch.randn(rows, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16))
        vs.append(torch.randn(rows, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16))
    return PrefilledKV("bench", list(range(prompt_len)), [1], [], 0, prompt_len, start, list(LAYERS), ks, vs)


def _prefill_side(device: str, jobs, results) -> None:
    transport = CudaIpcTransport(device, arena_bytes=1)
    while (job := jobs.get()) is not None:
        prompt_len, offer, repeats = job
        payload = make_payload(prompt_len, device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            handle = transport.send(payload, offer)  # pack into the peer's slot + synchronize
            times.append((time.perf_counter() - t0) * 1e3)
        results.put((handle, times))


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
    for prompt_len, bound in zip(prompts, bounds):
        offer = decode.offer(bound)
        jobs.put((prompt_len, offer, args.repeats))
        handle, send_ms = results.get(timeout=300)
        receive_ms = []
        for _ in range(args.repeats):
            asyncio.run(decode.receive(handle, offer, timeout_s=30))
            torch.cuda.synchronize()
            receive_ms.append(decode.last_stats.receive_ms)
        decode.release(offer)
        ipc_ms = min(send_ms) + min(receive_ms)
        rows.append({"prompt_tokens": prompt_len, "bytes": handle.nbytes, "cuda_ipc_send_ms": min(send_ms),
                     "cuda_ipc_receive_ms": min(receive_ms), "cuda_ipc_total_ms": ipc_ms,
                     "cuda_ipc_GBps": handle.nbytes / ipc_ms / 1e6,
                     "host_staging_ms": host_staging_ms(handle.nbytes, args.repeats),
                     **peer_copy(args.prefill_device, args.decode_device, handle.nbytes, args.repeats)})
    jobs.put(None)
    proc.join(30)
    print(f"peer access {args.prefill_device} -> {args.decode_device}: {rows[0]['peer_access']}")
    print(f"{'prompt':>7} {'MiB':>8} {'ipc send':>9} {'ipc recv':>9} {'ipc GB/s':>9} {'host stage':>10} "
          f"{'peer GB/s':>9}  (ms, best of {args.repeats})")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['bytes'] / 2**20:>8.1f} {r['cuda_ipc_send_ms']:>9.2f} "
              f"{r['cuda_ipc_receive_ms']:>9.2f} {r['cuda_ipc_GBps']:>9.1f} {r['host_staging_ms']:>10.2f} "
              f"{r['peer_copy_GBps']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "prefill_device": args.prefill_device,
                       "decode_device": args.decode_device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
