"""The CUDA C++ FP8 decode GEMM (kernels/moe/fp8_decode_cuda.py) against the Triton FP8 decode GEMM it would
replace (kernels/moe/triton_grouped_gemm.grouped_gemm_decode), same process, same weights and routings, on
gpt-oss expert shapes: gate_up [2I=5760, Kp=2944] and down [D=2880, Kp], T tokens x top-4 of 32 (20b) or
128 (120b) experts, T = 1, 2, 4, 8.

    python -m bench.fp8_decode --out bench/results/fp8_decode_cuda_h200.json

us per call in a CUDA graph of 48 calls cycling through 8 routings drawn apart, so that consecutive calls
read different experts' weights from HBM, as the layers of a decode step do (bench/mxfp4_decode.py's "rot").
TB/s counts the FP8 weight bytes of the experts each call reads. The Triton kernel runs with the engine's
K splits (triton_grouped_gemm.decode_splits); the CUDA kernel with the same splits and with one (bf16 out),
at every ring depth and 1 or 2 blocks per SM. Each CUDA result is compared with the twin
(fp8_reference.grouped_gemm).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.moe_common import calc_diff, graph_time_us
from kernels.moe import fp8_decode_cuda as fc
from kernels.moe import fp8_reference as ref
from kernels.moe import triton_grouped_gemm as tgg
from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
from kernels.moe.fp8_quant import padded, quantize_weight_blocks
from kernels.moe.routing_triton import plan_masked

D = I = 2880
TOP_K = 4
ROTATIONS = 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/fp8_decode_cuda.json")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--models", default="32,128", help="expert counts (20b: 32, 120b: 128)")
    p.add_argument("--depths", default="2,3,4")
    p.add_argument("--blocks-per-sm", default="1,2")
    p.add_argument("--loads", default="0,1,2")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    print(f"built {fc.build()}", flush=True)
    rows = []
    for experts in [int(x) for x in args.models.split(",")]:
        for name, (n, k) in {"gate_up": (2 * I, D), "down": (D, I)}.items():
            w, ws = quantize_weight_blocks(torch.randn(experts, n, k, device=dev) * k ** -0.5, padded(k))
            for t in [int(x) for x in args.tokens.split(",")]:
                rows.append(_bench(experts, name, w, ws, t, args, dev))
                print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                               for k_, v in rows[-1].items() if not isinstance(v, dict)), flush=True)
            del w, ws
            torch.cuda.empty_cache()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "rows": rows}, indent=1))
    print_table(rows)
    return 0


def _bench(experts, name, w, ws, t, args, dev) -> dict:
    n, kp = w.shape[1], w.shape[2]
    cases = []
    for seed in range(ROTATIONS):
        gen = torch.Generator(device=dev).manual_seed(1000 * t + seed)
        x = torch.randn(t, D if name == "gate_up" else I, device=dev, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(experts, device=dev, generator=gen)[:TOP_K] for _ in range(t)]).int()
        plan = plan_masked(ids, 0, experts, t)
        a = dispatch_quant(x, plan.row_of_pair, TOP_K, Fp8Rows.empty(experts, t, kp, dev))
        cases.append((plan, a))
    sets = [(c,) for c in (cases * 6)[:48]]
    active = sum(int(c[0].num_active) for c in cases) / len(cases)
    nbytes = active * n * kp + active * (n // 128) * (kp // 128) * 4
    splits = tgg.decode_splits(t)

    def out_of(s):
        shape = (experts * t, n) if s == 1 else (s, experts * t, n)
        return torch.empty(shape, device=dev, dtype=torch.bfloat16 if s == 1 else torch.float32)

    out_t = out_of(splits)

    def run_triton(c):
        plan, a = c
        tgg.grouped_gemm_decode(a, w, ws, out_t, plan.counts, plan.active, plan.num_active, t)

    row = {"experts": experts, "gemm": name, "tokens": t, "active": active, "weight_bytes": nbytes,
           "triton_splits": splits, "triton_us": graph_time_us(run_triton, sets)[0], "cuda": {}}
    row["triton_tb_s"] = nbytes / row["triton_us"] / 1e6
    best = None
    for s in sorted({splits, 1}):
        out_c = out_of(s)
        for depth in [int(x) for x in args.depths.split(",")]:
            for bps, load in [(int(b), int(ld)) for b in args.blocks_per_sm.split(",") for ld in args.loads.split(",")]:
                cfg = dict(depth=depth, blocks_per_sm=bps, load=load)

                def run_cuda(c, cfg=cfg, out_c=out_c):
                    plan, a = c
                    fc.grouped_gemm_decode_cuda(a, w, ws, out_c, plan.counts, plan.active, plan.num_active, t,
                                                config=cfg)

                us = graph_time_us(run_cuda, sets)[0]
                key = f"S{s}_d{depth}_b{bps}_l{load}"
                row["cuda"][key] = us
                if best is None or us < row["cuda"][best]:
                    best = key
        # correctness of the last config on the last routing against the twin
        plan, a = cases[-1]
        run_cuda(cases[-1])
        rows_ = plan.row_of_pair.long()
        expert_of_row = torch.full((experts * t,), -1, device=dev)
        for e_, cnt in enumerate(plan.counts.tolist()):
            expert_of_row[e_ * t: e_ * t + cnt] = e_
        want = ref.grouped_gemm(a.data, a.scales_rows(), w, ws, expert_of_row)[rows_].float()
        got = (out_c.float() if s == 1 else out_c.sum(0))[rows_]
        row[f"cuda_S{s}_diff"] = calc_diff(got, want)
    row["cuda_best"] = best
    row["cuda_us"] = row["cuda"][best]
    row["cuda_tb_s"] = nbytes / row["cuda_us"] / 1e6
    row["speedup"] = row["triton_us"] / row["cuda_us"]
    return row


def print_table(rows) -> None:
    print("\nus per call (TB/s of the FP8 weight bytes), CUDA graph of 48 calls over 8 routings")
    print("model gemm     T  active | Triton          | CUDA best        config       | Triton / CUDA")
    for r in rows:
        model = "20b" if r["experts"] == 32 else "120b"
        print(f"{model:5} {r['gemm']:7} {r['tokens']:2} {r['active']:6.2f} | {r['triton_us']:6.1f} ({r['triton_tb_s']:.2f})"
              f"   | {r['cuda_us']:6.1f} ({r['cuda_tb_s']:.2f})  {r['cuda_best']:12} | {r['speedup']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
