"""Decode-sized dense projections whose weights stream before the PDL wait (CUDA C++, `csrc/dense_gemv.cu`).

y [T, N] = x [T, K] @ W [N, K]^T + b for T <= 8 bf16 rows: one warp per output row holds the row in registers,
loaded at the kernel's start, before griddepcontrol.wait, so under programmatic dependent launch the weight
bytes move while the previous kernel (attention before O, the norm before QKV) finishes; fp32 sums, the bias
added once, one bf16 rounding. Twin: torch.nn.functional.linear (same products, sums in another order).
Built on first use with torch's cpp_extension (sm_90a); importing this module builds nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

MAX_TOKENS = 8
MAX_K = 4096


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().parents[2] / "csrc" / "dense_gemv.cu"
    build = Path(os.environ.get("DENSE_GEMV_BUILD_DIR", Path.home() / ".cache" / "gpt_oss_serve" / "dense_gemv"))
    build.mkdir(parents=True, exist_ok=True)
    return load(name="dense_gemv_ext", sources=[str(src)], build_directory=str(build),
                extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "-O3"], extra_cflags=["-O3"], verbose=False)


def build() -> str:
    """Build the extension now; returns the path of the shared object."""
    return _extension().__file__


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether preload_gemv takes these shapes (else the caller keeps its other path)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 == weight.dtype and 0 < x.shape[0] <= MAX_TOKENS
            and x.shape[1] % 8 == 0 and x.shape[1] <= MAX_K)


def preload_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool | None = None
                 ) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T + bias [N] -> [T, N] bf16 (T <= 8, K <= 4096, multiples of 8). pdl: launch
    with programmatic stream serialization (default: while a CUDA graph is being captured, as kernels.pdl)."""
    if not runs(x, weight) or weight.shape[1] != x.shape[1]:
        raise ValueError(f"preload_gemv takes bf16 x [1..{MAX_TOKENS}, K <= {MAX_K}] and W [N, K]; got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}")
    if pdl is None:
        from kernels import pdl as pdl_mod

        pdl = pdl_mod.active(x)
    x = x.contiguous() if x.stride(1) != 1 or x.stride(0) % 8 else x
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _extension().preload_gemv(x, weight, bias, y, bool(pdl))
    return y
