"""The prefill SwiGLU + FP8 quantization epilogue (kernels/moe/epilogues_triton.py) with IEEE divisions
(the twin's rounding) against `fast_div` (approximate division, a per-block reciprocal), same process.

    python -m bench.swiglu_ab [--out bench/results/swiglu_ab_h200.json]

Two numbers first (20b, 4k prompt: 16,384 pairs x 5,760 bf16 inputs): reads 189 MB of GEMM-1 output,
writes 94 MB of FP8 + scales, ~81 us at ~3.5 TB/s; the eager profile measured 129 us per layer
(bench/RESULTS.md, "Where the prefill time goes"). Per output element the IEEE variant does two correctly
rounded divisions (the sigmoid and the quantization); if those hold it back, the fast variant shows it.
Each variant's codes are compared with the twin (fraction off by one FP8 step; none may be off by more).
Then the contiguous layout of a real plan: the per-pair kernel against row tiles (swiglu_quant_contiguous,
which loads the bias once per tile instead of once per element), bitwise equal, three tile shapes; and the
tiles reading (gate, up) pairs as int32 words, with and without the SFU sigmoid (mufu: codes one step off
the per-pair kernel's are counted).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from bench.moe_common import distinct_experts
from kernels.moe import epilogues_triton as epi
from kernels.moe import fp8_reference as ref
from kernels.moe.fp8_quant import fp8_steps, padded

INTER = 2880
SHAPES = {"decode T=1": 4, "20b 4k": 4 * 4096, "120b 8k": 4 * 8192}


def contiguous_tiles(dev, gen) -> list[dict]:
    """Prefill SwiGLU over a real contiguous plan (top-4 of 32 experts, DeepGEMM's 128-row alignment): the
    per-pair kernel against row tiles of 32 / 64 rows (epilogues_triton.swiglu_quant_contiguous), both with
    the prefill default (fast division); outputs must match bit for bit."""
    from kernels.moe import routing_triton

    rows_out = []
    for name, tokens in (("20b 4k", 4096), ("120b 8k", 8192)):
        experts = 32
        ids = distinct_experts(tokens, experts).to(dev)
        plan = routing_triton.plan_contiguous(ids, 0, experts, 128)
        h = (torch.randn(plan.num_rows, 2 * INTER, generator=gen, device=dev) * 3).bfloat16()
        bias = torch.randn(experts, 2 * INTER, generator=gen, device=dev) * 0.1
        moved = ids.numel() * (2 * INTER * 2 + padded(INTER) * (1 + 4 / 128))
        row = {"shape": name + " contiguous", "pairs": ids.numel()}
        outs = {}
        variants = {"per pair": lambda out: epi.swiglu_quant(h, plan.row_of_pair, ids, bias, 0, 1.702, 7.0, out)}
        for block_rows, warps in ((32, 4), (64, 4), (64, 8)):
            variants[f"tiles {block_rows} rows {warps} warps"] = (
                lambda out, b=block_rows, w=warps: epi.swiglu_quant_contiguous(
                    h, plan.m_indices, bias, 1.702, 7.0, out, 128, ids.numel(), block_rows=b, num_warps=w))
        # Fp8Experts.swiglu_words / swiglu_mufu (32 rows, 4 warps); mufu is not bitwise: its codes one FP8 step
        # off the per-pair kernel's are counted
        for words, mufu in ((True, False), (False, True), (True, True)):
            variants[("words" if words else "halves") + (" mufu" if mufu else "")] = (
                lambda out, wd=words, mu=mufu: epi.swiglu_quant_contiguous(
                    h, plan.m_indices, bias, 1.702, 7.0, out, 128, ids.numel(), words=wd, mufu=mu))
        for key, fn in variants.items():
            out = epi.Fp8Rows.empty(1, plan.num_rows, padded(INTER), dev)
            out.data.zero_()
            fn(out)
            outs[key] = out.data.view(torch.uint8).clone()
            us = do_bench(lambda: fn(out), warmup=10, rep=50, return_mode="median") * 1e3
            row[f"{key} us"] = us
            row[f"{key} GB/s"] = moved / (us * 1e-6) / 1e9
            row[f"{key} bitwise equal"] = bool(torch.equal(outs[key], outs["per pair"]))
            steps = fp8_steps(outs[key], outs["per pair"])
            row[f"{key} codes off by one"] = float((steps == 1).float().mean())
            row[f"{key} codes off by more"] = int((steps > 1).sum())
        rows_out.append(row)
        print(f"{row['shape']:>20}: " + "; ".join(_cell(row, k) for k in variants), flush=True)
    return rows_out


def _cell(row: dict, key: str) -> str:
    same = "" if row[f"{key} bitwise equal"] else (f", differs: off1 {row[f'{key} codes off by one']:.1e}, "
                                                   f">1: {row[f'{key} codes off by more']}")
    return f"{key} {row[f'{key} us']:.1f} us ({row[f'{key} GB/s']:.0f} GB/s{same})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/swiglu_ab.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name, pairs in SHAPES.items():
        experts = 32
        h = (torch.randn(pairs, 2 * INTER, generator=gen, device=dev) * 3).bfloat16()
        bias = torch.randn(experts, 2 * INTER, generator=gen, device=dev) * 0.1
        ids = torch.randint(0, experts, (pairs,), generator=gen, device=dev).int()
        row_of_pair = torch.randperm(pairs, generator=gen, device=dev).int()
        pair_of_row = torch.empty_like(row_of_pair).long()
        pair_of_row[row_of_pair.long()] = torch.arange(pairs, device=dev)
        check = min(pairs, 4096)
        want, want_s = ref.swiglu_quant(h[:check], bias[ids[pair_of_row[:check]].long()], 1.702, 7.0)
        row = {"shape": name, "pairs": pairs}
        moved = h.numel() * 2 + pairs * padded(INTER) * (1 + 4 / 128)
        for fast in (False, True):
            out = epi.Fp8Rows.empty(1, pairs, padded(INTER), dev)

            def run():
                epi.swiglu_quant(h, row_of_pair, ids, bias, 0, 1.702, 7.0, out, fast_div=fast)

            run()
            steps = fp8_steps(out.data[:check], want)
            us = do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3
            key = "fast" if fast else "ieee"
            row[f"{key}_us"] = us
            row[f"{key}_gbps"] = moved / (us * 1e-6) / 1e9
            row[f"{key}_codes_off_by_one"] = float((steps == 1).float().mean())
            row[f"{key}_codes_off_by_more"] = int((steps > 1).sum())
            row[f"{key}_scale_max_rel"] = float(((out.scales_rows()[:check] - want_s) / want_s).abs().max())
        rows_out.append(row)
        print(f"{name:>11}: ieee {row['ieee_us']:8.1f} us ({row['ieee_gbps']:5.0f} GB/s, off1 "
              f"{row['ieee_codes_off_by_one']:.1e})  fast {row['fast_us']:8.1f} us ({row['fast_gbps']:5.0f} GB/s, "
              f"off1 {row['fast_codes_off_by_one']:.1e}, >1: {row['fast_codes_off_by_more']})  "
              f"{row['ieee_us'] / row['fast_us']:.2f}x", flush=True)
    rows_out += contiguous_tiles(dev, gen)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(dev), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
