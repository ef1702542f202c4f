"""What one kernel of a dependent chain costs in a CUDA graph, apart from its bytes: the prize of fewer launches.

    python -m bench.launch_floor --out bench/results/launch_floor_h200.json

A batch-1 decode step is a chain of ~285 dependent kernels (bench/decode_timeline: 20b, 2.11 ms), each waiting for
its predecessor. This captures chains of N copies of one streaming kernel (Triton, `pdl_prologue` first as every
decode kernel has it) into a CUDA graph, each reading the previous kernel's small output (a true dependency) and a
slab of "weights" of its own (the chain walks a buffer larger than L2, so every slab comes from HBM), with and
without programmatic dependent launch, and reports microseconds per kernel for weight slabs of 0 to 8 blocks of
4 kB per program (up to 66 MB per kernel) and grids of 132 to 2,112 programs. A line through the sizes gives
each configuration's fixed cost per kernel (launch,
dependency wait, ramp, tail) and its marginal bandwidth: fixed cost x kernels per step is what a step could at
most gain by launching fewer, larger kernels (a persistent per-layer kernel) at the same bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_prologue

BLOCK = 2048  # bf16 elements per program per loop step: 32 bytes per thread at 4 warps


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, w_ptr, w_per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """dst[p, :] = src[p, :] + the fp32 sum, over its slab's BLOCK-wide rows, of program p's weight slab."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    base = w_ptr + pid.to(tl.int64) * w_per_prog
    for i in range(0, w_per_prog, BLOCK):
        acc += tl.load(base + i + offs).to(tl.float32)
    x = tl.load(src_ptr + pid * BLOCK + offs).to(tl.float32)
    tl.store(dst_ptr + pid * BLOCK + offs, (x + acc).to(dst_ptr.dtype.element_ty))


def chain_step(src: torch.Tensor, dst: torch.Tensor, weights: torch.Tensor, pdl: bool) -> None:
    """One kernel of the chain: src / dst [G, BLOCK], weights [G, W] (W a multiple of BLOCK, may be 0)."""
    grid, w = weights.shape
    if src.shape != (grid, BLOCK) or dst.shape != src.shape or w % BLOCK:
        raise ValueError(f"chain_step: src {tuple(src.shape)}, dst {tuple(dst.shape)}, weights {tuple(weights.shape)}")
    extra = {"launch_pdl": True} if pdl else {}
    _chain_kernel[(grid,)](src, dst, weights, w, BLOCK=BLOCK, PDL=pdl, num_warps=4, **extra)


def chain_reference(src: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The twin of chain_step's output, summed in the kernel's order (so equal bit for bit)."""
    grid, w = weights.shape
    acc = torch.zeros(grid, BLOCK, dtype=torch.float32, device=src.device)
    for i in range(0, w, BLOCK):
        acc += weights[:, i:i + BLOCK].float()
    return (src.float() + acc).to(src.dtype)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x over (x, y) points: (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def time_chain(grid: int, blocks: int, pdl: bool, kernels: int, replays: int = 5) -> float:
    """Microseconds per kernel of a graph of `kernels` chained launches of `grid` programs, each program reading
    `blocks` x BLOCK bf16 weights (grid x blocks x 4 kB per kernel)."""
    w = blocks * BLOCK
    # each kernel its own slab; the chain walks through >= 256 MB (over L2) before it reuses one
    slabs = max(1, min(kernels, (256 * 2**20) // (grid * w * 2))) if w else 1
    weights = torch.randn(slabs, grid, w, dtype=torch.bfloat16, device="cuda")
    bufs = [torch.randn(grid, BLOCK, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for i in range(3):  # compile, warm
        chain_step(bufs[i % 2], bufs[(i + 1) % 2], weights[i % slabs], False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(kernels):
            chain_step(bufs[i % 2], bufs[(i + 1) % 2], weights[i % slabs], pdl)
    graph.replay()
    torch.cuda.synchronize()
    from bench.e2e_timing import timed  # (imported here: the interpreter cases need only the kernel and its twin)

    us = timed(graph.replay, torch.device("cuda"), replays) * 1e6 / kernels
    del graph, weights
    torch.cuda.empty_cache()
    return us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grids", default="132,528,1056,2112")
    p.add_argument("--blocks", default="0,1,2,4,8", help="weight blocks (BLOCK bf16 = 4 kB) per program")
    p.add_argument("--kernels", type=int, default=256, help="launches per graph")
    p.add_argument("--out", default="bench/results/launch_floor.json")
    args = p.parse_args(argv)
    grids = [int(g) for g in args.grids.split(",")]
    sizes = [int(s) for s in args.blocks.split(",")]
    # correctness first: a short chain on fresh inputs against the twin (exact: fp32 sums of bf16, one rounding)
    g, w = 133, 3 * BLOCK
    src, dst = torch.randn(g, BLOCK, dtype=torch.bfloat16, device="cuda"), torch.empty(g, BLOCK, dtype=torch.bfloat16,
                                                                                        device="cuda")
    wt = torch.randn(g, w, dtype=torch.bfloat16, device="cuda")
    chain_step(src, dst, wt, False)
    ref = chain_reference(src.cpu(), wt.cpu())
    err = (dst.cpu().float() - ref.float()).abs().max().item()
    if err:
        raise SystemExit(f"the chain kernel differs from its twin by up to {err}: timings withheld")
    rows = []
    for grid in grids:
        for pdl in (False, True):
            us = {k: time_chain(grid, k, pdl, args.kernels) for k in sizes}
            fit = [(grid * k * BLOCK * 2, t) for k, t in us.items() if k > 0]
            a, b = fit_line(fit) if len(fit) >= 2 else (float("nan"), float("nan"))
            rows.append({"grid": grid, "pdl": pdl, "us_per_kernel": {str(k): round(t, 3) for k, t in us.items()},
                         "mb_per_kernel": {str(k): round(grid * k * BLOCK * 2 / 2**20, 2) for k in sizes},
                         "fit_fixed_us": round(a, 3), "fit_tb_s": round(1e-6 / b, 2) if b > 0 else None})
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
              "args": vars(args), "check_max_abs_err_vs_twin": err, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("chain kernel vs twin: bitwise equal (bf16 output, fp32 sums in the same order)")
    print(f"us per kernel in a graph of {args.kernels} dependent launches, by weight blocks (4 kB) per program:")
    print(f"{'grid':>5s} {'PDL':>4s} " + " ".join(f"{k:>7d}" for k in sizes) + f" {'fixed us':>9s} {'TB/s':>6s}"
          f"  MB per kernel")
    for r in rows:
        print(f"{r['grid']:5d} {'on' if r['pdl'] else 'off':>4s} "
              + " ".join(f"{r['us_per_kernel'][str(k)]:7.2f}" for k in sizes)
              + f" {r['fit_fixed_us']:9.2f} {r['fit_tb_s'] or float('nan'):6.2f}  "
              + "/".join(f"{r['mb_per_kernel'][str(k)]:g}" for k in sizes))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
