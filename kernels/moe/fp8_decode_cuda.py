"""FP8 decode grouped GEMM in CUDA C++ (`csrc/fp8_decode.cu`): the experts' FP8 weights, as converted for
DeepGEMM, streamed into mma.sync A fragments by one register ring per warp.

Why (kernels/moe/NOTES.md, "FP8 decode GEMM in CUDA C++"): at batch 1 the Triton decode GEMM
(`triton_grouped_gemm.grouped_gemm_decode`) streams the experts at ~3.2 TB/s (gate_up T=1, Nsight Compute,
2026-12-02) and its 48 calls are 749 us of a 2.11 ms 20b step; the H200 streams ~4.2 TB/s. This kernel keeps
DEPTH 128-deep blocks (2 KB per warp) in flight per warp from its first block to its last, across the
(tile, K split) items it serves, instead of one short pipeline per Triton program.

Same inputs and outputs as the Triton kernel (masked layout, `Fp8Rows` activations, optional a_row_map,
fp32 split-K partials [S, rows, N] or bf16 [rows, N]) for T <= 8 tokens per expert; no host sync, no
allocation: CUDA-graph capturable. Built on first use with torch's cpp_extension (CUDA only; importing this
module builds nothing). Twin: kernels/moe/fp8_reference.grouped_gemm (tests/kernels/test_fp8_decode_cuda.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

MAX_TOKENS = 8  # one 8-token mma column tile
WARPS = 8  # warps per block (csrc kWarps)
# blocks per SM the grid aims at (the kernel's launch bounds allow 2), the register ring's depth, and the weight
# loads' flavor (csrc LOAD: 0 read-only path, 1 plain, 2 plain + 256-byte L2 fetch)
CONFIG = dict(blocks_per_sm=2, depth=2, load=0)


@functools.cache
def _extension():
    """Build (first call, ~1 min) and load csrc/fp8_decode.cu for sm_90a."""
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().parents[2] / "csrc" / "fp8_decode.cu"
    build = Path(os.environ.get("FP8_DECODE_BUILD_DIR", Path.home() / ".cache" / "gpt_oss_serve" / "fp8_decode"))
    build.mkdir(parents=True, exist_ok=True)
    return load(name="fp8_decode_ext", sources=[str(src)], build_directory=str(build),
                extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "-O3"],
                extra_cflags=["-O3"], verbose=False)


def build() -> str:
    """Build the extension now; returns the path of the shared object (for cuobjdump)."""
    return _extension().__file__


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def blocks_per_slot(device: torch.device, slots: int, n: int, splits: int, blocks_per_sm: int) -> int:
    """Blocks per active-expert slot: enough for `blocks_per_sm` per SM when every slot is active, and
    no more than the slot's items (N / 16 tiles x K splits) give warps."""
    target = -(-_sm_count(device.index or 0) * blocks_per_sm // max(slots, 1))
    return max(1, min(target, -(-(n // 16) * splits // WARPS)))


def grouped_gemm_decode_cuda(a, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
                             active: torch.Tensor, num_active: torch.Tensor, max_tokens: int,
                             a_row_map: torch.Tensor | None = None, config: dict | None = None,
                             pdl: bool | None = None) -> torch.Tensor:
    """`triton_grouped_gemm.grouped_gemm_decode` for T <= 8 rows per expert: a (`Fp8Rows`), W [E, N, Kp] e4m3
    and its [E, N/128, Kp/128] scales -> out rows [e * m_cap, + counts[e]) = A @ W[e]^T for the experts
    active[:num_active]; out [rows, N] bf16, or [S, rows, N] fp32 partial sums over S K splits. pdl: launch
    with programmatic stream serialization (default: while a CUDA graph is captured, as kernels.pdl does)."""
    if not 0 < max_tokens <= min(MAX_TOKENS, a.rows_per_group):
        raise ValueError(f"grouped_gemm_decode_cuda covers 1..{MAX_TOKENS} rows per expert "
                         f"(and m_cap {a.rows_per_group}); got {max_tokens}")
    if a_row_map is not None and a.groups != 1:
        raise ValueError(f"a_row_map needs A as one group of token rows, got {a.groups} groups")
    cfg = dict(CONFIG, **(config or {}))
    splits = out.shape[0] if out.dim() == 3 else 1
    if pdl is None:
        from kernels import pdl as pdl_mod

        pdl = pdl_mod.active(a.data)
    bps = blocks_per_slot(a.data.device, active.numel(), w.shape[1], splits, cfg["blocks_per_sm"])
    _extension().fp8_mma_decode(a.data, a.scale_storage, w, w_scales, out, counts, active, num_active, a_row_map,
                                a.rows_per_group, max_tokens, bps, cfg["depth"], cfg["load"], bool(pdl))
    return out
