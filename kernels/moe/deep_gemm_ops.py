"""The one module that imports DeepGEMM (the `deep_gemm` module).

Layouts DeepGEMM's SM90 FP8 kernels (the "1D2D" kernels) expect:
- A: FP8 [M, K] (contiguous) or [G, M, K] (masked), K-major; scales fp32 1x128 per row,
  MN-major and TMA-aligned: [.., M, K/128] with strides (1, align(M, 4)) (per group for masked).
  Anything else is transposed by DeepGEMM on every call; `Fp8Rows` writes this layout directly.
- B: FP8 [G, N, K] K-major, scales fp32 [G, ceil(N/128), K/128] contiguous (128x128 blocks).
- D: bf16 [M, N] / [G, M, N]. K must be a multiple of 128 (hence 2880 -> 2944); N only of 8.
- contiguous grouped_layout: m_indices [M] (expert per row, -1 padding; a 128-row block's expert is
  its first row's), or with use_psum_layout the end row of each expert [G] (segments start
  128-aligned): then only real blocks are scheduled, padding blocks cost nothing.
- masked: masked_m [G] = counts, expected_m a host hint for the tile heuristics. D tiles are
  stored whole, so the rows per group must be a multiple of the tile rows (we use 128).
Kernels are JIT-compiled per shape on first use (DG_JIT_CACHE_DIR; nvcc from CUDA_HOME).
The calls use names DeepGEMM 2.x and sgl-deep-gemm 0.1.7..0.2.x both export (m_grouped_fp8_fp4_gemm_nt_*).
Status (H200, torch 2.11.0+cu130, 2026-11-30): the prebuilt sgl-deep-gemm wheels fail every GEMM
("dim == 2 or dim == 3"); DeepGEMM 2.6.1 built from source on the host with the distribution's g++
(`scripts/build_deep_gemm.sh`) passes every test here and runs the gate_up grouped GEMM at 1,182
TFLOP/s. `python -m scripts.deep_gemm_smoke` checks a build step by step; kernels/moe/NOTES.md has the rest.
"""

from __future__ import annotations

import functools

import torch

from kernels.moe.epilogues_triton import SCALE_ROW_ALIGN, Fp8Rows


class DeepGemmUnavailable(RuntimeError):
    """deep_gemm cannot be used here; the message says why (build it with scripts/build_deep_gemm.sh on an SM90 GPU)."""


@functools.lru_cache(maxsize=1)
def _module():
    try:
        import deep_gemm
    except (ImportError, OSError, RuntimeError, AssertionError) as exc:
        # cached without its traceback: the frames of the first caller (an engine's first forward, under graph
        # capture) would otherwise stay alive with every local they hold, the whole engine with them (seen on
        # the GPU, 2026-12-05: a closed 120b engine kept ~40 GiB, and the next one in the process ran out of memory)
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        return exc
    return deep_gemm


def available() -> bool:
    return why_unavailable() == ""


@functools.lru_cache(maxsize=1)
def why_unavailable() -> str:
    """"" when DeepGEMM imports AND runs a GEMM here; otherwise the reason. A build that imports but
    cannot run (the prebuilt wheels on torch 2.11, above) must not be picked by `auto` backends."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"DeepGEMM's FP8 1D2D kernels need SM90, this GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}"
    mod = _module()
    if isinstance(mod, Exception):
        return f"import deep_gemm failed: {mod!r}"
    return _probe()


def _probe() -> str:
    """One tiny masked grouped GEMM through the same wrapper the MoE uses; its error, or ""."""
    device = torch.device("cuda")
    a = Fp8Rows.empty(1, 128, 128, device)
    a.data.fill_(0.5)
    a.scale_storage.fill_(1.0)
    w = torch.full((1, 128, 128), 0.5, device=device).to(a.data.dtype)
    out = torch.empty(128, 128, dtype=torch.bfloat16, device=device)
    try:
        grouped_gemm_masked(a, w, torch.ones(1, 1, 1, device=device), out,
                            torch.full((1,), 128, dtype=torch.int32, device=device), expected_m=128)
        torch.cuda.synchronize()
    except RuntimeError as exc:  # DeepGEMM reports failures as RuntimeError (pybind11 or tvm-ffi builds)
        return f"deep_gemm imports but its GEMM fails here: {exc}"
    if not torch.allclose(out.float(), torch.full_like(out, 32.0, dtype=torch.float32)):
        return "deep_gemm ran a probe GEMM but returned wrong values"
    return ""


def _dg():
    mod = _module()
    if isinstance(mod, Exception):
        raise DeepGemmUnavailable(f"deep_gemm is not usable ({mod!r}); build it on the GPU host with "
                                  "scripts/build_deep_gemm.sh, or use the Triton backend")
    return mod


def mk_alignment() -> int:
    """Row alignment of expert segments in the contiguous layout (128 on SM90)."""
    return int(_dg().get_mk_alignment_for_contiguous_layout())


def check_scale_alignment(rows: int) -> None:
    """Our MN-major scale rows must match DeepGEMM's TMA alignment, or it would copy them every call."""
    want = int(_dg().get_tma_aligned_size(rows, 4))
    have = -(-rows // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN
    if want != have:
        raise DeepGemmUnavailable(f"DeepGEMM aligns {rows} fp32 scale rows to {want}, Fp8Rows to {have}: "
                                  "update SCALE_ROW_ALIGN in epilogues_triton.py")


def grouped_gemm_contiguous(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor,
                            m_indices: torch.Tensor | None = None, psum: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = A @ W[e]^T for the expert segments given by m_indices or (preferred) psum."""
    if (m_indices is None) == (psum is None):
        raise ValueError("pass exactly one of m_indices (per-row experts) and psum (segment ends)")
    dg = _dg()
    a_pair = (a.data, a.scales_2d())
    if psum is not None:
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous(a_pair, (w, w_scales), out, psum, use_psum_layout=True)
    else:
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous(a_pair, (w, w_scales), out, m_indices)
    return out


def grouped_gemm_masked(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor,
                        counts: torch.Tensor, expected_m: int) -> torch.Tensor:
    """out [E * m_cap, N] = A @ W[e]^T on the first counts[e] rows of each expert's m_cap rows."""
    g, m = a.groups, a.rows_per_group
    dg = _dg()
    dg.m_grouped_fp8_fp4_gemm_nt_masked((a.data.view(g, m, -1), a.scales_3d()), (w, w_scales),
                                    out.view(g, m, -1), counts, max(1, int(expected_m)))
    return out


def bf16_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dense bf16 GEMM out [M, N] = x [M, K] @ W [N, K]^T (fp32 accumulation, no bias): a comparison with cuBLAS."""
    _dg().bf16_gemm_nt(x, w, out)
    return out


def gemm(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dense FP8 GEMM out [M, N] = A @ W^T (W [N, K] with 128x128 scales): the dense-layer comparison."""
    _dg().fp8_fp4_gemm_nt((a.data, a.scales_2d()), (w, w_scales), out)
    return out
