"""Shared constants and timing helpers of the MoE benchmarks (bench/moe.py, bench/moe_gemm.py, the epilogue A/Bs)."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from kernels.moe.fp8_quant import padded

DEV = torch.device("cuda")
D = I = 2880
TOP_K = 4
MODELS = {"20b": 32, "120b": 128}
TOKENS = [1, 8, 64, 512, 4096, 16384]
COPY_TBPS, FP8_PFLOPS = 4.3, 1.27  # H200 ceilings measured on these machines (ARCHITECTURE.md)
FP8_EXPERT_BYTES = (2 * I + D) * padded(D)
BF16_EXPERT_BYTES = (2 * I * D + D * I) * 2
FLOP_PER_PAIR = 2 * (2 * I * D + D * I)


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def median_us(fn) -> float:
    return do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def graph_time_us(fn, sets) -> tuple[float, str]:
    """Median us per forward of a CUDA graph running fn over every input set (eager if capture fails)."""
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for s in sets:
                fn(*s)
        us, mode = median_us(graph.replay) / len(sets), "graph"
    except RuntimeError as exc:  # a variant that cannot be captured is timed eagerly, and says so
        print(f"  (graph capture failed: {str(exc).splitlines()[0][:120]}; timing eagerly)")
        torch.cuda.synchronize()
        us, mode = median_us(lambda: [fn(*s) for s in sets]) / len(sets), "eager"
    del graph
    return us, mode


def graph_us(fn, reps: int = 50) -> float:
    """Median us per call of fn() captured `reps` times in one CUDA graph (launch gaps included, as
    inside a decode step's graph)."""
    return graph_time_us(fn, [()] * reps)[0]


def distinct_experts(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """[tokens, TOP_K] int32 on the CPU: each token's TOP_K distinct experts, uniformly at random (as routing of
    random weights spreads tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :TOP_K].int()
