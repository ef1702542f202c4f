"""The MXFP4 decode grouped GEMMs against the FP8 decode GEMM they would replace, on gpt-oss expert shapes:
gate_up [2I=5760, D=2880] and down [D, I], active experts of T tokens x top-4 out of 32 (20b) or 128
(120b), T = 1, 4, 16. Three kernels in the same process: the FP8 Triton decode GEMM (what runs), the
Triton MXFP4 prescaled kernel (kernels/moe/mxfp4_decode_gemm.py) and the CUDA C++ mma.sync kernel
(kernels/moe/mxfp4_cuda.py). First a config sweep of the CUDA kernel at T = 1 and 16 (20b shapes),
then the table.

    python -m bench.mxfp4_decode --out bench/results/mxfp4_cuda_decode_h200.json

Two timings per kernel, both CUDA graphs of 48-50 calls, us per call: "hot" repeats one routing (the
2026-11-30 method: at T = 1 a 20b/120b gate_up's 35 MB of MXFP4 weights, or a down's 18 MB, can stay in
the 60 MB L2 between calls), "rot" cycles through 8 routings drawn apart (the weights of consecutive calls
differ, as in a decode step, where each layer's experts arrive from HBM). TB/s counts each kernel's own
weight bytes (MXFP4 17/32 byte per weight; FP8 1 byte, K padded to 2944). Each MXFP4 result is compared
with its dequantize-to-bf16 twin.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.moe_common import calc_diff, graph_time_us, graph_us
from kernels.moe import mxfp4_cuda as mc
from kernels.moe import mxfp4_decode_gemm as mx
from kernels.moe import triton_grouped_gemm as tgg
from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
from kernels.moe.fp8_quant import padded, quantize_weight_blocks
from kernels.moe.routing_triton import plan_masked
from model.mxfp4 import quantize_mxfp4

D = I = 2880
TOP_K = 4
ROTATIONS = 8
# The Triton prescaled kernel's best configs from the 2026-11-30 sweep (bench/results/mxfp4_decode_h200.json),
# used for T <= 4 (splits 1 above, as then).
TRITON_BEST = {"gate_up": dict(BLOCK_N=128, num_stages=3, splits=4), "down": dict(BLOCK_N=128, num_stages=2, splits=4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/mxfp4_decode.json")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--models", default="32,128", help="expert counts (20b: 32, 120b: 128)")
    p.add_argument("--mma-sweep", default="kind=0;tiles_per_block=2,4,8;k_splits=2,3,5;depth=4,8"
                   "|kind=2;tiles_per_block=2,4,8;k_splits=2,3,5;depth=6,8"
                   "|kind=1;tiles_per_block=2,4;k_splits=3,5;chunks_per_piece=4",
                   help="CUDA kernel configs timed at T = 1 and 16 on 20b shapes, grids joined by '|' "
                        "('' = mxfp4_cuda.CONFIG)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    so = mc.build()
    print(f"built {so}", flush=True)
    rows, log, best = [], [], {}
    for experts in [int(x) for x in args.models.split(",")]:
        for name, (n, k) in {"gate_up": (2 * I, D), "down": (D, I)}.items():
            tokens = [int(x) for x in args.tokens.split(",")]
            rows += _bench_shape(experts, name, n, k, tokens, args.mma_sweep, best, log, dev)
            torch.cuda.empty_cache()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({  # after each shape: a cut-off run keeps what it measured
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "sweep": log, "best": {f"{g}_T{t}": c for (g, t), c in best.items()},
                "rows": rows}, indent=1))
    print_table(rows)
    return 0


def _bench_shape(experts, name, n, k, tokens, mma_sweep, best, log, dev) -> list[dict]:
    """The rows of one weight shape (gate_up or down of a model) at each T."""
    rows = []
    dense = torch.randn(experts, n, k, device=dev) * k ** -0.5
    parts = [quantize_mxfp4(dense[e:e + 1]) for e in range(experts)]  # per expert: bounded memory
    blocks = torch.cat([b for b, _ in parts]).view(experts, n, k // 32, 16)
    scales = torch.cat([s for _, s in parts])
    del parts
    w8, s8 = quantize_weight_blocks(dense, padded(k))
    del dense
    pre = mx.pack_prescaled_words(blocks, scales)
    mma = mc.pack_mma_words(blocks, scales)
    for t in tokens:
        cases = [_case(experts, k, t, dev, seed) for seed in range(ROTATIONS)]
        if experts == 32 and mma_sweep and t in (1, 16):
            best[(name, t)] = _sweep(name, t, n, experts, mma, cases, mma_sweep, log)
        mma_cfg = best.get((name, 1 if t <= 4 else 16), dict(mc.CONFIG))
        tri_cfg = dict(TRITON_BEST[name])
        tri_splits = tri_cfg.pop("splits") if t <= 4 else 1
        splits = tgg.decode_splits(t)
        out_8 = torch.empty((splits, experts * t, n) if splits > 1 else (experts * t, n), device=dev,
                            dtype=torch.float32 if splits > 1 else torch.bfloat16)
        out_p = torch.empty((tri_splits, experts * t, n) if tri_splits > 1 else (experts * t, n), device=dev,
                            dtype=torch.float32 if tri_splits > 1 else torch.bfloat16)
        out_c = torch.empty(experts * t, n, device=dev, dtype=torch.bfloat16)
        for c in cases:
            c["a8"] = dispatch_quant(c["x"], c["plan"].row_of_pair, TOP_K,
                                     Fp8Rows.empty(experts, t, padded(k), dev))
            c["a16"] = c["a_bf16"].half()

        def run_tri(c):
            pl = c["plan"]
            mx.grouped_gemm_decode_mxfp4_prescaled(c["a16"], pre, out_p, pl.counts, pl.active, pl.num_active,
                                                   t, t, config=tri_cfg)

        def run_fp8(c):
            pl = c["plan"]
            tgg.grouped_gemm_decode(c["a8"], w8, s8, out_8, pl.counts, pl.active, pl.num_active, t)

        def run_mma(c):
            pl = c["plan"]
            mc.grouped_gemm_decode_mxfp4_mma(c["a_bf16"], mma, out_c, pl.counts, pl.active, pl.num_active,
                                             t, t, config=mma_cfg)

        c0 = cases[0]
        active = int(c0["plan"].num_active)
        rot_sets = [(c,) for c in (cases * 7)[:48]]
        row = {"experts": experts, "gemm": name, "tokens": t, "active": active,
               "active_rot": sum(int(c["plan"].num_active) for c in cases) / len(cases),
               "mxfp4_bytes": active * n * k * 17 // 32, "fp8_bytes": active * n * padded(k),
               "triton_config": dict(tri_cfg, splits=tri_splits), "mma_config": mma_cfg}
        for kname, fn in (("fp8", run_fp8), ("triton", run_tri), ("mma", run_mma)):
            row[f"{kname}_us"] = graph_us(lambda fn=fn: fn(c0))
            row[f"{kname}_rot_us"] = graph_time_us(fn, rot_sets)[0]
        rot_mx = row["active_rot"] * n * k * 17 / 32
        rot_8 = row["active_rot"] * n * padded(k)
        for kname, nbytes, rbytes in (("fp8", row["fp8_bytes"], rot_8), ("triton", row["mxfp4_bytes"], rot_mx),
                                      ("mma", row["mxfp4_bytes"], rot_mx)):
            row[f"{kname}_tb_s"] = nbytes / row[f"{kname}_us"] / 1e6
            row[f"{kname}_rot_tb_s"] = rbytes / row[f"{kname}_rot_us"] / 1e6
        # correctness of the last-run case of each MXFP4 kernel against the twin
        cl = cases[-1]
        r = cl["plan"].row_of_pair.long()
        want = mx.reference_decode_mxfp4(cl["a_bf16"], blocks, scales, cl["plan"].counts, t)[r]
        run_tri(cl)
        run_mma(cl)
        got_p = (out_p.sum(0) if tri_splits > 1 else out_p.float())[r]
        got_c = out_c.float()[r]
        row["triton_diff"] = calc_diff(got_p, want)
        row["mma_diff"] = calc_diff(got_c, want)
        row["mma_max_abs_err"] = float((got_c - want).abs().max())
        row["ref_max_abs"] = float(want.abs().max())
        rows.append(row)
        print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
              flush=True)
    return rows


def _case(experts: int, k: int, t: int, dev, seed: int) -> dict:
    """One routing of t tokens (top-4 of `experts`, seeded): plan, token rows x, masked-layout A rows."""
    gen = torch.Generator(device=dev).manual_seed(1000 * t + seed)
    x = torch.randn(t, k, device=dev, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, device=dev, generator=gen)[:TOP_K] for _ in range(t)]).int()
    plan = plan_masked(ids, 0, experts, t)
    a_bf16 = torch.zeros(experts * t, k, device=dev, dtype=torch.bfloat16)
    a_bf16[plan.row_of_pair.long()] = x[torch.arange(t * TOP_K, device=dev) // TOP_K]
    return {"x": x, "plan": plan, "a_bf16": a_bf16}


def _sweep(name, t, n, experts, mma, cases, spec, log) -> dict:
    """Time the CUDA kernel (rotating routings) over the grid in `spec` ("key=v,v;key=v,..."); the fastest."""
    grid = []
    for sub in spec.split("|"):
        g_ = [dict(mc.CONFIG)]
        for part in sub.split(";"):
            key, values = part.split("=")
            g_ = [dict(g, **{key: int(v)}) for g in g_ for v in values.split(",")]
        grid += g_
    out = torch.empty(experts * t, n, device="cuda", dtype=torch.bfloat16)
    sets = [(c,) for c in (cases * 7)[:48]]
    best, best_us = dict(mc.CONFIG), float("inf")
    for cfg in grid:
        if cfg["tiles_per_block"] * cfg["k_splits"] > 16:
            continue
        try:  # a config over the shared-memory or piece limits is recorded, not fatal
            mc.grouped_gemm_decode_mxfp4_mma(cases[0]["a_bf16"], mma, out, cases[0]["plan"].counts,
                                             cases[0]["plan"].active, cases[0]["plan"].num_active, t, t, config=cfg)
        except RuntimeError as exc:
            log.append(dict(gemm=name, tokens=t, **cfg, error=str(exc).splitlines()[0][:160]))
            continue

        def run(c, cfg=cfg):
            pl = c["plan"]
            mc.grouped_gemm_decode_mxfp4_mma(c["a_bf16"], mma, out, pl.counts, pl.active, pl.num_active, t, t,
                                             config=cfg)

        us = graph_time_us(run, sets)[0]
        log.append(dict(gemm=name, tokens=t, **cfg, rot_us=us))
        print(f"sweep {name} T={t} {cfg}: {us:.2f} us", flush=True)
        if us < best_us:
            best, best_us = cfg, us
    return best


def print_table(rows) -> None:
    print("\nus per call (TB/s of the kernel's weight bytes); hot: one routing repeated, rot: 8 routings cycled")
    print("model gemm     T act |  FP8 hot        rot           |  Triton MXFP4 hot  rot         "
          "|  CUDA MXFP4 hot   rot")
    for r in rows:
        model = "20b" if r["experts"] == 32 else "120b"
        cells = " | ".join(f"{r[f'{k}_us']:6.1f} ({r[f'{k}_tb_s']:.2f}) "
                           f"{r[f'{k}_rot_us']:6.1f} ({r[f'{k}_rot_tb_s']:.2f})" for k in ("fp8", "triton", "mma"))
        print(f"{model:5} {r['gemm']:7} {r['tokens']:2} {r['active']:3} | {cells}")


if __name__ == "__main__":
    raise SystemExit(main())
