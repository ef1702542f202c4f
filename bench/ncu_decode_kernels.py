"""The batch-1 decode step's streaming kernels, one eager launch each, for Nsight Compute (hardware counters:
which stall holds a kernel that neither streams HBM nor fills the issue slots). 20b shapes, T = 1 token:
the CUDA MXFP4 grouped GEMM (gate_up, down; kernels/moe/mxfp4_cuda.py), the FP8 Triton grouped decode GEMM it
replaces, and the FP8 slab GEMV (QKV, O; kernels/layers/slab_gemv_triton.py). Each kernel runs `--calls` times
on `--copies` weight copies in turn, so no two consecutive calls read the same bytes.

    ncu --clock-control none --set full -k regex:'mxfp4|_slab_gemv|_fp8_grouped' -o prof \
        python -m bench.ncu_decode_kernels
    python -m bench.ncu_decode_kernels --time      # the same launches timed (triton do_bench), no profiler

`--config` (JSON) overrides the MXFP4 kernel's mxfp4_cuda.CONFIG; `--only` picks kernels (comma list of
mxfp4_gate_up, mxfp4_down, fp8_gate_up, fp8_down, slab_qkv, slab_o).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.moe_common import median_us

D = I = 2880
EXPERTS = 32
TOP_K = 4
QKV_N, O_K = 5120, 4096


def _mxfp4_inputs(n, k, copies, dev):
    from kernels.moe import mxfp4_cuda as mc

    out = []
    for c in range(copies):
        gen = torch.Generator(device=dev).manual_seed(c)
        blocks = torch.randint(0, 256, (EXPERTS, n, k // 32, 16), dtype=torch.uint8, device=dev, generator=gen)
        scales = torch.randint(118, 128, (EXPERTS, n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
        out.append(mc.pack_mma_words(blocks, scales))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--copies", type=int, default=3)
    p.add_argument("--time", action="store_true", help="time each kernel with CUDA events instead")
    p.add_argument("--config", default="{}")
    p.add_argument("--only", default="mxfp4_gate_up,mxfp4_down,fp8_gate_up,fp8_down,slab_qkv,slab_o")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    from kernels.layers import fp8_linear, gemv_triton
    from kernels.layers.slab_gemv_triton import slab_gemv
    from kernels.moe import mxfp4_cuda as mc
    from kernels.moe import triton_grouped_gemm as tgg
    from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
    from kernels.moe.fp8_quant import padded
    from kernels.moe.routing_triton import plan_masked

    cfg = json.loads(args.config)
    only = set(args.only.split(","))
    x = torch.randn(1, D, device=dev).bfloat16()
    ids = torch.randperm(EXPERTS, device=dev)[:TOP_K][None].int()
    plan = plan_masked(ids, 0, EXPERTS, 1)
    a_rows = torch.zeros(EXPERTS, D, device=dev, dtype=torch.bfloat16)
    a_rows[plan.row_of_pair.long()] = x
    runs = {}
    for name, (n, k) in {"gate_up": (2 * I, D), "down": (D, I)}.items():
        if f"mxfp4_{name}" in only:
            packs = _mxfp4_inputs(n, k, args.copies, dev)
            out = torch.empty(EXPERTS, n, device=dev, dtype=torch.bfloat16)
            runs[f"mxfp4_{name}"] = [
                (lambda pk=pk, out=out: mc.grouped_gemm_decode_mxfp4_mma(
                    a_rows, pk, out, plan.counts, plan.active, plan.num_active, 1, 1, config=cfg, pdl=False))
                for pk in packs]
        if f"fp8_{name}" in only:
            kp = padded(k)
            a8 = dispatch_quant(x, plan.row_of_pair, TOP_K, Fp8Rows.empty(EXPERTS, 1, kp, dev))
            splits = tgg.decode_splits(1)
            out8 = torch.empty((splits, EXPERTS, n) if splits > 1 else (EXPERTS, n), device=dev,
                               dtype=torch.float32 if splits > 1 else torch.bfloat16)
            ws = [((torch.randn(EXPERTS, n, kp, device=dev) * 0.1).to(torch.float8_e4m3fn),
                   torch.ones(EXPERTS, -(-n // 128), kp // 128, device=dev)) for _ in range(args.copies)]
            runs[f"fp8_{name}"] = [
                (lambda w=w, s=s, a8=a8, out8=out8: tgg.grouped_gemm_decode(
                    a8, w, s, out8, plan.counts, plan.active, plan.num_active, 1)) for w, s in ws]
    for name, (n, k) in {"qkv": (QKV_N, D), "o": (D, O_K)}.items():
        if f"slab_{name}" not in only:
            continue
        xs = torch.randn(1, k, device=dev).bfloat16()
        tickets = gemv_triton.new_tickets(n, dev)
        lin = [fp8_linear.quantize_weight(torch.randn(n, k, device=dev) * k ** -0.5) for _ in range(args.copies)]
        bias = torch.randn(n, device=dev).bfloat16()
        runs[f"slab_{name}"] = [(lambda w=w, s=s, xs=xs, tickets=tickets, bias=bias: slab_gemv(xs, w, s, bias, tickets))
                                for w, s in lin]
    torch.cuda.synchronize()
    for name, fns in runs.items():
        fns[0]()  # compile / first launch outside the measured calls
        torch.cuda.synchronize()
        if args.time:  # do_bench zeroes a 256 MB buffer before every call: weights cold, as under ncu's cache control
            us = median_us(lambda copies=itertools.cycle(fns): next(copies)())
            print(f"{name}: median {us:.2f} us (cold L2, eager)")
        else:
            for i in range(args.calls):
                fns[(i + 1) % len(fns)]()
            torch.cuda.synchronize()
            print(f"{name}: {args.calls} launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
